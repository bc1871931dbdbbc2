"""AC2: Actor-Critic with Action Chunking (Wen, Bailey, Mahankali, Ma; arXiv 2609.39247; spec/ac2.md).

The policy and the value function share weights; the critic is the policy itself, asked through a prompt
for a number on the grid {0, 0.1, ..., 1}. Each step replays prefixes s of past trajectories and samples a
group of g continuations from each. On problems where the critic is trusted ("ready"), the continuations
are short *action chunks* c_i of b tokens whose endpoints the critic scores, v_i = V(s . c_i); elsewhere
they run to the end and the judge scores them. Either way A_i = v_i - mean_j v_j (lambda = 0 on ready
problems, lambda = 1 on unready ones, Section 3.2), and the critic learns to predict, at s, the group mean.
No terminal reward is needed on ready problems: that is where the decoding savings come from.

One step, in code order (spec/ac2.md "One step"): 1 batch (refills + replay slots, prefix cuts, cold
start) -> 2 route (full / short / audit) -> 3 generate -> 4 critic wave (probes + consumed chunks) ->
5 judge -> 6 invalid critic values -> 7 buffer update -> 8 readiness, reference bank, critic records ->
9 advantages -> 10 actor minibatch 1, critic step, actor minibatch 2 -> 11 sync, log, checkpoint.

    python ac2.py --tiny                                              # built-in task, CPU, minutes
    python ac2.py --model Qwen/Qwen3-4B-Thinking-2507 --judge-base-url https://api.deepseek.com/v1
    python ac2.py --prefix-grpo ...                                   # the paper's Prefix GRPO baseline
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import re
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
from common.judges import Judge, JudgeConfig, extract_final_answer, extract_proof
from common.tiny import TINY_CRITIC_INSTRUCTION, TINY_CRITIC_REFERENCE, resolve_model, tiny_reward

ACTOR_PROMPT = (  # Appendix C (spec/ac2.md "Actor prompt")
    "Consider the following mathematical problem:\n{problem}\n\nSolve the problem. Write a complete "
    "solution/proof.\n\n- Enclose any brief thinking in <think></think> tags, then finish your thinking with "
    "</think>.\n\nThen write your final solution/proof inside <proof></proof> tags:\n<proof>\n...your "
    "solution/proof...\n</proof>\n"
)
# Appendix C, "reward horizon" wording; without a reference the middle sentence and its blank line go
CRITIC_INSTRUCTION = (
    "Pause here and estimate how much rubric credit this attempt will earn if you continue it to completion "
    "within its remaining token budget: 0 means no credit, 1 means full credit for a complete and correct proof, "
    "and values in between mean partial credit.{reference}\n\nDon't think; answer immediately with a single line "
    "and nothing else:\n\nQ value: z\n\nwhere z is one of 0, 0.1, ..., 1. The first characters of your response "
    "must be `Q value:`."
)
CRITIC_REFERENCE = " You should refer to a reference correct proof here:\n\n{reference_proof}"
CRITIC_PREFILL = "<think>\n\n</think>\n\nQ value: "  # forced; note the trailing space
GRID_STRINGS = ["0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1"]


@dataclasses.dataclass
class Args:
    """AC2. Defaults are the paper's main run (Table 4, Appendix C); `--tiny` runs the built-in task."""

    # --- experiment ---
    tiny: bool = False
    """use the built-in tiny task and model with the scaled-down defaults of `tiny_args()` (other flags still apply)"""
    exp_name: str = "ac2"
    """the name of this experiment (prefix of the run name)"""
    run_name: str | None = None
    """TensorBoard run folder under runs/ (default: <exp_name>__<seed>__<time>, or the resumed run's name)"""
    seed: int = 1
    """seed of every random choice (per step), of every sampling request and of torch"""
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

    # --- model, data, judge ---
    model: str = "Qwen/Qwen3-4B-Thinking-2507"
    """policy and critic (shared weights): a hub id, a local folder, or `tiny`"""
    dataset: str = "lm-provers/FineProofs-RL"
    """training problems: a hub id, a .json/.jsonl file, a save_to_disk folder, or `tiny`"""
    dataset_split: str = "train"
    """split of the training dataset"""
    problem_field: str = "problem"
    """field holding the problem statement"""
    train_limit: int | None = None
    """use only the first N training problems (readiness needs problems to come back: AC2 epochs its data)"""
    eval_dataset: str = "lm-provers/IMOProofBench"
    """held-out problems, judged with their reference solution and grading guidelines"""
    eval_split: str = "train"
    """split of the evaluation dataset"""
    eval_solution_field: str = "solution"
    """reference solution field (given to the judge at validation only)"""
    eval_guidelines_field: str = "grading_guidelines"
    """grading guidelines field (given to the judge at validation only)"""
    eval_limit: int | None = None
    """use only the first N evaluation problems"""
    train_eval_problems: int = 64
    """training problems (a fixed seeded sample) also evaluated at every evaluation, as eval/train_score (0: off)"""
    prompt_template: str = ACTOR_PROMPT
    """user message; `{problem}` is replaced by the problem (default: the paper's actor prompt)"""
    judge_base_url: str = "https://api.deepseek.com/v1"
    """base URL of the judge's OpenAI-compatible API (the paper used DeepSeek-V4-Flash)"""
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
    pass_points: int = 6
    """judge points (of 7) for a pass: reference bank, correct-only buffer, a trajectory's own reference"""

    # --- batch, buffer, chunks (Table 4) ---
    group_size: int = 16
    """g: continuations per replayed prefix"""
    n_refill: int = 192
    """fresh problems per step, one full rollout each (refills the buffer; not trained on)"""
    n_batch: int = 192
    """replay slots per step"""
    buffer_size: int = 256
    """replay buffer capacity in trajectories (FIFO)"""
    budget: int = 50_000
    """total response budget: replayed prefix + new tokens"""
    chunk_tokens: int = 10_000
    """b: new tokens per action chunk on ready problems"""
    cut_grid: int = 10_000
    """prefix cuts are multiples of this many tokens"""
    cut_max_frac: float = 0.9
    """cuts are drawn uniformly from the grid points in [0, cut_max_frac * L]"""
    audit_frac: float | None = None
    """alpha: ceil(alpha * ready slots) ready slots get full rollouts (audits); 0 = the no-audit variant.
    Default 0.25, or 0 with --group-size-one (the paper's "w/o Group & Audit" variant is that one switch)"""
    temperature: float = 0.8
    """rollout temperature (old log-probabilities use logits / temperature too)"""
    top_p: float = 1.0
    """rollout top-p"""
    top_k: int = -1
    """rollout top-k (-1: off)"""

    # --- readiness (Section 3.1, Appendix C) ---
    readiness: Literal["local", "global"] = "local"
    """local: per-problem readiness; global: once the gate first opens every slot is ready (the ablation)"""
    tau_global: float = 0.20
    """the global gate opens when the pooled probe error of the last `window` steps is below this"""
    tau_local: float = 0.18
    """a problem becomes ready when a probe of this step has error below this (and the other conditions)"""
    window: int = 5
    """steps pooled by the global gate (the window must be full)"""
    min_valid: int = 8
    """valid rewards a group needs to give a critic target / readiness observation"""

    # --- critic (Appendix C) ---
    critic_buffer: int = 1920
    """critic FIFO capacity in prefix-target records"""
    critic_sample: int = 768
    """records per critic update (sampled without replacement)"""
    critic_lr: float = 2 * math.sqrt(2) * 1e-6
    """initial critic learning rate"""
    critic_lr_floor: float = 5 * math.sqrt(2) * 1e-7
    """the learning-rate ladder never halves below this"""
    critic_lr_rho: float = math.sqrt(2)
    """two consecutive steps with ||d_critic|| / (||d_ppo1|| + ||d_ppo2||) above this halve the critic LR"""
    critic_max_grad_norm: float = 0.2
    """critic gradient clipping norm"""
    short_critic_instruction: bool = False
    """replace the paper's critic instruction by a few words (for the tiny model, whose contexts are characters)"""
    probe_without_reference: bool = True
    """also probe every referenced prefix without its reference, to log critic MAE with vs without (diagnostic)"""

    # --- actor (Appendix C) ---
    learning_rate: float = 2e-6
    """actor AdamW learning rate (constant)"""
    weight_decay: float = 0.01
    """actor AdamW weight decay"""
    max_grad_norm: float = 0.3
    """actor gradient clipping norm"""
    num_minibatches: int = 2
    """actor minibatches per step (the paper: 1,536 continuations each); the critic step sits after the first"""
    clip_low: float = 0.2
    """PPO epsilon_low"""
    clip_high: float = 0.28
    """PPO epsilon_high base; the entropy offset k is added"""
    dual_clip: float = 3.0
    """dual-clip constant c (for A < 0 the loss is capped at -A*c)"""
    entropy_target: float = 0.28
    """H*: target entropy of empty-prefix rows (nats, at the rollout temperature)"""
    entropy_step: float = 0.02
    """delta_H: step of k per training step"""
    entropy_k_init: float = 0.06
    """k_0: initial offset"""
    entropy_k_bound: float = 0.08
    """k is clipped to [-bound, bound]"""

    # --- variants (Sections 4.2-4.3) ---
    prefix_grpo: bool = False
    """Prefix GRPO baseline: same buffer and prefixes, always full continuations and terminal rewards, no critic"""
    group_size_one: bool = False
    """the paper's "w/o Group & Audit" variant: ready problems get g distinct prefixes with one chunk each,
    A = v - V(s), critic target from the single endpoint, and no audits (unless --audit-frac is given)"""
    single_cut_grid: int = 1000
    """cut grid of the group-size-one variant"""
    buffer_admit: Literal["all", "correct"] = "all"
    """which refill rollouts enter the buffer: all (the paper) or only passes (the correct-only ablation)"""
    stale_every: int = 0
    """stale-buffer variant: every N steps replace the whole buffer by `stale_size` fresh rollouts (0: off)"""
    stale_size: int = 1920
    """fresh rollouts per refresh in the stale-buffer variant; they are the whole buffer until the next refresh"""

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
    """keep the actor's AdamW state (8 bytes per parameter) in CPU memory except during its steps, as the critic's
    always is (GPU; see the README's memory plan for when this makes a model fit)"""
    critic_context_extra: int = 16_384
    """engine context beyond prompt + budget, for the critic instruction and reference (longer = overflow)"""

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
    """The built-in task on a 2-core CPU, Table 4 scaled down in proportion: g = 16 and >= 8 valid rewards as in
    the paper; 16 refills and 16 replay slots per step, a buffer of 24 (256/192 of the refills), a critic FIFO of
    10 steps' records and 4 steps' worth per update (1,920 and 768 for 192 slots); budget 200 tokens, chunks of
    16 and a cut grid of 8 (tiny responses are 15-130 tokens); a 128-problem training set so problems come back
    every 8 steps (readiness is per problem); learning rates x50 (actor and critic alike); the short critic
    instruction; the tiny verifier as the judge (pass = 7 points). Evaluation samples the policy at T = 1.
    """
    return Args(
        tiny=True, model="tiny", dataset="tiny", eval_dataset="tiny", eval_split="test", prompt_template="{problem}",
        train_limit=128, num_steps=100, group_size=16, n_refill=16, n_batch=16, buffer_size=24, budget=200,
        chunk_tokens=16, cut_grid=8, min_valid=8, critic_buffer=160, critic_sample=64,
        critic_lr=2 * math.sqrt(2) * 5e-5, critic_lr_floor=5 * math.sqrt(2) * 5e-6, critic_max_grad_norm=1.0,
        short_critic_instruction=True, learning_rate=1e-4, max_grad_norm=1.0, temperature=1.0, save_every=0,
        micro_batch_tokens=16_384, critic_context_extra=256, single_cut_grid=4, stale_size=160,
        eval_every=10, eval_samples=4, eval_temperature=1.0, eval_top_p=1.0, eval_top_k=-1, eval_max_tokens=200,
        train_eval_problems=128,
    )


