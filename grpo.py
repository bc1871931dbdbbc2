"""GRPO: the baseline that AC2, RPO and CCR are measured against (docs/grpo.md).

Each step samples a group of G complete responses for each of B problems, scores every response with a
verifier or an LLM judge, and gives every new token of response i the advantage A_i = R_i - mean_j R_j
(optionally / std_j R_j). The policy takes a dual-clip PPO step per minibatch on those tokens; old
log-probabilities are recomputed by the trainer. In the AC2 paper's terms (Section 2) this is the lambda = 1
estimator with a Monte-Carlo baseline at the root: every trajectory must be rolled out to its end.

    python grpo.py --tiny                                        # built-in task on a CPU, a few minutes
    python grpo.py --model Qwen/Qwen3-4B-Thinking-2507 \\
        --judge-base-url https://api.deepseek.com/v1             # the AC2 paper's GRPO baseline
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter

from common import engine, parallel, plan
from common.data import load_rows
from common.judges import AnswerVerifier, Watch, extract_final_answer, extract_proof, start_judge, watch_scores
from common.tiny import resolve_model, tiny_reward

AC2_PROMPT = (  # the AC2 paper's actor prompt, Appendix C
    "Consider the following mathematical problem:\n{problem}\n\nSolve the problem. Write a complete "
    "solution/proof.\n\n- Enclose any brief thinking in <think></think> tags, then finish your thinking with "
    "</think>.\n\nThen write your final solution/proof inside <proof></proof> tags:\n<proof>\n...your "
    "solution/proof...\n</proof>\n"
)


@dataclasses.dataclass
class Args:
    """GRPO. Defaults reproduce the AC2 paper's GRPO baseline (Appendix C); `--tiny` runs the built-in task."""

    # --- experiment ---
    tiny: bool = False
    """use the built-in tiny task and model with the scaled-down defaults of `tiny_args()` (other flags still apply)"""
    exp_name: str = "grpo"
    """the name of this experiment (prefix of the run name)"""
    run_name: str | None = None
    """TensorBoard run folder under runs/ (default: <exp_name>__<seed>__<time>, or the resumed run's name)"""
    seed: int = 1
    """seed of the data order, of every sampling request and of torch"""
    num_steps: int = 200
    """number of training steps"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project: str = "partial-rollouts"
    """the W&B project"""
    save_every: int = 10
    """write a checkpoint every this many steps (0: never; the last step is always saved when > 0)"""
    keep_checkpoints: int = 2
    """how many of the most recent checkpoints to keep"""
    checkpoint_dir: str = "checkpoints"
    """checkpoints go to <checkpoint_dir>/<run_name>/step_<N>"""
    resume: str | None = None
    """continue from a checkpoint folder (a step_<N> folder, or a run folder: its latest step)"""

    # --- model and data ---
    model: str = "Qwen/Qwen3-4B-Thinking-2507"
    """policy: a hub id, a local folder, or `tiny`"""
    dataset: str = "lm-provers/FineProofs-RL"
    """training problems: a hub id, a .json/.jsonl file, a save_to_disk folder, or `tiny`"""
    dataset_split: str = "train"
    """split of the training dataset"""
    problem_field: str = "problem"
    """field holding the problem statement"""
    answer_field: str = "answer"
    """field holding the gold final answer (used by --reward verifier)"""
    train_limit: int | None = None
    """use only the first N training problems"""
    eval_dataset: str = "lm-provers/IMOProofBench"
    """held-out problems (same formats as --dataset)"""
    eval_split: str = "train"
    """split of the evaluation dataset"""
    eval_answer_field: str = "answer"
    """gold answer field of the evaluation set (--reward verifier)"""
    eval_solution_field: str = "solution"
    """reference solution field given to the judge at evaluation only (--reward judge)"""
    eval_guidelines_field: str = "grading_guidelines"
    """grading guidelines field given to the judge at evaluation only (--reward judge)"""
    eval_limit: int | None = None
    """use only the first N evaluation problems"""
    train_eval_problems: int = 64
    """training problems (a fixed seeded sample) also evaluated at every evaluation, as eval/train_score (0: off)"""
    prompt_template: str = AC2_PROMPT
    """user message; `{problem}` is replaced by the problem (default: the AC2 paper's actor prompt)"""
    reward: Literal["judge", "verifier"] = "judge"
    """judge: an LLM grades the <proof> 0-7, reward points/7; verifier: math-verify on the last \\boxed{} answer"""
    max_ungradable_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps in which no response held an answer the reward can
    grade: every reward 0, a model that ignores the prompt's format"""

    # --- judge (an OpenAI-compatible endpoint; the paper used DeepSeek-V4-Flash) ---
    judge_base_url: str = "https://api.deepseek.com/v1"
    """base URL of the judge's OpenAI-compatible API"""
    judge_model: str = "deepseek-v4-flash"
    """judge model name"""
    judge_api_key_env: str = "JUDGE_API_KEY"
    """environment variable holding the judge's API key (never logged)"""
    judge_max_concurrency: int = 64
    """judge requests in flight at once"""
    judge_timeout_s: float = 1800.0
    """per-request timeout of the judge, seconds (the released client's: 40k-token gradings take minutes)"""
    judge_max_retries: int = 4
    """retries of a failed judge request (timeouts, 5xx, 408, 429; never other 4xx)"""
    judge_temperature: float = 1.0
    """judge sampling temperature"""
    judge_max_tokens: int = 40_000
    """judge max_tokens"""
    judge_max_invalid_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps in which over half of the judge calls failed"""

    # --- rollouts ---
    problems_per_step: int = 256
    """problems per step (B)"""
    group_size: int = 16
    """responses per problem (G)"""
    max_response_tokens: int = 50_000
    """response limit in new tokens (CCR's baseline used 32,768, RPO's 4,096)"""
    temperature: float = 0.8
    """sampling temperature (old log-probabilities use logits / temperature too)"""
    top_p: float = 1.0
    """sampling top-p"""
    top_k: int = -1
    """sampling top-k (-1: off)"""
    rollout_correction: Literal["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = "none"
    """importance weights w = pi_train_old / pi_vllm of the sampled tokens on the per-token policy loss, for the gap
    between vLLM's sampling and the trainer (other kernels, bf16 on GPU): per token, or per sequence from the
    geometric mean of its tokens' ratios (not their product, which over thousands of tokens is almost never near 1);
    truncated at C (min(w, C)) or masked outside [1/C, C]. None of the papers corrects: off (project choice;
    docs/reference.md, "Rollout correction")"""
    rollout_correction_cap: float | None = None
    """C; default 3 per token (TRL's cap) and 1.01 per sequence (a 1% systematic gap per token: a healthy bf16
    sequence's geometric mean lies within ~0.2% of 1)"""
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    """the PPO ratio's old log-probabilities: recomputed by the trainer (the papers), or the engine's sampling ones,
    which skips the trainer's forward pass over every token of the step (verl's bypass mode, prime-rl) -- the ratio's
    denominator is then the sampler's policy, its gap to the trainer included; sampling/mismatch_* is not measured"""

    # --- optimisation ---
    learning_rate: float = 2e-6
    """AdamW learning rate (constant)"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 0.3
    """gradient clipping norm"""
    num_minibatches: int = 2
    """PPO minibatches per step (one epoch, no shuffle)"""
    std_normalize: bool = False
    """divide advantages by the group's reward std (standard GRPO; RPO's setting)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """token mean over the minibatch, or per-sequence token mean then mean over sequences (original GRPO)"""
    clip_low: float = 0.2
    """PPO epsilon_low"""
    clip_high: float = 0.28
    """PPO epsilon_high base (clip-higher); the entropy offset k is added to it"""
    dual_clip: float = 3.0
    """dual-clip constant c: for A < 0 the loss is capped at -A*c (0: off)"""
    entropy_control: bool = True
    """adapt epsilon_high = clip_high + k to the policy entropy (AC2 paper, Eq. 9)"""
    entropy_target: float = 0.28
    """H*: target mean token entropy (nats, at the sampling temperature)"""
    entropy_step: float = 0.02
    """delta_H: step of k per training step"""
    entropy_k_init: float = 0.06
    """k_0: initial offset"""
    entropy_k_bound: float = 0.08
    """k is clipped to [-bound, bound]"""
    kl_coef: float = 0.0
    """beta of a k3 KL penalty to the frozen initial policy (0: off, no reference model kept)"""

    # --- efficiency ---
    micro_batch_tokens: int = 16_384
    """padded tokens per forward/backward (micro-batches accumulate into one minibatch step); a longer row is a
    micro-batch of its own. Bounds activation memory (benchmarks/memory_plan.py) at the cost of more forward /
    backward passes, each gathering the sharded weights again"""
    logprob_chunk_tokens: int = 1024
    """positions per chunk of the LM head + log-softmax, so no [tokens x vocab] tensor is ever materialised"""
    gradient_checkpointing: bool = True
    """recompute decoder activations in the backward pass (GPU only)"""
    gpu_memory_utilization: float = 0.4
    """share of GPU memory vLLM may take (it sleeps while the trainer works)"""
    vllm_sleep_level: int = 2
    """vLLM sleep level while the trainer works: 2 drops the engine's weights (the sync rewrites them), 1 keeps
    them in CPU memory"""
    offload_optimizer: bool = False
    """keep the AdamW state (8 bytes per parameter) in CPU memory except during its step (GPU; see the README's
    memory plan for when this makes a model fit)"""
    vllm_max_num_seqs: int = 0
    """sequences the engine decodes at once; 0: on GPU as many as its KV cache holds at the rows' expected length
    (half their limit), so that rows are not preempted and prefilled again; on CPU vLLM's default"""
    no_memory_check: bool = False
    """on GPU, start even when the memory plan says the run does not fit (common/plan.py)"""
    collective_timeout_s: float = 86_400.0
    """how long a rank waits for the others before the run fails (one step's generation and judge grading included,
    hours apart between ranks at 50,000-token responses)"""

    # --- evaluation and logging ---
    eval_every: int = 10
    """evaluate every this many steps (and before training and after the last step; 0: never)"""
    eval_samples: int = 16
    """responses per evaluation problem"""
    eval_temperature: float = 0.8
    """evaluation temperature"""
    eval_top_p: float = 0.95
    """evaluation top-p"""
    eval_top_k: int = 20
    """evaluation top-k"""
    eval_max_tokens: int = 50_000
    """evaluation response limit"""
    log_completions_every: int = 10
    """log a few sample completions as text every this many steps"""


def tiny_args() -> Args:
    """The built-in task on a 2-core CPU: the paper's recipe scaled down (a few minutes per 100 steps).

    Differences beyond scale: temperature 1 everywhere and no top-p/top-k at evaluation, because the tiny
    model's mistakes are a learned noise rate that truncated sampling would hide -- evaluation measures the
    policy itself.
    """
    return Args(
        tiny=True, model="tiny", dataset="tiny", eval_dataset="tiny", eval_split="test",
        prompt_template="{problem}", reward="verifier", num_steps=100, problems_per_step=32, group_size=8,
        max_response_tokens=200, temperature=1.0, learning_rate=1e-4, max_grad_norm=1.0, save_every=0,
        micro_batch_tokens=16_384, eval_every=10, eval_samples=4, eval_temperature=1.0, eval_top_p=1.0,
        eval_top_k=-1, eval_max_tokens=200, train_eval_problems=256,
    )


# ====================================================================================================
# ALGO LOGIC: GRPO's rules, its loss and the stages of its step (what a fork changes)
# ====================================================================================================
def sample_responses(llm, train: Problems, batch: list[int], step: int, args: Args, peaks) -> list[Sample]:
    """Step 1: G complete responses for each of the B problems, group-major (G rows per problem)."""
    from vllm import SamplingParams

    params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=args.max_response_tokens, logprobs=0, seed=request_seed(args.seed, step, j))
              for j in range(len(batch))]
    peaks.start()
    groups = engine.generate(llm, [train.prompts[p] for p in batch], params)
    peaks.end("rollout")
    return [Sample(p, train.prompts[p], c) for p, group in zip(batch, groups) for c in group]


