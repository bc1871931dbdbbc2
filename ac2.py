"""AC2: Actor-Critic with Action Chunking (Wen, Bailey, Mahankali, Ma; arXiv 2609.39247; docs/ac2.md).

The policy and the value function share weights; the critic is the policy itself, asked through a prompt
for a number on the grid {0, 0.1, ..., 1}. Each step replays prefixes s of past trajectories and samples a
group of g continuations from each. On problems where the critic is trusted ("ready"), the continuations
are short *action chunks* c_i of b tokens whose endpoints the critic scores, v_i = V(s . c_i); elsewhere
they run to the end and the judge scores them. Either way A_i = v_i - mean_j v_j (lambda = 0 on ready
problems, lambda = 1 on unready ones, Section 3.2), and the critic learns to predict, at s, the group mean.
No terminal reward is needed on ready problems: that is where the decoding savings come from.

One step, in code order (docs/ac2.md, "One step"): 1 batch (refills + replay slots, prefix cuts, cold
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
from common.judges import Watch, extract_final_answer, extract_proof, start_judge, watch_scores
from common.tiny import TINY_CRITIC_INSTRUCTION, TINY_CRITIC_REFERENCE, resolve_model, tiny_reward

ACTOR_PROMPT = (  # Appendix C
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
    max_ungradable_steps: int = 3
    """stop (with a checkpoint) after this many consecutive steps in which no response held an answer the reward can
    grade: every reward 0, a model that ignores the prompt's format"""
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
    critic_reference_first: bool = False
    """write the reference into the problem's turn, before the attempt, instead of after the attempt in the critic's
    instruction (project choice; the paper appends it: a tiny model learns the comparison about twice as fast in this
    order, docs/ac2.md)"""
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
    vllm_max_num_seqs: int = 0
    """sequences the engine decodes at once; 0: on GPU as many as its KV cache holds at the rows' expected length
    (half their limit), so that rows are not preempted and prefilled again; on CPU vLLM's default"""
    no_memory_check: bool = False
    """on GPU, start even when the memory plan says the run does not fit (common/plan.py)"""
    collective_timeout_s: float = 86_400.0
    """how long a rank waits for the others before the run fails (one step's generation and judge grading included,
    hours apart between ranks at 50,000-token responses)"""
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


# ====================================================================================================
# ALGO LOGIC: AC2's rules, as small functions (tests pin each to hand-computed values)
# ====================================================================================================
CHUNK_LANES = ("short", "single")  # rows that stop after b new tokens for the critic to score


def round_to_grid(x: float) -> float:
    """Nearest of {0, 0.1, ..., 1}, ties rounded down (Appendix C "Critic targets")."""
    return min(max(math.floor(x * 10 + 0.5 - 1e-9), 0), 10) / 10


def parse_critic_value(text: str) -> float | None:
    """The critic's number, or None if invalid (docs/ac2.md, "The critic prompt"). Keeps the released regex's
    quirks: "1.5" reads as 1 (the pattern stops after "1"), "0.75" is invalid (not within 1e-6 of a grid point)."""
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
    """Local readiness (Section 3.1, Appendix C; the released `sp_q_readiness.py`).

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

    def state_dict(self) -> dict:
        return {"errors": list(self.errors), "ready": sorted(self.ready), "nonzero": sorted(self.nonzero),
                "all_ready": self.all_ready}

    def load_state_dict(self, s: dict) -> None:
        self.errors.extend(s["errors"])
        self.ready, self.nonzero, self.all_ready = set(s["ready"]), set(s["nonzero"]), s["all_ready"]


@dataclasses.dataclass
class Trajectory:
    """A replay buffer entry: one fresh full rollout."""

    problem: int
    tokens: list[int]
    proof: str | None  # its own proof if it passed (>= pass_points): the reference for prefixes cut from it


class ReplayBuffer:
    """The FIFO of fresh rollouts that replay slots are cut from (256 trajectories; Table 4)."""

    def __init__(self, capacity: int):
        self.trajectories: collections.deque[Trajectory] = collections.deque(maxlen=capacity)

    def state_dict(self) -> list[dict]:
        return [dataclasses.asdict(t) for t in self.trajectories]

    def load_state_dict(self, s: list[dict]) -> None:
        self.trajectories.extend(Trajectory(**t) for t in s)


class ReferenceBank:
    """One reference proof per problem, add-once, never replaced (Section 3.1)."""

    def __init__(self):
        self.proofs: dict[int, str] = {}

    def state_dict(self) -> dict[int, str]:
        return self.proofs

    def load_state_dict(self, s: dict[int, str]) -> None:
        self.proofs = s


@dataclasses.dataclass
class CriticRecord:
    """A critic training target: the group mean z at prefix s of a problem, and the source's own reference."""

    problem: int
    prefix: list[int]
    target: float
    reference: str | None


class CriticFifo:
    """The critic's FIFO of prefix-target records (1,920; Appendix C)."""

    def __init__(self, capacity: int):
        self.records: collections.deque[CriticRecord] = collections.deque(maxlen=capacity)

    def state_dict(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.records]

    def load_state_dict(self, s: list[dict]) -> None:
        self.records.extend(CriticRecord(**r) for r in s)


@dataclasses.dataclass
class CriticLR:
    """The critic's learning-rate ladder (Appendix C): its current rate and the streak of steps with rho > rho_max."""

    lr: float
    streak: int = 0

    def update(self, rho: float | None, args: Args) -> None:
        self.lr, self.streak = critic_ladder(self.lr, self.streak, rho, args)

    def state_dict(self) -> dict:
        return {"critic_lr": self.lr, "ladder_streak": self.streak}

    def load_state_dict(self, s: dict) -> None:
        self.lr, self.streak = s["critic_lr"], s["ladder_streak"]