# ----------------------------------------------------------------------------------------------------
# The rules, as small pure functions (tests pin each to hand-computed values)
# ----------------------------------------------------------------------------------------------------
def round_to_grid(x: float) -> float:
    """Nearest of {0, 0.1, ..., 1}, ties rounded down (Appendix C "Critic targets")."""
    return min(max(math.floor(x * 10 + 0.5 - 1e-9), 0), 10) / 10


def parse_critic_value(text: str) -> float | None:
    """The critic's number, or None if invalid (spec/ac2.md "Parsing"). Keeps the regex's quirks: "1.5"
    reads as 1 (the pattern stops after "1"), "0.75" is invalid (not within 1e-6 of a grid point)."""
    m = re.match(r"^\s*(1(?:\.0+)?|0(?:\.\d+)?|\.\d+)", text)
    if not m:
        return None
    x = float(m.group(1))
    g = round(x * 10) / 10
    return g if abs(x - g) < 1e-6 else None


@dataclasses.dataclass
class Probe:
    """One prefix observation: the critic's V(s) and the group's rounded target z."""

    problem: int
    value: float | None  # parsed V(s); None = unparsable
    target: float | None = None  # z; None = fewer than min_valid valid rewards (no observation)
    overflow: bool = False  # the probe context did not fit: no observation at all

    @property
    def error(self) -> float | None:
        if self.overflow or self.target is None:
            return None
        return 1.0 if self.value is None else abs(self.value - self.target)  # unparsable probe: error 1


