"""The plan of a training step on GPUs: will it fit in memory, and how long will it take?

Every script asks it at start-up on CUDA, before any model is loaded (`check_memory`, `time_summary`): a
configuration that cannot fit stops in one sentence naming the flags that would make it fit, and the time a step
will take is printed before the first one starts. `benchmarks/memory_plan.py` is its command line (the README's
tables, the calibration). Nothing here runs a model: the shape comes from the config on the meta device.

Memory (per GPU, the GPU path of common/parallel.py: FSDP2 over the ranks, bf16 compute, fp32 master weights):
- fp32 weights, fp32 gradients and AdamW's two fp32 states, each sharded over the ranks (4 + 4 + 8 bytes per
  parameter / GPUs); gradients exist from the first backward to the end of the update; AC2's critic AdamW state is
  on the GPU only for the critic's step, the actor's too with --offload-optimizer;
- FSDP2 gathers weights in bf16: the root (embeddings, LM head) for the whole forward/backward, the decoder layers
  one (plus one prefetched) at a time;
- vLLM takes --gpu-memory-utilization x the GPU while awake and nothing asleep (level 2); waking up, its bf16
  weights (2 bytes per parameter; every rank holds all of them) come back before the KV cache;
- activations of one micro-batch of T padded tokens, T = max(--micro-batch-tokens, the longest row): with gradient
  checkpointing each layer's input is kept and one layer is recomputed at a time; the LM head runs
  --logprob-chunk-tokens positions at a time. The element counts per token are fitted to peak memory measured on a
  CPU (`benchmarks/memory_plan.py --calibrate`, stored in common/plan_coefficients.json) and priced at 2 bytes on
  GPU (bf16), except the hidden-size term, which RMSNorm's fp32 upcasts dominate (4 bytes);
- a margin of 1 GiB + 5% of the GPU for the CUDA context, NCCL buffers and fragmentation.

Time (per step, seconds; `time_plan`): decoding reads the bf16 weights once per decoding iteration and every running
sequence's KV cache, at the GPU's measured copy bandwidth, with as many sequences at once as the KV cache holds at
their expected length (at most `max_num_seqs`); prefill and training are FLOP-bound at a stated utilisation.
Responses are assumed to use `length_frac` of their limit (0.5 by default; 1 is the worst case, what
random weights do). The judge, sleep / wake-up and the weight sync are not counted. Every constant cites its source
in `GPUS` and below; the GPU figures are estimates until benchmarks/gpu_check.sh measures them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

GIB = 2**30
COEFFICIENTS = Path(__file__).parent / "plan_coefficients.json"
PROMPT_TOKENS = 1024  # a problem's templated prompt, an upper bound for the papers' data sets (their prompts: 100-600)


# ----------------------------------------------------------------------------------------------------
# The model's shape, from its config on the meta device
# ----------------------------------------------------------------------------------------------------
def model_shape(config) -> dict:
    """Parameter counts (total, per decoder layer, root = outside the layers, largest tensor) and dimensions of a
    transformers config (or a config.json's path)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, (str, Path)):
        spec = json.loads(Path(config).read_text())
        fields = {k: v for k, v in spec.items() if not k.startswith("_") and k not in ("architectures",)}
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # tied weights counted once
    layer = sum(p.numel() for n, p in params.items() if ".layers.0." in n)
    total = sum(p.numel() for p in params.values())
    c = config.get_text_config()
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {"params": total, "layer_params": layer, "root_params": total - layer * c.num_hidden_layers,
            "largest_param": max(p.numel() for p in params.values()), "hidden": c.hidden_size,
            "q": heads * head_dim, "kv": kv_heads * head_dim, "intermediate": c.intermediate_size,
            "layers": c.num_hidden_layers, "vocab": c.vocab_size}


def kv_bytes_per_token(s: dict, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token of context: K and V of every layer (bf16 on GPU)."""
    return 2 * s["layers"] * s["kv"] * dtype_bytes


# ----------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------
def load_coefficients() -> dict:
    return json.loads(COEFFICIENTS.read_text())


def per_token(c: dict, s: dict) -> tuple[float, float]:
    """(hidden-size part, rest) of a linear element count per token: c_h*h + (c_q*q + c_kv*kv + c_I*I)."""
    return c["h"] * s["hidden"], c["q"] * s["q"] + c["kv"] * s["kv"] + c["I"] * s["intermediate"]


def activation_bytes(coef: dict, s: dict, tokens: int, selected: int, chunk: int, kind: str, checkpointing: bool,
                     gpu: bool) -> dict[str, float]:
    """Activation terms of one micro-batch of `tokens` padded positions, `selected` of them through the LM head.

    A decoder layer saves `layer_saved` elements per token for its backward and peaks at `layer_backward` while
    it runs one; without gradients it peaks at `layer_nograd`. The LM head works on one chunk of the selected
    positions at a time (`lm_*` x chunk x vocab, fp32 logits). Without gradients the layers and the head run one
    after the other: the larger peak counts. Training without checkpointing keeps every layer's activations while
    the head's backward runs first: they add up. With checkpointing only each layer's input is kept; the head's
    backward, then each layer's recomputation and backward, run in turn. `outside` is what the model keeps
    besides (embeddings, final norm, the selected hidden states), in hidden-size units per token.
    """
    b_h, b_rest, b_res = (4, 2, 2) if gpu else (4, 4, 4)  # bytes: norms' fp32 upcasts / bf16 / residual stream

    def layer(name):
        eh, er = per_token(coef[name], s)
        return tokens * (eh * b_h + er * b_rest)

    head = coef[f"lm_{'nograd' if kind == 'nograd' else 'train'}"] * min(chunk, max(selected, 1)) * s["vocab"] * 4
    if kind == "nograd":
        outside = coef["outside_nograd"] * tokens * s["hidden"] * b_rest
        return {"activations: one layer or the LM-head chunk, and hidden states": max(layer("layer_nograd"), head)
                + outside}
    outside = coef["outside_ckpt" if checkpointing else "outside_train"] * tokens * s["hidden"] * b_rest
    if checkpointing:
        return {"activations: layer inputs kept": s["layers"] * tokens * s["hidden"] * b_res,
                "activations: one layer's recompute + backward (or the LM-head chunk), and hidden states":
                    max(layer("layer_backward"), head) + outside}
    return {"activations: all layers and hidden states": s["layers"] * layer("layer_saved") + outside,
            "activations: LM-head chunk": head}


def longest_rows(a, prompt_tokens: int = PROMPT_TOKENS) -> tuple[int, int]:
    """(longest trained row, longest critic row) in tokens, from the script's Args: prompt + the response limit;
    AC2's critic contexts can be as long as its engine allows (prompt + budget + --critic-context-extra); CCR's
    prompt lists --pack-size problems."""
    if hasattr(a, "critic_context_extra"):  # ac2.py
        return prompt_tokens + a.budget, prompt_tokens + a.budget + a.critic_context_extra
    if hasattr(a, "pack_size"):  # ccr.py
        return prompt_tokens * a.pack_size + a.budget, 0
    return prompt_tokens + a.max_response_tokens, 0


def memory_plan(a, s: dict, gpus: int, gpu_gib: float, coef: dict | None = None,
                prompt_tokens: int = PROMPT_TOKENS) -> dict[str, dict[str, float]]:
    """{phase: {term: GiB}} per GPU for the script whose Args are `a` (FSDP2 over `gpus` ranks, bf16 compute)."""
    coef = coef or load_coefficients()
    P, W = s["params"], gpus
    row, critic_row = longest_rows(a, prompt_tokens)
    T = max(a.micro_batch_tokens, row)
    ckpt = a.gradient_checkpointing
    weights, grads, adam = 4 * P / W, 4 * P / W, 8 * P / W
    ref = 4 * P / W if getattr(a, "kl_coef", 0) > 0 and getattr(a, "objective", "grpo") != "dapo" else 0
    vllm = a.gpu_memory_utilization * gpu_gib * GIB
    gathered = {"gathered bf16 root (embeddings, LM head)": 2 * s["root_params"],
                "gathered bf16 layers (current + prefetched)": 2 * 2 * s["layer_params"]}
    resident = {"fp32 weights": weights}
    if not a.offload_optimizer:
        resident["AdamW state (actor)"] = adam
    if ref:
        resident["reference model"] = ref
    phases = {
        "engine_start": {"fp32 weights": weights, "vLLM (--gpu-memory-utilization)": vllm},
        "rollout": {**resident, "vLLM (--gpu-memory-utilization)": vllm},
        "old_logprobs": {**resident, **gathered,
                         **activation_bytes(coef, s, T, row, a.logprob_chunk_tokens, "nograd", ckpt, True)},
        "backward": {**resident, "fp32 gradients": grads, **gathered,
                     **activation_bytes(coef, s, T, row, a.logprob_chunk_tokens, "train", ckpt, True)},
        "optimizer_step": {"fp32 weights": weights, "fp32 gradients": grads, "AdamW state (actor)": adam,
                           **({"reference model": ref} if ref else {})},
        "wake_up": {**resident, "vLLM bf16 weights (every rank holds all)": 2 * P,
                    "sync: one gathered parameter (bf16)": 2 * s["largest_param"]},
    }
    if critic_row:
        Tc = max(a.micro_batch_tokens, critic_row)
        critic_backward = {**resident, "fp32 gradients": grads, **gathered,
                           **activation_bytes(coef, s, Tc, 8, a.logprob_chunk_tokens, "train", ckpt, True)}
        critic_update = {"fp32 weights": weights, "fp32 gradients": grads, **resident,
                         "AdamW state (critic, moved in for its step)": adam}
        phases["critic_step"] = max((critic_backward, critic_update), key=lambda t: sum(t.values()))
    return {ph: {k: v / GIB for k, v in terms.items()} for ph, terms in phases.items()}


def margin_gib(gpu_gib: float) -> float:
    """Outside PyTorch's allocator: CUDA context, NCCL buffers, fragmentation (an allowance, not a measurement)."""
    return 1.0 + 0.05 * gpu_gib


def peak(plan: dict[str, dict[str, float]]) -> tuple[str, float]:
    """The phase with the largest total, and that total (GiB)."""
    phase = max(plan, key=lambda k: sum(plan[k].values()))
    return phase, sum(plan[phase].values())


def fits(a, s: dict, gpus: int, gpu_gib: float, coef: dict | None = None) -> bool:
    return peak(memory_plan(a, s, gpus, gpu_gib, coef))[1] + margin_gib(gpu_gib) <= gpu_gib


# what a configuration that does not fit can change, tried in this order (each set includes the ones before)
FALLBACKS = [{}, {"offload_optimizer": True}, {"offload_optimizer": True, "gpu_memory_utilization": 0.3},
             {"offload_optimizer": True, "gpu_memory_utilization": 0.3, "micro_batch_tokens": 16_384}]


def flags_of(changes: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v:g}"
                    for k, v in changes.items())


def check_memory(a, s: dict, gpus: int, gpu_gib: float, coef: dict | None = None) -> str | None:
    """None when the configuration fits `gpus` GPUs of `gpu_gib`; else one sentence: which phase does not fit, and
    the flags (or the number of GPUs) that would make it fit."""
    coef = coef or load_coefficients()
    if fits(a, s, gpus, gpu_gib, coef):
        return None
    phase, need = peak(memory_plan(a, s, gpus, gpu_gib, coef))
    fixes = [flags_of(c) for c in FALLBACKS[1:] if fits(dataclasses.replace(a, **c), s, gpus, gpu_gib, coef)]
    more = next((g for g in (2, 4, 8, 16, 32, 64) if g > gpus and fits(a, s, g, gpu_gib, coef)), None)
    options = ([f"`{fixes[0]}`"] if fixes else []) + ([f"{more} GPUs"] if more else [])
    how = " or ".join(options) if options else "a smaller --micro-batch-tokens or response limit and more GPUs"
    return (f"the memory plan says this run does not fit {gpus} x {gpu_gib:.0f} GiB: its {phase} phase needs "
            f"{need + margin_gib(gpu_gib):.0f} GiB per GPU (margin included); it would fit with {how} "
            f"(benchmarks/memory_plan.py shows each phase; --no-memory-check runs anyway)")


# ----------------------------------------------------------------------------------------------------
# Host memory
# ----------------------------------------------------------------------------------------------------
ROLLOUT_BYTES_PER_TOKEN = 48  # a token id in Python lists (a 28-byte int, referenced from two lists) + float32 log-prob
ENGINE_HOST_GIB = 4.0  # an allowance: vLLM's own host memory per engine (its CPU-side buffers and Python state)


def host_plan(a, s: dict, gpus: int, ranks_per_node: int = 8, prompt_tokens: int = PROMPT_TOKENS,
              frac: float = 0.5) -> dict[str, float]:
    """{term: GiB} of one node's host memory at its busiest, for `gpus` ranks of which `ranks_per_node` share it:
    rank 0's full fp32 copy (it alone reads the weights at start-up, and gathers them at every checkpoint), the
    offloaded AdamW states (pinned: 8 bytes per parameter / ranks, per rank), AC2's ladder snapshot (pinned: 4 bytes
    per parameter / ranks), the rollouts of a step -- every rank holds all of them, twice while they are gathered --
    with responses at `frac` of their limit, vLLM's weights at sleep level 1, and an allowance per engine."""
    P, W, n = s["params"], gpus, min(ranks_per_node, gpus)
    w = step_workload(a, prompt_tokens, frac)
    tokens = sum(rows * (context + new) for _, rows, context, new in w["rollouts"])
    ac2 = hasattr(a, "critic_context_extra")
    offloaded = int(a.offload_optimizer) + int(ac2)  # AC2's critic state always lives in host memory
    terms = {"rank 0's full fp32 weights (start-up, checkpoints)": 4 * P,
             "rollouts of a step, on every rank (x2 while gathered)": 2 * ROLLOUT_BYTES_PER_TOKEN * tokens * n,
             "vLLM, an allowance per engine": ENGINE_HOST_GIB * GIB * n}
    if offloaded:
        terms["offloaded AdamW states (pinned)"] = offloaded * 8 * P / W * n
    if ac2:
        terms["the LR ladder's snapshot (pinned)"] = 4 * P / W * n
    if a.vllm_sleep_level == 1:
        terms["vLLM's bf16 weights while it sleeps (level 1)"] = 2 * P * n
    return {k: v / GIB for k, v in terms.items()}


def host_memory_gib() -> float:
    """This machine's memory (MemTotal), GiB; 0 where /proc/meminfo cannot be read."""
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 2**20


# ----------------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPU:
    """What the time plan needs of a GPU, each figure with its source."""

    name: str
    memory_gib: float
    bandwidth: float  # bytes/s the decoder reads at
    flops: float  # dense bf16 FLOP/s of large matmuls
    spec_flops: float  # the data sheet's dense bf16 FLOP/s (MFU is quoted against it)


GPUS = {
    # H200: the data sheet says 141 GB HBM3e, 4.8 TB/s and 989 TFLOP/s dense bf16; measured on the H200 this project
    # is lent (docs/scaling.md, "The GPU check"): ~139.8 GiB usable, ~4.3 TB/s device-to-device copies, ~790 TFLOP/s
    # bf16 matmuls. The plan uses the measured figures.
    "H200": GPU("H200", 139.8, 4.3e12, 790e12, 989e12),
    # H100 SXM: the data sheet says 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s; not measured here, so the H200's measured /
    # data-sheet ratios (0.90 of the bandwidth, 0.80 of the FLOPs) are applied.
    "H100": GPU("H100", 79.6, 0.90 * 3.35e12, 790e12, 989e12),
}
TRAIN_MFU = 0.147  # prime-rl's trainer, Qwen3-4B at 16k tokens on 8 x H200: 14.7% MFU (the project's anchor)
PREFILL_MFU = 0.4  # an assumption: vLLM's prefill runs large matmuls, well above the trainer's MFU
DECODE_ITERATION_S = 0.004  # an assumption: vLLM's overhead per decoding iteration on GPU (CUDA graphs, sampling)


def kv_cache_tokens(s: dict, gpu_gib: float, utilization: float) -> float:
    """Tokens the engine's KV cache holds: its share of the GPU less its bf16 weights (vLLM's own activations and
    CUDA graphs, a few GiB, left out), at 2 bytes per K or V element."""
    kv = kv_bytes_per_token(s)
    return max(utilization * gpu_gib * GIB - 2 * s["params"], kv) / kv


def expected_row_tokens(a, prompt_tokens: int = PROMPT_TOKENS, frac: float = 0.5) -> int:
    """A rollout's expected length: the prompt and `frac` of the script's response limit (AC2's budget counts the
    replayed prefix too; CCR's prompt lists --pack-size problems)."""
    if hasattr(a, "critic_context_extra"):
        return int(prompt_tokens + frac * a.budget)
    if hasattr(a, "pack_size"):
        return int(prompt_tokens * a.pack_size + frac * a.budget)
    return int(prompt_tokens + frac * a.max_response_tokens)


def max_num_seqs(s: dict, gpu_gib: float, utilization: float, row_tokens: int) -> int:
    """vLLM's max_num_seqs on GPU: as many sequences as the KV cache holds at `row_tokens` each (between 8 and
    vLLM's default of 1,024). vLLM's default against ~300k tokens of cache and 50,000-token rows would admit far
    more sequences than fit, and preempt and re-prefill them over and over."""
    return int(min(1024, max(8, kv_cache_tokens(s, gpu_gib, utilization) // row_tokens)))


def decode_seconds(rows: int, context: int, new_tokens: int, s: dict, gpu: GPU, utilization: float,
                   max_num_seqs: int) -> float:
    """`rows` sequences of `new_tokens` after `context` tokens on one engine: waves of as many sequences as the KV
    cache holds at their final length (at most `max_num_seqs`); each decoding iteration reads the bf16 weights once
    and every running sequence's KV cache, or is FLOP-bound if that is slower."""
    if rows <= 0 or new_tokens <= 0:
        return 0.0
    kv = kv_bytes_per_token(s)
    fit = int(kv_cache_tokens(s, gpu.memory_gib, utilization) // (context + new_tokens))
    batch = max(1, min(max_num_seqs, rows, fit))
    waves = math.ceil(rows / batch)
    mean_context = context + new_tokens / 2
    read = 2 * s["params"] + batch * mean_context * kv
    flops = batch * (2 * s["params"] + 4 * s["layers"] * s["q"] * mean_context)
    per_iteration = max(read / gpu.bandwidth, flops / gpu.flops) + DECODE_ITERATION_S
    return waves * new_tokens * per_iteration


def forward_flops(s: dict, tokens: int, context: int) -> float:
    """One forward pass over `tokens` positions attending to `context` on average (2 FLOPs per multiply-add)."""
    return 2 * s["params"] * tokens + 4 * s["layers"] * s["q"] * context * tokens


def step_workload(a, prompt_tokens: int, frac: float) -> dict:
    """What one training step of the script with Args `a` does, in rows and tokens, with responses at `frac` of
    their limit: rollouts as (rows, context, new tokens) per kind, and the trained tokens."""
    if hasattr(a, "critic_context_extra"):  # ac2.py: before readiness every replay slot is rolled out in full
        budget = frac * a.budget
        prefix = 0.45 * budget  # cuts are uniform on [0, 0.9 L]
        full = a.n_batch * a.group_size
        ready_chunks = a.n_batch * a.group_size * (1 - (a.audit_frac if a.audit_frac is not None else 0.25))
        return {"rollouts": [("refill", a.n_refill, prompt_tokens, budget),
                             ("replay, before readiness", full, prompt_tokens + prefix, budget - prefix)],
                "rollouts_ready": [("refill", a.n_refill, prompt_tokens, budget),
                                   ("audits", full - ready_chunks, prompt_tokens + prefix, budget - prefix),
                                   ("chunks", ready_chunks, prompt_tokens + prefix, min(a.chunk_tokens, budget))],
                "trained": full * (budget - prefix), "trained_context": prompt_tokens + prefix + budget / 2,
                "critic_rows": 2 * a.critic_sample, "probes": 2 * a.n_batch, "critic_context": prompt_tokens + prefix}
    if hasattr(a, "pack_size"):  # ccr.py
        rows = a.packs_per_step * a.group_size
        new = frac * a.budget
        return {"rollouts": [("packs", rows, prompt_tokens * a.pack_size, new)], "trained": rows * new,
                "trained_context": prompt_tokens * a.pack_size + new / 2}
    if hasattr(a, "cache_epsilon"):  # rpo.py: the tail of a cached answer, m ~ U{1..L}, L ~ half the answer
        answer = frac * a.max_response_tokens
        new = (a.fixed_L if a.truncation == "fixed" else answer / 2) / 2
        rows = a.problems_per_step * a.group_size
        trained = answer if a.prefix_in_loss else new
        return {"rollouts": [("tails", rows, prompt_tokens + answer - new, new)], "trained": rows * trained,
                "trained_context": prompt_tokens + answer / 2}
    rows = a.problems_per_step * a.group_size  # grpo.py
    new = frac * a.max_response_tokens
    return {"rollouts": [("responses", rows, prompt_tokens, new)], "trained": rows * new,
            "trained_context": prompt_tokens + new / 2}


def time_plan(a, s: dict, gpus: int, gpu: GPU, frac: float = 0.5, prompt_tokens: int = PROMPT_TOKENS,
              ready: bool = False) -> dict[str, float]:
    """Seconds of each phase of one step on `gpus` GPUs (each its own engine; rollouts and training divide by the
    GPUs), with responses at `frac` of their limit; AC2 `ready`: every problem ready (chunks and audits)."""
    w = step_workload(a, prompt_tokens, frac)
    rollouts = w["rollouts_ready"] if ready and "rollouts_ready" in w else w["rollouts"]
    seqs = getattr(a, "vllm_max_num_seqs", 0) or 1024
    out = {"decode": sum(decode_seconds(math.ceil(n / gpus), int(ctx), int(new), s, gpu, a.gpu_memory_utilization,
                                        seqs) for _, n, ctx, new in rollouts)}
    out["prefill"] = sum(forward_flops(s, int(ctx), int(ctx / 2)) * n / gpus for _, n, ctx, _ in rollouts) / (
        PREFILL_MFU * gpu.flops) / getattr(a, "group_size", 1)  # a group shares its prompt's prefill
    ckpt = 4 if a.gradient_checkpointing else 3  # forward + backward (2x) + the recomputed forward
    tokens = w["trained"] / gpus
    out["train"] = (1 + ckpt) * forward_flops(s, int(tokens), int(w["trained_context"])) / (TRAIN_MFU * gpu.spec_flops)
    if "critic_rows" in w:  # AC2: the probes' prefill, and the critic's training rows (prompt + prefix each)
        ctx = int(w["critic_context"])
        out["critic"] = ((1 + ckpt) * forward_flops(s, w["critic_rows"] * ctx // gpus, ctx // 2)
                         / (TRAIN_MFU * gpu.spec_flops)
                         + forward_flops(s, w["probes"] * ctx // gpus, ctx // 2) / (PREFILL_MFU * gpu.flops))
    return out


def evaluation_seconds(a, s: dict, gpus: int, gpu: GPU, n_problems: int, frac: float = 0.5,
                       prompt_tokens: int = PROMPT_TOKENS) -> float:
    """One evaluation: --eval-samples responses of --eval-max-tokens (at `frac`) to each of `n_problems`."""
    rows = math.ceil(n_problems * a.eval_samples / gpus)
    seqs = getattr(a, "vllm_max_num_seqs", 0) or 1024
    return decode_seconds(rows, prompt_tokens, int(frac * a.eval_max_tokens), s, gpu, a.gpu_memory_utilization,
                          seqs)


def duration(seconds: float) -> str:
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.0f} h"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def time_summary(a, s: dict, gpus: int, gpu: GPU, eval_problems: int = 0) -> str:
    """The line a script prints at start-up: a step here and on 4 x 8 GPUs, and the step-0 evaluation."""
    here = sum(time_plan(a, s, gpus, gpu).values())
    worst = sum(time_plan(a, s, gpus, gpu, frac=1.0).values())
    cluster = sum(time_plan(a, s, 32, gpu).values())
    line = (f"time plan (an estimate; responses at half their limit, up to {duration(worst)} at the limit): one step "
            f"~ {duration(here)} on {gpus} x {gpu.name}, ~ {duration(cluster)} on 4 x 8")
    if eval_problems and a.eval_every:
        line += f"; each evaluation ~ {duration(evaluation_seconds(a, s, gpus, gpu, eval_problems))}"
    if hasattr(a, "critic_context_extra"):
        line += f"; once every problem is ready ~ {duration(sum(time_plan(a, s, gpus, gpu, ready=True).values()))}"
    return line


def gpu_named(name: str, memory_gib: float) -> GPU:
    """The plan's figures for the GPU the run is on (by its name); an unknown GPU gets the H100's, at its memory."""
    for key, gpu in GPUS.items():
        if key in name:
            return gpu
    return dataclasses.replace(GPUS["H100"], name=name, memory_gib=memory_gib)
