"""GRPO: the baseline that AC2, RPO and CCR are measured against (spec/grpo.md).

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
import random
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter

from common import dist, engine
from common.data import load_rows
from common.judges import AnswerVerifier, Judge, JudgeConfig, extract_final_answer, extract_proof
from common.tiny import resolve_model, tiny_reward

AC2_PROMPT = (  # AC2 paper, Appendix C (spec/ac2.md "Actor prompt")
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


# ----------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------
def request_seed(*keys: int) -> int:
    """A sampling seed per (run seed, step, request): resumed runs sample exactly what straight runs did."""
    return int(np.random.SeedSequence([abs(k) for k in keys]).generate_state(1)[0] >> 1)


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


def encode_prompt(tokenizer, template: str, problem: str) -> list[int]:
    """Chat-templated user turn + generation prompt (for thinking models it opens `<think>`)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": template.format(problem=problem)}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def score_responses(args: Args, texts, rows, *, verifier, judge, evaluation: bool = False):
    """(rewards, valid flags, judge points or None, [(error, detail) of each judge call]) for each response."""
    n = len(texts)
    if args.dataset == "tiny" and (not evaluation or args.eval_dataset == "tiny"):
        return [tiny_reward(t, r["answer"]) for t, r in zip(texts, rows)], [True] * n, [None] * n, []
    if args.reward == "verifier":
        field = args.eval_answer_field if evaluation else args.answer_field
        golds = [str(r[field]) for r in rows]
        return verifier.verify(golds, [extract_final_answer(t) for t in texts]), [True] * n, [None] * n, []
    # judge: a response without a complete proof gets 0 without a call and stays valid (spec/ac2.md step 5)
    proofs = [extract_proof(t) for t in texts]
    todo = [i for i, p in enumerate(proofs) if p is not None]
    results = judge.grade(
        [rows[i][args.problem_field] for i in todo],
        [proofs[i] for i in todo],
        [rows[i].get(args.eval_solution_field) for i in todo] if evaluation else None,
        [rows[i].get(args.eval_guidelines_field) for i in todo] if evaluation else None,
        validation=evaluation,
    )
    rewards, valid, points = [0.0] * n, [True] * n, [0] * n
    for i, res in zip(todo, results):
        rewards[i], valid[i], points[i] = res.reward, res.valid, res.points
    return rewards, valid, points, [(res.error, res.detail) for res in results]


def judge_failure_streak(calls: list[tuple[str | None, str | None]], streak: int) -> tuple[int, str | None]:
    """A step in which more than half of the judge calls failed extends the streak and explains itself (the
    causes, most frequent first, with one server message each); any other step ends the streak. A failing
    judge turns rewards into invalid zeros, so the caller stops the run when the streak gets long."""
    failed = [(e, d) for e, d in calls if e is not None]
    if not calls or 2 * len(failed) <= len(calls):
        return 0, None
    causes = collections.Counter(e for e, _ in failed)
    detail = dict(reversed(failed))  # the first message of each cause
    listed = "; ".join(f"{e} x{k}" + (f" ({detail[e]})" if detail[e] else "") for e, k in causes.most_common())
    return streak + 1, f"{len(failed)} of {len(calls)} judge calls failed: {listed}"


def group_advantages(rewards: torch.Tensor, group_size: int, std_normalize: bool) -> torch.Tensor:
    """A_i = R_i - mean_j R_j over each group (spec/grpo.md); with std_normalize, / (std_j R_j + 1e-4)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:  # unbiased std as in TRL; equal rewards give A = 0 either way
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4) if group_size > 1 else adv
    return adv.reshape(-1)


def update_entropy_offset(k: float, mean_entropy: float, args: Args) -> float:
    """AC2 paper Eq. 9: k <- clip(k + delta_H * sign(H* - H_hat), -bound, bound); eps_high = clip_high + k."""
    step = args.entropy_step * float(np.sign(args.entropy_target - mean_entropy))
    return float(np.clip(k + step, -args.entropy_k_bound, args.entropy_k_bound))


# ----------------------------------------------------------------------------------------------------
# Log-probabilities (chunked) and the PPO loss
# ----------------------------------------------------------------------------------------------------
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


def ppo_loss(logp, old_logp, adv, clip_low: float, clip_high: float, dual_clip: float):
    """Per-token dual-clip PPO loss (spec/ac2.md "Actor loss"), plus which clip was active.

    ratio = exp(clamp(logp - old_logp, -20, 20)); L = max(-A*ratio, -A*clip(ratio, 1-eps_low, 1+eps_high));
    for A < 0 the loss is further capped at -A*c (dual clip), so a huge ratio cannot blow up a negative update.
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