class ReadinessTracker:
    """Local readiness (Section 3.1, Appendix C; `sp_q_readiness.py`).

    Global gate: open iff the last `window` steps are all recorded (a step without errors still takes a
    slot) and the mean of all their pooled per-prefix errors is < tau_global. A problem becomes ready, only
    while the gate is open and only from this step's probes, iff its probe is valid, the prefix error is
    < tau_local, its nonzero latch is set and it was in the reference bank before this step's additions.
    Ready is forever. With local=False (the ablation) every problem is ready once the gate first opens.
    """

    def __init__(self, window=5, tau_global=0.20, tau_local=0.18, local=True):
        self.tau_global, self.tau_local, self.local = tau_global, tau_local, local
        self.errors: collections.deque[list[float]] = collections.deque(maxlen=window)
        self.ready: set[int] = set()
        self.nonzero: set[int] = set()
        self.all_ready = False

    def is_ready(self, problem: int) -> bool:
        return self.all_ready or problem in self.ready

    def global_mae(self) -> float | None:
        pooled = [e for step in self.errors for e in step]
        return float(np.mean(pooled)) if pooled else None

    def gate_open(self) -> bool:
        mae = self.global_mae()
        return len(self.errors) == self.errors.maxlen and mae is not None and mae < self.tau_global

    def update(self, probes: list[Probe], bank_before: set[int]) -> set[int]:
        """Record one step's probes; return the problems that became ready (they route the next step)."""
        for p in probes:  # the nonzero latch first, so this step's probes count
            if not p.overflow and p.value is not None and p.value > 0:
                self.nonzero.add(p.problem)
        self.errors.append([p.error for p in probes if p.error is not None])
        if not self.gate_open():
            return set()
        if not self.local:
            newly = {p.problem for p in probes} - self.ready if not self.all_ready else set()
            self.all_ready = True
            return newly
        newly = {
            p.problem for p in probes
            if p.value is not None and p.error is not None and p.error < self.tau_local
            and p.problem in self.nonzero and p.problem in bank_before and p.problem not in self.ready
        }
        self.ready |= newly
        return newly

    def state(self) -> dict:
        return {"errors": list(self.errors), "ready": sorted(self.ready), "nonzero": sorted(self.nonzero),
                "all_ready": self.all_ready}

    def load(self, s: dict) -> None:
        self.errors.extend(s["errors"])
        self.ready, self.nonzero, self.all_ready = set(s["ready"]), set(s["nonzero"]), s["all_ready"]


def audit_fraction(args: Args) -> float:
    """alpha: --audit-frac when given, else 0.25 -- or 0 with --group-size-one ("w/o Group & Audit", Section 4.3)."""
    if args.audit_frac is not None:
        return args.audit_frac
    return 0.0 if args.group_size_one else 0.25


def buffer_capacity(args: Args) -> int:
    """The replay buffer's FIFO capacity: --buffer-size, or in the stale-buffer variant every rollout of a refresh
    (the paper's 1,920 fresh rollouts *are* the buffer until the next refresh)."""
    return args.stale_size if args.stale_every else args.buffer_size


def draw_fresh(n_rows: int, n: int, rng: np.random.Generator) -> list[int]:
    """n fresh problems, without replacement within the step (spec/ac2.md step 1); a request for more than the
    data set holds (a stale-buffer refresh on a small set) takes further passes, each a new permutation."""
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(n_rows, size=min(n - len(out), n_rows), replace=False).tolist()
    return out


def route_slots(ready: list[bool], audit_frac: float, rng: np.random.Generator) -> list[str]:
    """Unready -> full; ready -> short, except ceil(alpha * n_ready_slots) ready slots at random -> audit."""
    ready_idx = [i for i, r in enumerate(ready) if r]
    n_audit = math.ceil(audit_frac * len(ready_idx) - 1e-9)
    audit = set(rng.choice(ready_idx, size=n_audit, replace=False).tolist()) if n_audit else set()
    return ["audit" if i in audit else "short" if r else "full" for i, r in enumerate(ready)]


def fill_slots(buffer: list, n_batch: int, rng: np.random.Generator) -> list:
    """Question-uniform replay: permute the buffer's distinct problems (sorted first), fill slot i with problem
    perm[i % n_problems] (wrap-around), and take one of that problem's stored trajectories uniformly."""
    problems = sorted({t.problem for t in buffer})
    perm = rng.permutation(problems)
    by_problem = collections.defaultdict(list)
    for t in buffer:
        by_problem[t.problem].append(t)
    out = []
    for i in range(n_batch):
        stored = by_problem[int(perm[i % len(perm)])]
        out.append(stored[int(rng.integers(len(stored)))])
    return out


