"""RPO: Replay-based Policy Optimization (Yi et al., arXiv 2601.19404; docs/rpo.md).

Every training problem keeps one cached answer a_k. Each step, for each problem, draw m ~ U{1..L}, keep the
cached answer minus its last m tokens as a shared prefix, and sample G continuations of at most m new tokens
from it: the policy only decodes the tail of an answer it (or an earlier version of it) already wrote. The
full response (prefix + continuation) is verified; correct responses earn a length-aware reward that keeps
within-group differences alive when every response is right (Section 3.4). After the update the cache
takes one response of the group: the best with probability epsilon, else a uniformly chosen other one.
Only sampling and the reward change: the objective is GRPO's (or DAPO's), Eqs. 5-8.

    python rpo.py --tiny                                                 # built-in task, CPU, minutes
    python rpo.py --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B     # the paper's 1.5B configuration
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
from common.judges import AnswerVerifier, Watch, extract_final_answer, watch_scores
from common.tiny import resolve_model, tiny_reward

OPEN_RS_PROMPT = (  # open-rs style: think first, answer in \boxed{} (the paper's Section 4.1)
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer, "
    "and put your final answer within \\boxed{{}}.\n\n{problem}"
)


@dataclasses.dataclass
class Args:
    """RPO. Defaults reproduce the paper's 1.5B configuration (Section 4.1); `--tiny` runs the built-in task."""

    # --- experiment ---
    tiny: bool = False
    """use the built-in tiny task and model with the scaled-down defaults of `tiny_args()` (other flags still apply)"""
    exp_name: str = "rpo"
    """the name of this experiment (prefix of the run name)"""
    run_name: str | None = None
    """TensorBoard run folder under runs/ (default: <exp_name>__<seed>__<time>, or the resumed run's name)"""
    seed: int = 1
    """seed of the data order, the truncations, the cache updates, every sampling request and torch"""
    epochs: int = 4
    """passes over the training set (the number of steps follows from the batch size)"""
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
    model: str = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    """policy: a hub id, a local folder, or `tiny`"""
    dataset: str = "knoveleng/open-rs"
    """training problems: a hub id, a .json/.jsonl file, a save_to_disk folder, or `tiny`"""
    dataset_split: str = "train"
    """split of the training dataset"""
    problem_field: str = "problem"
    """field holding the problem statement"""
    answer_field: str = "answer"
    """field holding the gold final answer"""
    train_limit: int | None = None
    """use only the first N training problems"""
    eval_dataset: str = "HuggingFaceH4/MATH-500"
    """held-out problems (same formats as --dataset; the paper evaluated MATH-500, AIME, AMC, ...)"""
    eval_split: str = "test"
    """split of the evaluation dataset"""
    eval_problem_field: str = "problem"
    """problem field of the evaluation set"""
    eval_answer_field: str = "answer"
    """gold answer field of the evaluation set"""
    eval_limit: int | None = None
    """use only the first N evaluation problems"""
    train_eval_problems: int = 64
    """training problems (a fixed seeded sample) also evaluated at every evaluation, as eval/train_score (0: off)"""
    prompt_template: str = OPEN_RS_PROMPT
    """user message; `{problem}` is replaced by the problem"""
    max_ungradable_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps in which no response held an answer the reward can
    grade: every reward 0, a model that ignores the prompt's format"""

    # --- RPO: cache, truncation, length-aware reward ---
    truncation: Literal["dynamic", "fixed"] = "dynamic"
    """L = floor(shortest response of the problem's previous group / 2) (dynamic, the main results) or fixed"""
    fixed_L: int = 300
    """L when --truncation fixed (the paper: 300, 500, 800)"""
    continuation_budget: Literal["m", "loose"] = "m"
    """new tokens per continuation: m (the released code) or max_response_tokens - prefix (project choice)"""
    prefix_in_loss: bool = True
    """train on the cached prefix tokens too (the paper's objective and code); off masks the prefix"""
    cache_update: Literal["epsilon", "none"] = "epsilon"
    """after each update replace each cached answer by one of its group (epsilon-greedy), or freeze the cache"""
    cache_epsilon: float = 0.1
    """probability of caching the highest-reward response (else a uniformly chosen other one); paper 0.1"""
    cache_init: Literal["eager", "lazy"] = "eager"
    """sample every problem's first answer before training (eager), or the first time it is visited (lazy)"""
    cache_init_temperature: float = 0.9
    """temperature of the cache's initial answers (released code)"""
    cache_init_top_p: float = 0.9
    """top-p of the cache's initial answers (released code)"""
    cache_init_max_tokens: int | None = None
    """length limit of the cache's first answers (default: --max-response-tokens, the paper's maximum generation
    length; with a continuation budget of m no response ever outgrows its cached answer, so a first answer cut
    at 2,048 before its final answer could never be finished). The released code used 2,048"""
    length_alpha: float = 0.01
    """alpha of the length-aware reward sigma(alpha * (l_ref - len)); 0 disables the shaping"""
    length_min: float = 0.5
    """m: lower clip of a correct response's shaped reward"""
    length_max: float = 1.0
    """M: upper clip of a correct response's shaped reward"""
    length_ref: Literal["group", "correct"] = "group"
    """l_ref: mean length over the whole group (paper) or over its correct responses (released code)"""

    # --- rollouts ---
    problems_per_step: int = 96
    """problems per step (global batch 576 = 96 x 6)"""
    group_size: int = 6
    """G: continuations per problem"""
    max_response_tokens: int = 4096
    """maximum generation length (prefix + continuation are capped at this)"""
    temperature: float = 0.7
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

    # --- objective ---
    objective: Literal["grpo", "dapo"] = "grpo"
    """grpo: std-normalised advantage, per-sequence token mean, k3 KL to the initial policy;
    dapo: token mean over the batch, clip-higher, no KL (the paper reports RPO on top of both)"""
    kl_coef: float = 0.04
    """beta of the k3 KL penalty (GRPO objective only)"""
    clip_low: float = 0.2
    """PPO epsilon (low side)"""
    clip_high: float = 0.2
    """PPO epsilon (high side) for GRPO; DAPO uses --dapo-clip-high"""
    dapo_clip_high: float = 0.28
    """clip-higher epsilon of the DAPO objective"""
    learning_rate: float = 1e-6
    """AdamW peak learning rate (cosine decay after a linear warm-up)"""
    warmup_frac: float = 0.1
    """share of the steps spent warming the learning rate up"""
    min_lr_rate: float = 0.1
    """the cosine decays to this fraction of the peak (released recipe: `cosine_with_min_lr`, min_lr_rate 0.1)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
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
    eval_top_k: int = -1
    """evaluation top-k (-1: off)"""
    eval_max_tokens: int = 4096
    """evaluation response limit"""
    log_completions_every: int = 20
    """log a few sample completions as text every this many steps"""


def tiny_args() -> Args:
    """The built-in task on a 2-core CPU: the paper's recipe scaled down. Responses are 15-65 tokens, so
    truncations L are ~10-30 tokens; evaluation samples the policy itself at T = 1 as for every script."""
    return Args(
        tiny=True, model="tiny", dataset="tiny", eval_dataset="tiny", eval_split="test", prompt_template="{problem}",
        train_limit=512, epochs=6, problems_per_step=32, group_size=6, max_response_tokens=200, temperature=1.0,
        learning_rate=1e-4, warmup_frac=0.1, cache_init_temperature=1.0,
        cache_init_top_p=1.0, micro_batch_tokens=16_384, save_every=0, eval_every=10, eval_samples=4,
        eval_temperature=1.0, eval_top_p=1.0, eval_max_tokens=200, log_completions_every=10, train_eval_problems=256,
    )


# ====================================================================================================
# ALGO LOGIC: RPO's rules, its loss and the stages of its step (what a fork changes)
# ====================================================================================================
def length_aware_reward(correct, lengths, alpha: float, m: float, M: float, ref: str = "group") -> list[float]:
    """Eq. 11 on one group: R_i = clip(r_i * sigmoid(alpha * (l_ref - len_i)), m, M) for correct responses,
    0 for wrong ones (the released code; read literally, clip(0, m, M) would pay wrong answers m).
    l_ref = mean length of the group (paper) or of its correct responses (ref="correct", the code).
    alpha = 0 gives every correct response sigmoid(0) = 0.5 (clipped to [m, M])."""
    lengths = np.asarray(lengths, dtype=float)
    right = np.asarray(correct, dtype=bool)
    pool = lengths[right] if ref == "correct" and right.any() else lengths
    l_ref = pool.mean() if len(pool) else 0.0
    shaped = np.clip(1.0 / (1.0 + np.exp(-alpha * (l_ref - lengths))), m, M)
    return np.where(right, shaped, 0.0).tolist()


def truncation_limit(args: Args, cached_len: int, previous_shortest: int | None) -> int:
    """L: fixed, or floor(l / 2) with l the shortest response of this problem's previous group (its cached
    answer's length on a first visit: the current group does not exist yet at rollout time)."""
    if args.truncation == "fixed":
        return args.fixed_L
    return max(1, (previous_shortest if previous_shortest is not None else cached_len) // 2)


def draw_truncation(L: int, cached_len: int, rng: np.random.Generator) -> int:
    """m ~ U{1..L} (the code starts at 1: m = 0 would give an empty budget), clamped to the cached length."""
    return min(int(rng.integers(1, L + 1)), cached_len)


def pick_cache_entry(rewards: list[float], epsilon: float, rng: np.random.Generator) -> int:
    """Eq. 10: with probability epsilon the highest-reward response, else one of the other G-1 uniformly."""
    best = int(np.argmax(rewards))
    if rng.random() <= epsilon or len(rewards) == 1:
        return best
    others = [i for i in range(len(rewards)) if i != best]
    return others[int(rng.integers(len(others)))]


def loss_span(prompt_len: int, prefix_len: int, continuation_len: int, prefix_in_loss: bool) -> tuple[int, int]:
    """(first position, count) of the tokens that carry loss in prompt + prefix + continuation: the whole
    response o = prefix || continuation (the paper's Eqs. 5-8 and code), or only the new tokens."""
    start = prompt_len + (0 if prefix_in_loss else prefix_len)
    return start, prompt_len + prefix_len + continuation_len - start


def cache_init_limit(args: Args) -> int:
    """Length limit of the cache's first answers: --cache-init-max-tokens, else the maximum generation length."""
    return args.cache_init_max_tokens or args.max_response_tokens


def lr_factor(step: int, warmup: int, total: int, min_rate: float) -> float:
    """Learning rate / peak before optimizer step `step` (0-based): linear warm-up over `warmup` steps (the first
    step already at 1/warmup), then a cosine from 1 down to `min_rate` at the last step (the released recipe,
    transformers' `cosine_with_min_lr` with min_lr_rate 0.1)."""
    if step + 1 < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step + 1 - warmup) / max(1, total - warmup))
    return min_rate + (1 - min_rate) * 0.5 * (1 + math.cos(math.pi * progress))