def score_responses(args: Args, texts: list[str], problems: list[dict], verifier, judge, held_out: bool = False):
    """(rewards, valid flags, judge points or None, [(error, detail) of each judge call]) for each response.

    The judge grades training responses on the released 7/6/1/0 scale and held-out ones 0-7 with their reference
    solution and guidelines (docs/ac2.md, "The judge"); a response without a complete proof gets 0 without a call
    and stays valid."""
    n = len(texts)
    if args.dataset == "tiny" and (not held_out or args.eval_dataset == "tiny"):
        return [tiny_reward(t, r["answer"]) for t, r in zip(texts, problems)], [True] * n, [None] * n, []
    if args.reward == "verifier":
        field = args.eval_answer_field if held_out else args.answer_field
        golds = [str(r[field]) for r in problems]
        return verifier.verify(golds, [extract_final_answer(t) for t in texts]), [True] * n, [None] * n, []
    proofs = [extract_proof(t) for t in texts]
    todo = [i for i, p in enumerate(proofs) if p is not None]
    results = judge.grade(
        [problems[i][args.problem_field] for i in todo],
        [proofs[i] for i in todo],
        [problems[i].get(args.eval_solution_field) for i in todo] if held_out else None,
        [problems[i].get(args.eval_guidelines_field) for i in todo] if held_out else None,
        validation=held_out,
    )
    rewards, valid, points = [0.0] * n, [True] * n, [0] * n
    for i, res in zip(todo, results):
        rewards[i], valid[i], points[i] = res.reward, res.valid, res.points
    return rewards, valid, points, [(res.error, res.detail) for res in results]