def draw_cut(length: int, grid: int, max_frac: float, rng: np.random.Generator) -> int:
    """A multiple of `grid` drawn uniformly in [0, max_frac * length] (0 = empty prefix), then min(cut, L-1)."""
    cut = grid * int(rng.integers(int(max_frac * length) // grid + 1))
    return min(cut, length - 1)


def is_consumed(n_new: int, max_tokens: int, chunk: int, remaining: int, has_finished_answer: bool) -> bool:
    """A short row is scored by the critic only if it hit its chunk cap, the cap was below the remaining
    budget (else the end of the budget goes to the judge), and it holds no finished proof (spec/ac2.md step 4)."""
    return max_tokens == chunk and n_new == chunk and chunk < remaining and not has_finished_answer


def replace_invalid_values(values: list[float | None], valid: list[bool]) -> tuple[list[float], list[float]]:
    """Endpoint values of one group -> (v_i, actor-loss weights) (Appendix C "Scoring failures").

    An invalid critic value (None) becomes the mean of the group's valid values (0 if none) and gets weight 0.
    An invalid judge verdict arrives as 0.0 with valid=False: it stays 0 with full weight (kept in the update)
    but does not count as a valid value.
    """
    good = [v for v, ok in zip(values, valid) if ok and v is not None]
    fill = float(np.mean(good)) if good else 0.0
    return [fill if v is None else v for v in values], [0.0 if v is None else 1.0 for v in values]


def ladder_ratio(d_critic: float | None, d_actor: list[float]) -> float | None:
    """rho = ||d_critic|| / (||d_ppo1|| + ||d_ppo2||) (Appendix C). None when there was no critic step (no
    records); inf when the critic step was skipped as non-finite (d_critic = inf): the released code counts
    such a step as one over the threshold."""
    if d_critic is None:
        return None
    if math.isinf(d_critic):
        return math.inf
    return d_critic / sum(d_actor) if sum(d_actor) > 0 else None


def critic_ladder(lr: float, streak: int, rho: float | None, args: Args) -> tuple[float, int]:
    """Two consecutive steps with rho > sqrt(2) halve the next critic LR, down to the floor (Appendix C); a
    skipped non-finite critic step arrives as rho = inf and counts; no critic step (None) breaks the streak."""
    streak = streak + 1 if rho is not None and rho > args.critic_lr_rho else 0
    if streak >= 2:
        return max(lr / 2, args.critic_lr_floor), 0
    return lr, streak


def select_critic_rows(records: list[dict], order: list[int], bank: dict, sample: int, fits) -> tuple[list, int]:
    """Critic training rows of one step (Appendix C "Critic targets"): records taken in `order` (a random
    permutation of the FIFO) until `sample` are used, skipping those whose context does not `fits`.
    A record with a reference -- its source trajectory's own, else the bank's *current* one -- gives two rows,
    with and without it, at weight 1/2 each; without a reference, one row at weight 1.
    Returns ([(record, reference or None, weight)], number of records used).
    """
    rows, used = [], 0
    for idx in order:
        if used == sample:
            break
        rec = records[idx]
        ref = rec["reference"] or bank.get(rec["problem"])
        variants = [(ref, 0.5), (None, 0.5)] if ref else [(None, 1.0)]
        if all(fits(rec, r) for r, _ in variants):
            rows += [(rec, r, w) for r, w in variants]
            used += 1
    return rows, used


def judge_failure_streak(calls: list[tuple[str | None, str | None]], streak: int) -> tuple[int, str | None]:
    """A step in which more than half of the judge calls failed extends the streak and explains itself (the
    causes, most frequent first, with one server message each); any other step ends the streak. Failed calls
    are invalid zeros, kept in the PPO update (step 5), so a dead judge would train the policy on noise: the
    caller stops the run when the streak gets long."""
    failed = [(e, d) for e, d in calls if e is not None]
    if not calls or 2 * len(failed) <= len(calls):
        return 0, None
    causes = collections.Counter(e for e, _ in failed)
    detail = dict(reversed(failed))  # the first message of each cause
    listed = "; ".join(f"{e} x{k}" + (f" ({detail[e]})" if detail[e] else "") for e, k in causes.most_common())
    return streak + 1, f"{len(failed)} of {len(calls)} judge calls failed: {listed}"


def update_entropy_offset(k: float, mean_entropy: float, args: Args) -> float:
    """Eq. 9: k <- clip(k + delta_H * sign(H* - H_hat), -bound, bound); eps_high = clip_high + k."""
    step = args.entropy_step * float(np.sign(args.entropy_target - mean_entropy))
    return float(np.clip(k + step, -args.entropy_k_bound, args.entropy_k_bound))


# ----------------------------------------------------------------------------------------------------
# Critic prompting (token level; `build_q_context_ids`)
# ----------------------------------------------------------------------------------------------------
def critic_context(prompt_ids: list[int], attempt_ids: list[int], reference: str | None, tok, args: Args) -> list[int]:
    """Problem prompt + attempt + `</think>` (only if the attempt has none) + the instruction as a new user
    turn + the forced assistant prefill ending in `Q value: `; the critic then writes the number."""
    think_end = tok.convert_tokens_to_ids("</think>")
    instruction, ref_text = ((TINY_CRITIC_INSTRUCTION, TINY_CRITIC_REFERENCE) if args.short_critic_instruction
                             else (CRITIC_INSTRUCTION, CRITIC_REFERENCE))
    text = instruction.format(reference=ref_text.format(reference_proof=reference) if reference else "")
    tail = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{CRITIC_PREFILL}"
    close = [] if think_end in attempt_ids else [think_end]
    return prompt_ids + attempt_ids + close + tok(tail, add_special_tokens=False)["input_ids"]


def critic_target(value: float, tok) -> list[int]:
    """The tokens the critic is trained to write: the grid value's string, then end-of-turn."""
    return tok(GRID_STRINGS[round(value * 10)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def query_critic(llm, contexts: list[list[int]], tok, max_len: int) -> list[tuple[float | None, bool]]:
    """Greedy, at most 4 tokens, parsed; returns (value or None, overflow) per context."""
    from vllm import SamplingParams

    fits = [i for i, c in enumerate(contexts) if len(c) + 4 <= max_len]
    out: list[tuple[float | None, bool]] = [(None, True)] * len(contexts)
    if fits:
        groups = engine.generate(llm, [contexts[i] for i in fits], SamplingParams(temperature=0.0, max_tokens=4))
        for i, g in zip(fits, groups):
            out[i] = (parse_critic_value(tok.decode(g[0].token_ids, skip_special_tokens=True)), False)
    return out


# ----------------------------------------------------------------------------------------------------
# Shared machinery, as in grpo.py (repeated on purpose: each script reads on its own)
# ----------------------------------------------------------------------------------------------------
def request_seed(*keys: int) -> int:
    """A sampling seed per (run seed, step, request): resumed runs sample exactly what straight runs did."""
    return int(np.random.SeedSequence([abs(k) for k in keys]).generate_state(1)[0] >> 1)


def encode_prompt(tokenizer, template: str, problem: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": template.format(problem=problem)}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chunk_logprobs(hidden, targets, weight, bias, temperature: float, with_entropy: bool):
    logits = F.linear(hidden, weight, bias).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None])[:, 0] - logz
    entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None
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
    """Log-probs (and entropies) of input_ids[b, starts[b] : starts[b] + lengths[b]], LM head in checkpointed
    chunks so no [tokens x vocab] tensor is kept. Flat over the selected tokens, in batch order."""
    hidden = final_hidden_states(model, input_ids)
    rows = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)]).to(input_ids.device)
    cols = torch.cat([torch.arange(s - 1, s - 1 + n) for s, n in zip(starts, lengths)]).to(input_ids.device)
    h, targets = hidden[rows, cols], input_ids[rows, cols + 1]
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
    """Per-token dual-clip PPO loss (Appendix C): max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), capped at -A c
    for A < 0; r = exp(clamp(logp - old_logp, -20, 20))."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    dual = (adv < 0) & (loss > -adv * dual_clip)
    loss = torch.where(dual, -adv * dual_clip, loss)
    clipped = ((adv < 0) & (ratio < 1 - clip_low)) | ((adv > 0) & (ratio > 1 + clip_high))
    return loss, {"clipfrac": clipped, "clipfrac_dual": dual, "approx_kl": (ratio - 1) - torch.log(ratio)}


def make_micro_batches(indices: list[int], lengths: list[int], budget: int) -> list[list[int]]:
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


def snapshot(model) -> list[torch.Tensor]:
    """A CPU copy of this process's weights (its shards under FSDP): never a second full copy on the GPU."""
    return [dist.local(p).detach().to("cpu", copy=True) for p in model.parameters()]


def displacement(model, before: list[torch.Tensor]) -> float:
    """L2 norm of the parameter change since `before` (for the critic LR ladder), one parameter at a time."""
    local = sum(float((dist.local(p).detach() - b.to(dist.local(p).device)).float().pow(2).sum())
                for p, b in zip(model.parameters(), before))
    return math.sqrt(dist.sum_all(local))


# ----------------------------------------------------------------------------------------------------
# Step state
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Trajectory:
    """A replay buffer entry: one fresh full rollout."""

    problem: int
    tokens: list[int]
    proof: str | None  # its own proof if it passed (>= pass_points): the reference for prefixes cut from it