def grpo_advantages(rewards, group_size: int) -> torch.Tensor:
    """Eq. 6: (R_i - mean R) / std R per group (unbiased std + 1e-4, as TRL; equal rewards give 0).
    DAPO normalises the same way; it differs in aggregation, clip-higher and the absent KL."""
    r = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    return (adv / (r.std(dim=1, keepdim=True) + 1e-4) if group_size > 1 else adv).reshape(-1)


def verify(texts: list[str], rows: list[dict], field: str, tiny: bool, verifier) -> list[float]:
    """r in {0, 1} on the full response: math-verify (gold first), or the tiny task's own verifier."""
    if tiny:
        return [tiny_reward(t, r["answer"]) for t, r in zip(texts, rows)]
    return verifier.verify([str(r[field]) for r in rows], [extract_final_answer(t) for t in texts])


def eval_scores(texts: list[str], rows: list[dict], held_out: bool, args: Args, verifier):
    """Evaluation's scores: accuracy from scratch (no cached prefix), held-out or on training problems."""
    if held_out:
        return verify(texts, rows, args.eval_answer_field, args.eval_dataset == "tiny", verifier), {}
    return verify(texts, rows, args.answer_field, args.dataset == "tiny", verifier), {}


@dataclasses.dataclass
class AnswerCache:
    """The cache pool (Section 3.1): one answer per training problem, right or wrong, and what RPO tracks of it."""

    answers: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # problem -> cached answer token ids
    correct: dict[int, float] = dataclasses.field(default_factory=dict)
    finished: dict[int, bool] = dataclasses.field(default_factory=dict)  # has a final answer (else only cut shorter)
    previous_shortest: dict[int, int] = dataclasses.field(default_factory=dict)  # L's statistic, per problem

    def put(self, problem: int, answer: list[int], correct: float, text: str) -> None:
        self.answers[problem], self.correct[problem] = list(answer), correct
        self.finished[problem] = extract_final_answer(text) is not None

    def state_dict(self) -> dict:
        return {"cache": self.answers, "cache_correct": self.correct, "cache_finished": self.finished,
                "previous_shortest": self.previous_shortest}

    def load_state_dict(self, s: dict) -> None:
        self.answers, self.correct, self.finished = s["cache"], s["cache_correct"], s["cache_finished"]
        self.previous_shortest = s["previous_shortest"]