ANSWER = {"judge": "a complete <proof> block after </think>", "verifier": "a \\boxed{} answer after </think>"}


def gradable(text: str, args: Args) -> bool:
    """Does the response hold what its scorer grades (a proof for the judge, a final answer for the verifier)?"""
    return (extract_proof(text) if args.reward == "judge" else extract_final_answer(text)) is not None


def eval_scores(texts: list[str], problems: list[dict], held_out: bool, args: Args, verifier, judge):
    """Evaluation's scores and extra keys: with a judge, the pass rate (>= 6 of 7) and the invalid share."""
    rewards, valid, points, _ = score_responses(args, texts, problems, verifier, judge, held_out)
    extra = {}
    if args.reward == "judge" and held_out:
        extra = {"eval/pass_rate": float(np.mean([(p or 0) >= 6 for p in points])),
                 "eval/judge_invalid": float(np.mean([not v for v in valid]))}
    return rewards, extra


def group_advantages(rewards, group_size: int, std_normalize: bool) -> torch.Tensor:
    """A_i = R_i - mean_j R_j over each group (AC2 paper, Section 2); with std_normalize, / (std_j R_j + 1e-4)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:  # unbiased std as in TRL; equal rewards give A = 0 either way
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4) if group_size > 1 else adv
    return adv.reshape(-1)


def update_entropy_offset(k: float, mean_entropy: float, args: Args) -> float:
    """AC2 paper Eq. 9: k <- clip(k + delta_H * sign(H* - H_hat), -bound, bound); eps_high = clip_high + k."""
    step = args.entropy_step * float(np.sign(args.entropy_target - mean_entropy))
    return float(np.clip(k + step, -args.entropy_k_bound, args.entropy_k_bound))


def ppo_loss(logp, old_logp, adv, clip_low: float, clip_high: float, dual_clip: float):
    """Per-token dual-clip PPO loss (AC2 paper, Appendix C), plus which clip was active.

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = max(-A*ratio, -A*clip(ratio, 1-eps_low, 1+eps_high));
    for A < 0 the loss is further capped at -A*c (dual clip, c > 0; 0 turns it off), so a huge ratio cannot blow
    up a negative update.
    """
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = (adv < 0) & (loss > -adv * dual_clip) if dual_clip > 0 else torch.zeros_like(adv, dtype=torch.bool)
    loss = torch.where(dual_active, -adv * dual_clip, loss)
    stats = {
        "clip_low": (adv < 0) & (ratio < 1 - clip_low),
        "clip_high": (adv > 0) & (ratio > 1 + clip_high),
        "clip_dual": dual_active,
        "approx_kl": (ratio - 1) - torch.log(ratio),  # k3 estimate of KL(old || new)
    }
    return loss, stats


def aggregate_loss(tok_loss, token_counts: list[int], loss_agg: str, denom: float):
    """This micro-batch's share of the minibatch loss; micro-batch shares add up to the minibatch loss.

    token-mean: sum of token losses / tokens in the minibatch (denom) -- every token weighs the same.
    seq-mean-token-mean: each sequence's token mean, summed / sequences in the minibatch (denom).
    """
    if loss_agg == "token-mean":
        return tok_loss.sum() / denom
    per_seq = torch.stack([t.mean() for t in tok_loss.split(token_counts)])
    return per_seq.sum() / denom


def training_rows(samples: list[Sample], advantages: torch.Tensor) -> list[TrainRow]:
    """Every response's new tokens carry its advantage; the prompt gets no loss."""
    return [TrainRow(s.context + s.completion.token_ids, len(s.context), len(s.completion.token_ids), float(a),
                     sampled=s.completion.logprobs) for s, a in zip(samples, advantages)]


def micro_batch_loss(rows: list[TrainRow], logp, minibatch: list[TrainRow], clip_high: float, args: Args):
    """A micro-batch's share of its minibatch's loss: dual-clip PPO (+ beta * k3 KL to the reference), token mean
    over the minibatch or per-sequence mean over its sequences; and the counts its statistics need."""
    denom = sum(r.n for r in minibatch) if args.loss_agg == "token-mean" else len(minibatch)
    adv = torch.cat([torch.full((r.n,), r.advantage) for r in rows]).to(logp.device)
    tok_loss, st = ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, args.clip_low, clip_high,
                            args.dual_clip)
    sums = {key: float(v.detach().float().sum()) for key, v in st.items()}
    if args.rollout_correction != "none":  # the sampler's gap, weighed token by token on the policy term
        tok_loss = tok_loss * torch.cat([r.is_weight for r in rows])
    if args.kl_coef > 0:  # k3 estimator of KL(pi || pi_ref), per token
        d = torch.cat([r.ref_logp for r in rows]) - logp
        kl = torch.exp(d) - d - 1
        tok_loss = tok_loss + args.kl_coef * kl
        sums["kl_ref"] = float(kl.detach().sum())
    return aggregate_loss(tok_loss, [r.n for r in rows], args.loss_agg, denom), sums


STATS = ("clip_low", "clip_high", "clip_dual", "approx_kl")  # what `micro_batch_loss` counts (+ kl_ref with a KL)


def step_scalars(rewards: list[float], valid: list[bool], samples: list[Sample], args: Args) -> dict[str, float]:
    """GRPO's own logged quantities of one step."""
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    r = rewards_t.view(-1, args.group_size)
    new_tokens = [len(s.completion.token_ids) for s in samples]
    return {
        "charts/learning_rate": args.learning_rate, "train/reward_mean": float(rewards_t.mean()),
        "train/reward_std": float(rewards_t.std()) if len(rewards) > 1 else 0.0,
        "train/zero_std_frac": float((r.std(dim=1) == 0).float().mean()) if args.group_size > 1 else 1.0,
        "train/judge_invalid": float(np.mean([not v for v in valid])),
        "train/response_len_mean": float(np.mean(new_tokens)), "train/response_len_min": min(new_tokens),
        "train/response_len_max": max(new_tokens),
        "train/truncated_frac": float(np.mean([s.completion.truncated for s in samples])),
    }


def completions(texts: list[str], rewards: list[float]) -> list[str]:
    return [f"**reward {rewards[j]:.2f}**\n```\n{texts[j][-2000:]}\n```" for j in range(min(4, len(texts)))]


