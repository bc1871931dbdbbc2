"""CCR: Concurrent Constraint Reinforcement (Yang et al., arXiv 2610.22887; docs/ccr.md).

N independently verifiable problems share one prompt and one short completion cap B. The policy answers
them in order, one `Answer k: \\boxed{..}` line each. Answers completed before the cap keep their credit
when the completion is truncated, so a short window no longer erases the accuracy signal:

    R = w_acc * (1/N) * sum_{k <= N_eff} X_k + w_fmt * r_fmt,   N_eff = answers completed, in order

and a truncated completion stays in the loss with that partial reward. The shared budget makes wasted
reasoning on one problem cost the next problem's credit, with no explicit length penalty. Training is
GRPO within the group of S completions of the same pack. No code was released: choices the paper leaves
open are marked "project choice" and are flags.

    python ccr.py --tiny                                                  # built-in task, CPU, minutes
    python ccr.py --model Qwen/Qwen3-4B-Thinking-2507                     # the paper's 4B configuration
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import re
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
from common.judges import AnswerVerifier, Watch, after_thinking, extract_boxed, extract_final_answer, watch_scores
from common.tiny import (
    TINY_PACK_BUDGET,
    TINY_PACK_PROBLEM,
    TINY_PACK_SEPARATOR,
    TINY_PACK_TEMPLATE,
    resolve_model,
    tiny_reward,
)

PACK_TEMPLATE = (  # project choice: docs/ccr.md, "Answer recovery"
    "You will be given {n} problems. Solve them in order in a single response. Your whole response, reasoning "
    "included, is limited to {budget} tokens shared across all problems. After solving problem k, write a line "
    '"Answer k: \\boxed{{<final answer>}}" before starting problem k+1.\n\n{problems}'
)
SINGLE_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclasses.dataclass
class Args:
    """CCR. Defaults are the paper's 4B configuration (Section 5.1); `--tiny` runs the built-in task."""

    # --- experiment ---
    tiny: bool = False
    """use the built-in tiny task and model with the scaled-down defaults of `tiny_args()` (other flags still apply)"""
    exp_name: str = "ccr"
    """the name of this experiment (prefix of the run name)"""
    run_name: str | None = None
    """TensorBoard run folder under runs/ (default: <exp_name>__<seed>__<time>, or the resumed run's name)"""
    seed: int = 1
    """seed of the subset, the packs, every sampling request and torch"""
    epochs: int = 8
    """passes over the packed training set (packs are re-drawn every epoch); 8 x 125 steps = the paper's 1,000
    steps at the default batch (project choice derived from the paper's numbers: docs/ccr.md)"""
    num_steps: int | None = None
    """stop after this many steps instead (default: all the epochs); schedules still span `epochs`"""
    track: bool = False
    """also log to Weights & Biases"""
    wandb_project: str = "partial-rollouts"
    """the W&B project"""
    save_every: int = 20
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
    dataset: str = "zwhe99/DeepMath-103K"
    """training problems: a hub id, a .json/.jsonl file, a save_to_disk folder, or `tiny`"""
    dataset_split: str = "train"
    """split of the training dataset"""
    problem_field: str = "question"
    """field holding the problem statement"""
    answer_field: str = "final_answer"
    """field holding the gold final answer"""
    difficulty_field: str = "difficulty"
    """field holding a numeric difficulty (packs are stratified by it)"""
    train_limit: int | None = None
    """use only the first N training problems (before --subset-size)"""
    subset_size: int | None = 3000
    """train on a seeded random subset of this many problems (the paper: 3,000 -> 1,000 packs); None: all"""
    eval_dataset: str = "HuggingFaceH4/MATH-500"
    """held-out problems, evaluated one at a time (same formats as --dataset)"""
    eval_split: str = "test"
    """split of the evaluation dataset"""
    eval_problem_field: str = "problem"
    """problem field of the evaluation set"""
    eval_answer_field: str = "answer"
    """gold answer field of the evaluation set"""
    eval_limit: int | None = None
    """use only the first N evaluation problems"""
    train_eval_problems: int = 64
    """training problems (a fixed seeded sample) also evaluated, one at a time, at every evaluation, as
    eval/train_score (0: off)"""

    # --- packing and reward ---
    pack_size: int = 3
    """N: problems per completion"""
    budget: int = 8000
    """B: the shared completion cap, in tokens (single-problem GRPO used 32k)"""
    pack_template: str = PACK_TEMPLATE
    """packed user message with {n}, {budget} and {problems}"""
    max_ungradable_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps in which no response held an answer the reward can
    grade: every reward 0, a model that ignores the prompt's format"""
    problem_format: str = "Problem {k}: {problem}"
    """how each problem is listed in {problems} ({k}: its number)"""
    problem_separator: str = "\n\n"
    """what separates the listed problems"""
    single_template: str = SINGLE_TEMPLATE
    """single-problem user message for evaluation, with {problem}"""
    w_acc: float = 1.0
    """weight of the accuracy reward (project choice)"""
    w_fmt: float = 0.5
    """weight of the format reward r_fmt = N_eff / N (project choice)"""

    # --- rollouts and objective ---
    packs_per_step: int = 8
    """packed prompts per step: 8 packs x S = 4 = 32 completions of ~5.5k tokens = the paper's ~175k tokens per
    step (project choice derived from the paper's numbers: docs/ccr.md)"""
    group_size: int = 4
    """S: completions per pack (BCR)"""
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
    std_normalize: bool = True
    """A = (R - mean R) / (std R + 1e-4), "a stabilized group standard deviation" (the paper, Section 2);
    --no-std-normalize: plain centring R - mean R (the authors' blog formula)"""
    learning_rate: float = 1e-6
    """AdamW learning rate, constant (project choice)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    clip_low: float = 0.2
    """PPO epsilon (low side)"""
    clip_high: float = 0.2
    """PPO epsilon (high side); 0.28 = clip-higher (project choice)"""
    num_minibatches: int = 1
    """optimizer steps per batch (one epoch over the batch, no shuffle)"""

    # --- efficiency ---
    micro_batch_tokens: int = 16_384
    """padded tokens per forward/backward (micro-batches accumulate into one minibatch step); a longer row is a
    micro-batch of its own. Bounds activation memory (benchmarks/memory_plan.py) at the cost of more forward /
    backward passes, each gathering the sharded weights again"""
    logprob_chunk_tokens: int = 1024
    """positions per chunk of the LM head + log-softmax (no [tokens x vocab] tensor is ever materialised)"""
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
    eval_every: int = 20
    """evaluate every this many steps (and before training and after the last step; 0: never)"""
    eval_samples: int = 1
    """responses per evaluation problem"""
    eval_temperature: float = 0.6
    """evaluation temperature"""
    eval_top_p: float = 0.95
    """evaluation top-p"""
    eval_top_k: int = 20
    """evaluation top-k"""
    eval_max_tokens: int = 32_768
    """single-problem evaluation response limit"""
    packed_eval_sizes: tuple[int, ...] = ()
    """also evaluate packs of these sizes (e.g. 1 2 3 4 5) under --budget; empty: off"""
    log_completions_every: int = 20
    """log a few sample completions as text every this many steps"""


def tiny_args() -> Args:
    """The built-in task on a 2-core CPU: 3 problems per pack under a 192-token cap that fits about two of
    them, so truncation really happens; evaluation samples the policy itself at T = 1 as for every script."""
    return Args(
        tiny=True, model="tiny", dataset="tiny", problem_field="problem", answer_field="answer",
        difficulty_field="difficulty", subset_size=None, eval_dataset="tiny", eval_split="test",
        eval_problem_field="problem", eval_answer_field="answer", budget=TINY_PACK_BUDGET,
        pack_template=TINY_PACK_TEMPLATE, problem_format=TINY_PACK_PROBLEM, problem_separator=TINY_PACK_SEPARATOR,
        single_template="{problem}", packs_per_step=32, group_size=4,
        temperature=1.0, learning_rate=1e-4, epochs=3, micro_batch_tokens=16_384, save_every=0, eval_every=10,
        eval_samples=4, eval_temperature=1.0, eval_top_p=1.0, eval_top_k=-1, eval_max_tokens=200,
        packed_eval_sizes=(1, 2, 3, 4), log_completions_every=10, train_eval_problems=256,
    )


# ====================================================================================================
# ALGO LOGIC: CCR's rules, its loss and the stages of its step (what a fork changes)
# ====================================================================================================
def parse_packed_answers(text: str, n: int) -> list[str | None]:
    """The N answers of a packed completion, in order (docs/ccr.md, "Answer recovery").

    Only the answer section is parsed: the text after the last `</think>` when there is one, else the whole
    completion (a truncated one still thinking) -- thinking models restate the required format while they
    draft, and a draft inside a finished thinking section must not count. For k = 1..N: find the first
    `Answer k:` after the previous answer, then the first complete `\\boxed{..}` after it (brace-depth
    matched) and before the next `Answer j:` marker. The first k without a closed, non-empty answer ends the
    run: it and everything after it are None (an empty `\\boxed{}` is no answer: shortening must preserve
    correctness, not just the markers).
    """
    text = after_thinking(text)
    out: list[str | None] = [None] * n
    pos = 0
    for k in range(1, n + 1):
        m = re.compile(rf"Answer\s*{k}\s*:").search(text, pos)
        if not m:
            break
        nxt = re.compile(r"Answer\s*\d+\s*:").search(text, m.end())
        segment = text[m.end() : nxt.start() if nxt else len(text)]
        answer = extract_boxed(segment, which="first")
        if answer is None or not answer.strip():
            break
        out[k - 1] = answer
        pos = m.end() + segment.index("\\boxed") + len(answer)
    return out


def packed_reward(correct: list[float], n_eff: int, n: int, w_acc: float, w_fmt: float) -> tuple[float, float, float]:
    """(R, r_acc, r_fmt): r_acc = (1/N) sum_{k <= N_eff} X_k -- normalised by N, not N_eff, unfinished = 0;
    r_fmt = N_eff / N (the answers present, closed and in order); R = w_acc r_acc + w_fmt r_fmt."""
    r_acc = sum(correct[:n_eff]) / n
    r_fmt = n_eff / n
    return w_acc * r_acc + w_fmt * r_fmt, r_acc, r_fmt


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    """A_j = (R_j - mean R) / (std R + 1e-4) within each group of S completions of one pack (Section 2: "a
    stabilized group standard deviation"; unbiased std as in TRL; equal rewards give 0); without std_normalize
    the plain centring R_j - mean R."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def make_packs(difficulties: list[float], n: int, epoch: int, seed: int) -> list[list[int]]:
    """Difficulty-stratified packs (project choice following BCR): sort by difficulty, split into N equal
    strata, pack i = one problem per stratum, order shuffled inside each pack; re-drawn every epoch."""
    rng = np.random.default_rng([seed, epoch])
    order = sorted(range(len(difficulties)), key=lambda i: (difficulties[i], i))
    per = len(order) // n
    strata = [rng.permutation(order[s * per : (s + 1) * per]).tolist() for s in range(n)]
    packs = [[strata[s][i] for s in range(n)] for i in range(per)]
    for p in packs:
        rng.shuffle(p)
    return packs


@dataclasses.dataclass
class PackSchedule:
    """This epoch's packs (re-drawn every epoch, seeded) and which epoch they belong to."""

    difficulties: list[float]
    pack_size: int
    seed: int
    packs: list[list[int]] = dataclasses.field(default_factory=list)
    epoch: int = 0

    def __post_init__(self):
        self.packs = make_packs(self.difficulties, self.pack_size, 0, self.seed)

    def batch(self, step: int, packs_per_step: int) -> list[list[int]]:
        """Step `step`'s packs (1-based); a new epoch draws new packs."""
        epoch, index = divmod(step - 1, self.steps_per_epoch(packs_per_step))
        if epoch != self.epoch:
            self.packs, self.epoch = make_packs(self.difficulties, self.pack_size, epoch, self.seed), epoch
        return self.packs[index * packs_per_step : (index + 1) * packs_per_step]

    def steps_per_epoch(self, packs_per_step: int) -> int:
        return math.ceil(len(self.difficulties) // self.pack_size / packs_per_step)

    def state_dict(self) -> dict:
        return {"packs": self.packs, "packs_epoch": self.epoch}

    def load_state_dict(self, s: dict) -> None:
        self.packs, self.epoch = s["packs"], s["packs_epoch"]


def pack_prompt(tok, problems: list[str], args: Args) -> list[int]:
    """N problems in one user message under the shared cap B (the pack template: a project choice)."""
    listed = args.problem_separator.join(args.problem_format.format(k=k, problem=q) for k, q in enumerate(problems, 1))
    return encode_chat(tok, args.pack_template.format(n=len(problems), budget=args.budget, problems=listed))


def verify_answers(golds: list[str], answers: list[str | None], tiny: bool, verifier) -> list[float]:
    """X_k per problem: math-verify (gold first), or the tiny task's exact comparison of the boxed contents."""
    if tiny:
        return [float(a is not None and a.strip() == g) for g, a in zip(golds, answers)]
    return verifier.verify(golds, answers)


def score_packs(texts: list[str], packs: list[list[dict]], field: str, tiny: bool, args: Args, verifier):
    """(R, r_acc, r_fmt, N_eff) per completion: answers completed before the cap keep their credit, truncated
    or not; N_eff = the answers completed, in order."""
    parsed = [parse_packed_answers(t, len(p)) for t, p in zip(texts, packs)]
    flat = [(str(r[field]), a) for p, ans in zip(packs, parsed) for r, a in zip(p, ans)]
    xs = iter(verify_answers([g for g, _ in flat], [a for _, a in flat], tiny, verifier))
    out = []
    for p, ans in zip(packs, parsed):
        x = [next(xs) for _ in p]
        n_eff = next((k for k, a in enumerate(ans) if a is None), len(ans))
        out.append((*packed_reward(x, n_eff, len(p), args.w_acc, args.w_fmt), n_eff))
    return out


def eval_scores(texts: list[str], rows: list[dict], held_out: bool, args: Args, verifier):
    """Single-problem scores in the ordinary answer format (the policy must still solve one problem at a time)."""
    if held_out:
        if args.eval_dataset == "tiny":
            return [tiny_reward(t, r["answer"]) for t, r in zip(texts, rows)], {}
        return verifier.verify([str(r[args.eval_answer_field]) for r in rows],
                               [extract_final_answer(t) for t in texts]), {}
    return verify_answers([str(r[args.answer_field]) for r in rows], [extract_final_answer(t) for t in texts],
                          args.dataset == "tiny", verifier), {}


def packed_evaluation(llm, tok, rows: list[dict], args: Args, verifier) -> dict[str, float]:
    """Packs of each --packed-eval-sizes under the training cap B: r_acc and N_eff by pack size."""
    from vllm import SamplingParams

    logged = {}
    for n in args.packed_eval_sizes:
        packs = [rows[i : i + n] for i in range(0, len(rows) - n + 1, n)]
        prompts = [pack_prompt(tok, [r[args.eval_problem_field] for r in p], args) for p in packs]
        outs = engine.generate(llm, prompts, progress=f"evaluation: packs of {n}", params=[SamplingParams(
            n=1, temperature=args.eval_temperature, top_p=args.eval_top_p, top_k=args.eval_top_k,
            max_tokens=args.budget, seed=request_seed(args.seed, -3, n, i)) for i in range(len(prompts))])
        scored = score_packs([tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs], packs,
                             args.eval_answer_field, args.eval_dataset == "tiny", args, verifier)
        logged[f"eval/packed_r_acc_n{n}"] = float(np.mean([s[1] for s in scored]))
        logged[f"eval/packed_n_eff_n{n}"] = float(np.mean([s[3] for s in scored]))
    return logged


def sample_packs(llm, prompts: list[list[int]], step: int, args: Args, peaks) -> list[Sample]:
    """S completions of each packed prompt under the one shared cap B, group-major."""
    from vllm import SamplingParams

    params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=args.budget, logprobs=0, seed=request_seed(args.seed, step, j))
              for j in range(len(prompts))]
    peaks.start()
    groups = engine.generate(llm, prompts, params)
    peaks.end("rollout")
    return [Sample(j, prompt, c) for j, (prompt, group) in enumerate(zip(prompts, groups)) for c in group]