def first_answers(llm, tok, train: Problems, problems: list[int], step: int, cache: AnswerCache, counters: Counters,
                  args: Args, verifier) -> None:
    """Cache pool initialisation (Section 3.1, Eq. 1): one answer per problem from the current policy, right or
    wrong, counted in charts/decoding_flops. Eager: every problem before step 1; lazy: on first visit."""
    from vllm import SamplingParams

    if not problems:
        return
    params = [SamplingParams(temperature=args.cache_init_temperature, top_p=args.cache_init_top_p,
                             max_tokens=cache_init_limit(args), seed=request_seed(args.seed, -2, step, p))
              for p in problems]
    answers = engine.generate(llm, [train.prompts[p] for p in problems], params, progress="the cache's first answers")
    texts = [tok.decode(a[0].token_ids, skip_special_tokens=True) for a in answers]
    rewards = verify(texts, [train.rows[p] for p in problems], args.answer_field, args.dataset == "tiny", verifier)
    for p, a, r, t in zip(problems, answers, rewards, texts):
        cache.put(p, a[0].token_ids, r, t)
        counters.add(len(train.prompts[p]), len(a[0].token_ids))


@dataclasses.dataclass
class Truncation:
    """One problem's replayed prefix this step: the cached answer minus its last m tokens, m ~ U{1..L}."""

    problem: int
    L: int
    m: int
    prefix: list[int]
    budget: int  # new tokens per continuation