def progress_line(step: int, scalars: dict, last_eval: float, clock: Clock, args: Args) -> str:
    t = clock.times
    return (f"step {step}/{args.num_steps} | reward {scalars['train/reward_mean']:.3f}{eval_field(last_eval)} | len "
            f"{scalars['train/response_len_mean']:.0f} | kl {scalars['sampling/mismatch_kl']:.1e} | gen "
            f"{t['time/generate']:.1f}s score {t['time/score']:.1f}s train {t['time/train']:.1f}s sync "
            f"{t['time/sync']:.2f}s")


def save(step: int, model, tok, optimizer, run_name: str, k_entropy: float, counters: Counters, args: Args) -> Path:
    """A checkpoint of everything the run carries, as of the end of step `step`."""
    state = {"run_name": run_name, "entropy_k": k_entropy, **counters.state_dict()}
    return parallel.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok, {"optimizer": optimizer},
                                    state, args.keep_checkpoints)


# ====================================================================================================
# TRY NOT TO MODIFY: the data order. Identical in grpo.py and rpo.py (tests/test_shared_blocks.py)
# ====================================================================================================
def problems_for_step(n_rows: int, per_step: int, step: int, seed: int) -> list[int]:
    """Row indices of step `step` (1-based): consecutive slices of seeded per-epoch permutations."""
    out, pos = [], (step - 1) * per_step
    while len(out) < per_step:
        epoch, offset = divmod(pos, n_rows)
        perm = list(range(n_rows))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        take = min(per_step - len(out), n_rows - offset)
        out += perm[offset : offset + take]
        pos += take
    return out
# -------------------------------------------------------------------------------------- end: the data order


# ====================================================================================================
# TRY NOT TO MODIFY: the PPO update. Identical in grpo.py, rpo.py and ccr.py (tests/test_shared_blocks.py; ac2.py
# puts its critic step between two minibatches, so it calls `train_minibatch` itself)
# ====================================================================================================
def ppo_update(model, optimizer, rows: list[TrainRow], micro_batch_loss, stats: tuple[str, ...], args,
               peaks) -> dict[str, float]:
    """One epoch over the rows in --num-minibatches consecutive minibatches (no shuffle), one optimizer step each,
    around the script's own loss: `micro_batch_loss(rows, logp, minibatch)` is one micro-batch's share of its
    minibatch's loss, with the counts of `stats` (the losses/* keys). Loss denominators count the whole minibatch,
    so each rank's share adds up to the one-process loss."""
    model.train()
    totals, grad_norms, skipped = collections.Counter(), [], 0
    for mb in minibatches(rows, args.num_minibatches):
        if not mb:
            continue
        loss = partial(micro_batch_loss, minibatch=[rows[i] for i in mb])
        result = train_minibatch(model, optimizer, rows, mb, loss, args.temperature, args.max_grad_norm, args, peaks,
                                 args.offload_optimizer)
        totals.update(result.sums)
        totals["policy_loss"] += result.loss / args.num_minibatches
        grad_norms.append(result.grad_norm)
        skipped += not result.stepped
    model.zero_grad(set_to_none=True)  # free the gradients before the engine takes the memory back
    return update_scalars(totals, grad_norms, skipped, rows, stats)
# ----------------------------------------------------------------------------------------------- end: the PPO update


# ====================================================================================================
# TRY NOT TO MODIFY: the shared machinery. Identical in grpo.py, ac2.py, rpo.py and ccr.py
# (tests/test_shared_blocks.py): sampling records, log-probabilities, the update around each script's own
# loss, evaluation, set-up, logging.
# ====================================================================================================
@dataclasses.dataclass
class Problems:
    """A set of problems: the data set's rows and their tokenized prompts."""

    rows: list[dict]
    prompts: list[list[int]]


@dataclasses.dataclass
class Sample:
    """One sampled continuation of a prompt (+ prefix): which problem, the tokens before it, what was sampled."""

    problem: int  # its index among the training problems (CCR: the pack's, in this step's batch)
    context: list[int]  # prompt (+ replayed prefix) token ids
    completion: engine.Completion


@dataclasses.dataclass
class TrainRow:
    """One sequence the trainer scores: loss on the n tokens of `ids` from position `start` on.

    `sampled`: the engine's sampling log-probabilities of the tokens it drew this step, the last len(sampled)
    loss tokens (the sampler / trainer gap is measured on them). `weight`: the row's weight in its loss; 0 leaves
    it out of the update (its tokens still count in the update's statistics). The old log-probabilities, the
    entropies and the reference's log-probabilities are filled in by `old_logprobs`, on the rank that trains it.
    """

    ids: list[int]
    start: int
    n: int
    advantage: float = 0.0
    weight: float = 1.0
    sampled: Sequence[float] = ()
    prefix_len: int = 0  # tokens of a replayed prefix after the prompt (AC2, RPO); 0: a response to the prompt alone
    old_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    is_weight: torch.Tensor | None = None  # --rollout-correction's weight of each loss token (1 where not sampled)


@dataclasses.dataclass
class Counters:
    """The cumulative counts every script logs and checkpoints (charts/decoding_flops, charts/generated_tokens)."""

    flops_A: int
    flops_B: int
    decoding_flops: int = 0
    generated_tokens: int = 0

    def add(self, context_len: int, new_tokens: int) -> None:
        """One policy rollout of `new_tokens` after `context_len` tokens (AC2 paper, Eq. 6)."""
        self.decoding_flops += engine.decoding_flops(self.flops_A, self.flops_B, context_len, new_tokens)
        self.generated_tokens += new_tokens

    def add_samples(self, samples: list[Sample]) -> None:
        for s in samples:
            self.add(len(s.context), len(s.completion.token_ids))

    def scalars(self) -> dict[str, int]:
        return {"charts/decoding_flops": self.decoding_flops, "charts/generated_tokens": self.generated_tokens}

    def state_dict(self) -> dict:
        return {"decoding_flops": self.decoding_flops, "generated_tokens": self.generated_tokens}

    def load_state_dict(self, state: dict) -> None:
        self.decoding_flops, self.generated_tokens = state["decoding_flops"], state["generated_tokens"]


def request_seed(*keys: int) -> int:
    """A sampling seed per (run seed, step, request): resumed runs sample exactly what straight runs did."""
    return int(np.random.SeedSequence([abs(k) for k in keys]).generate_state(1)[0] >> 1)


def encode_chat(tokenizer, message: str) -> list[int]:
    """A chat-templated user turn + the generation prompt (for thinking models it opens `<think>`)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chunk_logprobs(hidden, targets, weight, bias, temperature: float, with_entropy: bool):
    logits = F.linear(hidden, weight, bias).float() / temperature  # [chunk, vocab], never [tokens, vocab]
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - logz
    if not with_entropy:
        return logp, None
    entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def final_hidden_states(model, input_ids):
    """The decoder's output (after the final norm), computed by the model's own forward -- so that a sharded
    trainer's hooks gather the weights -- with the vocabulary logits of only the last position."""
    out = {}
    hook = model.get_decoder().norm.register_forward_hook(lambda module, args, output: out.setdefault("h", output))
    try:
        model(input_ids=input_ids, logits_to_keep=1)
    finally:
        hook.remove()
    return out["h"]