def pad_batch(seqs: list[list[int]], pad_id: int, device) -> torch.Tensor:
    out = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out.to(device)


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    # one process per GPU under torchrun, each holding all of the algorithm's state (common/dist.py)
    rank, world, device = dist.init()
    master = rank == 0
    if master and world > 1:
        print(f"{world} ranks, one {device.type} each", flush=True)
    resume_dir = dist.find_checkpoint(args.resume) if args.resume else None
    ckpt = dist.read_state(resume_dir) if resume_dir else None
    run_name = args.run_name or (ckpt["run_name"] if ckpt else f"{args.exp_name}__{args.seed}__{int(time.time())}")
    run_name = dist.from_rank0(run_name)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # --- data (fail fast, one sentence) ---
    train_fields = [args.problem_field] + ([args.answer_field] if args.reward == "verifier" else [])
    eval_fields = [args.problem_field] + ([args.eval_answer_field] if args.reward == "verifier" else [])
    train_rows = load_rows(args.dataset, args.dataset_split, train_fields, args.train_limit)
    eval_rows = load_rows(args.eval_dataset, args.eval_split, eval_fields, args.eval_limit) if args.eval_every else []

    # --- the judge: one real grading request before any model is loaded (fail fast, one sentence) ---
    judge = None
    if args.reward == "judge":
        judge = Judge(JudgeConfig(args.judge_base_url, args.judge_model, args.judge_api_key_env,
                                  args.judge_max_concurrency, args.judge_timeout_s, args.judge_max_retries,
                                  temperature=args.judge_temperature, max_tokens=args.judge_max_tokens))
        if master:
            print(f"checking the judge {args.judge_model} at {args.judge_base_url} with one real grading request...",
                  flush=True)
        if (err := judge.check()) is not None:
            raise SystemExit(f"the judge {args.judge_model} at {args.judge_base_url} failed a grading request with "
                             f"the run's settings (max_tokens {args.judge_max_tokens}, temperature "
                             f"{args.judge_temperature}): {err}")

    # --- models: the trainer (plain transformers, FSDP2-sharded under a process group) and the engine (vLLM) ---
    model_path = resolve_model(args.model)
    try:
        config = AutoConfig.from_pretrained(model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:
        raise SystemExit(f"could not load model {args.model!r}: {str(e).splitlines()[0][:300]}") from None
    model = AutoModelForCausalLM.from_pretrained(resume_dir / "policy" if resume_dir else model_path,
                                                 dtype=torch.float32)  # fp32 master weights
    if device.type == "cuda" and args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = dist.shard(model, device)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = dist.shard(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), device).eval()
        ref_model.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")  # fused: no temporary
    prompts = [encode_prompt(tokenizer, args.prompt_template, r[args.problem_field]) for r in train_rows]
    eval_prompts = [encode_prompt(tokenizer, args.prompt_template, r[args.problem_field]) for r in eval_rows]
    # a fixed sample of training problems, evaluated like the held-out ones (eval/train_score)
    train_eval_rows = [train_rows[i] for i in sorted(random.Random(args.seed).sample(
        range(len(train_rows)), min(args.train_eval_problems, len(train_rows))))] if args.eval_every else []
    train_eval_prompts = [encode_prompt(tokenizer, args.prompt_template, r[args.problem_field])
                          for r in train_eval_rows]
    longest_prompt = max(map(len, prompts + eval_prompts))
    eval_max_tokens = args.eval_max_tokens if args.eval_every else 0  # the engine's context need not hold it
    peaks = dist.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    peaks.start()
    if master:
        print(f"starting the vLLM engine for {args.model} ...", flush=True)
    llm = engine.create_engine(
        model_path, max_model_len=longest_prompt + max(args.max_response_tokens, eval_max_tokens) + 8,
        seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
    )
    peaks.end("engine_start")
    flops_A, flops_B = engine.decoding_flops_coefficients(config)
    verifier = AnswerVerifier() if args.reward == "verifier" and args.dataset != "tiny" else None

    # --- state that a checkpoint carries ---
    start_step, k_entropy, total_flops, total_tokens = 0, args.entropy_k_init, 0, 0
    judge_streak = 0  # consecutive steps in which over half of the judge calls failed (not checkpointed)
    if ckpt:
        dist.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                             offload=("optimizer",) if args.offload_optimizer else ())
        start_step, k_entropy = ckpt["step"], ckpt["entropy_k"]
        total_flops, total_tokens = ckpt["decoding_flops"], ckpt["generated_tokens"]
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)  # the engine serves exactly the trainer's (possibly resumed) weights

    def save(at_step: int) -> Path:
        return dist.save_checkpoint(Path(args.checkpoint_dir) / run_name, at_step, model, tokenizer,
                                    {"optimizer": optimizer}, {"run_name": run_name, "entropy_k": k_entropy,
                                    "decoding_flops": total_flops, "generated_tokens": total_tokens},
                                    args.keep_checkpoints)

    writer = SummaryWriter(f"runs/{run_name}") if master else None  # rank 0 logs
    if master:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v!r}|" for k, v in vars(args).items()))
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project, name=run_name, config=vars(args), sync_tensorboard=True)

    def sample_for_eval(prompts_: list[list[int]], salt: int, label: str):
        """The evaluation sampler on these prompts, the same seeds at every evaluation: (groups, texts)."""
        params = [SamplingParams(n=args.eval_samples, temperature=args.eval_temperature, top_p=args.eval_top_p,
                                 top_k=args.eval_top_k, max_tokens=args.eval_max_tokens,
                                 seed=request_seed(args.seed, salt, i)) for i in range(len(prompts_))]
        groups = engine.generate(llm, prompts_, params, progress=f"evaluation: {label}")
        return groups, [tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]

    def evaluate(step: int) -> float:
        t0 = time.time()
        groups, texts = sample_for_eval(eval_prompts, -1, "held-out problems")
        rows = [r for r in eval_rows for _ in range(args.eval_samples)]
        rewards, valid, points, _ = score_responses(args, texts, rows, verifier=verifier, judge=judge,
                                                    evaluation=True)
        score = float(np.mean(rewards))
        if master:
            writer.add_scalar("eval/mean_score", score, step)
            if args.reward == "judge":
                writer.add_scalar("eval/pass_rate", float(np.mean([(p or 0) >= 6 for p in points])), step)
                writer.add_scalar("eval/judge_invalid", float(np.mean([not v for v in valid])), step)
            writer.add_scalar("eval/response_len_mean", float(np.mean([len(c.token_ids) for g in groups for c in g])),
                              step)
        if train_eval_prompts:  # the same sampling on training problems: the train / held-out gap
            _, texts = sample_for_eval(train_eval_prompts, -4, "training problems")
            rows = [r for r in train_eval_rows for _ in range(args.eval_samples)]
            train_score = float(np.mean(score_responses(args, texts, rows, verifier=verifier, judge=judge)[0]))
            if master:
                writer.add_scalar("eval/train_score", train_score, step)
        if master:
            writer.add_scalar("time/eval", time.time() - t0, step)
        return score

    last_eval = evaluate(0) if args.eval_every and start_step == 0 else float("nan")
    if start_step == 0 and master:
        print(f"step 0 | eval {last_eval:.3f}")

    for step in range(start_step + 1, args.num_steps + 1):
        t_step = time.time()
        # 1. sample G complete responses for each of B problems
        t0 = time.time()
        batch_idx = problems_for_step(len(train_rows), args.problems_per_step, step, args.seed)
        params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=args.max_response_tokens, logprobs=0,
                                 seed=request_seed(args.seed, step, j)) for j in range(len(batch_idx))]
        peaks.start()
        groups = engine.generate(llm, [prompts[i] for i in batch_idx], params)
        peaks.end("rollout")
        engine.sleep(llm, args.vllm_sleep_level)
        samples = [(i, c) for i, g in zip(batch_idx, groups) for c in g]  # group-major: G rows per problem
        new_tokens = [len(c.token_ids) for _, c in samples]
        t_generate = time.time() - t0

        # 2. score every response; a judge that fails most calls step after step stops the run, with the
        #    state before this step saved, rather than train the policy on its zeros
        t0 = time.time()
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in samples]
        rewards, valid, _, calls = score_responses(args, texts, [train_rows[i] for i, _ in samples], verifier=verifier,
                                                   judge=judge)
        judge_streak, warning = judge_failure_streak(calls, judge_streak)
        if warning and master:
            print(f"warning: step {step}: {warning}", flush=True)
        if judge_streak >= args.judge_max_invalid_steps:
            path = save(step - 1)
            raise SystemExit(f"stopped: more than half of the judge's calls failed in {judge_streak} consecutive "
                             f"steps (last: {warning}). The state before step {step} is saved in {path}; fix the "
                             f"judge, then continue with --resume {path}")
        total_tokens += sum(new_tokens)
        total_flops += sum(engine.decoding_flops(flops_A, flops_B, len(prompts[i]), len(c.token_ids))
                           for i, c in samples)
        rewards_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = group_advantages(rewards_t, args.group_size, args.std_normalize)
        t_score = time.time() - t0

        # 3. old log-probabilities and entropies, recomputed by the trainer (logits / temperature), for the rows
        #    this process trains (all of them with one process; row i goes to rank i % world under torchrun)
        t0 = time.time()
        seqs = [prompts[i] + c.token_ids for i, c in samples]
        starts = [len(prompts[i]) for i, _ in samples]
        lengths = [len(s) for s in seqs]
        old_logps, ref_logps, entropies = {}, {}, {}
        model.eval()
        peaks.start()
        with torch.no_grad(), autocast(device):
            for mb in dist.even(make_micro_batches(dist.mine(range(len(samples))), lengths, args.micro_batch_tokens)):
                if not mb:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
                    dist.idle_pass(model)
                    if ref_model is not None:
                        dist.idle_pass(ref_model)
                    continue
                ids = pad_batch([seqs[i] for i in mb], tokenizer.pad_token_id, device)
                mb_starts, mb_lens = [starts[i] for i in mb], [new_tokens[i] for i in mb]
                lp, ent = sequence_logprobs(model, ids, mb_starts, mb_lens, args.temperature,
                                            args.logprob_chunk_tokens, with_entropy=True)
                ref = sequence_logprobs(ref_model, ids, mb_starts, mb_lens, args.temperature,
                                        args.logprob_chunk_tokens)[0] if ref_model else lp
                for j, a, b, c in zip(mb, lp.split(mb_lens), ent.split(mb_lens), ref.split(mb_lens)):
                    old_logps[j], entropies[j], ref_logps[j] = a, b, c
        peaks.end("old_logprobs")
        mine = sorted(old_logps)
        trainer_lp = torch.cat([old_logps[i] for i in mine] or [torch.zeros(0)]).float().cpu()
        vllm_lp = torch.tensor([x for i in mine for x in samples[i][1].logprobs])
        log_ratio = trainer_lp - vllm_lp  # trainer vs sampler on the sampled tokens
        mismatch_kl = dist.mean_all(torch.exp(log_ratio) - 1 - log_ratio)
        mismatch_max = dist.max_all(float(log_ratio.abs().max()) if len(log_ratio) else 0.0)
        mean_entropy = dist.mean_all(torch.cat([entropies[i] for i in mine] or [torch.zeros(0)]).float().cpu())
        # 4. adaptive entropy control, once per step before the update (every GRPO row has an empty prefix)
        if args.entropy_control:
            k_entropy = update_entropy_offset(k_entropy, mean_entropy, args)
        clip_high = args.clip_high + (k_entropy if args.entropy_control else 0.0)

        # 5. PPO update: one epoch, num_minibatches consecutive minibatches, each one optimizer step. Loss
        #    denominators count the whole minibatch, so each rank's share adds up to the one-process loss.
        model.train()
        stats = {"policy_loss": 0.0, "clip_low": 0.0, "clip_high": 0.0, "clip_dual": 0.0, "approx_kl": 0.0,
                 "kl_ref": 0.0}
        grad_norms, skipped = [], 0
        n = len(samples)
        for m in range(args.num_minibatches):
            mb_idx = [i for i in range(m * n // args.num_minibatches, (m + 1) * n // args.num_minibatches)
                      if new_tokens[i] > 0]
            if not mb_idx:
                continue
            denom = sum(new_tokens[i] for i in mb_idx) if args.loss_agg == "token-mean" else len(mb_idx)
            optimizer.zero_grad(set_to_none=True)
            peaks.start()
            for micro in dist.even(make_micro_batches(dist.mine(mb_idx), lengths, args.micro_batch_tokens)):
                if not micro:
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in micro], tokenizer.pad_token_id, device)
                with autocast(device):
                    logp, _ = sequence_logprobs(model, ids, [starts[i] for i in micro], [new_tokens[i] for i in micro],
                                                args.temperature, args.logprob_chunk_tokens)
                old = torch.cat([old_logps[i] for i in micro])
                adv = torch.cat([advantages[i].expand(new_tokens[i]) for i in micro]).to(device)
                tok_loss, st = ppo_loss(logp, old, adv, args.clip_low, clip_high, args.dual_clip)
                if ref_model is not None:  # k3 estimator of KL(pi || pi_ref), per token
                    d = torch.cat([ref_logps[i] for i in micro]) - logp
                    kl = torch.exp(d) - d - 1
                    tok_loss = tok_loss + args.kl_coef * kl
                    stats["kl_ref"] += float(kl.detach().sum()) / sum(new_tokens)
                loss = aggregate_loss(tok_loss, [new_tokens[i] for i in micro], args.loss_agg, denom)
                loss.backward()
                stats["policy_loss"] += float(loss.detach()) / args.num_minibatches
                for key in ("clip_low", "clip_high", "clip_dual", "approx_kl"):
                    stats[key] += float(st[key].detach().float().sum()) / sum(new_tokens)
            peaks.end("backward")
            grad_norm = dist.full(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            if torch.isfinite(grad_norm):
                peaks.start()
                dist.step(optimizer, device, args.offload_optimizer)
                peaks.end("optimizer_step")
            else:  # a non-finite gradient would poison the weights; skip this minibatch's step
                skipped += 1
            grad_norms.append(float(grad_norm))
        model.zero_grad(set_to_none=True)  # free the gradients before the engine takes the memory back
        stats = {k: dist.sum_all(v) for k, v in stats.items()}  # each rank summed its own rows
        t_train = time.time() - t0

        # 6. the engine serves the new weights from the next rollout on
        t0 = time.time()
        peaks.start()
        engine.wake_up(llm, model)
        peaks.end("wake_up")
        t_sync = time.time() - t0

        # 7. log (rank 0)
        r = rewards_t.view(-1, args.group_size)
        scalars = {
            "charts/decoding_flops": total_flops, "charts/generated_tokens": total_tokens,
            "charts/step_time": time.time() - t_step, "charts/learning_rate": args.learning_rate,
            "train/reward_mean": float(rewards_t.mean()), "train/reward_std": float(rewards_t.std()) if n > 1 else 0.0,
            "train/zero_std_frac": float((r.std(dim=1) == 0).float().mean()) if args.group_size > 1 else 1.0,
            "train/judge_invalid": float(np.mean([not v for v in valid])),
            "train/response_len_mean": float(np.mean(new_tokens)), "train/response_len_min": min(new_tokens),
            "train/response_len_max": max(new_tokens),
            "train/truncated_frac": float(np.mean([c.truncated for _, c in samples])),
            "losses/policy_loss": stats["policy_loss"],
            "losses/clipfrac": stats["clip_low"] + stats["clip_high"],
            "losses/clipfrac_low": stats["clip_low"], "losses/clipfrac_high": stats["clip_high"],
            "losses/clipfrac_dual": stats["clip_dual"], "losses/approx_kl": stats["approx_kl"],
            "losses/entropy": mean_entropy, "losses/eps_high": clip_high,
            "losses/grad_norm": float(np.mean(grad_norms)),
            "losses/skipped_steps": skipped, "sampling/mismatch_kl": mismatch_kl, "sampling/mismatch_max": mismatch_max,
            "time/generate": t_generate, "time/score": t_score, "time/train": t_train, "time/sync": t_sync,
        }
        if ref_model is not None:
            scalars["losses/kl_ref"] = stats["kl_ref"]
        scalars.update(peaks.pop())
        if master:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            if args.log_completions_every and step % args.log_completions_every == 0:
                shown = "\n\n".join(f"**reward {rewards[j]:.2f}**\n```\n{texts[j][-2000:]}\n```"
                                     for j in range(min(4, n)))
                writer.add_text("samples/completions", shown, step)
        if args.eval_every and (step % args.eval_every == 0 or step == args.num_steps):
            last_eval = evaluate(step)
        if master:
            print(f"step {step}/{args.num_steps} | reward {scalars['train/reward_mean']:.3f} | eval {last_eval:.3f} | "
                  f"len {scalars['train/response_len_mean']:.0f} | kl {mismatch_kl:.1e} | gen {t_generate:.1f}s "
                  f"score {t_score:.1f}s train {t_train:.1f}s sync {t_sync:.2f}s", flush=True)

        # 8. checkpoint
        if args.save_every and (step % args.save_every == 0 or step == args.num_steps):
            path = save(step)
            if master:
                print(f"saved {path}")

    if master:
        writer.close()
    if verifier is not None:
        verifier.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