def truncate(cache: AnswerCache, batch: list[int], args: Args, rng: np.random.Generator) -> list[Truncation]:
    """Section 3.2, Eq. 3: one shared prefix per problem; the continuation budget is m (the released code) or the
    rest of --max-response-tokens (project choice)."""
    out = []
    for p in batch:
        answer = cache.answers[p]
        L = truncation_limit(args, len(answer), cache.previous_shortest.get(p))
        m = draw_truncation(L, len(answer), rng)
        prefix = answer[: len(answer) - m]
        budget = m if args.continuation_budget == "m" else args.max_response_tokens - len(prefix)
        out.append(Truncation(p, L, m, prefix, budget))
    return out


def sample_tails(llm, train: Problems, cuts: list[Truncation], step: int, args: Args, peaks) -> list[Sample]:
    """Eq. 4: G continuations of each shared prefix, group-major; the policy decodes only an answer's tail."""
    from vllm import SamplingParams

    params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             max_tokens=max(1, c.budget), logprobs=0, seed=request_seed(args.seed, step, j))
              for j, c in enumerate(cuts)]
    contexts = [train.prompts[c.problem] + c.prefix for c in cuts]
    peaks.start()
    groups = engine.generate(llm, contexts, params)
    peaks.end("rollout")
    return [Sample(c.problem, ctx, o) for c, ctx, group in zip(cuts, contexts, groups) for o in group]