def ppo_loss(logp, old_logp, adv, clip_low: float, clip_high: float):
    """Per-token PPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old_logp), plus which clip
    was active."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    stats = {"clip_low": (adv < 0) & (ratio < 1 - clip_low), "clip_high": (adv > 0) & (ratio > 1 + clip_high),
             "approx_kl": (ratio - 1) - torch.log(ratio)}  # k3 estimate of KL(old || new)
    return loss, stats


def training_rows(samples: list[Sample], advantages: torch.Tensor) -> list[TrainRow]:
    """Every completion's tokens carry its advantage, a truncated one's too; the prompt gets no loss."""
    return [TrainRow(s.context + s.completion.token_ids, len(s.context), len(s.completion.token_ids), float(a),
                     sampled=s.completion.logprobs) for s, a in zip(samples, advantages)]


def micro_batch_loss(rows: list[TrainRow], logp, minibatch: list[TrainRow], args: Args):
    """A micro-batch's share of its minibatch's loss: the clipped surrogate, token-level mean over the minibatch
    (long truncated completions are not down-weighted per token), beta = 0; and the counts its statistics need."""
    denom = sum(r.n for r in minibatch)
    adv = torch.cat([torch.full((r.n,), r.advantage) for r in rows]).to(logp.device)
    tok_loss, st = ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, args.clip_low, args.clip_high)
    if args.rollout_correction != "none":  # the sampler's gap, weighed token by token
        tok_loss = tok_loss * torch.cat([r.is_weight for r in rows])
    return tok_loss.sum() / denom, {key: float(v.detach().float().sum()) for key, v in st.items()}


STATS = ("clip_low", "clip_high", "approx_kl")  # what `micro_batch_loss` counts


def step_scalars(scored, samples: list[Sample], rewards: torch.Tensor, args: Args) -> dict[str, float]:
    """CCR's own logged quantities of one step."""
    new_tokens = [len(s.completion.token_ids) for s in samples]
    truncated = [s.completion.truncated for s in samples]
    n_eff = [s[3] for s in scored]
    scalars = {
        "charts/learning_rate": args.learning_rate, "train/reward_mean": float(rewards.mean()),
        "ccr/tokens_per_step": sum(new_tokens), "ccr/r_acc": float(np.mean([s[1] for s in scored])),
        "ccr/r_fmt": float(np.mean([s[2] for s in scored])), "ccr/n_eff_mean": float(np.mean(n_eff)),
        "ccr/truncated_frac": float(np.mean(truncated)), "ccr/completion_len_mean": float(np.mean(new_tokens)),
        "ccr/truncated_rewarded_frac": float(np.mean([s[1] > 0 for s, t in zip(scored, truncated) if t] or [0.0])),
        "ccr/zero_std_frac": float((rewards.view(-1, args.group_size).std(dim=1) == 0).float().mean())
        if args.group_size > 1 else 1.0,
    }
    for k in range(args.pack_size + 1):
        scalars[f"ccr/n_eff_frac_{k}"] = float(np.mean([e == k for e in n_eff]))
    return scalars


