"""Memory plan: the per-GPU peak of each phase of a training step, for any script, model shape and GPU count.

    python benchmarks/memory_plan.py --script ac2                      # the script's default model, 1 x 80 GB
    python benchmarks/memory_plan.py --script ac2 --gpus 8 --gpu-gib 80 -- --micro-batch-tokens 16384
    python benchmarks/memory_plan.py --script rpo --config benchmarks/configs/deepseek-r1-distill-qwen-7b.json
    python benchmarks/memory_plan.py --table                           # the README's table
    python benchmarks/memory_plan.py --calibrate                       # measure on this CPU, fit, check (~10 min)

Flags after `--` are the script's own (parsed by its tyro Args, so its defaults apply). The model is built on
the meta device from a config.json (benchmarks/configs/ holds the paper models'), so nothing is downloaded.

What it assumes, term by term (the GPU path of common/parallel.py: FSDP2 over `--gpus` ranks, one per GPU):
- fp32 master weights, fp32 gradients and AdamW's two fp32 states, each sharded over the ranks (4 + 4 + 8
  bytes per parameter / gpus); gradients exist from the first backward to the end of the update only;
  AC2's critic AdamW state is on the GPU only for the critic's step (8 bytes / gpus more there), the actor's
  too with --offload-optimizer;
- FSDP2 gathers weights in bf16: the root (embeddings, LM head) for the whole forward/backward, the decoder
  layers one (plus one prefetched) at a time;
- vLLM takes --gpu-memory-utilization x the GPU while awake (weights, activations, KV cache) and nothing
  asleep (level 2); waking up, its bf16 weights (2 bytes per parameter, every rank holds all of them) come
  back before the KV cache, while the sync gathers one parameter at a time;
- activations of one micro-batch of T padded tokens, T = max(--micro-batch-tokens, the longest row): with
  gradient checkpointing each layer's input (T x hidden) is kept and one layer is recomputed at a time;
  the LM head runs `--logprob-chunk-tokens` positions at a time. The per-token element counts of a decoder
  layer, of the model outside the layers and of the LM-head chunk are *fitted to peak memory measured on
  this CPU* (`--calibrate`, fp32, without and with checkpointing) and stored in
  benchmarks/results/memory_calibration.json; on GPU they are priced at 2 bytes (bf16), except the hidden-size
  term, which RMSNorm's fp32 upcasts dominate (4 bytes).
Unverified on a GPU until benchmarks/gpu_check.sh has run on one: the bf16 pricing, vLLM's own overheads and
the CUDA context / NCCL buffers (a fixed margin of 1 GiB + 5% of the GPU here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "benchmarks" / "configs"
CALIBRATION = ROOT / "benchmarks" / "results" / "memory_calibration.json"
MODEL_CONFIGS = {  # hub id -> fixture config
    "Qwen/Qwen3-4B-Thinking-2507": "qwen3-4b.json",
    "Qwen/Qwen3-8B": "qwen3-8b.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "deepseek-r1-distill-qwen-1.5b.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "deepseek-r1-distill-qwen-7b.json",
}
GIB = 2**30


# ----------------------------------------------------------------------------------------------------
# The model's shape, from its config on the meta device
# ----------------------------------------------------------------------------------------------------
def model_shape(config_file: str | Path) -> dict:
    """Parameter counts (total, per decoder layer, root = outside the layers, largest tensor) and dimensions."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = json.loads(Path(config_file).read_text())
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


# ----------------------------------------------------------------------------------------------------
# Activation model (element counts fitted by --calibrate)
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------
def script_args(script: str, argv: list[str]):
    """The script's Args with these flags applied (its own defaults otherwise)."""
    import importlib

    import tyro

    module = importlib.import_module(script)
    default = module.tiny_args() if "--tiny" in argv else None
    return tyro.cli(module.Args, args=argv, default=default)


