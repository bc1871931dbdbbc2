"""GRPO on the built-in tiny task: held-out score before/after, wall time by phase, decoding throughput.

    python benchmarks/grpo_tiny.py [--steps 100] [--seed 1] [extra grpo.py flags...]
    python benchmarks/grpo_tiny.py --run runs/cmp_grpo_s1_n100     # summarise a finished grpo.py --tiny run

Runs `grpo.py --tiny` as a user would, then reads its TensorBoard log (the only logging path) and writes
benchmarks/results/grpo_tiny.json plus a markdown summary on stdout.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tblog import read_scalars  # benchmarks/ is on sys.path when these run as scripts

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--run", help="a finished grpo.py --tiny run folder to summarise instead of running one")
    a, extra = ap.parse_known_args()
    if a.run:
        run_dir = Path(a.run)
        done = run_dir / ".done"  # benchmarks/compare.py records its runs' wall time there
        wall = float(done.read_text()) if done.exists() else float("nan")
    else:
        run_dir = ROOT / "runs" / f"bench_grpo_tiny_s{a.seed}_{int(time.time())}"
        t0 = time.time()
        subprocess.run([sys.executable, str(ROOT / "grpo.py"), "--tiny", "--num-steps", str(a.steps), "--seed",
                        str(a.seed), "--run-name", run_dir.name, *extra], cwd=ROOT, check=True)
        wall = time.time() - t0
    run = run_dir.name
    s = read_scalars(run_dir)
    a.steps = max(s["charts/step_time"])
    ev = s["eval/mean_score"]
    first_step = lambda cond: next((k for k in sorted(ev) if cond(ev[k])), None)  # noqa: E731
    step_times = s["charts/step_time"]
    plus15 = first_step(lambda v: v >= ev[0] + 0.15)
    seconds_to_plus15 = None if plus15 is None else sum(v for k, v in step_times.items() if k <= plus15) + sum(
        v for k, v in s["time/eval"].items() if k < plus15)
    phase = {p: sum(s[f"time/{p}"].values()) for p in ("generate", "score", "train", "sync", "eval")}
    tokens = s["charts/generated_tokens"][max(s["charts/generated_tokens"])]
    result = {
        "run": run, "steps": a.steps, "seed": a.seed, "wall_seconds_total": round(wall, 1),
        "eval_before": round(ev[0], 3), "eval_after": round(ev[max(ev)], 3), "eval_peak": round(max(ev.values()), 3),
        "eval_curve": {k: round(v, 3) for k, v in sorted(ev.items())},
        "first_eval_step_at_plus_15_points": plus15,
        "train_seconds_to_plus_15_points": None if seconds_to_plus15 is None else round(seconds_to_plus15, 1),
        "phase_seconds": {k: round(v, 1) for k, v in phase.items()},
        "seconds_per_step": round(sum(step_times.values()) / len(step_times), 2),
        "median_seconds_per_step": round(statistics.median(step_times.values()), 2),
        "generated_tokens": int(tokens),
        "decode_tokens_per_second": round(tokens / phase["generate"], 1),
        "decoding_flops": s["charts/decoding_flops"][max(s["charts/decoding_flops"])],
    }
    out = ROOT / "benchmarks" / "results" / "grpo_tiny.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"\n| held-out score before | after {a.steps} steps | peak | +15 points at step | train s to +15 | "
          f"s/step (median) | generate / score / train / sync / eval (s) | decode tok/s |\n|-|-|-|-|-|-|-|-|")
    print(f"| {result['eval_before']} | {result['eval_after']} | {result['eval_peak']} | {plus15} | "
          f"{result['train_seconds_to_plus_15_points']} | {result['seconds_per_step']} "
          f"({result['median_seconds_per_step']}) | "
          + " / ".join(str(v) for v in result["phase_seconds"].values()) + f" | {result['decode_tokens_per_second']} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
