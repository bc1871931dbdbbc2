"""CCR: Concurrent Constraint Reinforcement (Yang et al., arXiv 2610.22887; spec/ccr.md).

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

import dataclasses
import math
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter

from common import dist, engine
from common.data import load_rows
from common.judges import AnswerVerifier, after_thinking, extract_boxed, extract_final_answer
from common.tiny import (
    TINY_PACK_BUDGET,
    TINY_PACK_PROBLEM,
    TINY_PACK_SEPARATOR,
    TINY_PACK_TEMPLATE,
    resolve_model,
    tiny_reward,
)

PACK_TEMPLATE = (  # spec/ccr.md "Prompt and answer recovery" (project choice)
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


# ----------------------------------------------------------------------------------------------------
# CCR's rules
# ----------------------------------------------------------------------------------------------------
def parse_packed_answers(text: str, n: int) -> list[str | None]:
    """The N answers of a packed completion, in order (spec/ccr.md "Prompt and answer recovery").

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


# ----------------------------------------------------------------------------------------------------
# Shared machinery, as in grpo.py (repeated on purpose: each script reads on its own)
# ----------------------------------------------------------------------------------------------------
def request_seed(*keys: int) -> int:
    return int(np.random.SeedSequence([abs(k) for k in keys]).generate_state(1)[0] >> 1)