def sequence_logprobs(model, input_ids, starts, lengths, temperature: float, chunk: int, with_entropy=False):
    """Log-probabilities (and entropies) of tokens input_ids[b, starts[b] : starts[b]+lengths[b]].

    Right-padded batch, plain positions 0..n-1 as vLLM saw them. Only the hidden states of the needed
    positions go through the LM head, `chunk` positions at a time; with gradients on, each chunk is
    checkpointed so its logits are recomputed in the backward pass instead of kept.
    Returns flat tensors over the selected tokens, in batch order.
    """
    hidden = final_hidden_states(model, input_ids)
    rows = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)]).to(input_ids.device)
    cols = torch.cat([torch.arange(s - 1, s - 1 + n) for s, n in zip(starts, lengths)]).to(input_ids.device)
    h, targets = hidden[rows, cols], input_ids[rows, cols + 1]  # position t predicts token t+1
    head = model.get_output_embeddings()
    logps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        fn_args = (h[i : i + chunk], targets[i : i + chunk], head.weight, head.bias, temperature, with_entropy)
        lp, ent = checkpoint(_chunk_logprobs, *fn_args, use_reentrant=False) if torch.is_grad_enabled() \
            else _chunk_logprobs(*fn_args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def make_micro_batches(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Greedy packing, longest first, so that (rows x longest row) <= budget tokens (one row may exceed it)."""
    order = sorted(indices, key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def pad_batch(seqs: list[list[int]], device) -> torch.Tensor:
    """Right-padded token ids: causal attention never lets a real token see the pads after it, so any id does."""
    out = torch.zeros((len(seqs), max(map(len, seqs))), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out.to(device)


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def old_logprobs(model, rows: list[TrainRow], temperature: float, args, peaks, ref_model=None) -> None:
    """The trainer's log-probabilities (logits / T) and entropies of every row's loss tokens before the update --
    and the frozen reference's, with `ref_model` -- for the rows this rank trains (all of them in one process;
    row i: rank i % world under torchrun). With --old-logprobs engine the policy's pass is skipped: every row's old
    log-probabilities are the engine's (each rank has them all), and there are no entropies; a reference model
    still scores the rows."""
    device = next(model.parameters()).device
    from_engine = args.old_logprobs == "engine"
    if from_engine:
        for r in rows:
            r.old_logp = torch.tensor(r.sampled, dtype=torch.float32, device=device)
        if ref_model is None:
            return
    model.eval()
    peaks.start()
    with torch.no_grad(), autocast(device):
        for micro in parallel.even(make_micro_batches(parallel.mine(range(len(rows))), [len(r.ids) for r in rows],
                                                      args.micro_batch_tokens)):
            if not micro:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
                if not from_engine:
                    parallel.idle_pass(model)
                if ref_model is not None:
                    parallel.idle_pass(ref_model)
                continue
            batch = [rows[i] for i in micro]
            ids, starts, ns = pad_batch([r.ids for r in batch], device), [r.start for r in batch], [r.n for r in batch]
            if not from_engine:
                lp, ent = sequence_logprobs(model, ids, starts, ns, temperature, args.logprob_chunk_tokens,
                                            with_entropy=True)
                for r, a, b in zip(batch, lp.split(ns), ent.split(ns)):
                    r.old_logp, r.entropy = a, b
            if ref_model is not None:
                ref = sequence_logprobs(ref_model, ids, starts, ns, temperature, args.logprob_chunk_tokens)[0]
                for r, c in zip(batch, ref.split(ns)):
                    r.ref_logp = c
    peaks.end("old_logprobs")


def sampled_tokens(rows: list[TrainRow], field: str = "old_logp") -> torch.Tensor:
    """This rank's rows' `old_logp` or `entropy` on the tokens the engine sampled, on the CPU, in row order."""
    mine = [r for r in rows if getattr(r, field) is not None]
    return torch.cat([getattr(r, field)[r.n - len(r.sampled):] for r in mine] or [torch.zeros(0)]).float().cpu()


def sampled_entropy(rows: list[TrainRow]) -> float:
    """The mean token entropy (at the sampling temperature, before the update) over the tokens the engine sampled,
    all ranks together (NaN with --old-logprobs engine: no pass measured it)."""
    return parallel.mean_all(sampled_tokens(rows, "entropy"), default=float("nan"))


def sampler_gap(rows: list[TrainRow], args) -> dict[str, float]:
    """The engine's sampling log-probabilities against the trainer's old ones on the same tokens, over all ranks:
    the k3 KL (`sampling/mismatch_kl`) and the largest gap (`sampling/mismatch_max`); NaN with --old-logprobs engine,
    where the trainer's are not computed."""
    if args.old_logprobs == "engine":
        return {"sampling/mismatch_kl": float("nan"), "sampling/mismatch_max": float("nan")}
    engine_lp = torch.tensor([x for r in rows if r.old_logp is not None for x in r.sampled])
    log_ratio = sampled_tokens(rows) - engine_lp
    return {"sampling/mismatch_kl": parallel.mean_all(torch.exp(log_ratio) - 1 - log_ratio),
            "sampling/mismatch_max": parallel.max_all(float(log_ratio.abs().max()) if len(log_ratio) else 0.0)}


def correction_cap(args) -> float:
    return args.rollout_correction_cap or (3.0 if args.rollout_correction.startswith("token") else 1.01)


def rollout_correction(rows: list[TrainRow], args) -> dict[str, float]:
    """--rollout-correction: the importance weight of every loss token of the rows this rank trains, in
    `row.is_weight` (detached; the loss multiplies its per-token policy term by it), and the rollout/* keys.

    w = exp(old - vllm) on the tokens the engine sampled: per token, or per sequence from the mean log-ratio of its
    sampled tokens (a geometric mean); truncated (min(w, C)) or masked (0 outside [1/C, C]). Tokens the engine did
    not sample this step (RPO's replayed prefix) keep weight 1. The weights compare the trainer's log-probabilities
    with the engine's of the same distribution: the engine's are processed (temperature applied), and top-p / top-k,
    which would make them those of a truncated distribution, are refused with a correction on (`check_flags`)."""
    if args.rollout_correction == "none":
        return {}
    cap, per_sequence = correction_cap(args), args.rollout_correction.startswith("sequence")
    truncate = args.rollout_correction.endswith("truncate")
    raw, changed, units = [], 0, 0
    for r in rows:
        if r.old_logp is None:
            continue
        k = len(r.sampled)
        log_w = (r.old_logp[r.n - k:].float() - torch.tensor(r.sampled, device=r.old_logp.device)).detach()
        if per_sequence and k:
            log_w = log_w.mean().expand(k)
        w = torch.exp(log_w)
        out = w > cap if truncate else (w > cap) | (w < 1 / cap)
        r.is_weight = torch.cat([torch.ones(r.n - k, device=w.device),
                                 torch.clamp(w, max=cap) if truncate else torch.where(out, 0.0, w)])
        raw.append(w.cpu())
        counted = out[:1] if per_sequence else out  # a sequence counts once
        changed, units = changed + int(counted.sum()), units + len(counted)
    w = torch.cat(raw or [torch.zeros(0)])
    verb = "truncated" if truncate else "masked"
    return {"rollout/is_weight_mean": parallel.mean_all(w, default=float("nan")),
            "rollout/is_weight_max": parallel.max_all(float(w.max()) if len(w) else 0.0),
            f"rollout/is_{verb}_frac": parallel.sum_all(changed) / max(parallel.sum_all(units), 1)}


def check_flags(args, needs_the_trainers_pass: str | None = None) -> None:
    """Combinations of --rollout-correction and --old-logprobs that cannot work, refused in one sentence.
    `needs_the_trainers_pass`: why this script cannot take the engine's old log-probabilities, if it cannot."""
    correcting, from_engine = args.rollout_correction != "none", args.old_logprobs == "engine"
    if correcting and from_engine:
        raise SystemExit("--rollout-correction with --old-logprobs engine would weigh the engine's log-probabilities "
                         "against themselves (every weight 1): choose one")
    if (correcting or from_engine) and (args.top_p < 1 or args.top_k > 0):
        raise SystemExit(f"--{'rollout-correction' if correcting else 'old-logprobs engine'} compares the engine's "
                         "log-probabilities with the trainer's, but with top-p / top-k the engine's are those of a "
                         "truncated distribution: sample with --top-p 1 --top-k -1")
    if from_engine and needs_the_trainers_pass:
        raise SystemExit(f"--old-logprobs engine skips the trainer's pass, but {needs_the_trainers_pass}")


def minibatches(rows: list[TrainRow], num_minibatches: int) -> list[list[int]]:
    """One epoch in `num_minibatches` consecutive slices of the rows (no shuffle), without the rows that carry no
    loss (no tokens, or weight 0); a slice may come out empty."""
    n = len(rows)
    return [[i for i in range(m * n // num_minibatches, (m + 1) * n // num_minibatches)
             if rows[i].n > 0 and rows[i].weight > 0] for m in range(num_minibatches)]


@dataclasses.dataclass
class MinibatchResult:
    loss: float  # the minibatch loss (all ranks)
    sums: dict[str, float]  # the micro-batch loss's token counts, this rank's rows
    grad_norm: float
    stepped: bool  # False: a non-finite loss or gradient, and the step was skipped


def train_minibatch(model, optimizer, rows: list[TrainRow], indices: list[int], micro_batch_loss, temperature: float,
                    max_grad_norm: float, args, peaks, offload: bool,
                    phases: tuple[str, str] = ("backward", "optimizer_step")) -> MinibatchResult:
    """One optimizer step on the rows `indices`: this rank's share, in micro-batches of at most
    --micro-batch-tokens padded tokens whose gradients accumulate; `micro_batch_loss(rows, logp)` is the script's
    own loss, (this micro-batch's share of the minibatch loss, {name: token count}). Gradients clipped to
    `max_grad_norm`; a non-finite loss or gradient would poison the weights, so that step is skipped. `phases`
    name the memory/<phase> logs of the passes and of the optimizer step."""
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    loss_sum, sums = 0.0, collections.Counter()
    peaks.start()
    for micro in parallel.even(make_micro_batches(parallel.mine(indices), [len(r.ids) for r in rows],
                                                  args.micro_batch_tokens)):
        if not micro:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
            parallel.idle_pass(model)
            continue
        batch = [rows[i] for i in micro]
        ids = pad_batch([r.ids for r in batch], device)
        with autocast(device):
            logp, _ = sequence_logprobs(model, ids, [r.start for r in batch], [r.n for r in batch], temperature,
                                        args.logprob_chunk_tokens)
        loss, counts = micro_batch_loss(batch, logp)
        loss.backward()
        loss_sum += float(loss.detach())
        sums.update(counts)
    peaks.end(phases[0])
    loss_sum = parallel.sum_all(loss_sum)  # each rank summed its own rows
    grad_norm = parallel.full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    stepped = math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm))
    if stepped:
        peaks.start()
        parallel.optimizer_step(optimizer, device, offload)
        peaks.end(phases[1])
    return MinibatchResult(loss_sum, dict(sums), float(grad_norm), stepped)