def longest_rows(script: str, a, prompt_tokens: int) -> tuple[int, int]:
    """(longest trained row, longest critic row) in tokens: prompt + the script's response limit; AC2's critic
    contexts can be as long as the engine allows (prompt + budget + --critic-context-extra)."""
    if script == "ac2":
        return prompt_tokens + a.budget, prompt_tokens + a.budget + a.critic_context_extra
    if script == "ccr":
        return prompt_tokens * a.pack_size + a.budget, 0
    return prompt_tokens + a.max_response_tokens, 0


def plan(script: str, a, s: dict, gpus: int, gpu_gib: float, coef: dict, prompt_tokens: int = 1024) -> dict:
    """{phase: {term: GiB}} per GPU on the GPU path (FSDP2 over `gpus` ranks, bf16 compute)."""
    P, W = s["params"], gpus
    row, critic_row = longest_rows(script, a, prompt_tokens)
    T = max(a.micro_batch_tokens, row)
    ckpt = a.gradient_checkpointing
    weights, grads, adam = 4 * P / W, 4 * P / W, 8 * P / W
    ref = 4 * P / W if getattr(a, "kl_coef", 0) > 0 and not (script == "rpo" and a.objective == "dapo") else 0
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
    if script == "ac2":
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


def report(script: str, a, s: dict, gpus: int, gpu_gib: float, coef: dict) -> tuple[str, bool]:
    p = plan(script, a, s, gpus, gpu_gib, coef)
    lines = [f"{script}.py, {s['params'] / 1e9:.2f}B parameters, {gpus} x {gpu_gib:g} GiB "
             f"(margin {margin_gib(gpu_gib):.1f} GiB for CUDA context / NCCL / fragmentation)"]
    ok = True
    for phase, terms in p.items():
        total = sum(terms.values())
        top = max(terms, key=terms.get)
        fits = total + margin_gib(gpu_gib) <= gpu_gib
        ok &= fits
        lines.append(f"  {phase:<15} {total:7.1f} GiB  {'fits' if fits else 'DOES NOT FIT':<12} largest: {top} "
                     f"{terms[top]:.1f}")
    return "\n".join(lines), ok


def load_coef() -> dict:
    if not CALIBRATION.exists():
        raise SystemExit(f"{CALIBRATION} is missing: run `python benchmarks/memory_plan.py --calibrate` first.")
    return json.loads(CALIBRATION.read_text())["coefficients"]


def config_for(a) -> Path:
    name = a.model
    if name in MODEL_CONFIGS:
        return CONFIGS / MODEL_CONFIGS[name]
    if Path(name, "config.json").exists():
        return Path(name, "config.json")
    raise SystemExit(f"no config for --model {name!r}: pass --config <config.json>.")


# ----------------------------------------------------------------------------------------------------
# The README table: what fits, and with which flags
# ----------------------------------------------------------------------------------------------------
PAPER_RUNS = [  # (label, script, flags)
    ("GRPO, Qwen3-4B, 50k responses (AC2 paper's baseline)", "grpo", []),
    ("AC2, Qwen3-4B, 50k budget (Table 4)", "ac2", []),
    ("RPO, R1-Distill-Qwen-1.5B, 4k responses (Section 4.1)", "rpo", []),
    ("CCR, Qwen3-4B, 3 problems under 8k (Section 5.1)", "ccr", []),
]
MACHINES = [(1, 79.6), (1, 139.8), (8, 79.6)]  # (GPUs, GiB each): H100 80 GB, H200 141 GB, 8 x H100 80 GB
FALLBACKS = [[], ["--offload-optimizer"], ["--offload-optimizer", "--gpu-memory-utilization", "0.3"],
             ["--offload-optimizer", "--gpu-memory-utilization", "0.3", "--micro-batch-tokens", "16384"]]