@dataclasses.dataclass
class Group:
    """The continuations of one prompt + prefix, and everything a step learns about them, row by row."""

    problem: int
    prefix: list[int]
    lane: str  # refill | cold | full | short | audit | single (group-size-one chunk)
    source: Trajectory | None = None
    max_tokens: int = 0
    samples: list[Sample] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)  # prefix + continuation, decoded
    reference: str | None = None  # what the critic sees
    consumed: list[bool] = dataclasses.field(default_factory=list)  # scored by the critic, not the judge
    critic: list[float | None] = dataclasses.field(default_factory=list)  # consumed rows' values (None: invalid)
    verdicts: list[tuple[int | None, bool] | None] = dataclasses.field(default_factory=list)  # judged rows
    values: list[float] = dataclasses.field(default_factory=list)  # v_i
    valid: list[bool] = dataclasses.field(default_factory=list)  # valid for critic targets
    points: list[int | None] = dataclasses.field(default_factory=list)  # judge points (None: consumed or invalid)
    weights: list[float] = dataclasses.field(default_factory=list)  # actor-loss weight per row
    probe: float | None = None  # V(s), with the reference
    probe_overflow: bool = False
    probe_without_reference: tuple[float | None, bool] | None = None  # (V(s), overflow); None: not asked


@dataclasses.dataclass
class CriticQuery:
    """One critic call of the wave: a probe V(s) of a group (sample None) or the value of one consumed chunk."""

    group: Group
    sample: int | None
    with_reference: bool


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
    """n fresh problems, without replacement within the step (docs/ac2.md, step 1); a request for more than the
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


def fill_slots(buffer: list[Trajectory], n_batch: int, rng: np.random.Generator) -> list[Trajectory]:
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


def single_prefixes(t: Trajectory, args: Args, rng: np.random.Generator) -> list[list[int]]:
    """The group-size-one variant's prefixes (Section 4.3): g cuts on the single-cut grid, distinct where the
    trajectory is long enough, one chunk each."""
    grid = list(range(0, int(args.cut_max_frac * len(t.tokens)) + 1, args.single_cut_grid))
    cuts = rng.choice(grid, size=args.group_size, replace=len(grid) < args.group_size)
    return [t.tokens[: min(int(c), len(t.tokens) - 1)] for c in cuts]


def new_token_budget(lane: str, prefix_len: int, args: Args) -> int:
    """max_tokens of a row (Section 3.2): the budget counts prefix + new tokens, and a chunk stops after b."""
    remaining = args.budget - prefix_len
    return min(args.chunk_tokens, remaining) if lane in CHUNK_LANES else remaining


def critic_reference(g: Group, bank: ReferenceBank) -> str | None:
    """The reference the critic sees: the source trajectory's own proof if it passed, else the bank's, else none."""
    return g.source.proof if g.source and g.source.proof else bank.proofs.get(g.problem)


def find_proof(text: str, tiny: bool) -> str | None:
    """The proof a judge grades (after the last `</think>`, the first <proof> block); on the tiny task the whole
    trace, once its answer is boxed after `</think>`."""
    if tiny:
        return text.strip() if extract_final_answer(text) is not None else None
    return extract_proof(text)


def is_consumed(n_new: int, max_tokens: int, chunk: int, remaining: int, has_finished_answer: bool) -> bool:
    """A short row is scored by the critic only if it hit its chunk cap, the cap was below the remaining
    budget (else the end of the budget goes to the judge), and it holds no finished proof (docs/ac2.md, step 4)."""
    return max_tokens == chunk and n_new == chunk and chunk < remaining and not has_finished_answer


def consumed_rows(g: Group, args: Args) -> list[bool]:
    """Step 4: which of a group's rows the critic scores (chunks only; `is_consumed`)."""
    return [g.lane in CHUNK_LANES and is_consumed(len(s.completion.token_ids), g.max_tokens, args.chunk_tokens,
                                                  args.budget - len(g.prefix),
                                                  find_proof(text, args.dataset == "tiny") is not None)
            for s, text in zip(g.samples, g.texts)]


def critic_queries(groups: list[Group], args: Args) -> list[CriticQuery]:
    """Step 4's critic calls, in order: for each replay group (not refills, not cold starts) a probe V(s) with its
    reference, the same probe without it (a diagnostic, when there is a reference), and a value for each consumed
    chunk. Prefix GRPO asks the critic nothing."""
    if args.prefix_grpo:
        return []
    out = []
    for g in groups:
        if g.lane in ("refill", "cold"):
            continue
        out.append(CriticQuery(g, None, True))
        if args.probe_without_reference and g.reference is not None:
            out.append(CriticQuery(g, None, False))
        out += [CriticQuery(g, i, True) for i, used in enumerate(g.consumed) if used]
    return out


def replace_invalid_values(values: list[float | None], valid: list[bool]) -> tuple[list[float], list[float]]:
    """Endpoint values of one group -> (v_i, actor-loss weights) (Appendix C "Scoring failures").

    An invalid critic value (None) becomes the mean of the group's valid values (0 if none) and gets weight 0.
    An invalid judge verdict arrives as 0.0 with valid=False: it stays 0 with full weight (kept in the update)
    but does not count as a valid value.
    """
    good = [v for v, ok in zip(values, valid) if ok and v is not None]
    fill = float(np.mean(good)) if good else 0.0
    return [fill if v is None else v for v in values], [0.0 if v is None else 1.0 for v in values]