def completions(texts: list[str], scored, samples: list[Sample]) -> list[str]:
    return [f"**R={scored[i][0]:.2f} N_eff={scored[i][3]} truncated={samples[i].completion.truncated}**\n```\n"
            f"{texts[i][-2000:]}\n```" for i in range(min(3, len(texts)))]


def progress_line(step: int, last_step: int, scalars: dict, last_eval: float, clock: Clock) -> str:
    t = clock.times
    return (f"step {step}/{last_step} | R {scalars['train/reward_mean']:.3f} r_acc {scalars['ccr/r_acc']:.3f} | N_eff "
            f"{scalars['ccr/n_eff_mean']:.2f} | truncated {scalars['ccr/truncated_frac']:.2f} | tokens "
            f"{scalars['ccr/tokens_per_step']}{eval_field(last_eval)} | gen {t['time/generate']:.1f}s train "
            f"{t['time/train']:.1f}s")


def save(step: int, model, tok, optimizer, run_name: str, schedule: PackSchedule, counters: Counters,
         args: Args) -> Path:
    """A checkpoint of everything the run carries, as of the end of step `step`."""
    state = {"run_name": run_name, **schedule.state_dict(), **counters.state_dict()}
    return parallel.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok, {"optimizer": optimizer},
                                    state, args.keep_checkpoints)


