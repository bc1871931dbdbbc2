"""AC2 on the built-in tiny task at the paper's thresholds: when readiness engages, and what it saves.

    python benchmarks/ac2_tiny.py      # runs `ac2.py --tiny` and `grpo.py --tiny --train-limit 128` (seed 1, 100 steps)
    python benchmarks/ac2_tiny.py --ac2-run runs/X --grpo-run runs/Y   # summarise finished runs instead

Reads the TensorBoard logs the scripts write (the only logging path) and reports the global gate, the
ready fraction over time, consumed chunks, and generated tokens and decoding FLOPs per step against
grpo.py on the same 128 training problems, before and after readiness. Writes benchmarks/results/ac2_tiny.json.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tblog import read_scalars  # benchmarks/ is on sys.path when these run as scripts

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, steps: int, seed: int, *extra: str) -> Path:
    name = f"bench_{script[:-3]}_tiny_s{seed}_n{steps}_{int(time.time())}"
    subprocess.run([sys.executable, str(ROOT / script), "--tiny", "--num-steps", str(steps), "--seed", str(seed),
                    "--run-name", name, *extra], cwd=ROOT, check=True)
    return ROOT / "runs" / name


def per_step(cumulative: dict[int, float]) -> dict[int, float]:
    return {k: v - cumulative.get(k - 1, 0.0) for k, v in sorted(cumulative.items()) if k >= 1}


def window_mean(series: dict[int, float], steps) -> float:
    vals = [series[k] for k in steps if k in series]
    return float(np.mean(vals)) if vals else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ac2-run", help="summarise this finished ac2.py --tiny run instead of running one")
    ap.add_argument("--grpo-run", help="summarise this finished grpo.py --tiny run instead of running one")
    a = ap.parse_args()
    ac2 = read_scalars(Path(a.ac2_run) if a.ac2_run else run("ac2.py", a.steps, a.seed))
    # GRPO on AC2's 128 training problems (ac2.tiny_args().train_limit): the matched baseline
    grpo = read_scalars(Path(a.grpo_run) if a.grpo_run else run("grpo.py", a.steps, a.seed, "--train-limit", "128"))
    last = max(ac2["charts/decoding_flops"])
    gate = ac2["ac2/gate_open"]
    ready = ac2["ac2/ready_frac"]
    gate_step = next((k for k in sorted(gate) if gate[k] > 0), None)
    first_ready = next((k for k in sorted(ready) if ready[k] > 0), None)
    windows = {"steps 2-10": range(2, 11), f"steps {last - 9}-{last}": range(last - 9, last + 1)}
    if first_ready:
        windows[f"before readiness (2-{first_ready - 1})"] = range(2, first_ready)
    flops = {"ac2": per_step(ac2["charts/decoding_flops"]), "grpo": per_step(grpo["charts/decoding_flops"])}
    tokens = {"ac2": per_step(ac2["charts/generated_tokens"]), "grpo": per_step(grpo["charts/generated_tokens"])}
    result = {
        "steps": last, "seed": a.seed,
        "gate_opens_at_step": gate_step, "first_step_with_ready_slots": first_ready,
        "ready_frac_every_10": {k: round(v, 3) for k, v in sorted(ready.items()) if k % 10 == 0 or k == last},
        "ready_problems_final": ac2["ac2/ready_problems"][last],
        "global_mae_every_10": {k: round(v, 3) for k, v in sorted(ac2["ac2/global_mae"].items()) if k % 10 == 0},
        "consumed_rows_every_10": {k: v for k, v in sorted(ac2["ac2/consumed_rows"].items()) if k % 10 == 0},
        "consumed_rows_total": sum(ac2["ac2/consumed_rows"].values()),
        "windows": {name: {
            "ac2_tokens_per_step": round(window_mean(tokens["ac2"], steps)),
            "grpo_tokens_per_step": round(window_mean(tokens["grpo"], steps)),
            "ac2_flops_per_step": window_mean(flops["ac2"], steps),
            "grpo_flops_per_step": window_mean(flops["grpo"], steps),
        } for name, steps in windows.items()},
        "eval_ac2": {k: round(v, 3) for k, v in sorted(ac2["eval/mean_score"].items())},
        "eval_grpo": {k: round(v, 3) for k, v in sorted(grpo["eval/mean_score"].items())},
        "cumulative_flops_ac2": ac2["charts/decoding_flops"][last],
        "cumulative_flops_grpo": grpo["charts/decoding_flops"][max(grpo["charts/decoding_flops"])],
    }
    out = ROOT / "benchmarks" / "results" / "ac2_tiny.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print("\n| window | AC2 tokens / step | GRPO tokens / step | AC2 FLOPs / step | GRPO FLOPs / step |\n|-|-|-|-|-|")
    for name, w in result["windows"].items():
        print(f"| {name} | {w['ac2_tokens_per_step']:,} | {w['grpo_tokens_per_step']:,} | "
              f"{w['ac2_flops_per_step']:.3g} | {w['grpo_flops_per_step']:.3g} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