def endpoint_values(g: Group) -> None:
    """Step 6: v_i of every row -- the critic's value of a consumed chunk, else the judge's points / 7 (an invalid
    verdict: 0, kept in the update, not a valid target) -- with invalid critic values replaced
    (`replace_invalid_values`); a group-size-one row without a baseline V(s) carries no loss and no target."""
    raw, g.valid, g.points = [], [], []
    for i in range(len(g.samples)):
        if g.consumed[i]:
            raw.append(g.critic[i])
            g.valid.append(raw[-1] is not None)
            g.points.append(None)
        else:
            points, ok = g.verdicts[i]
            raw.append((points or 0) / 7 if ok else 0.0)
            g.valid.append(ok)
            g.points.append(points if ok else None)
    g.values, g.weights = replace_invalid_values(raw, g.valid)
    if g.lane == "single" and (g.probe is None or g.probe_overflow):
        g.weights = [0.0] * len(raw)


def admit_to_buffer(buffer: ReplayBuffer, groups: list[Group], refresh: bool, args: Args) -> None:
    """Step 7: every refill rollout with a non-empty response enters the FIFO, passed or not (the correct-only
    variant: passes only), with its own proof if it passed; a stale-buffer refresh replaces the whole buffer."""
    if args.stale_every and refresh:
        buffer.trajectories.clear()
    for g in groups:
        if g.lane == "refill" and g.samples[0].completion.token_ids:
            passed = (g.points[0] or 0) >= args.pass_points
            if args.buffer_admit == "all" or passed:
                proof = find_proof(g.texts[0], args.dataset == "tiny") if passed else None
                buffer.trajectories.append(Trajectory(g.problem, list(g.samples[0].completion.token_ids), proof))


def probe_target(g: Group, args: Args) -> float | None:
    """z: the mean of the group's valid values rounded to the grid, ties down; None (no observation) with fewer
    than min_valid valid values -- one for a group-size-one row, which also needs its own probe V(s)."""
    valid_values = [v for v, ok in zip(g.values, g.valid) if ok]
    enough = len(valid_values) >= (1 if g.lane == "single" else args.min_valid)
    if g.lane == "single" and (g.probe is None or g.probe_overflow):
        enough = False
    return round_to_grid(float(np.mean(valid_values))) if enough else None


def update_bank(bank: ReferenceBank, groups: list[Group], args: Args, rng: np.random.Generator) -> None:
    """Step 8, after the readiness transitions: a problem without a reference takes one of this step's passing
    rollouts (>= pass_points, with a proof; any lane, refills included) at random. Add-once, never replaced."""
    candidates = collections.defaultdict(list)
    for g in groups:
        for i, pts in enumerate(g.points):
            passed = pts is not None and pts >= args.pass_points
            if passed and (proof := find_proof(g.texts[i], args.dataset == "tiny")):
                candidates[g.problem].append(proof)
    for problem in sorted(candidates):
        if problem not in bank.proofs:
            bank.proofs[problem] = candidates[problem][int(rng.integers(len(candidates[problem])))]


def group_advantages(g: Group) -> list[float]:
    """Step 9 (Eqs. 3-4): A_i = v_i - mean_j v_j over the group, no std; group-size-one: A = v - V(s)."""
    base = g.probe if g.lane == "single" else float(np.mean(g.values))
    return [v - (base or 0.0) for v in g.values]


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


def select_critic_rows(records: list[CriticRecord], order: list[int], bank: dict[int, str], sample: int,
                       fits) -> tuple[list, int]:
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
        ref = rec.reference or bank.get(rec.problem)
        variants = [(ref, 0.5), (None, 0.5)] if ref else [(None, 1.0)]
        if all(fits(rec, r) for r, _ in variants):
            rows += [(rec, r, w) for r, w in variants]
            used += 1
    return rows, used


def update_entropy_offset(k: float, mean_entropy: float, args: Args) -> float:
    """Eq. 9: k <- clip(k + delta_H * sign(H* - H_hat), -bound, bound); eps_high = clip_high + k."""
    step = args.entropy_step * float(np.sign(args.entropy_target - mean_entropy))
    return float(np.clip(k + step, -args.entropy_k_bound, args.entropy_k_bound))


def ppo_loss(logp, old_logp, adv, clip_low: float, clip_high: float, dual_clip: float):
    """Per-token dual-clip PPO loss (Appendix C), plus which clip was active.

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


# ----------------------------------------------------------------------------------------------------
# The critic prompt (token level; the released `build_q_context_ids`)
# ----------------------------------------------------------------------------------------------------
def critic_context(prompt_ids: list[int], attempt_ids: list[int], reference: str | None, tok, args: Args) -> list[int]:
    """Problem prompt + attempt + `</think>` (only if the attempt has none) + the instruction as a new user
    turn + the forced assistant prefill ending in `Q value: `; the critic then writes the number. With
    `--critic-reference-first` the reference closes the problem's turn instead of following the instruction."""
    think_end = tok.convert_tokens_to_ids("</think>")
    instruction, ref_text = ((TINY_CRITIC_INSTRUCTION, TINY_CRITIC_REFERENCE) if args.short_critic_instruction
                             else (CRITIC_INSTRUCTION, CRITIC_REFERENCE))
    if reference and args.critic_reference_first:  # project choice: the reference ends the problem's user turn
        end = len(prompt_ids) - 1 - prompt_ids[::-1].index(tok.convert_tokens_to_ids("<|im_end|>"))
        ref_ids = tok(ref_text.format(reference_proof=reference), add_special_tokens=False)["input_ids"]
        prompt_ids, reference = prompt_ids[:end] + ref_ids + prompt_ids[end:], None
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