LOSS_KEYS = {"clip_low": "losses/clipfrac_low", "clip_high": "losses/clipfrac_high",
             "clip_dual": "losses/clipfrac_dual", "approx_kl": "losses/approx_kl", "kl_ref": "losses/kl_ref"}


def update_scalars(totals: dict, grad_norms: list[float], skipped: int, rows: list[TrainRow],
                   stats: tuple[str, ...]) -> dict[str, float]:
    """The losses/* keys of one update: the policy loss (summed over minibatches by the caller), each count of
    `stats` as a share of all the rows' loss tokens (all ranks together), losses/clipfrac = low + high, the mean
    gradient norm before clipping and the steps skipped as non-finite."""
    n_tok = max(sum(r.n for r in rows), 1)
    out = {"losses/policy_loss": totals["policy_loss"]}
    out.update({LOSS_KEYS[k]: parallel.sum_all(totals[k]) / n_tok for k in stats})  # each rank counted its own rows
    out["losses/clipfrac"] = out["losses/clipfrac_low"] + out["losses/clipfrac_high"]
    return {**out, "losses/grad_norm": float(np.mean(grad_norms or [0.0])), "losses/skipped_steps": skipped}


def sample_for_eval(llm, tok, prompts: list[list[int]], salt: int, label: str, args):
    """The evaluation sampler on these prompts, the same seeds at every evaluation: (texts, lengths)."""
    from vllm import SamplingParams

    params = [SamplingParams(n=args.eval_samples, temperature=args.eval_temperature, top_p=args.eval_top_p,
                             top_k=args.eval_top_k, max_tokens=args.eval_max_tokens,
                             seed=request_seed(args.seed, salt, i)) for i in range(len(prompts))]
    groups = engine.generate(llm, prompts, params, progress=f"evaluation: {label}")
    return ([tok.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g],
            [len(c.token_ids) for g in groups for c in g])