def encode_chat(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
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
    """Per-token PPO loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A), r = exp(logp - old_logp)."""
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

    fields = [args.problem_field, args.answer_field, args.difficulty_field]
    rows = load_rows(args.dataset, args.dataset_split, fields, args.train_limit)
    if args.subset_size and args.subset_size < len(rows):  # the paper's 3,000-problem subset, seeded
        keep = np.random.default_rng([args.seed, 7]).choice(len(rows), args.subset_size, replace=False)
        rows = [rows[i] for i in sorted(keep.tolist())]
    try:
        difficulties = [float(r[args.difficulty_field]) for r in rows]
    except (TypeError, ValueError):
        bad = next(i for i, r in enumerate(rows) if not _is_number(r[args.difficulty_field]))
        raise SystemExit(f"dataset {args.dataset!r}: row {bad} has a non-numeric {args.difficulty_field!r}: "
                         f"{rows[bad][args.difficulty_field]!r}.") from None
    if len(rows) < args.pack_size:
        raise SystemExit(f"dataset {args.dataset!r} has {len(rows)} problems, fewer than --pack-size {args.pack_size}.")
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  fused=device.type == "cuda")  # fused: no full-size temporary on GPU
    packs_per_epoch = len(rows) // args.pack_size
    steps_per_epoch = math.ceil(packs_per_epoch / args.packs_per_step)
    num_steps = args.epochs * steps_per_epoch

    def pack_prompt(problems: list[str]) -> list[int]:
        listed = args.problem_separator.join(args.problem_format.format(k=k, problem=q)
                                             for k, q in enumerate(problems, 1))
        return encode_chat(tok, args.pack_template.format(n=len(problems), budget=args.budget, problems=listed))

    eval_prompts = [encode_chat(tok, args.single_template.format(problem=r[args.eval_problem_field]))
                    for r in eval_rows]
    # a fixed sample of training problems, evaluated one at a time like the held-out ones (eval/train_score)
    train_eval_rows = [rows[i] for i in sorted(random.Random(args.seed).sample(
        range(len(rows)), min(args.train_eval_problems, len(rows))))] if args.eval_every else []
    train_eval_prompts = [encode_chat(tok, args.single_template.format(problem=r[args.problem_field]))
                          for r in train_eval_rows]
    longest_pack = max(len(pack_prompt([r[args.problem_field] for r in rows[i : i + args.pack_size]]))
                       for i in range(0, min(len(rows), 300), args.pack_size))
    eval_len = max(map(len, eval_prompts)) + args.eval_max_tokens if eval_prompts else 0
    max_len = max(longest_pack + args.budget, eval_len) + 256
    peaks = dist.Peaks()  # memory/<phase>: peak memory of each phase (benchmarks/memory_plan.py predicts them)
    peaks.start()
    if master:
        print(f"starting the vLLM engine for {args.model} ...", flush=True)
    llm = engine.create_engine(model_path, max_model_len=max_len, seed=args.seed,
                               gpu_memory_utilization=args.gpu_memory_utilization)
    peaks.end("engine_start")
    flops_A, flops_B = engine.decoding_flops_coefficients(config)
    verifier = AnswerVerifier()  # its worker processes start on first use only

    def verify(golds: list[str], answers: list[str | None], tiny: bool) -> list[float]:
        if tiny:  # the tiny task's verifier compares boxed contents exactly
            return [float(a is not None and a.strip() == g) for g, a in zip(golds, answers)]
        return verifier.verify(golds, answers)

    def score_packs(texts: list[str], packs: list[list[dict]], field: str, tiny: bool):
        """(R, r_acc, r_fmt, N_eff) per completion."""
        parsed = [parse_packed_answers(t, len(p)) for t, p in zip(texts, packs)]
        flat = [(str(r[field]), a) for p, ans in zip(packs, parsed) for r, a in zip(p, ans)]
        xs = iter(verify([g for g, _ in flat], [a for _, a in flat], tiny))
        out = []
        for p, ans in zip(packs, parsed):
            x = [next(xs) for _ in p]
            n_eff = next((k for k, a in enumerate(ans) if a is None), len(ans))
            out.append((*packed_reward(x, n_eff, len(p), args.w_acc, args.w_fmt), n_eff))
        return out

    # --- state: the epoch's packs (re-drawn each epoch, seeded) and counters ---
    start_step, total_flops, total_tokens = 0, 0, 0
    packs, packs_epoch = make_packs(difficulties, args.pack_size, 0, args.seed), 0
    if ckpt:
        dist.load_checkpoint(resume_dir, model, {"optimizer": optimizer},
                             offload=("optimizer",) if args.offload_optimizer else ())
        start_step, total_flops, total_tokens = ckpt["step"], ckpt["decoding_flops"], ckpt["generated_tokens"]
        packs, packs_epoch = ckpt["packs"], ckpt["packs_epoch"]
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

    def sample_for_eval(prompts_: list[list[int]], salt: int, label: str):
        """The evaluation sampler on these prompts, the same seeds at every evaluation: (groups, texts)."""
        params = [SamplingParams(n=args.eval_samples, temperature=args.eval_temperature, top_p=args.eval_top_p,
                                 top_k=args.eval_top_k, max_tokens=args.eval_max_tokens,
                                 seed=request_seed(args.seed, salt, i)) for i in range(len(prompts_))]
        groups = engine.generate(llm, prompts_, params, progress=f"evaluation: {label}")
        return groups, [tok.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]

    def evaluate(step: int) -> float:
        """Single problems, ordinary answer format (the policy must still solve one problem at a time);
        optionally packs of several sizes under the training cap."""
        t0 = time.time()
        groups, texts = sample_for_eval(eval_prompts, -1, "held-out problems")
        golds = [r for r in eval_rows for _ in range(args.eval_samples)]
        if args.eval_dataset == "tiny":
            xs = [tiny_reward(t, r["answer"]) for t, r in zip(texts, golds)]
        else:
            xs = verifier.verify([str(r[args.eval_answer_field]) for r in golds],
                                 [extract_final_answer(t) for t in texts])
        score = float(np.mean(xs))
        logged = {"eval/mean_score": score,
                  "eval/tokens_per_problem": float(np.mean([len(c.token_ids) for g in groups for c in g]))}
        if train_eval_prompts:  # the same single-problem sampling on training problems: the train / held-out gap
            _, texts = sample_for_eval(train_eval_prompts, -4, "training problems")
            golds = [r for r in train_eval_rows for _ in range(args.eval_samples)]
            answers = [extract_final_answer(t) for t in texts]
            logged["eval/train_score"] = float(np.mean(verify([str(r[args.answer_field]) for r in golds], answers,
                                                              args.dataset == "tiny")))
        for n in args.packed_eval_sizes:
            eval_packs = [eval_rows[i : i + n] for i in range(0, len(eval_rows) - n + 1, n)]
            prompts_n = [pack_prompt([r[args.eval_problem_field] for r in p]) for p in eval_packs]
            outs = engine.generate(llm, prompts_n, progress=f"evaluation: packs of {n}", params=[SamplingParams(
                n=1, temperature=args.eval_temperature, top_p=args.eval_top_p, top_k=args.eval_top_k,
                max_tokens=args.budget, seed=request_seed(args.seed, -3, n, i)) for i in range(len(prompts_n))])
            scored = score_packs([tok.decode(o[0].token_ids, skip_special_tokens=True) for o in outs], eval_packs,
                                 args.eval_answer_field, args.eval_dataset == "tiny")
            logged[f"eval/packed_r_acc_n{n}"] = float(np.mean([s[1] for s in scored]))
            logged[f"eval/packed_n_eff_n{n}"] = float(np.mean([s[3] for s in scored]))
        logged["time/eval"] = time.time() - t0
        if master:
            for key, value in logged.items():
                writer.add_scalar(key, value, step)
        return score

    last_eval = evaluate(0) if args.eval_every and start_step == 0 else float("nan")
    if start_step == 0 and master:
        print(f"step 0 | single-problem eval {last_eval:.3f}")

    last_step = min(num_steps, args.num_steps or num_steps)
    for step in range(start_step + 1, last_step + 1):
        t_step, t0 = time.time(), time.time()
        epoch, index = divmod(step - 1, steps_per_epoch)
        if epoch != packs_epoch:  # a new epoch: new packs
            packs, packs_epoch = make_packs(difficulties, args.pack_size, epoch, args.seed), epoch
        batch = packs[index * args.packs_per_step : (index + 1) * args.packs_per_step]
        # 1. Sample S completions of each packed prompt under the one shared cap B
        prompts = [pack_prompt([rows[i][args.problem_field] for i in p]) for p in batch]
        params = [SamplingParams(n=args.group_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 max_tokens=args.budget, logprobs=0, seed=request_seed(args.seed, step, j))
                  for j in range(len(batch))]
        peaks.start()
        groups = engine.generate(llm, prompts, params)
        peaks.end("rollout")
        engine.sleep(llm, args.vllm_sleep_level)
        samples = [(j, c) for j in range(len(batch)) for c in groups[j]]  # group-major
        new_tokens = [len(c.token_ids) for _, c in samples]
        total_tokens += sum(new_tokens)
        total_flops += sum(engine.decoding_flops(flops_A, flops_B, len(prompts[j]), len(c.token_ids))
                           for j, c in samples)
        t_generate = time.time() - t0

        # 2. Reward: answers completed before the cap keep their credit, truncated or not
        t0 = time.time()
        texts = [tok.decode(c.token_ids, skip_special_tokens=True) for _, c in samples]
        scored = score_packs(texts, [[rows[i] for i in batch[j]] for j, _ in samples], args.answer_field,
                             args.dataset == "tiny")
        rewards = torch.tensor([s[0] for s in scored], dtype=torch.float32)
        r = rewards.view(-1, args.group_size)
        advantages = group_advantages(rewards, args.group_size, args.std_normalize)
        t_score = time.time() - t0

        # 3. Old log-probs; truncated completions stay in the loss with their partial reward
        t0 = time.time()
        seqs = [prompts[j] + c.token_ids for j, c in samples]
        starts = [len(prompts[j]) for j, _ in samples]
        old_lp = {}  # for the rows this process trains (row i: rank i % world under torchrun)
        model.eval()
        peaks.start()
        with torch.no_grad(), autocast(device):
            for mb in dist.even(make_micro_batches(dist.mine(range(len(seqs))), [len(s) for s in seqs],
                                                   args.micro_batch_tokens)):
                if not mb:  # this rank has no rows left: an empty pass keeps FSDP's collectives in step
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in mb], tok.pad_token_id, device)
                lp = sequence_logprobs(model, ids, [starts[i] for i in mb], [new_tokens[i] for i in mb],
                                       args.temperature, args.logprob_chunk_tokens)
                for i, a in zip(mb, lp.split([new_tokens[i] for i in mb])):
                    old_lp[i] = a
        peaks.end("old_logprobs")
        mine = sorted(old_lp)
        trainer_lp = torch.cat([old_lp[i] for i in mine] or [torch.zeros(0)]).float().cpu()
        log_ratio = trainer_lp - torch.tensor([x for i in mine for x in samples[i][1].logprobs])

        # 4. Clipped surrogate, token-level mean over the batch (long truncated completions are not
        #    down-weighted per token), beta = 0
        model.train()
        n, n_tok, grad_norm = len(seqs), sum(new_tokens), torch.tensor(0.0)
        stats = {"policy_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0}
        for k in range(args.num_minibatches):
            mb = [i for i in range(k * n // args.num_minibatches, (k + 1) * n // args.num_minibatches) if new_tokens[i]]
            if not mb:
                continue
            denom = sum(new_tokens[i] for i in mb)
            optimizer.zero_grad(set_to_none=True)
            peaks.start()
            for micro in dist.even(make_micro_batches(dist.mine(mb), [len(s) for s in seqs], args.micro_batch_tokens)):
                if not micro:
                    dist.idle_pass(model)
                    continue
                ids = pad_batch([seqs[i] for i in micro], tok.pad_token_id, device)
                with autocast(device):
                    lp = sequence_logprobs(model, ids, [starts[i] for i in micro], [new_tokens[i] for i in micro],
                                           args.temperature, args.logprob_chunk_tokens)
                adv = torch.cat([advantages[i].expand(new_tokens[i]) for i in micro]).to(device)
                tok_loss, clipped, approx_kl = clipped_surrogate(lp, torch.cat([old_lp[i] for i in micro]), adv,
                                                                 args.clip_low, args.clip_high)
                loss = tok_loss.sum() / denom
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
        t_train = time.time() - t0
        t0 = time.time()
        peaks.start()
        engine.wake_up(llm, model)
        peaks.end("wake_up")
        t_sync = time.time() - t0

        # 5. Log, evaluate, checkpoint
        truncated = [c.truncated for _, c in samples]
        n_eff = [s[3] for s in scored]
        scalars = {
            "charts/decoding_flops": total_flops, "charts/generated_tokens": total_tokens,
            "charts/step_time": time.time() - t_step, "train/reward_mean": float(rewards.mean()),
            "losses/policy_loss": stats["policy_loss"], "losses/clipfrac": stats["clipfrac"],
            "losses/approx_kl": stats["approx_kl"], "losses/grad_norm": float(grad_norm),
            # Monte-Carlo estimate of the token entropy: mean -log p of the sampled tokens
            "losses/entropy": -dist.mean_all(trainer_lp),
            "sampling/mismatch_kl": dist.mean_all(torch.exp(log_ratio) - 1 - log_ratio),
            "time/generate": t_generate, "time/score": t_score, "time/train": t_train, "time/sync": t_sync,
            "ccr/tokens_per_step": sum(new_tokens), "ccr/r_acc": float(np.mean([s[1] for s in scored])),
            "ccr/r_fmt": float(np.mean([s[2] for s in scored])), "ccr/n_eff_mean": float(np.mean(n_eff)),
            "ccr/truncated_frac": float(np.mean(truncated)), "ccr/completion_len_mean": float(np.mean(new_tokens)),
            "ccr/truncated_rewarded_frac": float(np.mean([s[1] > 0 for s, t in zip(scored, truncated) if t] or [0.0])),
            "ccr/zero_std_frac": float((r.std(dim=1) == 0).float().mean()) if args.group_size > 1 else 1.0,
        }
        for k in range(args.pack_size + 1):
            scalars[f"ccr/n_eff_frac_{k}"] = float(np.mean([e == k for e in n_eff]))
        scalars.update(peaks.pop())
        if master:
            for key, value in scalars.items():
                writer.add_scalar(key, value, step)
            writer.add_histogram("ccr/n_eff", np.array(n_eff), step, bins=np.arange(args.pack_size + 2) - 0.5)
            if args.log_completions_every and step % args.log_completions_every == 0:
                shown = [f"**R={scored[i][0]:.2f} N_eff={scored[i][3]} truncated={truncated[i]}**\n```\n"
                         f"{texts[i][-2000:]}\n```" for i in range(min(3, n))]
                writer.add_text("samples/completions", "\n\n".join(shown), step)
        if args.eval_every and (step % args.eval_every == 0 or step == last_step):
            last_eval = evaluate(step)
        if master:
            print(f"step {step}/{last_step} | R {scalars['train/reward_mean']:.3f} r_acc {scalars['ccr/r_acc']:.3f} | "
                  f"N_eff {scalars['ccr/n_eff_mean']:.2f} | truncated {scalars['ccr/truncated_frac']:.2f} | tokens "
                  f"{sum(new_tokens)} | eval {last_eval:.3f} | gen {t_generate:.1f}s train {t_train:.1f}s", flush=True)
        if args.save_every and (step % args.save_every == 0 or step == last_step):
            state = {"run_name": run_name, "packs": packs, "packs_epoch": packs_epoch, "decoding_flops": total_flops,
                     "generated_tokens": total_tokens}
            path = dist.save_checkpoint(Path(args.checkpoint_dir) / run_name, step, model, tok,
                                        {"optimizer": optimizer}, state, args.keep_checkpoints)
            if master:
                print(f"saved {path}")
    if master:
        writer.close()
    verifier.close()
    return {"run_name": run_name, "eval/mean_score": last_eval}


def _is_number(x) -> bool:
    try:
        float(x)
        return True
    except (TypeError, ValueError):
        return False


if __name__ == "__main__":
    # `--tiny` swaps in the tiny defaults; every other flag still overrides them
    main(tyro.cli(Args, default=tiny_args() if "--tiny" in sys.argv[1:] else None))