def critic_record_fits(rec: CriticRecord, reference: str | None, train: Problems, tok, args: Args,
                       max_len: int) -> bool:
    """A critic row must fit the engine's context (else it is skipped, like an overflowing probe)."""
    context = critic_context(train.prompts[rec.problem], rec.prefix, reference, tok, args)
    return len(context) + len(critic_target(rec.target, tok)) <= max_len


def critic_rows(fifo: CriticFifo, bank: ReferenceBank, train: Problems, tok, args: Args, rng: np.random.Generator,
                max_len: int) -> tuple[list[TrainRow], int]:
    """Step 10's critic batch: `select_critic_rows` over a random permutation of the FIFO; each row is the critic
    context, then the target value's tokens and end-of-turn, which carry the loss. Returns (rows, records used)."""
    records = list(fifo.records)
    chosen, n_records = select_critic_rows(records, rng.permutation(len(records)).tolist(), bank.proofs,
                                           args.critic_sample, partial(critic_record_fits, train=train, tok=tok,
                                                                       args=args, max_len=max_len))
    rows = []
    for rec, ref, w in chosen:
        context, target = critic_context(train.prompts[rec.problem], rec.prefix, ref, tok, args), critic_target(
            rec.target, tok)
        rows.append(TrainRow(context + target, len(context), len(target), weight=w))
    return rows, n_records


def grade(texts: list[str], problems: list[dict], args: Args, judge, validation: bool = False):
    """([(points or None, valid)] per text, [(error, detail)] per judge call). No proof: 0 points, no call, valid
    (docs/ac2.md, step 5). Training uses the 7/6/1/0 grader, validation the 0-7 one with references; on the tiny
    task the verifier stands in for the judge (7 points for the right answer)."""
    tiny = args.dataset == "tiny"
    if tiny and (not validation or args.eval_dataset == "tiny"):
        return [(7 * int(tiny_reward(t, r["answer"])), True) for t, r in zip(texts, problems)], []
    proofs = [find_proof(t, tiny) for t in texts]
    todo = [i for i, p in enumerate(proofs) if p is not None]
    res = judge.grade([problems[i][args.problem_field] for i in todo], [proofs[i] for i in todo],
                      [problems[i].get(args.eval_solution_field) for i in todo] if validation else None,
                      [problems[i].get(args.eval_guidelines_field) for i in todo] if validation else None,
                      validation=validation)
    out = [(0, True)] * len(texts)
    for i, r in zip(todo, res):
        out[i] = (r.points, r.valid)
    return out, [(r.error, r.detail) for r in res]


def eval_scores(texts: list[str], problems: list[dict], held_out: bool, args: Args, judge):
    """Evaluation's scores (points / 7) and, held out, the pass rate (>= pass_points)."""
    scored, _ = grade(texts, problems, args, judge, validation=held_out)
    extra = {"eval/pass_rate": float(np.mean([(p or 0) >= args.pass_points for p, _ in scored]))} if held_out else {}
    return [(p or 0) / 7 for p, _ in scored], extra


# ====================================================================================================
# ALGO LOGIC: the stages of AC2's step, in the paper's order (docs/ac2.md, "One step")
# ====================================================================================================
def make_groups(buffer: ReplayBuffer, tracker: ReadinessTracker, n_problems: int, step: int, args: Args,
                rng: np.random.Generator) -> tuple[list[Group], bool, dict]:
    """Steps 1-2: fresh refill problems (one full rollout each), then the replay slots -- cut from the buffer's
    trajectories and routed by readiness (unready: full; ready: a chunk, or an audit) -- or, while the buffer is
    empty, a cold start of fresh problems with empty prefixes trained like GRPO. Each row's new-token budget.
    Returns the groups, whether a stale buffer is refreshed this step, and the share of ready replay slots."""
    refresh = args.stale_every == 0 or (step - 1) % args.stale_every == 0
    n_fresh = (args.n_refill if args.stale_every == 0 else args.stale_size) if refresh else 0
    cold = not buffer.trajectories
    fresh = draw_fresh(n_problems, n_fresh + (args.n_batch if cold else 0), rng)
    groups = [Group(p, [], "refill") for p in fresh[:n_fresh]]
    logged = {}
    if cold:
        groups += [Group(p, [], "cold") for p in fresh[n_fresh:]]
    else:
        sources = fill_slots(list(buffer.trajectories), args.n_batch, rng)
        ready = [not args.prefix_grpo and tracker.is_ready(t.problem) for t in sources]
        logged["ac2/ready_frac"] = float(np.mean(ready))
        for t, lane in zip(sources, route_slots(ready, audit_fraction(args), rng)):
            if lane == "short" and args.group_size_one:
                groups += [Group(t.problem, prefix, "single", t) for prefix in single_prefixes(t, args, rng)]
            else:
                cut = draw_cut(len(t.tokens), args.cut_grid, args.cut_max_frac, rng)
                groups.append(Group(t.problem, t.tokens[:cut], lane, t))
    for g in groups:
        g.max_tokens = new_token_budget(g.lane, len(g.prefix), args)
    return groups, refresh, logged


def generate(llm, tok, train: Problems, groups: list[Group], step: int, args: Args) -> None:
    """Step 3: one request per group, the prefix after the templated prompt: g continuations (one for a refill
    and for a group-size-one chunk); the prefix gets no loss."""
    from vllm import SamplingParams

    params = [SamplingParams(n=1 if g.lane in ("refill", "single") else args.group_size, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, max_tokens=max(g.max_tokens, 1), logprobs=0,
                             seed=request_seed(args.seed, step, i)) for i, g in enumerate(groups)]
    contexts = [train.prompts[g.problem] + g.prefix for g in groups]
    for g, context, completions in zip(groups, contexts, engine.generate(llm, contexts, params)):
        g.samples = [Sample(g.problem, context, c) for c in completions]
        g.texts = [tok.decode(g.prefix + c.token_ids, skip_special_tokens=True) for c in completions]