def evaluate(step: int, llm, tok, held_out: Problems, train_sample: Problems, score, args, writer,
             more=None) -> float:
    """eval/mean_score on the held-out problems, --eval-samples each; the same sampling on a fixed sample of
    training problems (eval/train_score: the train / held-out gap); `more()` adds a script's own evaluations.
    `score(texts, rows, held_out)` is the script's: (a score per text, extra keys)."""
    t0 = time.time()
    texts, lengths = sample_for_eval(llm, tok, held_out.prompts, -1, "held-out problems", args)
    scores, logged = score(texts, [r for r in held_out.rows for _ in range(args.eval_samples)], True)
    logged = {"eval/mean_score": float(np.mean(scores)), **logged, "eval/response_len_mean": float(np.mean(lengths))}
    if train_sample.prompts:
        texts, _ = sample_for_eval(llm, tok, train_sample.prompts, -4, "training problems", args)
        scores, _ = score(texts, [r for r in train_sample.rows for _ in range(args.eval_samples)], False)
        logged["eval/train_score"] = float(np.mean(scores))
    logged.update(more() if more else {})
    logged["time/eval"] = time.time() - t0
    log_scalars(writer, logged, step)
    return logged["eval/mean_score"]


def eval_field(last_eval: float) -> str:
    """The progress line's last held-out score; nothing before the first evaluation, or without evaluations."""
    return "" if math.isnan(last_eval) else f" | eval {last_eval:.3f}"


def evaluating(step: int, last_step: int, args) -> bool:
    """Evaluate before training, every --eval-every steps and after the last step."""
    return bool(args.eval_every) and (step % args.eval_every == 0 or step == last_step)


def train_sample(n_problems: int, args) -> list[int]:
    """The fixed, seeded sample of training problems evaluated like the held-out ones (eval/train_score)."""
    if not args.eval_every:
        return []
    return sorted(random.Random(args.seed).sample(range(n_problems), min(args.train_eval_problems, n_problems)))


def start_run(args) -> tuple[int, torch.device, Path | None, dict | None, str]:
    """Rank, device, the checkpoint to resume (with its state) and the run name; seeds Python, NumPy and torch.
    One process per GPU under torchrun, each holding all of the algorithm's state (common/parallel.py)."""
    rank, world, device = parallel.init(args.collective_timeout_s)
    if rank == 0 and world > 1:
        print(f"{world} ranks, one {device.type} each", flush=True)
    resume_dir = parallel.find_checkpoint(args.resume) if args.resume else None
    ckpt = parallel.read_state(resume_dir) if resume_dir else None
    run_name = args.run_name or (ckpt["run_name"] if ckpt else f"{args.exp_name}__{args.seed}__{int(time.time())}")
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    return rank, device, resume_dir, ckpt, parallel.from_rank0(run_name)


def load_policy(args, device, resume_dir: Path | None, eval_problems: int = 0):
    """(model path, config, tokenizer, trainer): fp32 master weights, FSDP2-sharded under a process group
    (common/parallel.py: only rank 0 reads them), gradient checkpointing on GPU. On GPU the plan speaks first,
    before any weight is read (`check_plan`). An unreachable model stops the run in one sentence."""
    from transformers import AutoConfig, AutoTokenizer

    model_path = resolve_model(args.model)
    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception as e:
        raise SystemExit(f"could not load model {args.model!r}: {str(e).splitlines()[0][:300]}") from None
    try:
        if device.type == "cuda":
            check_plan(args, config, device, eval_problems)
        tok = AutoTokenizer.from_pretrained(model_path)
        model = parallel.load_model(resume_dir / "policy" if resume_dir else model_path, device,
                                    gradient_checkpointing=device.type == "cuda" and args.gradient_checkpointing)
    except (OSError, ValueError) as e:
        raise SystemExit(f"could not load model {args.model!r}: {str(e).splitlines()[0][:300]}") from None
    return model_path, config, tok, model


def check_plan(args, config, device, eval_problems: int) -> None:
    """Stop now, in one sentence, if the memory plan says this run does not fit its GPUs -- naming the flags or the
    GPUs that would make it fit (--no-memory-check runs anyway) -- and print how long a step will take."""
    shape = plan.model_shape(config)
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    if not args.no_memory_check and (problem := plan.check_memory(args, shape, parallel.WORLD, gpu_gib)):
        raise SystemExit(problem)
    if parallel.RANK == 0:
        gpu = plan.gpu_named(torch.cuda.get_device_name(device), gpu_gib)
        print(plan.time_summary(args, shape, parallel.WORLD, gpu, eval_problems), flush=True)
        per_node, host = torch.cuda.device_count(), plan.host_memory_gib()
        need = sum(plan.host_plan(args, shape, parallel.WORLD, per_node).values())
        if host and need > 0.9 * host:
            print(f"warning: the plan puts this node's host memory at {need:.0f} GiB of its {host:.0f} GiB "
                  f"(benchmarks/memory_plan.py shows each term)", flush=True)


def load_reference(model_path: str, device):
    """The frozen initial policy, for a KL penalty."""
    return parallel.load_model(model_path, device).eval().requires_grad_(False)


def adamw(model, lr: float, weight_decay: float, device) -> torch.optim.AdamW:
    """AdamW, betas (0.9, 0.999), eps 1e-8; fused on GPU (no full-size temporary)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), eps=1e-8,
                             fused=device.type == "cuda")


def start_engine(model_path: str, config, max_model_len: int, args, peaks, master: bool):
    """The in-process vLLM engine (common/engine.py); memory/engine_start is its start-up's peak. On GPU it decodes
    --vllm-max-num-seqs sequences at once, by default as many as its KV cache holds at the rows' expected length."""
    peaks.start()
    if master:
        print(f"starting the vLLM engine for {args.model} ...", flush=True)
    max_num_seqs = args.vllm_max_num_seqs or None
    if torch.cuda.is_available() and not max_num_seqs:
        gpu_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        max_num_seqs = plan.max_num_seqs(plan.model_shape(config), gpu_gib, args.gpu_memory_utilization,
                                         plan.expected_row_tokens(args))
    llm = engine.create_engine(model_path, max_model_len=max_model_len, seed=args.seed,
                               gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max_num_seqs)
    peaks.end("engine_start")
    return llm


def open_writer(run_name: str, args, master: bool) -> SummaryWriter | None:
    """TensorBoard under runs/<run_name> with the hyperparameters (rank 0 only; --track mirrors it to W&B)."""
    if not master:
        return None
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
        f"|{k}|{v!r}|" for k, v in vars(args).items()))
    if args.track:
        import wandb

        wandb.init(project=args.wandb_project, name=run_name, config=vars(args), sync_tensorboard=True)
    return writer


def log_scalars(writer: SummaryWriter | None, scalars: dict[str, float], step: int) -> None:
    if writer is not None:
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)