def training_problems(args: Args) -> tuple[list[dict], list[float]]:
    """The training problems (the paper's 3,000-problem subset, seeded) and their numeric difficulties."""
    rows = load_rows(args.dataset, args.dataset_split, [args.problem_field, args.answer_field, args.difficulty_field],
                     args.train_limit)
    if args.subset_size and args.subset_size < len(rows):
        keep = np.random.default_rng([args.seed, 7]).choice(len(rows), args.subset_size, replace=False)
        rows = [rows[i] for i in sorted(keep.tolist())]
    for i, r in enumerate(rows):
        try:
            float(r[args.difficulty_field])
        except (TypeError, ValueError):
            raise SystemExit(f"dataset {args.dataset!r}: row {i} has a non-numeric {args.difficulty_field!r}: "
                             f"{r[args.difficulty_field]!r}.") from None
    if len(rows) < args.pack_size:
        raise SystemExit(f"dataset {args.dataset!r} has {len(rows)} problems, fewer than --pack-size {args.pack_size}.")
    return rows, [float(r[args.difficulty_field]) for r in rows]


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
    check_flags(args)
    rank, device, resume_dir, ckpt, run_name = start_run(args)
    master = rank == 0

    # --- data, models and engine (each fails fast, with one sentence) ---
    problems, difficulties = training_problems(args)
    eval_rows = load_rows(args.eval_dataset, args.eval_split, [args.eval_problem_field, args.eval_answer_field],
                          args.eval_limit) if args.eval_every else []
    model_path, config, tok, model = load_policy(args, device, resume_dir, len(eval_rows))
    optimizer = adamw(model, args.learning_rate, args.weight_decay, device)
    schedule = PackSchedule(difficulties, args.pack_size, args.seed)
    num_steps = args.epochs * schedule.steps_per_epoch(args.packs_per_step)
    last_step = min(num_steps, args.num_steps or num_steps)
    # evaluation: single problems, the ordinary answer format
    held_out = Problems(eval_rows, [encode_chat(tok, args.single_template.format(problem=r[args.eval_problem_field]))
                                    for r in eval_rows])
    sample = train_sample(len(problems), args)
    train_eval = Problems([problems[i] for i in sample], [encode_chat(tok, args.single_template.format(
        problem=problems[i][args.problem_field])) for i in sample])
    longest_pack = max(len(pack_prompt(tok, [r[args.problem_field] for r in problems[i : i + args.pack_size]], args))
                       for i in range(0, min(len(problems), 300), args.pack_size))
    eval_len = max(map(len, held_out.prompts)) + args.eval_max_tokens if held_out.prompts else 0
    peaks = parallel.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    llm = start_engine(model_path, config, max(longest_pack + args.budget, eval_len) + 256, args, peaks, master)
    verifier = AnswerVerifier()  # its worker processes start on first use only
    score = partial(eval_scores, args=args, verifier=verifier)
    packed_eval = partial(packed_evaluation, llm, tok, eval_rows, args, verifier)

    # --- state a checkpoint carries: the epoch's packs and the counters ---
    start_step, counters = 0, Counters(*engine.decoding_flops_coefficients(config))
    watch = Watch()  # steps in a row with no gradable answer (not checkpointed)
    if ckpt:
        parallel.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                                 offload=("optimizer",) if args.offload_optimizer else ())
        start_step = ckpt["step"]
        counters.load_state_dict(ckpt)
        schedule.load_state_dict(ckpt)
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)  # the engine serves exactly the trainer's (possibly resumed) weights
    writer = open_writer(run_name, args, master)
    last_eval = float("nan")
    if start_step == 0 and args.eval_every:
        last_eval = evaluate(0, llm, tok, held_out, train_eval, score, args, writer, more=packed_eval)
        if master:
            print(f"step 0 | single-problem eval {last_eval:.3f}")

    for step in range(start_step + 1, last_step + 1):
        clock = Clock()
        # 1. Pack N problems per prompt, stratified by difficulty, under one shared cap B
        batch = schedule.batch(step, args.packs_per_step)
        prompts = [pack_prompt(tok, [problems[i][args.problem_field] for i in p], args) for p in batch]
        # 2. One capped completion: S samples of each packed prompt, at most B tokens in all
        samples = sample_packs(llm, prompts, step, args, peaks)
        engine.sleep(llm, args.vllm_sleep_level)
        clock.lap("generate")
        # 3. N_eff reward: answers completed before the cap keep their credit, truncated or not
        texts = [tok.decode(s.completion.token_ids, skip_special_tokens=True) for s in samples]
        scored = score_packs(texts, [[problems[i] for i in batch[s.problem]] for s in samples], args.answer_field,
                             args.dataset == "tiny", args, verifier)
        watch_scores(watch, [], sum(s[3] > 0 for s in scored), len(scored), "an `Answer 1: \\boxed{..}` line",
                     "--pack-template", step, args, master, partial(save, step - 1, model, tok, optimizer, run_name,
                                                                     schedule, counters, args))
        counters.add_samples(samples)
        rewards = torch.tensor([s[0] for s in scored], dtype=torch.float32)
        rows = training_rows(samples, group_advantages(rewards, args.group_size, args.std_normalize))
        clock.lap("score")
        # 4. GRPO within each pack's group; truncated completions stay in the loss with their partial reward
        old_logprobs(model, rows, args.temperature, args, peaks)
        correction = rollout_correction(rows, args)  # --rollout-correction's weights, from these log-probabilities
        losses = ppo_update(model, optimizer, rows, partial(micro_batch_loss, args=args), STATS, args, peaks)
        clock.lap("train")
        wake_up(llm, model, peaks)
        clock.lap("sync")
        # 5. log, evaluate, checkpoint
        scalars = {**counters.scalars(), **step_scalars(scored, samples, rewards, args), **losses, "losses/entropy":
                   sampled_entropy(rows), **correction, **sampler_gap(rows, args), **clock.scalars(), **peaks.pop()}
        log_step(writer, step, scalars, completions(texts, scored, samples), args)
        if writer is not None:
            writer.add_histogram("ccr/n_eff", np.array([s[3] for s in scored]), step,
                                 bins=np.arange(args.pack_size + 2) - 0.5)
        if evaluating(step, last_step, args):
            last_eval = evaluate(step, llm, tok, held_out, train_eval, score, args, writer, more=packed_eval)
        if master:
            print(progress_line(step, last_step, scalars, last_eval, clock), flush=True)
        if saving(step, last_step, args):
            save(step, model, tok, optimizer, run_name, schedule, counters, args)

    if writer is not None:
        writer.close()
    verifier.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