def critic_wave(llm, tok, train: Problems, groups: list[Group], bank: ReferenceBank, args: Args, max_len: int):
    """Step 4, with the rollouts' own weights: each group's reference and consumed rows, then every critic call of
    `critic_queries` in one batch; an overflowing context is an invalid value (a probe: no observation)."""
    for g in groups:
        g.reference = critic_reference(g, bank)
        g.consumed = consumed_rows(g, args)
        g.critic = [None] * len(g.samples)
    queries = critic_queries(groups, args)
    contexts = [critic_context(train.prompts[q.group.problem], q.group.prefix + (
        q.group.samples[q.sample].completion.token_ids if q.sample is not None else []),
        q.group.reference if q.with_reference else None, tok, args) for q in queries]
    for q, (value, overflow) in zip(queries, query_critic(llm, contexts, tok, max_len)):
        if q.sample is None and q.with_reference:
            q.group.probe, q.group.probe_overflow = value, overflow
        elif q.sample is None:
            q.group.probe_without_reference = (value, overflow)
        else:
            q.group.critic[q.sample] = None if overflow else value


def judge_groups(groups: list[Group], train: Problems, args: Args, judge) -> tuple[list, int, int]:
    """Step 5: every row the critic does not score goes to the judge (points / 7). Returns the judge's calls, and
    how many of the judged rows held a proof it could grade, of how many."""
    todo = [(g, i) for g in groups for i in range(len(g.samples)) if not g.consumed[i]]
    verdicts, calls = grade([g.texts[i] for g, i in todo], [train.rows[g.problem] for g, _ in todo], args, judge)
    for g in groups:
        g.verdicts = [None] * len(g.samples)
    for (g, i), verdict in zip(todo, verdicts):
        g.verdicts[i] = verdict
    return calls, sum(find_proof(g.texts[i], args.dataset == "tiny") is not None for g, i in todo), len(todo)


def critic_bookkeeping(groups: list[Group], tracker: ReadinessTracker, bank: ReferenceBank, fifo: CriticFifo,
                       args: Args, rng: np.random.Generator) -> tuple[list[Probe], set[int], dict]:
    """Step 8: each replay group's probe observation and critic record (`probe_target`); the readiness transitions,
    with the bank as it was before this step; then the bank's additions (`update_bank`) and the records into the
    critic FIFO. Returns the probes, the problems that became ready and the critic's diagnostics."""
    probes, records, audit_err, mae_ref, mae_noref = [], [], [], [], []
    for g in groups:
        if g.lane in ("refill", "cold") or args.prefix_grpo:
            continue
        z = probe_target(g, args)
        probes.append(Probe(g.problem, g.probe, z, g.probe_overflow))
        if z is not None:
            records.append(CriticRecord(g.problem, list(g.prefix), z, g.source.proof if g.source else None))
            if g.probe is not None and g.reference is not None and g.probe_without_reference is not None:
                noref = g.probe_without_reference[0]
                mae_ref.append(abs(g.probe - z))
                mae_noref.append(1.0 if noref is None else abs(noref - z))
        if g.lane == "audit" and g.probe is not None:
            valid_values = [v for v, ok in zip(g.values, g.valid) if ok]
            audit_err.append(abs(g.probe - float(np.mean(valid_values or [0.0]))))
    newly_ready = tracker.update(probes, bank_before=set(bank.proofs))
    update_bank(bank, groups, args, rng)
    fifo.records.extend(records)
    return probes, newly_ready, {"ac2/audit_critic_error": float(np.mean(audit_err or [np.nan])),
                                 "ac2/critic_mae_with_ref": float(np.mean(mae_ref or [np.nan])),
                                 "ac2/critic_mae_without_ref": float(np.mean(mae_noref or [np.nan]))}


def actor_rows(groups: list[Group]) -> list[TrainRow]:
    """Step 9: the rows the actor trains -- every row of a replay or cold-start group with new tokens, its
    advantage broadcast over them; refill rows are not trained."""
    rows = []
    for g in groups:
        if g.lane == "refill":
            continue
        for s, advantage, weight in zip(g.samples, group_advantages(g), g.weights):
            if s.completion.token_ids:
                rows.append(TrainRow(s.context + s.completion.token_ids, len(s.context), len(s.completion.token_ids),
                                     advantage, weight, s.completion.logprobs, len(g.prefix)))
    return rows


def refill_rows(groups: list[Group]) -> list[TrainRow]:
    """The refills' rollouts, scored by the trainer for Eq. 9's entropy only."""
    return [TrainRow(s.context + s.completion.token_ids, len(s.context), len(s.completion.token_ids), weight=0.0,
                     sampled=s.completion.logprobs) for g in groups if g.lane == "refill"
            for s in g.samples[:1] if s.completion.token_ids]


def old_logprobs_and_entropy(model, actor: list[TrainRow], refills: list[TrainRow], args: Args, peaks) -> float:
    """Step 10's old log-probabilities of the actor's rows, and Eq. 9's H-hat from the rows with an empty prefix.
    With --old-logprobs engine the trainer still scores the empty-prefix rows, whose entropies Eq. 9 needs, and every
    actor row takes the engine's log-probabilities: the pass over the replayed prefixes' continuations is saved."""
    rows = actor + refills
    if args.old_logprobs == "trainer":
        old_logprobs(model, rows, args.temperature, args, peaks)
        return empty_prefix_entropy(rows, args)
    fresh = [r for r in rows if r.prefix_len == 0]
    old_logprobs(model, fresh, args.temperature, dataclasses.replace(args, old_logprobs="trainer"), peaks)
    entropy = empty_prefix_entropy(fresh, args)
    old_logprobs(model, actor, args.temperature, args, peaks)
    return entropy


