"""Gather what benchmarks/gpu_check.sh has measured so far into one JSON, beside the plan's predictions.

Called after every stage: the stages' outcomes (--stages, one JSON line each), the trainer stage's own report
(--trainer, benchmarks/gpu_trainer_check.py), and per script run (TensorBoard logs under --runs) each phase's peak
memory (memory/<phase>, GiB: device-level on GPU, the peak resident set on CPU), the step, generation, training and
sync times and sampling/mismatch_kl of each step. For the paper-shape runs, common/plan.py's per-phase prediction for
the same model and flags on this GPU (without its margin), so that the README can put them side by side.
"""

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from memory_plan import script_args  # noqa: E402
from tblog import read_scalars  # noqa: E402

from common import plan  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--stages", required=True)
    ap.add_argument("--trainer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--grpo-flags", default="")
    ap.add_argument("--ac2-flags", default="")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if gpu else 0.0
    stages = Path(a.stages)
    report = {"device": torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.processor() or 'unknown'})",
              "device_memory_gib": round(gpu_gib, 1), "torch": torch.__version__, "seconds": a.seconds,
              "config": Path(a.config).name,
              "stages": [json.loads(line) for line in stages.read_text().splitlines()] if stages.exists() else [],
              "trainer": json.loads(Path(a.trainer).read_text()) if Path(a.trainer).exists() else None, "runs": {}}
    shape = plan.model_shape(a.config)
    for run in sorted(Path(a.runs).iterdir()) if Path(a.runs).exists() else []:
        s = read_scalars(run)
        entry = {"memory_gib": {k[len("memory/"):]: round(max(v.values()), 2) for k, v in s.items()
                                if k.startswith("memory/")},
                 "step_time_s": [round(v, 1) for _, v in sorted(s.get("charts/step_time", {}).items())]}
        for key in ("time/generate", "time/train", "time/sync", "time/critic", "sampling/mismatch_kl",
                    "sampling/mismatch_max"):
            if key in s:
                entry[key] = [round(v, 6 if key.startswith("sampling") else 2) for _, v in sorted(s[key].items())]
        script = run.name.split("-", 1)[1]
        flags = {"paper-grpo": a.grpo_flags, "paper-ac2": a.ac2_flags}.get(run.name)
        if flags is not None and gpu:  # the plan speaks of the GPU path only
            args = script_args(script, ["--model", "random", *shlex.split(flags)])
            entry["plan_gib"] = {ph: round(sum(t.values()), 2)
                                 for ph, t in plan.memory_plan(args, shape, 1, gpu_gib).items()}
        report["runs"][run.name] = entry
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