def table(coef: dict) -> str:
    names = {79.6: "80 GB", 139.8: "141 GB"}
    rows = ["| paper configuration | " + " | ".join(f"{n} x {names.get(g, g)}" for n, g in MACHINES) + " |",
            "|-|" + "-|" * len(MACHINES)]
    for label, script, flags in PAPER_RUNS:
        cells = []
        for gpus, gib in MACHINES:
            for extra in FALLBACKS:
                a = script_args(script, flags + extra)
                s = model_shape(config_for(a))
                p = plan(script, a, s, gpus, gib, coef)
                peak_phase = max(p, key=lambda k: sum(p[k].values()))
                peak = sum(p[peak_phase].values())
                if peak + margin_gib(gib) <= gib:
                    cells.append(f"fits{' with `' + ' '.join(extra) + '`' if extra else ''}: peak {peak:.0f} GiB "
                                 f"({peak_phase})")
                    break
            else:
                cells.append(f"does not fit: peak {peak:.0f} GiB ({peak_phase}) even with `{' '.join(extra)}`")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------
# Calibration: peak memory measured on this CPU at small shapes, element counts fitted, then checked
# ----------------------------------------------------------------------------------------------------
MEASURE = r"""
import json, os, sys
sys.path.insert(0, {root!r})
import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM
import grpo
from common import parallel
h, I, L, heads, kv, hd, V, T, ckpt = {point}
cfg = AutoConfig.for_model("qwen3", hidden_size=h, intermediate_size=I, num_hidden_layers=L, num_attention_heads=heads,
                           num_key_value_heads=kv, head_dim=hd, vocab_size=V, tie_word_embeddings=True,
                           max_position_embeddings=65536)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg).float()
model.config.use_cache = False
ids = torch.randint(5, V, (1, T))
with torch.no_grad():
    grpo.sequence_logprobs(model, ids[:, :64], [1], [63], 1.0, 1024)  # warm-up
out, peaks = {{}}, parallel.Peaks()

def measure(name, fn):
    peaks.start()
    fn()
    peaks.end(name)
    out[name] = peaks.peaks[name + "_growth"] * 2**30

# components: one decoder layer on T positions, and the LM head on one chunk of 1024 positions
layer = model.model.layers[0]
x = torch.randn(1, T, h)
pos = model.model.rotary_emb(x, torch.arange(T)[None])
def layer_nograd():
    with torch.no_grad():
        layer(x, position_embeddings=pos)
saved = {{}}
def layer_forward():
    xg = x.clone().requires_grad_()
    saved["y"], saved["x"] = layer(xg, position_embeddings=pos), xg
def layer_backward():
    saved["y"].sum().backward()
    saved.clear()
hc = torch.randn(1024, h)
tg = torch.randint(0, V, (1024,))
W = model.get_output_embeddings().weight
def lm_nograd():
    with torch.no_grad():
        grpo._chunk_logprobs(hc, tg, W, None, 1.0, True)
def lm_train():
    hg = hc.clone().requires_grad_()
    lp, _ = checkpoint(grpo._chunk_logprobs, hg, tg, W.detach(), None, 1.0, False, use_reentrant=False)  # W's
    # gradient is counted with the model's gradients
    lp.sum().backward()
measure("layer_nograd", layer_nograd)
measure("layer_saved", layer_forward)
peaks.start()
layer_backward()
peaks.end("bwd")
out["layer_backward"] = out["layer_saved"] + peaks.peaks["bwd_growth"] * 2**30 \
    - 4 * sum(p.numel() for p in layer.parameters())  # its weights' gradients: counted with the model's
model.zero_grad(set_to_none=True)
measure("lm_nograd", lm_nograd)
model.zero_grad(set_to_none=True)
measure("lm_train", lm_train)
model.zero_grad(set_to_none=True)
# the whole model, as the scripts run it
if ckpt:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
def whole_nograd():
    with torch.no_grad():
        grpo.sequence_logprobs(model, ids, [1], [T - 1], 1.0, 1024, with_entropy=True)
def whole_train():
    lp, _ = grpo.sequence_logprobs(model, ids, [1], [T - 1], 1.0, 1024)
    (-lp.sum()).backward()
measure("nograd", whole_nograd)
model.train()
measure("train", whole_train)
out["train"] -= 4 * sum(p.numel() for p in model.parameters())  # less the gradients
print(json.dumps(out))
"""
# (hidden, intermediate, layers, heads, kv heads, head dim, vocab, tokens): each varies one dimension of point 0
FIT_POINTS = [(256, 768, 4, 4, 2, 64, 4096, 8192), (512, 768, 4, 4, 2, 64, 4096, 8192),
              (256, 2048, 4, 4, 2, 64, 4096, 8192), (256, 768, 4, 8, 2, 64, 4096, 8192),
              (256, 768, 4, 4, 4, 64, 4096, 8192), (256, 768, 8, 4, 2, 64, 4096, 8192),
              (256, 768, 4, 4, 2, 64, 16384, 8192), (256, 768, 4, 4, 2, 64, 4096, 4096)]