def empty_prefix_entropy(rows: list[TrainRow], args: Args) -> float:
    """Eq. 9's H-hat: the mean token entropy at the rollout temperature over rows with an empty prefix (refills,
    cold starts, cuts at 0), all ranks together; H* itself (no change of k) when there are none."""
    ents = [r.entropy for r in rows if r.entropy is not None and r.prefix_len == 0]
    return parallel.mean_all(torch.cat(ents or [torch.zeros(0)]).float().cpu(), default=args.entropy_target)


class Snapshot:
    """A copy of this process's weights (its shards under FSDP) in host memory, for the LR ladder's ||d theta||
    (Appendix C): one set of buffers for the whole run, refilled before each of a step's three updates (pinned on
    GPU, for fast copies), never a second copy on the GPU."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    def take(self, model) -> None:
        parallel.reshard(model)  # after the old log-prob pass the root's parameters are still gathered
        params = [parallel.local(p).detach() for p in model.parameters()]
        if not self.buffers:
            self.buffers = [torch.empty(p.shape, dtype=p.dtype, pin_memory=p.is_cuda) for p in params]
        for buffer, p in zip(self.buffers, params):
            buffer.copy_(p)

    def displacement(self, model) -> float:
        """L2 norm of the parameter change since `take` (all ranks), one parameter at a time."""
        local = sum(float((parallel.local(p).detach() - b.to(parallel.local(p).device)).float().pow(2).sum())
                    for p, b in zip(model.parameters(), self.buffers))
        return math.sqrt(parallel.sum_all(local))


def actor_loss(rows: list[TrainRow], logp, clip_high: float, denom: float, args: Args):
    """The dual-clip PPO loss of one micro-batch, token mean over its minibatch (Appendix C)."""
    adv = torch.cat([torch.full((r.n,), r.advantage) for r in rows]).to(logp.device)
    tok_loss, st = ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, args.clip_low, clip_high,
                            args.dual_clip)
    if args.rollout_correction != "none":  # the sampler's gap, weighed token by token (the actor's loss only)
        tok_loss = tok_loss * torch.cat([r.is_weight for r in rows])
    return tok_loss.sum() / denom, {key: float(v.detach().float().sum()) for key, v in st.items()}


def critic_loss(rows: list[TrainRow], logp, n_records: int):
    """NLL of the value tokens + end-of-turn, weight w/4 per token, summed / records (Appendix C)."""
    w = torch.cat([torch.full((r.n,), r.weight / 4) for r in rows]).to(logp.device)
    return -(logp * w).sum() / n_records, {}


def critic_step(model, critic_opt, rows: list[TrainRow], n_records: int, lr: float, args: Args, peaks,
                snapshot: Snapshot) -> tuple[float, float | None]:
    """One critic AdamW step (its state visits the GPU for this step only). Returns (loss, ||d_critic||): nan and
    None without records, and d = inf for a step skipped as non-finite (the ladder counts it, as the released
    code does)."""
    if not rows:
        return float("nan"), None
    for group in critic_opt.param_groups:
        group["lr"] = lr
    snapshot.take(model)
    result = train_minibatch(model, critic_opt, rows, list(range(len(rows))), partial(critic_loss, n_records=n_records),
                             1.0, args.critic_max_grad_norm, args, peaks, offload=True,
                             phases=("critic_step", "critic_step"))
    return result.loss, snapshot.displacement(model) if result.stepped else math.inf


def train_actor_and_critic(model, actor_opt, critic_opt, actor: list[TrainRow], critic: list[TrainRow],
                           n_records: int, clip_high: float, ladder: CriticLR, args: Args, peaks,
                           snapshot: Snapshot) -> dict:
    """Step 10 (Section 3.3): actor minibatch 1 -> one critic step -> actor minibatch 2 on the shared weights, each
    with its own AdamW state; then the critic's LR ladder on rho = ||d_critic|| / (||d_ppo1|| + ||d_ppo2||)."""
    model.train()
    totals, grad_norms, d_actor, skipped = collections.Counter(), [], [], 0
    critic_loss_value, d_critic = float("nan"), None
    for m, mb in enumerate(minibatches(actor, args.num_minibatches)):
        if m == 1:
            critic_loss_value, d_critic = critic_step(model, critic_opt, critic, n_records, ladder.lr, args, peaks,
                                                      snapshot)
        if not mb:
            d_actor.append(0.0)
            continue
        snapshot.take(model)
        loss = partial(actor_loss, clip_high=clip_high, denom=sum(actor[i].n for i in mb), args=args)
        result = train_minibatch(model, actor_opt, actor, mb, loss, args.temperature, args.max_grad_norm, args, peaks,
                                 args.offload_optimizer)
        totals.update(result.sums)
        totals["policy_loss"] += result.loss / args.num_minibatches
        grad_norms.append(result.grad_norm)
        skipped += not result.stepped
        d_actor.append(snapshot.displacement(model))
    if args.num_minibatches == 1:
        critic_loss_value, d_critic = critic_step(model, critic_opt, critic, n_records, ladder.lr, args, peaks,
                                                  snapshot)
    model.zero_grad(set_to_none=True)  # free the gradients before the engine takes the memory back
    rho = ladder_ratio(d_critic, d_actor)
    ladder.update(rho, args)
    return {**update_scalars(totals, grad_norms, skipped, actor, ("clip_low", "clip_high", "clip_dual", "approx_kl")),
            "ac2/critic_loss": critic_loss_value, "ac2/critic_lr": ladder.lr,
            "ac2/critic_rho": rho if rho is not None else float("nan")}


