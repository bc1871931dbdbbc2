"""RPO: Replay-based Policy Optimization (Yi et al., arXiv 2601.19404; spec/rpo.md).

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

import dataclasses
import math
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
from common.judges import AnswerVerifier, extract_final_answer
from common.tiny import resolve_model, tiny_reward

OPEN_RS_PROMPT = (  # open-rs style: think first, answer in \boxed{} (spec/rpo.md "Defaults")
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


# ----------------------------------------------------------------------------------------------------
# RPO's rules
# ----------------------------------------------------------------------------------------------------
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


def grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Eq. 6: (R_i - mean R) / std R per group (unbiased std + 1e-4, as TRL; equal rewards give 0).
    DAPO normalises the same way; it differs in aggregation, clip-higher and the absent KL."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    return (adv / (r.std(dim=1, keepdim=True) + 1e-4) if group_size > 1 else adv).reshape(-1)


# ----------------------------------------------------------------------------------------------------
# Shared machinery, as in grpo.py (repeated on purpose: each script reads on its own)
# ----------------------------------------------------------------------------------------------------
def request_seed(*keys: int) -> int:
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
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": template.format(problem=problem)}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chunk_logprobs(hidden, targets, weight, bias, temperature: float):
    logits = F.linear(hidden, weight, bias).float() / temperature
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


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


def sequence_logprobs(model, input_ids, starts, lengths, temperature: float, chunk: int):
    """Log-probs of input_ids[b, starts[b] : starts[b] + lengths[b]], LM head in checkpointed chunks."""
    hidden = final_hidden_states(model, input_ids)
    rows = torch.cat([torch.full((n,), b, dtype=torch.long) for b, n in enumerate(lengths)]).to(input_ids.device)
    cols = torch.cat([torch.arange(s - 1, s - 1 + n) for s, n in zip(starts, lengths)]).to(input_ids.device)
    h, targets = hidden[rows, cols], input_ids[rows, cols + 1]
    head = model.get_output_embeddings()
    out = []
    for i in range(0, h.shape[0], chunk):
        fn_args = (h[i : i + chunk], targets[i : i + chunk], head.weight, head.bias, temperature)
        out.append(checkpoint(_chunk_logprobs, *fn_args, use_reentrant=False) if torch.is_grad_enabled()
                   else _chunk_logprobs(*fn_args))
    return torch.cat(out)


def clipped_surrogate(logp, old_logp, adv, clip_low: float, clip_high: float):
    """Per-token PPO/GRPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old_logp) (Eq. 5)."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high))
    clipped = ((adv < 0) & (ratio < 1 - clip_low)) | ((adv > 0) & (ratio > 1 + clip_high))
    return loss, clipped, (ratio - 1) - torch.log(ratio)


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
    dapo = args.objective == "dapo"
    clip_high = args.dapo_clip_high if dapo else args.clip_high
    kl_coef = 0.0 if dapo else args.kl_coef

    train_rows = load_rows(args.dataset, args.dataset_split, [args.problem_field, args.answer_field], args.train_limit)
    eval_rows = load_rows(args.eval_dataset, args.eval_split, [args.eval_problem_field, args.eval_answer_field],
                          args.eval_limit) if args.eval_every else []
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
    ref_model = None
    if kl_coef > 0:  # frozen initial policy for the k3 KL term
        ref_model = dist.shard(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), device).eval()
        ref_model.requires_grad_(False)
    num_steps = math.ceil(args.epochs * len(train_rows) / args.problems_per_step)
    warmup = max(1, int(args.warmup_frac * num_steps))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # fused: no full-size temporary on GPU
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, num_steps, args.min_lr_rate))
    prompts = [encode_prompt(tok, args.prompt_template, r[args.problem_field]) for r in train_rows]
    eval_prompts = [encode_prompt(tok, args.prompt_template, r[args.eval_problem_field]) for r in eval_rows]
    # a fixed sample of training problems, evaluated like the held-out ones (eval/train_score)
    train_eval_rows = [train_rows[i] for i in sorted(random.Random(args.seed).sample(
        range(len(train_rows)), min(args.train_eval_problems, len(train_rows))))] if args.eval_every else []
    train_eval_prompts = [encode_prompt(tok, args.prompt_template, r[args.problem_field]) for r in train_eval_rows]
    cache_init_max_tokens = cache_init_limit(args)
    longest = max(args.max_response_tokens, args.eval_max_tokens if args.eval_every else 0, cache_init_max_tokens)
    peaks = dist.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    peaks.start()
    if master:
        print(f"starting the vLLM engine for {args.model} ...", flush=True)
    llm = engine.create_engine(model_path, max_model_len=max(map(len, prompts + eval_prompts)) + longest + 8,
                               seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization)
    peaks.end("engine_start")
    flops_A, flops_B = engine.decoding_flops_coefficients(config)
    verifier = AnswerVerifier()  # its worker processes start on first use only

    def verify(texts: list[str], rows: list[dict], field: str, tiny: bool) -> list[float]:
        """r in {0, 1} on the full response: math-verify (gold first), or the tiny task's own verifier."""
        if tiny:
            return [tiny_reward(t, r["answer"]) for t, r in zip(texts, rows)]
        return verifier.verify([str(r[field]) for r in rows], [extract_final_answer(t) for t in texts])

    # --- state a checkpoint carries: the cache, each problem's previous shortest response, counters ---
    cache: dict[int, list[int]] = {}  # problem -> cached answer token ids (prefix source)
    cache_correct: dict[int, float] = {}
    cache_finished: dict[int, bool] = {}  # has a final answer; an unfinished entry is only ever cut shorter
    previous_shortest: dict[int, int] = {}
    start_step, total_flops, total_tokens = 0, 0, 0
    if ckpt:
        dist.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                             offload=("optimizer",) if args.offload_optimizer else ())
        schedule.load_state_dict(ckpt["schedule"])
        cache, cache_correct, previous_shortest = ckpt["cache"], ckpt["cache_correct"], ckpt["previous_shortest"]
        cache_finished = ckpt["cache_finished"]
        start_step, total_flops, total_tokens = ckpt["step"], ckpt["decoding_flops"], ckpt["generated_tokens"]
        if master:
            print(f"resumed from {resume_dir} at step {start_step}")
    engine.sync_weights(llm, model)

    writer = SummaryWriter(f"runs/{run_name}") if master else None  # rank 0 logs
    if master:
        writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(
            f"|{k}|{v!r}|" for k, v in vars(args).items()))
        if args.track:
            import wandb

            wandb.init(project=args.wandb_project, name=run_name, config=vars(args), sync_tensorboard=True)

    def fill_cache(problems: list[int], step: int) -> int:
        """Cache pool initialisation (Section 3.1, Eq. 1): one answer per problem from the current policy,
        right or wrong. Its decoding counts in charts/decoding_flops. Returns the tokens decoded."""
        params = [SamplingParams(temperature=args.cache_init_temperature, top_p=args.cache_init_top_p,
                                 max_tokens=cache_init_max_tokens, seed=request_seed(args.seed, -2, step, p))
                  for p in problems]
        answers = engine.generate(llm, [prompts[p] for p in problems], params, progress="the cache's first answers")
        texts = [tok.decode(a[0].token_ids, skip_special_tokens=True) for a in answers]
        rewards = verify(texts, [train_rows[p] for p in problems], args.answer_field, args.dataset == "tiny")
        for p, a, r, t in zip(problems, answers, rewards, texts):
            cache[p], cache_correct[p] = list(a[0].token_ids), r
            cache_finished[p] = extract_final_answer(t) is not None
        nonlocal total_flops
        total_flops += sum(engine.decoding_flops(flops_A, flops_B, len(prompts[p]), len(a[0].token_ids))
                           for p, a in zip(problems, answers))
        return sum(len(a[0].token_ids) for a in answers)

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
        score = float(np.mean(verify(texts, [r for r in eval_rows for _ in range(args.eval_samples)],
                                     args.eval_answer_field, args.eval_dataset == "tiny")))
        if master:
            writer.add_scalar("eval/mean_score", score, step)
            writer.add_scalar("eval/response_len_mean", float(np.mean([len(c.token_ids) for g in groups for c in g])),
                              step)
        if train_eval_prompts:  # the same sampling on training problems, from scratch: the train / held-out gap
            _, texts = sample_for_eval(train_eval_prompts, -4, "training problems")
            train_score = float(np.mean(verify(texts, [r for r in train_eval_rows for _ in range(args.eval_samples)],
                                               args.answer_field, args.dataset == "tiny")))
            if master:
                writer.add_scalar("eval/train_score", train_score, step)
        if master:
            writer.add_scalar("time/eval", time.time() - t0, step)
        return score

    if start_step == 0 and args.cache_init == "eager":
        t0 = time.time()
        total_tokens += fill_cache(list(range(len(train_rows))), 0)
        if master:
            print(f"cache initialised: {len(cache)} answers, {np.mean(list(cache_correct.values())):.3f} correct, "
                  f"{time.time() - t0:.1f}s")
    last_eval = evaluate(0) if args.eval_every and start_step == 0 else float("nan")
    if start_step == 0 and master:
        writer.add_scalar("charts/decoding_flops", total_flops, 0)
        writer.add_scalar("charts/generated_tokens", total_tokens, 0)
        print(f"step 0 | eval {last_eval:.3f}")

    last_step = min(num_steps, args.num_steps or num_steps)
    for step in range(start_step + 1, last_step + 1):
        t_step, t0 = time.time(), time.time()
        rng = np.random.default_rng([args.seed, step])  # this step's truncations and cache choices
        batch = problems_for_step(len(train_rows), args.problems_per_step, step, args.seed)
        lazy_tokens = fill_cache([p for p in batch if p not in cache], step)  # problems first seen without an entry
        # 1. Rollout (Section 3.2): one shared prefix per problem, the cached answer minus its last m tokens
        prefixes, budgets, Ls, ms = [], [], [], []
        for p in batch:
            L = truncation_limit(args, len(cache[p]), previous_shortest.get(p))
            m = draw_truncation(L, len(cache[p]), rng)
            prefixes.append(cache[p][: len(cache[p]) - m])
            budgets.append(m if args.continuation_budget == "m" else args.max_response_tokens - len(prefixes[-1]))
            Ls.append(L)
            ms.append(m)
        params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=max(1, b), logprobs=0, seed=request_seed(args.seed, step, j))
                  for j, b in enumerate(budgets)]
        peaks.start()
        groups = engine.generate(llm, [prompts[p] + pre for p, pre in zip(batch, prefixes)], params)
        peaks.end("rollout")
        engine.sleep(llm, args.vllm_sleep_level)
        samples = [(j, c) for j in range(len(batch)) for c in groups[j]]  # group-major
        new_tokens = [len(c.token_ids) for _, c in samples]
        total_tokens += sum(new_tokens) + lazy_tokens
        total_flops += sum(engine.decoding_flops(flops_A, flops_B, len(prompts[batch[j]]) + len(prefixes[j]),
                                                 len(c.token_ids)) for j, c in samples)
        t_generate = time.time() - t0

        # 2. Rewards on the full response (the answer may sit in the prefix), then the length-aware shaping
        t0 = time.time()
        responses = [prefixes[j] + c.token_ids for j, c in samples]  # o = prefix || continuation
        texts = [tok.decode(o, skip_special_tokens=True) for o in responses]
        correct = verify(texts, [train_rows[batch[j]] for j, _ in samples], args.answer_field, args.dataset == "tiny")
        shaped = []  # Eq. 11, per group, lengths in tokens of the full response
        for j in range(len(batch)):
            sl = slice(j * args.group_size, (j + 1) * args.group_size)
            shaped += length_aware_reward(correct[sl], [len(o) for o in responses[sl]], args.length_alpha,
                                          args.length_min, args.length_max, args.length_ref)
        rewards = torch.tensor(shaped, dtype=torch.float32)
        advantages = grpo_advantages(rewards, args.group_size)  # GRPO and DAPO both normalise by the group std
        t_score = time.time() - t0

        # 3. Old (and reference) log-probs of the trained tokens: the whole response, or only the continuation
        t0 = time.time()
        seqs = [prompts[batch[j]] + o for (j, _), o in zip(samples, responses)]
        spans = [loss_span(len(prompts[batch[j]]), len(prefixes[j]), len(c.token_ids), args.prefix_in_loss)
                 for j, c in samples]
        loss_start, loss_len = [s for s, _ in spans], [n for _, n in spans]
        old_lp, ref_lp = {}, {}  # for the rows this process trains (row i: rank i % world under torchrun)
        model.eval()
        peaks.start()
        with torch.no_grad(), autocast(device):
            for mb in dist.even(make_micro_batches(dist.mine(range(len(seqs))), [len(s) for s in seqs],
                                                   args.micro_batch_tokens)):
                if not mb:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
                    dist.idle_pass(model)
                    if ref_model is not None:
                        dist.idle_pass(ref_model)
                    continue
                ids = pad_batch([seqs[i] for i in mb], tok.pad_token_id, device)
                st, ln = [loss_start[i] for i in mb], [loss_len[i] for i in mb]
                lp = sequence_logprobs(model, ids, st, ln, args.temperature, args.logprob_chunk_tokens)
                rf = sequence_logprobs(ref_model, ids, st, ln, args.temperature, args.logprob_chunk_tokens) \
                    if ref_model is not None else lp
                for i, a, b in zip(mb, lp.split(ln), rf.split(ln)):
                    old_lp[i], ref_lp[i] = a, b
        # sampler vs trainer on the sampled continuation tokens (the tail of each row's trained tokens)
        peaks.end("old_logprobs")
        mine = sorted(old_lp)
        vllm_lp = torch.tensor([x for i in mine for x in samples[i][1].logprobs])
        trainer_lp = torch.cat([old_lp[i][loss_len[i] - new_tokens[i]:] for i in mine] or [torch.zeros(0)])
        trainer_lp = trainer_lp.float().cpu()
        log_ratio = trainer_lp - vllm_lp

        # 4. Update (Eqs. 5-8): GRPO = per-sequence token mean, mean over sequences, + beta * k3 KL;
        #    DAPO = token mean over the minibatch
        model.train()
        n = len(seqs)
        stats = {"policy_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0}
        n_tok, grad_norm = sum(loss_len), torch.tensor(0.0)
        for k in range(args.num_minibatches):
            mb = [i for i in range(k * n // args.num_minibatches, (k + 1) * n // args.num_minibatches) if loss_len[i]]
            if not mb:
                continue
            denom = sum(loss_len[i] for i in mb) if dapo else len(mb)
            optimizer.zero_grad(set_to_none=True)
            peaks.start()
            for micro in dist.even(make_micro_batches(dist.mine(mb), [len(s) for s in seqs], args.micro_batch_tokens)):
                if not micro:
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in micro], tok.pad_token_id, device)
                ln = [loss_len[i] for i in micro]
                with autocast(device):
                    lp = sequence_logprobs(model, ids, [loss_start[i] for i in micro], ln, args.temperature,
                                           args.logprob_chunk_tokens)
                adv = torch.cat([advantages[i].expand(loss_len[i]) for i in micro]).to(device)
                tok_loss, clipped, approx_kl = clipped_surrogate(lp, torch.cat([old_lp[i] for i in micro]), adv,
                                                                 args.clip_low, clip_high)
                if kl_coef > 0:  # k3 estimator of KL(pi || pi_ref)
                    d = torch.cat([ref_lp[i] for i in micro]) - lp
                    kl = torch.exp(d) - d - 1
                    tok_loss = tok_loss + kl_coef * kl
                    stats["kl_ref"] += float(kl.detach().sum()) / n_tok
                if dapo:
                    loss = tok_loss.sum() / denom
                else:
                    loss = torch.stack([t.mean() for t in tok_loss.split(ln)]).sum() / denom
                loss.backward()
                stats["policy_loss"] += float(loss.detach()) / args.num_minibatches
                stats["clipfrac"] += float(clipped.float().sum()) / n_tok
                stats["approx_kl"] += float(approx_kl.detach().sum()) / n_tok
            peaks.end("backward")
            grad_norm = dist.full(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
            if torch.isfinite(grad_norm):
                peaks.start()
                dist.step(optimizer, device, args.offload_optimizer)
                peaks.end("optimizer_step")
        model.zero_grad(set_to_none=True)  # free the gradients before the engine takes the memory back
        stats = {k: dist.sum_all(v) for k, v in stats.items()}  # each rank summed its own rows
        lr_now = schedule.get_last_lr()[0]
        schedule.step()
        t_train = time.time() - t0

        # 5. Cache update (Section 3.3, Eq. 10), after the gradient update; and L's statistic for next time
        for j, p in enumerate(batch):
            sl = range(j * args.group_size, (j + 1) * args.group_size)
            previous_shortest[p] = min(len(responses[i]) for i in sl)
            if args.cache_update == "epsilon":
                pick = sl[pick_cache_entry([shaped[i] for i in sl], args.cache_epsilon, rng)]
                cache[p], cache_correct[p] = list(responses[pick]), correct[pick]
                cache_finished[p] = extract_final_answer(texts[pick]) is not None
        t0 = time.time()
        peaks.start()
        engine.wake_up(llm, model)
        peaks.end("wake_up")
        t_sync = time.time() - t0

        # 6. Log, evaluate, checkpoint
        scalars = {
            "charts/decoding_flops": total_flops, "charts/generated_tokens": total_tokens,
            "charts/step_time": time.time() - t_step, "charts/learning_rate": lr_now,
            "train/reward_mean": float(np.mean(shaped)), "train/accuracy": float(np.mean(correct)),
            "train/response_len_mean": float(np.mean([len(o) for o in responses])),
            "losses/policy_loss": stats["policy_loss"], "losses/clipfrac": stats["clipfrac"],
            "losses/approx_kl": stats["approx_kl"], "losses/kl_ref": stats["kl_ref"],
            "losses/grad_norm": float(grad_norm),
            # Monte-Carlo estimate of the token entropy: mean -log p of the sampled continuation tokens
            "losses/entropy": -dist.mean_all(trainer_lp),
            "sampling/mismatch_kl": dist.mean_all(torch.exp(log_ratio) - 1 - log_ratio),
            "time/generate": t_generate, "time/score": t_score, "time/train": t_train, "time/sync": t_sync,
            "rpo/new_tokens_per_sample": float(np.mean(new_tokens)), "rpo/m_mean": float(np.mean(ms)),
            "rpo/L_mean": float(np.mean(Ls)), "rpo/prefix_len_mean": float(np.mean([len(x) for x in prefixes])),
            "rpo/reward_before_shaping": float(np.mean(correct)), "rpo/reward_after_shaping": float(np.mean(shaped)),
            "rpo/cache_correct_frac": float(np.mean(list(cache_correct.values()))),
            "rpo/cache_len_mean": float(np.mean([len(a) for a in cache.values()])),
            # entries without a final answer: with a continuation budget of m their groups can never score
            "rpo/cache_unfinished_frac": 1.0 - float(np.mean(list(cache_finished.values()))),
            "rpo/zero_std_frac": float((rewards.view(-1, args.group_size).std(dim=1) == 0).float().mean()),
        }
        scalars.update(peaks.pop())
        if master:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            if args.log_completions_every and step % args.log_completions_every == 0:
                shown = [f"**m={ms[0]}, reward {shaped[i]:.2f}** (prefix ends at `|`)\n```\n"
                         f"{tok.decode(prefixes[0], skip_special_tokens=True)}|"
                         f"{tok.decode(samples[i][1].token_ids, skip_special_tokens=True)}\n```" for i in range(2)]
                writer.add_text("samples/completions", "\n\n".join(shown), step)
        if args.eval_every and (step % args.eval_every == 0 or step == last_step):
            last_eval = evaluate(step)
        if master:
            print(f"step {step}/{last_step} | reward {scalars['train/reward_mean']:.3f} acc "
                  f"{scalars['train/accuracy']:.3f} | eval {last_eval:.3f} | new tok/sample "
                  f"{scalars['rpo/new_tokens_per_sample']:.1f} | cache correct "
                  f"{scalars['rpo/cache_correct_frac']:.2f} | gen {t_generate:.1f}s train {t_train:.1f}s", flush=True)
        if args.save_every and (step % args.save_every == 0 or step == last_step):
            state = {"run_name": run_name, "schedule": schedule.state_dict(), "cache": cache,
                     "cache_correct": cache_correct, "cache_finished": cache_finished,
                     "previous_shortest": previous_shortest,
                     "decoding_flops": total_flops, "generated_tokens": total_tokens}
            path = dist.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok,
                                        {"optimizer": optimizer}, state, args.keep_checkpoints)
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
