"""Gather what benchmarks/gpu_check.sh measured into one JSON, beside the memory plan's prediction.

Per run (TensorBoard logs under --runs): each phase's peak memory (memory/<phase>, GiB: on GPU the CUDA
allocator's peak, on CPU the peak resident set), and the step, generation, training and sync times of each
step. For the paper-length runs, benchmarks/memory_plan.py's per-phase prediction for the same model and flags
on this GPU (trainer and vLLM together, without the plan's margin), so the README can put them side by side.
"""

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import memory_plan  # noqa: E402
import torch  # noqa: E402
from tblog import read_scalars  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--grpo-flags", default="")
    ap.add_argument("--ac2-flags", default="")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else 0.0
    report = {"device": torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or 'unknown'})",
              "device_memory_gib": round(gpu_gib, 1), "torch": torch.__version__, "seconds": a.seconds,
              "config": Path(a.config).name, "runs": {}}
    coef = memory_plan.load_coef()
    shape = memory_plan.model_shape(a.config)
    for run in sorted(Path(a.runs).iterdir()):
        s = read_scalars(run)
        entry = {"memory_gib": {k[len("memory/"):]: round(max(v.values()), 2) for k, v in s.items()
                                if k.startswith("memory/")},
                 "step_time_s": [round(v, 1) for _, v in sorted(s.get("charts/step_time", {}).items())]}
        for key in ("time/generate", "time/train", "time/sync", "time/critic"):
            if key in s:
                entry[key] = [round(v, 2) for _, v in sorted(s[key].items())]
        script = run.name.split("-", 1)[1]
        flags = {"paper-grpo": a.grpo_flags, "paper-ac2": a.ac2_flags}.get(run.name)
        if flags is not None and gpu:  # the plan speaks of the GPU path only
            args = memory_plan.script_args(script, ["--model", "random", *shlex.split(flags)])
            plan = memory_plan.plan(script, args, shape, 1, gpu_gib, coef)
            entry["plan_gib"] = {ph: round(sum(t.values()), 2) for ph, t in plan.items()}
        report["runs"][run.name] = entry
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