def count_rollouts(groups: list[Group], counters: Counters) -> collections.Counter:
    """Every policy rollout of this step into the counters (refills included, critic calls not; Appendix B); the
    new tokens of each lane."""
    lane_tokens = collections.Counter()
    for g in groups:
        for s in g.samples:
            lane_tokens[g.lane] += len(s.completion.token_ids)
            counters.add(len(s.context), len(s.completion.token_ids))
    return lane_tokens


def step_scalars(groups, lane_tokens, probes, newly_ready, tracker, bank, buffer, fifo, n_records, n_problems,
                 args: Args) -> dict[str, float]:
    """AC2's own logged quantities of one step."""
    judged = [g.verdicts[i] for g in groups for i in range(len(g.samples)) if not g.consumed[i]]
    step_errors = [p.error for p in probes if p.error is not None]
    scalars = {
        "charts/learning_rate": args.learning_rate, "train/reward_mean": float(np.mean([(p or 0) / 7 for p, _ in judged]
                                                                                       or [0.0])),
        "ac2/value_mean": float(np.mean([v for g in groups if g.lane != "refill" for v in g.values] or [0.0])),
        "ac2/global_mae": tracker.global_mae() or float("nan"), "ac2/gate_open": float(tracker.gate_open()),
        "ac2/probe_mae": float(np.mean(step_errors or [np.nan])),
        "ac2/ready_problems": len(tracker.ready) if not tracker.all_ready else n_problems,
        "ac2/newly_ready": len(newly_ready), "ac2/bank_size": len(bank.proofs),
        "ac2/buffer_size": len(buffer.trajectories), "ac2/critic_fifo": len(fifo.records),
        "ac2/critic_records": n_records, "ac2/consumed_rows": sum(sum(g.consumed) for g in groups),
        "ac2/judged_rows": len(judged), "ac2/invalid_judge": sum(not ok for _, ok in judged),
        "ac2/invalid_critic": sum(c is None for g in groups for c, used in zip(g.critic, g.consumed) if used),
    }
    for lane in ("refill", "cold", "full", "short", "audit", "single"):
        scalars[f"ac2/tokens_{lane}"] = lane_tokens[lane]
    scalars["ac2/new_tokens_per_sample"] = sum(lane_tokens.values()) / max(1, sum(len(g.samples) for g in groups))
    return scalars


def completions(groups: list[Group]) -> list[str]:
    return [f"**{g.lane}, v={g.values[0]:.2f}**\n```\n{g.texts[0][-1500:]}\n```" for g in groups if g.samples][:4]


def progress_line(step: int, scalars: dict, last_eval: float, tracker: ReadinessTracker, clock: Clock,
                  args: Args) -> str:
    t, tokens = clock.times, sum(v for k, v in scalars.items() if k.startswith("ac2/tokens_"))
    return (f"step {step}/{args.num_steps} | reward {scalars['train/reward_mean']:.3f}{eval_field(last_eval)} | "
            f"ready {scalars['ac2/ready_problems']} gate {int(tracker.gate_open())} mae "
            f"{scalars['ac2/global_mae']:.3f} | consumed {scalars['ac2/consumed_rows']} | tokens {tokens} | gen "
            f"{t['time/generate']:.1f}s critic {t['time/critic']:.1f}s train {t['time/train']:.1f}s")