def log_step(writer: SummaryWriter | None, step: int, scalars: dict[str, float], shown: list[str], args) -> None:
    """This step's scalars, and a few sample completions as text every --log-completions-every steps."""
    log_scalars(writer, scalars, step)
    if writer is not None and args.log_completions_every and step % args.log_completions_every == 0:
        writer.add_text("samples/completions", "\n\n".join(shown), step)


def saving(step: int, last_step: int, args) -> bool:
    """A checkpoint every --save-every steps and after the last one (--save-every 0: never)."""
    return bool(args.save_every) and (step % args.save_every == 0 or step == last_step)


def wake_up(llm, model, peaks) -> None:
    """The engine serves the trainer's new weights from the next rollout on (sync, then the KV cache back)."""
    peaks.start()
    engine.wake_up(llm, model)
    peaks.end("wake_up")


class Clock:
    """Wall-clock seconds of each phase of a step (time/<phase>) and of the whole step (charts/step_time)."""

    def __init__(self):
        self.start = self.last = time.time()
        self.times: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.time()
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + now - self.last
        self.last = now

    def scalars(self) -> dict[str, float]:
        return {"charts/step_time": time.time() - self.start, **self.times}
# ------------------------------------------------------------------------------------ end: the shared machinery


def main(args: Args) -> dict:
    check_flags(args, "Eq. 9's entropy control needs the entropies it measures: add --no-entropy-control"
                if args.entropy_control else None)
    rank, device, resume_dir, ckpt, run_name = start_run(args)
    master = rank == 0

    # --- data, judge, models and engine (each fails fast, with one sentence) ---
    fields = [args.problem_field] + ([args.answer_field] if args.reward == "verifier" else [])
    eval_fields = [args.problem_field] + ([args.eval_answer_field] if args.reward == "verifier" else [])
    rows = load_rows(args.dataset, args.dataset_split, fields, args.train_limit)
    eval_rows = load_rows(args.eval_dataset, args.eval_split, eval_fields, args.eval_limit) if args.eval_every else []
    judge = start_judge(args, master) if args.reward == "judge" else None
    model_path, config, tok, model = load_policy(args, device, resume_dir, len(eval_rows))
    ref_model = load_reference(model_path, device) if args.kl_coef > 0 else None
    optimizer = adamw(model, args.learning_rate, args.weight_decay, device)
    train = Problems(rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.problem_field]))
                            for r in rows])
    held_out = Problems(eval_rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.problem_field]))
                                    for r in eval_rows])
    sample = train_sample(len(train.rows), args)
    train_eval = Problems([train.rows[i] for i in sample], [train.prompts[i] for i in sample])
    peaks = parallel.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    eval_max_tokens = args.eval_max_tokens if args.eval_every else 0  # the engine's context need not hold it
    longest = max(map(len, train.prompts + held_out.prompts)) + max(args.max_response_tokens, eval_max_tokens) + 8
    llm = start_engine(model_path, config, longest, args, peaks, master)
    verifier = AnswerVerifier() if args.reward == "verifier" and args.dataset != "tiny" else None
    score = partial(eval_scores, args=args, verifier=verifier, judge=judge)

    # --- state a checkpoint carries ---
    start_step, k_entropy = 0, args.entropy_k_init
    counters = Counters(*engine.decoding_flops_coefficients(config))
    watch = Watch()  # steps in a row with a failing judge, or with no gradable answer (not checkpointed)
    if ckpt:
        parallel.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                                 offload=("optimizer",) if args.offload_optimizer else ())
        start_step, k_entropy = ckpt["step"], ckpt["entropy_k"]
        counters.load_state_dict(ckpt)
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)  # the engine serves exactly the trainer's (possibly resumed) weights
    writer = open_writer(run_name, args, master)
    last_eval = float("nan")
    if start_step == 0 and args.eval_every:
        last_eval = evaluate(0, llm, tok, held_out, train_eval, score, args, writer)
        if master:
            print(f"step 0 | eval {last_eval:.3f}")

    for step in range(start_step + 1, args.num_steps + 1):
        clock = Clock()
        # 1. sample G complete responses for each of B problems: every rollout runs to its end (lambda = 1)
        batch = problems_for_step(len(train.rows), args.problems_per_step, step, args.seed)
        samples = sample_responses(llm, train, batch, step, args, peaks)
        engine.sleep(llm, args.vllm_sleep_level)
        clock.lap("generate")
        # 2. score every response; a judge that fails most calls step after step stops the run
        texts = [tok.decode(s.completion.token_ids, skip_special_tokens=True) for s in samples]
        rewards, valid, _, calls = score_responses(args, texts, [train.rows[s.problem] for s in samples], verifier,
                                                   judge)
        watch_scores(watch, calls, sum(map(gradable, texts, [args] * len(texts))), len(texts), ANSWER[args.reward],
                     "--prompt-template", step, args, master, partial(save, step - 1, model, tok, optimizer, run_name,
                                                                       k_entropy, counters, args))
        counters.add_samples(samples)
        # 3. A_i = R_i - mean_j R_j (/ std), on every token of response i
        rows = training_rows(samples, group_advantages(rewards, args.group_size, args.std_normalize))
        clock.lap("score")
        # 4. old log-probabilities, recomputed by the trainer; Eq. 9's entropy control, once per step
        old_logprobs(model, rows, args.temperature, args, peaks, ref_model)
        correction = rollout_correction(rows, args)  # --rollout-correction's weights, from these log-probabilities
        entropy = sampled_entropy(rows)
        k_entropy = update_entropy_offset(k_entropy, entropy, args) if args.entropy_control else k_entropy
        clip_high = args.clip_high + (k_entropy if args.entropy_control else 0.0)
        # 5. PPO update, one optimizer step per minibatch
        losses = ppo_update(model, optimizer, rows, partial(micro_batch_loss, clip_high=clip_high, args=args),
                            STATS + (("kl_ref",) if args.kl_coef > 0 else ()), args, peaks)
        clock.lap("train")
        # 6. the engine serves the new weights from the next rollout on
        wake_up(llm, model, peaks)
        clock.lap("sync")
        # 7. log, evaluate, checkpoint
        scalars = {**counters.scalars(), **step_scalars(rewards, valid, samples, args), **losses, "losses/entropy":
                   entropy, "losses/eps_high": clip_high, **correction, **sampler_gap(rows, args), **clock.scalars(),
                   **peaks.pop()}
        log_step(writer, step, scalars, completions(texts, rewards), args)
        if evaluating(step, args.num_steps, args):
            last_eval = evaluate(step, llm, tok, held_out, train_eval, score, args, writer)
        if master:
            print(progress_line(step, scalars, last_eval, clock, args), flush=True)
        if saving(step, args.num_steps, args):
            save(step, model, tok, optimizer, run_name, k_entropy, counters, args)

    if writer is not None:
        writer.close()
    if verifier is not None:
        verifier.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