CHECK_POINTS = [(384, 1024, 6, 6, 2, 64, 8192, 6144), (512, 1536, 3, 8, 4, 64, 12288, 4096)]


def measure(point: tuple, ckpt: bool) -> dict:
    code = MEASURE.format(root=str(ROOT), point=(*point, int(ckpt)))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # big blocks by mmap: RSS follows live tensors
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def shape_of(point: tuple) -> dict:
    h, I, L, heads, kv, hd, V, _ = point
    return {"hidden": h, "intermediate": I, "layers": L, "q": heads * hd, "kv": kv * hd, "vocab": V}


def calibrate(reuse: dict | None = None) -> dict:
    """Measure components and whole models on this CPU (fp32), fit the element counts on FIT_POINTS, then
    compare the whole-model predictions with the measurements, CHECK_POINTS held out of the fit. `reuse`: an
    earlier result whose measurements are refitted instead of measured again."""
    import numpy as np

    rows = [(tuple(p), c, m) for p, c, m in reuse["measurements"]] if reuse else []
    for point in [] if reuse else FIT_POINTS + CHECK_POINTS:
        for ckpt in (False, True):
            m = measure(point, ckpt)
            rows.append((point, ckpt, m))
            print(f"measured {point} checkpointing={ckpt}: " + ", ".join(f"{k} {v / 2**20:.0f} MiB"
                                                                       for k, v in m.items()), flush=True)
    fit = [(p, m) for p, c, m in rows if p in FIT_POINTS and not c]
    coef: dict = {}
    for name in ("layer_nograd", "layer_saved", "layer_backward"):  # elements per token, linear in the dims
        X = [[4 * p[7] * shape_of(p)[d] for d in ("hidden", "q", "kv", "intermediate")] for p, _ in fit]
        sol, *_ = np.linalg.lstsq(np.array(X, float), np.array([m[name] for _, m in fit], float), rcond=None)
        coef[name] = dict(zip(["h", "q", "kv", "I"], [round(float(v), 3) for v in sol]))
    for name in ("lm_nograd", "lm_train"):  # elements per (chunk x vocab)
        coef[name] = round(float(np.mean([m[name] / (4 * 1024 * shape_of(p)["vocab"]) for p, m in fit])), 3)
    # what the whole model holds besides its layers and head, in hidden-size units per token (negative where
    # the parts overlap: a layer's output is the next one's input)
    for name, kind, ckpt in (("outside_nograd", "nograd", False), ("outside_train", "train", False),
                             ("outside_ckpt", "train", True)):
        resid = []
        for p, c, m in rows:
            if p in FIT_POINTS and c == ckpt:
                s, T = shape_of(p), p[7]
                coef[name] = 0.0
                base = sum(activation_bytes(coef, s, T, T - 1, 1024, kind, ckpt, gpu=False).values())
                resid.append((m[kind] - base) / (4 * T * s["hidden"]))
        coef[name] = round(float(np.mean(resid)), 3)
    checks = []
    for p, c, m in rows:
        s, T = shape_of(p), p[7]
        for kind in ("nograd", "train"):
            pred = sum(activation_bytes(coef, s, T, T - 1, 1024, kind, c, gpu=False).values())
            checks.append({"point": p, "checkpointing": c, "phase": kind, "held_out": p in CHECK_POINTS,
                           "measured_mib": round(m[kind] / 2**20, 1), "predicted_mib": round(pred / 2**20, 1),
                           "error": round(pred / m[kind] - 1, 3)})
    return {"coefficients": coef, "checks": checks, "measurements": [[list(p), c, m] for p, c, m in rows]}