def save(step: int, model, tok, actor_opt, critic_opt, run_name: str, buffer: ReplayBuffer, tracker: ReadinessTracker,
         bank: ReferenceBank, fifo: CriticFifo, ladder: CriticLR, k_entropy: float, counters: Counters,
         args: Args) -> Path:
    """A checkpoint of everything the run carries, as of the end of step `step`."""
    state = {"run_name": run_name, "buffer": buffer.state_dict(), "readiness": tracker.state_dict(),
             "bank": bank.state_dict(), "critic_fifo": fifo.state_dict(), **ladder.state_dict(),
             "entropy_k": k_entropy, **counters.state_dict()}
    return parallel.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok,
                                    {"actor": actor_opt, "critic": critic_opt}, state, args.keep_checkpoints)


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
    if args.model == "tiny-ac2" and not args.critic_reference_first:  # read in another order, its critic is blind
        raise SystemExit("--model tiny-ac2's critic learned the reference before the attempt: add "
                         "--critic-reference-first")
    rank, device, resume_dir, ckpt, run_name = start_run(args)
    master = rank == 0

    # --- data, judge, models and engine (each fails fast, with one sentence) ---
    rows = load_rows(args.dataset, args.dataset_split, [args.problem_field], args.train_limit)
    eval_fields = [args.problem_field] + ([] if args.eval_dataset == "tiny" else [args.eval_solution_field])
    eval_rows = load_rows(args.eval_dataset, args.eval_split, eval_fields, args.eval_limit) if args.eval_every else []
    judge = start_judge(args, master) if args.dataset != "tiny" else None
    model_path, config, tok, model = load_policy(args, device, resume_dir, len(eval_rows))
    # one set of weights, two optimizers with their own state (Section 3.3); the critic's state spends all but its
    # one step per training step in CPU memory, the actor's too with --offload-optimizer
    actor_opt = adamw(model, args.learning_rate, args.weight_decay, device)
    critic_opt = adamw(model, args.critic_lr, 0.0, device)
    train = Problems(rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.problem_field]))
                            for r in rows])
    held_out = Problems(eval_rows, [encode_chat(tok, args.prompt_template.format(problem=r[args.problem_field]))
                                    for r in eval_rows])
    sample = train_sample(len(train.rows), args)
    train_eval = Problems([train.rows[i] for i in sample], [train.prompts[i] for i in sample])
    eval_max_tokens = args.eval_max_tokens if args.eval_every else 0  # the engine's context need not hold it
    max_len = max(map(len, train.prompts + held_out.prompts)) + max(args.budget, eval_max_tokens) + \
        args.critic_context_extra
    max_len = min(max_len, getattr(config.get_text_config(), "max_position_embeddings", max_len))
    peaks = parallel.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    llm = start_engine(model_path, config, max_len, args, peaks, master)
    score = partial(eval_scores, args=args, judge=judge)

    # --- all state a checkpoint carries ---
    buffer, bank, fifo = ReplayBuffer(buffer_capacity(args)), ReferenceBank(), CriticFifo(args.critic_buffer)
    tracker = ReadinessTracker(args.window, args.tau_global, args.tau_local, local=args.readiness == "local")
    ladder, k_entropy, snapshot = CriticLR(args.critic_lr), args.entropy_k_init, Snapshot()
    start_step, counters = 0, Counters(*engine.decoding_flops_coefficients(config))
    watch = Watch()  # steps in a row with a failing judge, or with no gradable answer (not checkpointed)
    if ckpt:
        parallel.load_checkpoint(resume_dir, model, {"actor": actor_opt, "critic": critic_opt},
                                 offload=("critic", "actor") if args.offload_optimizer else ("critic",))
        buffer.load_state_dict(ckpt["buffer"])
        tracker.load_state_dict(ckpt["readiness"])
        bank.load_state_dict(ckpt["bank"])
        fifo.load_state_dict(ckpt["critic_fifo"])
        ladder.load_state_dict(ckpt)
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
        rng = np.random.default_rng([args.seed, step])  # every random choice of this step, resumable
        # 1-2. Batch and route: refills, replay slots cut from the buffer (or a cold start), lanes by readiness
        groups, refresh, logged = make_groups(buffer, tracker, len(train.rows), step, args, rng)
        # 3. Generate: full rollouts, or b-token chunks on ready problems
        peaks.start()
        generate(llm, tok, train, groups, step, args)
        clock.lap("generate")
        # 4. Critic wave: a probe V(s) per replay group, a value per consumed chunk
        critic_wave(llm, tok, train, groups, bank, args, max_len)
        peaks.end("rollout")  # the rollouts and the critic wave
        engine.sleep(llm, args.vllm_sleep_level)
        clock.lap("critic")
        # 5. Judge every row the critic did not score; a judge that fails most calls step after step stops the run
        calls, gradable, judged = judge_groups(groups, train, args, judge)
        watch_scores(watch, calls, gradable, judged, "a proof the judge can grade (a <proof> block after </think>)",
                     "--prompt-template", step, args, master, partial(save, step - 1, model, tok, actor_opt,
                                                                       critic_opt, run_name, buffer, tracker, bank,
                                                                       fifo, ladder, k_entropy, counters, args))
        lane_tokens = count_rollouts(groups, counters)
        # 6. Endpoint values v_i; an invalid critic value -> the group's valid mean, no actor loss
        for g in groups:
            endpoint_values(g)
        clock.lap("score")
        # 7. Buffer: the refills' rollouts enter the FIFO
        admit_to_buffer(buffer, groups, refresh, args)
        # 8. Readiness (the bank as it was before this step), the reference bank, critic records
        probes, newly_ready, critic_logs = critic_bookkeeping(groups, tracker, bank, fifo, args, rng)
        # 9. Advantages A_i = v_i - mean_j v_j per group (lambda = 0 on ready problems, 1 elsewhere)
        actor, refills = actor_rows(groups), refill_rows(groups)
        # 10. Old log-probs; Eq. 9 on empty-prefix rows; actor minibatch 1 -> one critic step -> actor minibatch 2
        entropy = old_logprobs_and_entropy(model, actor, refills, args, peaks)
        correction = rollout_correction(actor, args)  # --rollout-correction's weights, the actor's rows only
        k_entropy = update_entropy_offset(k_entropy, entropy, args)  # once per step, before the update
        critic, n_records = critic_rows(fifo, bank, train, tok, args, rng, max_len)
        losses = train_actor_and_critic(model, actor_opt, critic_opt, actor, critic, n_records,
                                        args.clip_high + k_entropy, ladder, args, peaks, snapshot)
        clock.lap("train")
        # 11. Sync, log, evaluate, checkpoint
        wake_up(llm, model, peaks)
        clock.lap("sync")
        scalars = {**counters.scalars(), **logged, **losses, "losses/entropy": entropy, "ac2/eps_high":
                   args.clip_high + k_entropy, **step_scalars(groups, lane_tokens, probes, newly_ready, tracker, bank,
                                                              buffer, fifo, n_records, len(train.rows), args),
                   **critic_logs, **correction, **sampler_gap(actor, args), **clock.scalars(), **peaks.pop()}
        log_step(writer, step, scalars, completions(groups), args)
        if evaluating(step, args.num_steps, args):
            last_eval = evaluate(step, llm, tok, held_out, train_eval, score, args, writer)
        if master:
            print(progress_line(step, scalars, last_eval, tracker, clock, args), flush=True)
        if saving(step, args.num_steps, args):
            save(step, model, tok, actor_opt, critic_opt, run_name, buffer, tracker, bank, fifo, ladder, k_entropy,
                 counters, args)

    if writer is not None:
        writer.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