@dataclasses.dataclass
class Group:
    """The continuations of one prompt+prefix: a refill (n=1), a cold-start or a replay group."""

    problem: int
    prefix: list[int]
    lane: str  # refill | cold | full | short | audit | single (group-size-one chunk)
    source: Trajectory | None = None
    max_tokens: int = 0
    rows: list = dataclasses.field(default_factory=list)  # Completion objects
    values: list = dataclasses.field(default_factory=list)  # v_i (None = invalid critic value)
    valid: list = dataclasses.field(default_factory=list)  # valid for critic targets
    points: list = dataclasses.field(default_factory=list)  # judge points (None: consumed or invalid)
    consumed: list = dataclasses.field(default_factory=list)
    weights: list = dataclasses.field(default_factory=list)  # actor-loss weight per row
    probe: float | None = None
    probe_overflow: bool = False
    reference: str | None = None


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
    tiny_task = args.dataset == "tiny"

    # --- data, models, engine, judge (fail fast, one sentence) ---
    train_rows = load_rows(args.dataset, args.dataset_split, [args.problem_field], args.train_limit)
    eval_fields = [args.problem_field] + ([] if args.eval_dataset == "tiny" else [args.eval_solution_field])
    eval_rows = load_rows(args.eval_dataset, args.eval_split, eval_fields, args.eval_limit) if args.eval_every else []
    judge = None  # checked with one real grading request before any model is loaded
    if not tiny_task:
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
    model_path = resolve_model(args.model)
    try:
        config = AutoConfig.from_pretrained(model_path)
        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:
        raise SystemExit(f"could not load model {args.model!r}: {str(e).splitlines()[0][:300]}") from None
    model = AutoModelForCausalLM.from_pretrained(resume_dir / "policy" if resume_dir else model_path,
                                                 dtype=torch.float32)  # fp32 master weights
    if device.type == "cuda" and args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = dist.shard(model, device)  # FSDP2 under a process group (common/dist.py)
    # one set of weights, two optimizers with their own state (Section 3.3); the critic's state spends all but its
    # one step per training step in CPU memory, the actor's too with --offload-optimizer (fused: no temporary)
    actor_opt = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")
    critic_opt = torch.optim.AdamW(model.parameters(), lr=args.critic_lr, weight_decay=0.0, betas=(0.9, 0.999),
                                   eps=1e-8, fused=device.type == "cuda")
    prompts = [encode_prompt(tok, args.prompt_template, r[args.problem_field]) for r in train_rows]
    eval_prompts = [encode_prompt(tok, args.prompt_template, r[args.problem_field]) for r in eval_rows]
    # a fixed sample of training problems, evaluated like the held-out ones (eval/train_score)
    train_eval_rows = [train_rows[i] for i in sorted(random.Random(args.seed).sample(
        range(len(train_rows)), min(args.train_eval_problems, len(train_rows))))] if args.eval_every else []
    train_eval_prompts = [encode_prompt(tok, args.prompt_template, r[args.problem_field]) for r in train_eval_rows]
    eval_max_tokens = args.eval_max_tokens if args.eval_every else 0  # the engine's context need not hold it
    max_len = max(map(len, prompts + eval_prompts)) + max(args.budget, eval_max_tokens) + args.critic_context_extra
    max_len = min(max_len, getattr(config.get_text_config(), "max_position_embeddings", max_len))
    peaks = dist.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    peaks.start()
    if master:
        print(f"starting the vLLM engine for {args.model} ...", flush=True)
    llm = engine.create_engine(model_path, max_model_len=max_len, seed=args.seed,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    peaks.end("engine_start")
    flops_A, flops_B = engine.decoding_flops_coefficients(config)

    def find_proof(text: str) -> str | None:
        """The proof a judge grades; on the tiny task the whole trace, once its answer is boxed after </think>."""
        if tiny_task:
            return text.strip() if extract_final_answer(text) is not None else None
        return extract_proof(text)

    def judge_texts(texts: list[str], rows: list[dict], validation=False):
        """([(points or None, valid)] per text, [(error, detail)] per judge call). No proof: 0 points, no call,
        valid (spec/ac2.md step 5). Training uses the 7/6/1/0 grader, validation the 0-7 one with references."""
        if tiny_task and (not validation or args.eval_dataset == "tiny"):
            return [(7 * int(tiny_reward(t, r["answer"])), True) for t, r in zip(texts, rows)], []
        proofs = [find_proof(t) for t in texts]
        todo = [i for i, p in enumerate(proofs) if p is not None]
        res = judge.grade([rows[i][args.problem_field] for i in todo], [proofs[i] for i in todo],
                          [rows[i].get(args.eval_solution_field) for i in todo] if validation else None,
                          [rows[i].get(args.eval_guidelines_field) for i in todo] if validation else None,
                          validation=validation)
        out = [(0, True)] * len(texts)
        for i, r in zip(todo, res):
            out[i] = (r.points, r.valid)
        return out, [(r.error, r.detail) for r in res]

    # --- all state a checkpoint carries ---
    buffer: collections.deque[Trajectory] = collections.deque(maxlen=buffer_capacity(args))
    tracker = ReadinessTracker(args.window, args.tau_global, args.tau_local, local=args.readiness == "local")
    bank: dict[int, str] = {}  # problem -> reference proof (add-once)
    critic_fifo: collections.deque[dict] = collections.deque(maxlen=args.critic_buffer)
    critic_lr, ladder_streak, k_entropy = args.critic_lr, 0, args.entropy_k_init
    start_step, total_flops, total_tokens = 0, 0, 0
    judge_streak = 0  # consecutive steps in which over half of the judge calls failed (not checkpointed)
    if ckpt:
        dist.load_checkpoint(resume_dir, model, {"actor": actor_opt, "critic": critic_opt},
                             offload=("critic", "actor") if args.offload_optimizer else ("critic",))
        buffer.extend(Trajectory(**t) for t in ckpt["buffer"])
        tracker.load(ckpt["readiness"])
        bank, critic_fifo = ckpt["bank"], collections.deque(ckpt["critic_fifo"], maxlen=args.critic_buffer)
        critic_lr, ladder_streak, k_entropy = ckpt["critic_lr"], ckpt["ladder_streak"], ckpt["entropy_k"]
        start_step, total_flops, total_tokens = ckpt["step"], ckpt["decoding_flops"], ckpt["generated_tokens"]
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)  # the engine serves exactly the trainer's (possibly resumed) weights

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
        return groups, [tok.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]

    def evaluate(step: int) -> float:
        t0 = time.time()
        groups, texts = sample_for_eval(eval_prompts, -1, "held-out problems")
        scored, _ = judge_texts(texts, [r for r in eval_rows for _ in range(args.eval_samples)], validation=True)
        score = float(np.mean([(p or 0) / 7 for p, _ in scored]))
        if master:
            writer.add_scalar("eval/mean_score", score, step)
            writer.add_scalar("eval/pass_rate", float(np.mean([(p or 0) >= args.pass_points for p, _ in scored])),
                              step)
            writer.add_scalar("eval/response_len_mean", float(np.mean([len(c.token_ids) for g in groups for c in g])),
                              step)
        if train_eval_prompts:  # the same sampling on training problems (training grader): the train / held-out gap
            _, texts = sample_for_eval(train_eval_prompts, -4, "training problems")
            scored, _ = judge_texts(texts, [r for r in train_eval_rows for _ in range(args.eval_samples)])
            if master:
                writer.add_scalar("eval/train_score", float(np.mean([(p or 0) / 7 for p, _ in scored])), step)
        if master:
            writer.add_scalar("time/eval", time.time() - t0, step)
        return score

    def save(at_step: int, flops: int, tokens: int) -> Path:
        """A checkpoint of everything the run carries, as of the end of step `at_step`."""
        state = {"run_name": run_name, "buffer": [dataclasses.asdict(t) for t in buffer],
                 "readiness": tracker.state(), "bank": bank, "critic_fifo": list(critic_fifo),
                 "critic_lr": critic_lr, "ladder_streak": ladder_streak, "entropy_k": k_entropy,
                 "decoding_flops": flops, "generated_tokens": tokens}
        return dist.save_checkpoint(Path(args.checkpoint_dir) / run_name, at_step, model, tok,
                                    {"actor": actor_opt, "critic": critic_opt}, state, args.keep_checkpoints)

    last_eval = evaluate(0) if args.eval_every and start_step == 0 else float("nan")
    if start_step == 0 and master:
        print(f"step 0 | eval {last_eval:.3f}")

    for step in range(start_step + 1, args.num_steps + 1):
        t_step, t0 = time.time(), time.time()
        counters_at_start = total_flops, total_tokens
        rng = np.random.default_rng([args.seed, step])  # every random choice of this step, resumable

        # 1. Batch: fresh refill problems (one rollout each) and replay slots cut from the buffer
        refresh = args.stale_every == 0 or (step - 1) % args.stale_every == 0
        n_fresh = (args.n_refill if args.stale_every == 0 else args.stale_size) if refresh else 0
        cold = not buffer
        fresh = draw_fresh(len(train_rows), n_fresh + (args.n_batch if cold else 0), rng)
        groups = [Group(p, [], "refill", max_tokens=args.budget) for p in fresh[:n_fresh]]
        if cold:  # buffer empty: fresh problems, empty prefixes, full groups trained like GRPO, no critic targets
            groups += [Group(p, [], "cold", max_tokens=args.budget) for p in fresh[n_fresh:]]
        else:
            sources = fill_slots(list(buffer), args.n_batch, rng)
            ready = [not args.prefix_grpo and tracker.is_ready(t.problem) for t in sources]
            if master:
                writer.add_scalar("ac2/ready_frac", float(np.mean(ready)), step)
            # 2. Route: unready -> full, ready -> short chunk, ceil(alpha * n_ready) ready slots -> audit
            for t, lane in zip(sources, route_slots(ready, audit_fraction(args), rng)):
                if lane == "short" and args.group_size_one:  # g distinct prefixes (if possible), one chunk each
                    grid = list(range(0, int(args.cut_max_frac * len(t.tokens)) + 1, args.single_cut_grid))
                    cuts = rng.choice(grid, size=args.group_size, replace=len(grid) < args.group_size)
                    groups += [Group(t.problem, t.tokens[: min(int(c), len(t.tokens) - 1)], "single", t) for c in cuts]
                else:
                    cut = draw_cut(len(t.tokens), args.cut_grid, args.cut_max_frac, rng)
                    groups.append(Group(t.problem, t.tokens[:cut], lane, t))
        for g in groups:  # the budget counts prefix + new tokens
            remaining = args.budget - len(g.prefix)
            g.max_tokens = min(args.chunk_tokens, remaining) if g.lane in ("short", "single") else remaining

        # 3. Generate: one request per group, the prefix appended to the templated prompt
        peaks.start()
        params = [SamplingParams(n=1 if g.lane in ("refill", "single") else args.group_size,
                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=max(g.max_tokens, 1), logprobs=0, seed=request_seed(args.seed, step, i))
                  for i, g in enumerate(groups)]
        for g, rows in zip(groups, engine.generate(llm, [prompts[g.problem] + g.prefix for g in groups], params)):
            g.rows = rows
        texts = {(gi, ri): tok.decode(g.prefix + c.token_ids, skip_special_tokens=True)
                 for gi, g in enumerate(groups) for ri, c in enumerate(g.rows)}
        lane_tokens = collections.Counter()
        for g in groups:
            for c in g.rows:
                lane_tokens[g.lane] += len(c.token_ids)
                total_flops += engine.decoding_flops(flops_A, flops_B, len(prompts[g.problem]) + len(g.prefix),
                                                     len(c.token_ids))
        total_tokens += sum(lane_tokens.values())
        t_generate = time.time() - t0

        # 4. Critic wave (same weights as the rollouts): one greedy probe V(s) per replay group, and one
        #    critic call per consumed short row
        t0 = time.time()
        for gi, g in enumerate(groups):
            # the critic's reference: the source trajectory's own proof if it passed, else the bank's, else none
            g.reference = g.source.proof if g.source and g.source.proof else bank.get(g.problem)
            g.consumed = [g.lane in ("short", "single") and is_consumed(
                len(c.token_ids), g.max_tokens, args.chunk_tokens, args.budget - len(g.prefix),
                find_proof(texts[(gi, ri)]) is not None) for ri, c in enumerate(g.rows)]
        queries = []  # (group index, row index or -1 for the probe, with reference?)
        if not args.prefix_grpo:
            for gi, g in enumerate(groups):
                if g.lane in ("refill", "cold"):
                    continue
                queries.append((gi, -1, True))
                if args.probe_without_reference and g.reference is not None:
                    queries.append((gi, -1, False))
                queries += [(gi, ri, True) for ri, used in enumerate(g.consumed) if used]
        contexts = [critic_context(prompts[groups[gi].problem],
                                   groups[gi].prefix + (groups[gi].rows[ri].token_ids if ri >= 0 else []),
                                   groups[gi].reference if with_ref else None, tok, args)
                    for gi, ri, with_ref in queries]
        answers = query_critic(llm, contexts, tok, max_len)
        critic_values, probe_noref = {}, {}
        for (gi, ri, with_ref), (value, overflow) in zip(queries, answers):
            if ri < 0 and with_ref:
                groups[gi].probe, groups[gi].probe_overflow = value, overflow
            elif ri < 0:
                probe_noref[gi] = (value, overflow)
            else:
                critic_values[(gi, ri)] = None if overflow else value  # an overflowing context is invalid
        peaks.end("rollout")  # the rollouts and the critic wave
        engine.sleep(llm, args.vllm_sleep_level)
        t_critic = time.time() - t0

        # 5. Judge every non-consumed row: points/7; no proof -> 0 and valid; failures -> 0 and invalid
        t0 = time.time()
        to_judge = [(gi, ri) for gi, g in enumerate(groups) for ri in range(len(g.rows)) if not g.consumed[ri]]
        judged, calls = judge_texts([texts[k] for k in to_judge],
                                    [train_rows[groups[gi].problem] for gi, _ in to_judge])
        verdicts = dict(zip(to_judge, judged))
        judge_streak, warning = judge_failure_streak(calls, judge_streak)
        if warning and master:
            print(f"warning: step {step}: {warning}", flush=True)
        if judge_streak >= args.judge_max_invalid_steps:  # never train on a dead judge's zeros
            path = save(step - 1, *counters_at_start)  # nothing else has changed yet this step
            raise SystemExit(f"stopped: more than half of the judge's calls failed in {judge_streak} consecutive "
                             f"steps (last: {warning}). The state before step {step} is saved in {path}; fix the "
                             f"judge, then continue with --resume {path}")
        # 6. Endpoint values v_i; invalid critic values -> the group's valid mean, zero actor-loss weight
        for gi, g in enumerate(groups):
            raw, g.valid, g.points = [], [], []
            for ri in range(len(g.rows)):
                if g.consumed[ri]:  # critic value (None = invalid)
                    raw.append(critic_values[(gi, ri)])
                    g.valid.append(raw[-1] is not None)
                    g.points.append(None)
                else:  # judge reward points/7; an invalid verdict is 0, kept in the update, not a valid target
                    points, ok = verdicts[(gi, ri)]
                    raw.append((points or 0) / 7 if ok else 0.0)
                    g.valid.append(ok)
                    g.points.append(points if ok else None)
            g.values, g.weights = replace_invalid_values(raw, g.valid)
            if g.lane == "single" and (g.probe is None or g.probe_overflow):
                g.weights = [0.0] * len(raw)  # group-size-one: no baseline V(s), no loss and no target
        t_score = time.time() - t0

        # 7. Buffer: every fresh rollout with a non-empty response enters (correct-only variant: passes only)
        if args.stale_every and refresh:
            buffer.clear()
        for gi, g in enumerate(groups):
            if g.lane == "refill" and g.rows[0].token_ids:
                passed = (g.points[0] or 0) >= args.pass_points
                if args.buffer_admit == "all" or passed:
                    buffer.append(Trajectory(g.problem, list(g.rows[0].token_ids),
                                             find_proof(texts[(gi, 0)]) if passed else None))

        # 8. Critic bookkeeping: readiness (bank as it was before this step), reference bank, critic records
        probes, records, audit_err, mae_ref, mae_noref = [], [], [], [], []
        for gi, g in enumerate(groups):
            if g.lane in ("refill", "cold") or args.prefix_grpo:
                continue
            valid_values = [v for v, ok in zip(g.values, g.valid) if ok]
            enough = len(valid_values) >= (1 if g.lane == "single" else args.min_valid)
            if g.lane == "single" and (g.probe is None or g.probe_overflow):
                enough = False
            z = round_to_grid(float(np.mean(valid_values))) if enough else None
            probes.append(Probe(g.problem, g.probe, z, g.probe_overflow))
            if z is not None:
                records.append({"problem": g.problem, "prefix": list(g.prefix), "target": z,
                                "reference": g.source.proof if g.source else None})
                if g.probe is not None and g.reference is not None and gi in probe_noref:
                    noref_value = probe_noref[gi][0]
                    mae_ref.append(abs(g.probe - z))
                    mae_noref.append(1.0 if noref_value is None else abs(noref_value - z))
            if g.lane == "audit" and g.probe is not None:
                audit_err.append(abs(g.probe - float(np.mean(valid_values or [0.0]))))
        newly_ready = tracker.update(probes, bank_before=set(bank))
        candidates = collections.defaultdict(list)
        for gi, g in enumerate(groups):
            for ri, pts in enumerate(g.points):
                if pts is not None and pts >= args.pass_points and (proof := find_proof(texts[(gi, ri)])):
                    candidates[g.problem].append(proof)
        for problem in sorted(candidates):
            if problem not in bank:  # add-once, never replaced; one passing rollout at random
                bank[problem] = candidates[problem][int(rng.integers(len(candidates[problem])))]
        critic_fifo.extend(records)

        # 9. Advantages A_i = v_i - mean_j v_j per group (no std), on the whole batch before the split;
        #    group-size-one: A = v - V(s). Refill rows are not trained on.
        train_rows_list = []  # (group, row index, advantage, weight)
        for g in groups:
            if g.lane == "refill":
                continue
            base = g.probe if g.lane == "single" else float(np.mean(g.values))
            for ri, c in enumerate(g.rows):
                if c.token_ids:
                    train_rows_list.append((g, ri, g.values[ri] - (base or 0.0), g.weights[ri]))

        # 10a. Old log-probs (trainer, logits / T) for trained rows; entropy over empty-prefix rows (Eq. 9). Each
        #      process does the rows it trains (all of them with one process; row i: rank i % world under torchrun)
        t0 = time.time()
        # refill rows go through this pass for their entropy only
        all_rows = [(g, ri) for g, ri, _, _ in train_rows_list]
        all_rows += [(g, 0) for g in groups if g.lane == "refill" and g.rows[0].token_ids]
        seqs = [prompts[g.problem] + g.prefix + g.rows[ri].token_ids for g, ri in all_rows]
        starts = [len(prompts[g.problem]) + len(g.prefix) for g, ri in all_rows]
        n_new = [len(g.rows[ri].token_ids) for g, ri in all_rows]
        old_lp, ent = {}, {}
        model.eval()
        peaks.start()
        with torch.no_grad(), autocast(device):
            for mb in dist.even(make_micro_batches(dist.mine(range(len(all_rows))), [len(s) for s in seqs],
                                                   args.micro_batch_tokens)):
                if not mb:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in mb], tok.pad_token_id, device)
                lp, en = sequence_logprobs(model, ids, [starts[i] for i in mb], [n_new[i] for i in mb],
                                           args.temperature, args.logprob_chunk_tokens, with_entropy=True)
                for j, a, b in zip(mb, lp.split([n_new[i] for i in mb]), en.split([n_new[i] for i in mb])):
                    old_lp[j], ent[j] = a, b
        peaks.end("old_logprobs")
        n_train = len(train_rows_list)
        empty_prefix_ent = [e for j, e in sorted(ent.items()) if not all_rows[j][0].prefix]  # refill, cold, cut at 0
        mean_entropy = dist.mean_all(torch.cat(empty_prefix_ent or [torch.zeros(0)]).float().cpu(),
                                     default=args.entropy_target)
        k_entropy = update_entropy_offset(k_entropy, mean_entropy, args)  # once per step, before the update
        clip_high = args.clip_high + k_entropy
        mine = [j for j in sorted(old_lp) if j < n_train]
        vllm_lp = torch.tensor([x for j in mine for x in all_rows[j][0].rows[all_rows[j][1]].logprobs])
        log_ratio = torch.cat([old_lp[j] for j in mine] or [torch.zeros(0)]).float().cpu() - vllm_lp

        # 10b. Critic rows: up to critic_sample records from a random permutation of the FIFO, skipping
        #      overflow; a record with a reference (its own, else the bank's current one) gives two rows at 1/2
        def context(rec, ref):
            return critic_context(prompts[rec["problem"]], rec["prefix"], ref, tok, args)

        chosen, n_records = select_critic_rows(
            list(critic_fifo), rng.permutation(len(critic_fifo)).tolist(), bank, args.critic_sample,
            fits=lambda rec, ref: len(context(rec, ref)) + len(critic_target(rec["target"], tok)) <= max_len)
        critic_rows = []  # (context + target token ids, context length, target length, weight)
        for rec, ref, w in chosen:
            ctx, target = context(rec, ref), critic_target(rec["target"], tok)
            critic_rows.append((ctx + target, len(ctx), len(target), w))

        def critic_step(critic_rows, n_records: int, critic_lr: float) -> tuple[float, float | None]:
            """One AdamW step on the NLL of the value tokens + end-of-turn, weight w/4 per token, / records."""
            if not critic_rows:
                return float("nan"), None
            for group_ in critic_opt.param_groups:
                group_["lr"] = critic_lr
            critic_opt.zero_grad(set_to_none=True)
            peaks.start()
            total = 0.0
            for micro in dist.even(make_micro_batches(dist.mine(range(len(critic_rows))),
                                                      [len(r[0]) for r in critic_rows], args.micro_batch_tokens)):
                if not micro:
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([critic_rows[i][0] for i in micro], tok.pad_token_id, device)
                with autocast(device):
                    lp, _ = sequence_logprobs(model, ids, [critic_rows[i][1] for i in micro],
                                              [critic_rows[i][2] for i in micro], 1.0, args.logprob_chunk_tokens)
                w = torch.cat([torch.full((critic_rows[i][2],), critic_rows[i][3] / 4) for i in micro]).to(device)
                loss = -(lp * w).sum() / n_records
                loss.backward()
                total += float(loss.detach())
            total = dist.sum_all(total)  # each rank summed its own rows
            before = snapshot(model)
            grad_norm = dist.full(torch.nn.utils.clip_grad_norm_(model.parameters(), args.critic_max_grad_norm))
            if not (math.isfinite(total) and torch.isfinite(grad_norm)):  # skip a non-finite step; the ladder
                return total, math.inf  # counts it as a step over the threshold (released code)
            dist.step(critic_opt, device, offload=True)  # its state visits the GPU for this step only
            peaks.end("critic_step")
            return total, displacement(model, before)

        # 10c. Actor minibatch 1 -> one critic step -> actor minibatch 2 (shared weights, separate AdamW)
        model.train()
        stats = {"policy_loss": 0.0, "clipfrac": 0.0, "clipfrac_dual": 0.0, "approx_kl": 0.0}
        d_actor, grad_norms, critic_loss, d_critic = [], [], float("nan"), None
        n_tok = sum(n_new[:n_train])
        for m in range(args.num_minibatches):
            if m == 1:
                critic_loss, d_critic = critic_step(critic_rows, n_records, critic_lr)
            mb = [i for i in range(m * n_train // args.num_minibatches, (m + 1) * n_train // args.num_minibatches)
                  if train_rows_list[i][3] > 0]  # zero-weight rows (invalid critic value) carry no loss
            if not mb:
                d_actor.append(0.0)
                continue
            denom = sum(n_new[i] for i in mb)  # token mean over each minibatch
            actor_opt.zero_grad(set_to_none=True)
            peaks.start()
            for micro in dist.even(make_micro_batches(dist.mine(mb), [len(s) for s in seqs], args.micro_batch_tokens)):
                if not micro:
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in micro], tok.pad_token_id, device)
                with autocast(device):
                    lp, _ = sequence_logprobs(model, ids, [starts[i] for i in micro], [n_new[i] for i in micro],
                                              args.temperature, args.logprob_chunk_tokens)
                adv = torch.cat([torch.full((n_new[i],), train_rows_list[i][2]) for i in micro]).to(device)
                tok_loss, st = ppo_loss(lp, torch.cat([old_lp[i] for i in micro]), adv, args.clip_low, clip_high,
                                        args.dual_clip)
                loss = tok_loss.sum() / denom
                loss.backward()
                stats["policy_loss"] += float(loss.detach()) / args.num_minibatches
                for key, val in st.items():
                    stats[key] += float(val.detach().float().sum()) / max(n_tok, 1)
            peaks.end("backward")
            before = snapshot(model)
            grad_norm = dist.full(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            if torch.isfinite(grad_norm):
                peaks.start()
                dist.step(actor_opt, device, args.offload_optimizer)
                peaks.end("optimizer_step")
            grad_norms.append(float(grad_norm))
            d_actor.append(displacement(model, before))
        if args.num_minibatches == 1:
            critic_loss, d_critic = critic_step(critic_rows, n_records, critic_lr)
        model.zero_grad(set_to_none=True)  # free the gradients before the engine takes the memory back
        stats = {k: dist.sum_all(v) for k, v in stats.items()}  # each rank summed its own rows
        # the learning-rate ladder: rho = ||d_critic|| / (||d_ppo1|| + ||d_ppo2||)
        rho = ladder_ratio(d_critic, d_actor)
        critic_lr, ladder_streak = critic_ladder(critic_lr, ladder_streak, rho, args)
        t_train = time.time() - t0

        # 11. Sync, log, evaluate, checkpoint
        t0 = time.time()
        peaks.start()
        engine.wake_up(llm, model)
        peaks.end("wake_up")
        t_sync = time.time() - t0
        judged_rewards = [(p or 0) / 7 for p, _ in judged]
        step_errors = [p.error for p in probes if p.error is not None]
        scalars = {
            "charts/decoding_flops": total_flops, "charts/generated_tokens": total_tokens,
            "charts/step_time": time.time() - t_step, "train/reward_mean": float(np.mean(judged_rewards or [0.0])),
            "ac2/value_mean": float(np.mean([v for g in groups if g.lane != "refill" for v in g.values] or [0.0])),
            "losses/policy_loss": stats["policy_loss"], "losses/clipfrac": stats["clipfrac"],
            "losses/clipfrac_dual": stats["clipfrac_dual"], "losses/approx_kl": stats["approx_kl"],
            "losses/entropy": mean_entropy, "losses/grad_norm": sum(grad_norms) / args.num_minibatches,
            "sampling/mismatch_kl": dist.mean_all(torch.exp(log_ratio) - 1 - log_ratio),
            "time/generate": t_generate, "time/critic": t_critic, "time/score": t_score, "time/train": t_train,
            "time/sync": t_sync,
            "ac2/eps_high": clip_high, "ac2/global_mae": tracker.global_mae() or float("nan"),
            "ac2/gate_open": float(tracker.gate_open()), "ac2/probe_mae": float(np.mean(step_errors or [np.nan])),
            "ac2/ready_problems": len(tracker.ready) if not tracker.all_ready else len(train_rows),
            "ac2/newly_ready": len(newly_ready), "ac2/bank_size": len(bank), "ac2/buffer_size": len(buffer),
            "ac2/critic_fifo": len(critic_fifo), "ac2/critic_records": n_records, "ac2/critic_loss": critic_loss,
            "ac2/critic_lr": critic_lr, "ac2/critic_rho": rho if rho is not None else float("nan"),
            "ac2/consumed_rows": sum(sum(g.consumed) for g in groups),
            "ac2/judged_rows": len(to_judge), "ac2/invalid_judge": sum(not ok for _, ok in judged),
            "ac2/invalid_critic": sum(1 for v in critic_values.values() if v is None),
            "ac2/audit_critic_error": float(np.mean(audit_err or [np.nan])),
            "ac2/critic_mae_with_ref": float(np.mean(mae_ref or [np.nan])),
            "ac2/critic_mae_without_ref": float(np.mean(mae_noref or [np.nan])),
        }
        for lane in ("refill", "cold", "full", "short", "audit", "single"):
            scalars[f"ac2/tokens_{lane}"] = lane_tokens[lane]
        scalars["ac2/new_tokens_per_sample"] = sum(lane_tokens.values()) / max(1, sum(len(g.rows) for g in groups))
        scalars.update(peaks.pop())
        if master:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            if args.log_completions_every and step % args.log_completions_every == 0:
                shown = [f"**{g.lane}, v={g.values[0]:.2f}**\n```\n{texts[(gi, 0)][-1500:]}\n```"
                         for gi, g in enumerate(groups) if g.rows][:4]
                writer.add_text("samples/completions", "\n\n".join(shown), step)
        if args.eval_every and (step % args.eval_every == 0 or step == args.num_steps):
            last_eval = evaluate(step)
        if master:
            print(f"step {step}/{args.num_steps} | reward {scalars['train/reward_mean']:.3f} | eval {last_eval:.3f} | "
                  f"ready {scalars['ac2/ready_problems']} gate {int(tracker.gate_open())} mae "
                  f"{scalars['ac2/global_mae']:.3f} | consumed {scalars['ac2/consumed_rows']} | tokens "
                  f"{sum(lane_tokens.values())} | gen {t_generate:.1f}s critic {t_critic:.1f}s train {t_train:.1f}s",
                  flush=True)
        if args.save_every and (step % args.save_every == 0 or step == args.num_steps):
            path = save(step, total_flops, total_tokens)
            if master:
                print(f"saved {path}")
    if master:
        writer.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