def check_tiny_run(coef: dict) -> list[dict]:
    """grpo.py --tiny for 3 steps on this CPU: its memory/*_growth logs against the plan's CPU terms."""
    import tempfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tblog import read_scalars

    from common.tiny import tiny_model_path

    steps, mbt = 3, 16384
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
        subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--tiny", "--num-steps", str(steps), "--eval-every",
                        "0", "--run-name", "mem", "--micro-batch-tokens", str(mbt)], cwd=tmp, env=env, check=True,
                       capture_output=True)
        logged = read_scalars(Path(tmp) / "runs" / "mem")
    s = model_shape(Path(tiny_model_path()) / "config.json")
    a = script_args("grpo", ["--tiny"])
    P = s["params"]
    # a micro-batch holds up to --micro-batch-tokens padded tokens; ~ that many in the first (longest rows)
    act_ng = sum(activation_bytes(coef, s, mbt, 200, a.logprob_chunk_tokens, "nograd", False, gpu=False).values())
    act_tr = sum(activation_bytes(coef, s, mbt, 200, a.logprob_chunk_tokens, "train", False, gpu=False).values())
    predicted = {"old_logprobs": act_ng, "backward": act_tr + 4 * P}  # gradients appear in the first backward
    out = []
    for phase, pred in predicted.items():
        measured = max(logged[f"memory/{phase}_growth"].values()) * GIB
        out.append({"run": f"grpo.py --tiny, {steps} steps", "phase": phase, "measured_mib": round(measured / 2**20, 1),
                    "predicted_mib": round(pred / 2**20, 1), "error": round(pred / measured - 1, 3)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", choices=["grpo", "ac2", "rpo", "ccr"], default="ac2")
    ap.add_argument("--config", help="a config.json (default: the script's --model, from benchmarks/configs/)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks the trainer is sharded over (one per GPU)")
    ap.add_argument("--gpu-gib", type=float, default=79.6,
                    help="memory of one GPU, GiB (H100 80 GB: 79.6; H200: 139.8)")
    ap.add_argument("--table", action="store_true", help="the README table: paper runs x machines")
    ap.add_argument("--calibrate", action="store_true", help="measure on this CPU, fit, check; writes the calibration")
    ap.add_argument("--refit", action="store_true", help="refit the calibration's stored measurements (no measuring)")
    ap.add_argument("script_flags", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    args = ap.parse_args()
    if args.calibrate or args.refit:
        result = calibrate(json.loads(CALIBRATION.read_text()) if args.refit else None)
        CALIBRATION.parent.mkdir(exist_ok=True)
        CALIBRATION.write_text(json.dumps(result, indent=1))  # the tiny-run check below reads it
        result["tiny_run"] = check_tiny_run(result["coefficients"])
        CALIBRATION.write_text(json.dumps(result, indent=1))
        for c in result["checks"] + result["tiny_run"]:
            print(f"{'held out ' if c.get('held_out') else ''}{c.get('point', c.get('run'))} "
                  f"{'ckpt ' if c.get('checkpointing') else ''}{c['phase']}: measured {c['measured_mib']} MiB, "
                  f"predicted {c['predicted_mib']} MiB ({100 * c['error']:+.1f}%)")
        print(f"wrote {CALIBRATION}")
        return
    coef = load_coef()
    if args.table:
        print(table(coef))
        return
    flags = [f for f in args.script_flags if f != "--"]
    a = script_args(args.script, flags)
    s = model_shape(args.config or config_for(a))
    text, _ = report(args.script, a, s, args.gpus, args.gpu_gib, coef)
    print(text)


if __name__ == "__main__":
    main()