def verify_responses(tok, train: Problems, cuts: list[Truncation], samples: list[Sample], args: Args, verifier):
    """(responses o = prefix || continuation, their texts, their verifier rewards r in {0, 1})."""
    responses = [cuts[j // args.group_size].prefix + s.completion.token_ids for j, s in enumerate(samples)]
    texts = [tok.decode(o, skip_special_tokens=True) for o in responses]
    return responses, texts, verify(texts, [train.rows[s.problem] for s in samples], args.answer_field,
                                    args.dataset == "tiny", verifier)


def shaped_rewards(correct: list[float], responses: list[list[int]], args: Args) -> list[float]:
    """Section 3.4, Eq. 11, group by group, lengths in tokens of the full response (prefix + continuation)."""
    shaped = []
    for j in range(0, len(correct), args.group_size):
        sl = slice(j, j + args.group_size)
        shaped += length_aware_reward(correct[sl], [len(o) for o in responses[sl]], args.length_alpha,
                                      args.length_min, args.length_max, args.length_ref)
    return shaped


def ppo_loss(logp, old_logp, adv, clip_low: float, clip_high: float):
    """Per-token PPO/GRPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old_logp) (Eq. 5),
    plus which clip was active."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    stats = {"clip_low": (adv < 0) & (ratio < 1 - clip_low), "clip_high": (adv > 0) & (ratio > 1 + clip_high),
             "approx_kl": (ratio - 1) - torch.log(ratio)}  # k3 estimate of KL(old || new)
    return loss, stats


def training_rows(samples: list[Sample], cuts: list[Truncation], advantages: torch.Tensor,
                  args: Args) -> list[TrainRow]:
    """prompt + the full response o = prefix || continuation, with the loss on o or on the continuation only."""
    rows = []
    for j, (s, a) in enumerate(zip(samples, advantages)):
        prefix = cuts[j // args.group_size].prefix
        start, n = loss_span(len(s.context) - len(prefix), len(prefix), len(s.completion.token_ids),
                             args.prefix_in_loss)
        rows.append(TrainRow(s.context + s.completion.token_ids, start, n, float(a), sampled=s.completion.logprobs,
                             prefix_len=len(prefix)))
    return rows


def micro_batch_loss(rows: list[TrainRow], logp, minibatch: list[TrainRow], args: Args):
    """A micro-batch's share of its minibatch's loss (Eqs. 5-8): GRPO = per-sequence token mean, summed / the
    minibatch's sequences, + beta * k3 KL; DAPO = token sum / the minibatch's tokens, clip-higher, no KL."""
    dapo = args.objective == "dapo"
    clip_high, kl_coef = (args.dapo_clip_high, 0.0) if dapo else (args.clip_high, args.kl_coef)
    denom = sum(r.n for r in minibatch) if dapo else len(minibatch)
    adv = torch.cat([torch.full((r.n,), r.advantage) for r in rows]).to(logp.device)
    tok_loss, st = ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, args.clip_low, clip_high)
    sums = {key: float(v.detach().float().sum()) for key, v in st.items()}
    if args.rollout_correction != "none":  # the sampler's gap on the continuation (the prefix's weights are 1)
        tok_loss = tok_loss * torch.cat([r.is_weight for r in rows])
    if kl_coef > 0:  # k3 estimator of KL(pi || pi_ref)
        d = torch.cat([r.ref_logp for r in rows]) - logp
        kl = torch.exp(d) - d - 1
        tok_loss = tok_loss + kl_coef * kl
        sums["kl_ref"] = float(kl.detach().sum())
    if dapo:
        return tok_loss.sum() / denom, sums
    return torch.stack([t.mean() for t in tok_loss.split([r.n for r in rows])]).sum() / denom, sums


STATS = ("clip_low", "clip_high", "approx_kl", "kl_ref")  # what `micro_batch_loss` counts


def update_cache(cache: AnswerCache, cuts: list[Truncation], responses, texts, correct, shaped, args: Args,
                 rng: np.random.Generator) -> None:
    """Section 3.3, Eq. 10, after the gradient update: every problem's entry is replaced by one of its group's
    responses (prefix + continuation); and L's statistic, the group's shortest response, for its next visit."""
    for j, c in enumerate(cuts):
        sl = range(j * args.group_size, (j + 1) * args.group_size)
        cache.previous_shortest[c.problem] = min(len(responses[i]) for i in sl)
        if args.cache_update == "epsilon":
            pick = sl[pick_cache_entry([shaped[i] for i in sl], args.cache_epsilon, rng)]
            cache.put(c.problem, responses[pick], correct[pick], texts[pick])


def step_scalars(cuts, samples, responses, correct, shaped, cache: AnswerCache, args: Args) -> dict:
    """RPO's own logged quantities of one step."""
    return {
        "train/reward_mean": float(np.mean(shaped)), "train/accuracy": float(np.mean(correct)),
        "train/response_len_mean": float(np.mean([len(o) for o in responses])),
        "rpo/new_tokens_per_sample": float(np.mean([len(s.completion.token_ids) for s in samples])),
        "rpo/m_mean": float(np.mean([c.m for c in cuts])), "rpo/L_mean": float(np.mean([c.L for c in cuts])),
        "rpo/prefix_len_mean": float(np.mean([len(c.prefix) for c in cuts])),
        "rpo/reward_before_shaping": float(np.mean(correct)), "rpo/reward_after_shaping": float(np.mean(shaped)),
        "rpo/cache_correct_frac": float(np.mean(list(cache.correct.values()))),
        "rpo/cache_len_mean": float(np.mean([len(a) for a in cache.answers.values()])),
        # entries without a final answer: with a continuation budget of m their groups can never score
        "rpo/cache_unfinished_frac": 1.0 - float(np.mean(list(cache.finished.values()))),
        "rpo/zero_std_frac": float((torch.tensor(shaped, dtype=torch.float32).view(-1, args.group_size).std(dim=1)
                                    == 0).float().mean()),
    }


def completions(tok, cuts: list[Truncation], samples: list[Sample], shaped: list[float]) -> list[str]:
    """Two sample completions as text, the kept prefix and the new tail told apart."""
    return [f"**m={cuts[0].m}, reward {shaped[i]:.2f}** (prefix ends at `|`)\n```\n"
            f"{tok.decode(cuts[0].prefix, skip_special_tokens=True)}|"
            f"{tok.decode(samples[i].completion.token_ids, skip_special_tokens=True)}\n```" for i in range(2)]


def progress_line(step: int, last_step: int, scalars: dict, last_eval: float, clock: Clock) -> str:
    t = clock.times
    return (f"step {step}/{last_step} | reward {scalars['train/reward_mean']:.3f} acc "
            f"{scalars['train/accuracy']:.3f}{eval_field(last_eval)} | new tok/sample "
            f"{scalars['rpo/new_tokens_per_sample']:.1f} | cache correct {scalars['rpo/cache_correct_frac']:.2f} | "
            f"gen {t['time/generate']:.1f}s train {t['time/train']:.1f}s")


def save(step: int, model, tok, optimizer, schedule, run_name: str, cache: AnswerCache, counters: Counters,
         args: Args) -> Path:
    """A checkpoint of everything the run carries, as of the end of step `step`."""
    state = {"run_name": run_name, "schedule": schedule.state_dict(), **cache.state_dict(), **counters.state_dict()}
    return parallel.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok, {"optimizer": optimizer},
                                    state, args.keep_checkpoints)


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
    check_flags(args, "the replayed prefix's tokens, trained with --prefix-in-loss, were not sampled this step: add "
                "--no-prefix-in-loss" if args.prefix_in_loss else None)
    rank, device, resume_dir, ckpt, run_name = start_run(args)
    master = rank == 0

    # --- data, models and engine (each fails fast, with one sentence) ---
    rows = load_rows(args.dataset, args.dataset_split, [args.problem_field, args.answer_field], args.train_limit)
    eval_rows = load_rows(args.eval_dataset, args.eval_split, [args.eval_problem_field, args.eval_answer_field],
                          args.eval_limit) if args.eval_every else []
    model_path, config, tok, model = load_policy(args, device, resume_dir, len(eval_rows))
    ref_model = load_reference(model_path, device) if args.objective == "grpo" and args.kl_coef > 0 else None
    num_steps = math.ceil(args.epochs * len(rows) / args.problems_per_step)
    warmup = max(1, int(args.warmup_frac * num_steps))
    optimizer = adamw(model, args.learning_rate, args.weight_decay, device)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=num_steps,
                                                                    min_rate=args.min_lr_rate))
    train = Problems(rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.problem_field]))
                            for r in rows])
    held_out = Problems(eval_rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.eval_problem_field]))
                                    for r in eval_rows])
    sample = train_sample(len(train.rows), args)
    train_eval = Problems([train.rows[i] for i in sample], [train.prompts[i] for i in sample])
    peaks = parallel.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    longest = max(args.max_response_tokens, args.eval_max_tokens if args.eval_every else 0, cache_init_limit(args))
    longest += max(map(len, train.prompts + held_out.prompts)) + 8
    llm = start_engine(model_path, config, longest, args, peaks, master)
    verifier = AnswerVerifier()  # its worker processes start on first use only
    score = partial(eval_scores, args=args, verifier=verifier)

    # --- state a checkpoint carries: the cache, each problem's previous shortest response, counters ---
    start_step, cache, counters = 0, AnswerCache(), Counters(*engine.decoding_flops_coefficients(config))
    watch = Watch()  # steps in a row with no gradable answer (not checkpointed)
    if ckpt:
        parallel.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                                 offload=("optimizer",) if args.offload_optimizer else ())
        schedule.load_state_dict(ckpt["schedule"])
        cache.load_state_dict(ckpt)
        start_step = ckpt["step"]
        counters.load_state_dict(ckpt)
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)  # the engine serves exactly the trainer's (possibly resumed) weights
    writer = open_writer(run_name, args, master)
    last_eval = float("nan")
    if start_step == 0:
        if args.cache_init == "eager":  # Section 3.1: every problem's first answer before training
            t0 = time.time()
            first_answers(llm, tok, train, list(range(len(train.rows))), 0, cache, counters, args, verifier)
            if master:
                print(f"cache initialised: {len(cache.answers)} answers, "
                      f"{np.mean(list(cache.correct.values())):.3f} correct, {time.time() - t0:.1f}s")
        if args.eval_every:
            last_eval = evaluate(0, llm, tok, held_out, train_eval, score, args, writer)
        log_scalars(writer, {"charts/decoding_flops": counters.decoding_flops,
                             "charts/generated_tokens": counters.generated_tokens}, 0)
        if master and args.eval_every:
            print(f"step 0 | eval {last_eval:.3f}")

    last_step = min(num_steps, args.num_steps or num_steps)
    for step in range(start_step + 1, last_step + 1):
        clock = Clock()
        rng = np.random.default_rng([args.seed, step])  # this step's truncations and cache choices
        batch = problems_for_step(len(train.rows), args.problems_per_step, step, args.seed)
        # 1. Cache (Section 3.1): a problem first seen without an entry gets its first answer now (lazy init)
        first_answers(llm, tok, train, [p for p in batch if p not in cache.answers], step, cache, counters, args,
                      verifier)
        # 2. Truncate (Section 3.2, Eq. 3): the cached answer minus its last m tokens, m ~ U{1..L}
        cuts = truncate(cache, batch, args, rng)
        # 3. Roll out the tail (Eq. 4): G continuations of at most m new tokens from each shared prefix
        samples = sample_tails(llm, train, cuts, step, args, peaks)
        engine.sleep(llm, args.vllm_sleep_level)
        clock.lap("generate")
        # 4. Length-aware reward (Section 3.4, Eq. 11) on the full response -- the answer may sit in the prefix
        responses, texts, correct = verify_responses(tok, train, cuts, samples, args, verifier)
        watch_scores(watch, [], sum(extract_final_answer(t) is not None for t in texts), len(texts),
                     "a \\boxed{} answer after </think>", "--prompt-template", step, args, master, partial(
                         save, step - 1, model, tok, optimizer, schedule, run_name, cache, counters, args))
        counters.add_samples(samples)
        shaped = shaped_rewards(correct, responses, args)
        # GRPO and DAPO both normalise by the group's std (Eq. 6)
        rows = training_rows(samples, cuts, grpo_advantages(shaped, args.group_size), args)
        clock.lap("score")
        # 5. Update (Eqs. 5-8), the objective GRPO's or DAPO's
        old_logprobs(model, rows, args.temperature, args, peaks, ref_model)
        correction = rollout_correction(rows, args)  # --rollout-correction's weights, from these log-probabilities
        losses = ppo_update(model, optimizer, rows, partial(micro_batch_loss, args=args), STATS, args, peaks)
        lr_now = schedule.get_last_lr()[0]
        schedule.step()
        clock.lap("train")
        # 6. Cache update (Section 3.3, Eq. 10), after the gradient update
        update_cache(cache, cuts, responses, texts, correct, shaped, args, rng)
        wake_up(llm, model, peaks)
        clock.lap("sync")
        # 7. log, evaluate, checkpoint
        scalars = {**counters.scalars(), "charts/learning_rate": lr_now, **losses, **step_scalars(
            cuts, samples, responses, correct, shaped, cache, args), "rpo/continuation_entropy": sampled_entropy(rows),
            **correction, **sampler_gap(rows, args), **clock.scalars(), **peaks.pop()}
        log_step(writer, step, scalars, completions(tok, cuts, samples, shaped), args)
        if evaluating(step, last_step, args):
            last_eval = evaluate(step, llm, tok, held_out, train_eval, score, args, writer)
        if master:
            print(progress_line(step, last_step, scalars, last_eval, clock), flush=True)
        if saving(step, last_step, args):
            save(step, model, tok, optimizer, schedule, run_name, cache, counters, args)

    if writer is not None:
        writer.close()
    verifier.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
