"""GRPO, AC2, Prefix GRPO, RPO and CCR side by side on the tiny task, on one axis: decoding FLOPs (AC2 Eq. 6).

    python benchmarks/compare.py                      # 5 methods x 3 seeds x 30 steps, ~50 min on 2 cores
    python benchmarks/compare.py --steps 20 --seeds 1 # a quick look

Every run is the script's own `--tiny` configuration with the same model, data, held-out set and evaluation
sampler (256 problems x 4 samples at T = 1, max 200 tokens), the same number of training steps and the
same seeds; nothing is tuned per method here. The numbers come from the TensorBoard logs the scripts write
(no second logging path). Writes, under benchmarks/results/compare/: score_vs_flops.png,
score_vs_steps.png, table.md and summary.json; existing runs are reused unless --fresh.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tblog import read_scalars  # benchmarks/ is on sys.path when these run as scripts

ROOT = Path(__file__).resolve().parents[1]
METHODS = {  # name -> (script, extra flags)
    "GRPO": ("grpo.py", []),
    "AC2": ("ac2.py", []),
    "Prefix GRPO": ("ac2.py", ["--prefix-grpo", "--exp-name", "prefix_grpo"]),
    "RPO": ("rpo.py", []),
    "CCR": ("ccr.py", []),
}
TOKENS_PER_SAMPLE = {  # the key each script logs for new tokens per sampled continuation
    "GRPO": "train/response_len_mean", "AC2": "ac2/new_tokens_per_sample",
    "Prefix GRPO": "ac2/new_tokens_per_sample", "RPO": "rpo/new_tokens_per_sample", "CCR": "ccr/completion_len_mean",
}
PAPERS = {  # the papers' own headline numbers, where a comparable quantity exists
    "AC2": "2.5x fewer decoding FLOPs to GRPO's peak (0.79e20 vs 1.99e20)",
    "Prefix GRPO": "falls well behind AC2 in decoding FLOPs (Figure 1)",
    "RPO": "new tokens per sample ~5% of GRPO's (146 vs 2,690, L = 300)",
    "CCR": "-82.1% tokens per step vs GRPO with a 32k window (174,957 vs 975,464)",
}


def run(method: str, seed: int, steps: int, fresh: bool) -> Path:
    script, extra = METHODS[method]
    name = f"cmp_{re.sub('[^a-z0-9]+', '_', method.lower()).strip('_')}_s{seed}_n{steps}"
    run_dir = ROOT / "runs" / name
    if run_dir.exists() and not fresh and (ROOT / "runs" / name / ".done").exists():
        return run_dir
    steps_flag = ["--num-steps", str(steps)]
    t0 = time.time()
    print(f"running {method} seed {seed} ({script}) ...", flush=True)
    subprocess.run([sys.executable, str(ROOT / script), "--tiny", "--seed", str(seed), "--run-name", name,
                    "--eval-every", "10", *steps_flag, *extra], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    (run_dir / ".done").write_text(f"{time.time() - t0:.1f}\n")
    return run_dir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--fresh", action="store_true", help="re-run even if a finished run exists")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare"))
    a = ap.parse_args()
    t_start = time.time()
    dirs = {m: [run(m, s, a.steps, a.fresh) for s in a.seeds] for m in a.methods}
    logs = {m: [read_scalars(d) for d in ds] for m, ds in dirs.items()}
    run_seconds = sum(float((d / ".done").read_text()) for ds in dirs.values() for d in ds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    summary = {}
    for m, runs in logs.items():
        eval_steps = sorted(set.intersection(*(set(r["eval/mean_score"]) for r in runs)))
        score = np.array([[r["eval/mean_score"][k] for k in eval_steps] for r in runs])  # seeds x evals
        flops = np.array([[r["charts/decoding_flops"].get(k, 0.0) for k in eval_steps] for r in runs])
        tokens = [r["charts/generated_tokens"] for r in runs]
        last = max(tokens[0])
        per_step = [(t[last] - t.get(0, 0.0)) / last for t in tokens]  # RPO's step-0 cache fill excluded
        phases = {p: float(np.mean([np.mean(list(r[f"time/{p}"].values())) for r in runs]))
                  for p in ("generate", "score", "train", "sync") if f"time/{p}" in runs[0]}
        if "time/critic" in runs[0]:
            phases["critic"] = float(np.mean([np.mean(list(r["time/critic"].values())) for r in runs]))
        summary[m] = {
            "eval_steps": eval_steps, "score_mean": score.mean(0).tolist(), "score_std": score.std(0).tolist(),
            "flops_mean": flops.mean(0).tolist(), "peak_score": float(score.mean(0).max()),
            "final_score": float(score.mean(0)[-1]), "start_score": float(score.mean(0)[0]),
            "generated_tokens_per_step": float(np.mean(per_step)),
            "new_tokens_per_sample": float(np.mean([np.mean(list(r[TOKENS_PER_SAMPLE[m]].values())) for r in runs])),
            "seconds_per_step": float(np.mean([np.mean(list(r["charts/step_time"].values())) for r in runs])),
            "phase_seconds_per_step": phases,
        }
        if m.startswith("AC2"):
            summary[m]["ready_frac_final"] = float(np.mean([r["ac2/ready_frac"][max(r["ac2/ready_frac"])]
                                                             for r in runs if "ac2/ready_frac" in r] or [0.0]))
            summary[m]["consumed_rows_per_step_last10"] = float(np.mean([
                np.mean([v for k, v in r["ac2/consumed_rows"].items() if k > last - 10]) for r in runs]))
    if "GRPO" in summary:  # decoding FLOPs to first reach GRPO's peak (seed-mean curves)
        target = summary["GRPO"]["peak_score"]
        for m, s in summary.items():
            hit = next((i for i, v in enumerate(s["score_mean"]) if v >= target - 1e-9), None)
            s["flops_to_grpo_peak"] = None if hit is None else s["flops_mean"][hit]
        base = summary["GRPO"]["flops_to_grpo_peak"]
        for s in summary.values():
            s["flops_ratio_vs_grpo"] = None if not s["flops_to_grpo_peak"] or not base else base / s["flops_to_grpo_peak"]

    # plots: held-out score against decoding FLOPs (AC2 Figure 1's axis) and against steps, band = min..max
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for xkey, fname, xlabel in (("flops_mean", "score_vs_flops.png", "cumulative decoding FLOPs (Eq. 6)"),
                                ("eval_steps", "score_vs_steps.png", "training step")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for m, runs in logs.items():
            s = summary[m]
            steps = s["eval_steps"]
            scores = np.array([[r["eval/mean_score"][k] for k in steps] for r in runs])
            x = np.array(s[xkey], dtype=float)
            ax.plot(x, scores.mean(0), label=m, marker="o", ms=3)
            ax.fill_between(x, scores.min(0), scores.max(0), alpha=0.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out score (tiny task, T = 1)")
        ax.set_title(f"tiny task, {len(a.seeds)} seed(s), band = min..max")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)

    fmt = lambda x, f="{:.3g}": "-" if x is None else f.format(x)  # noqa: E731
    lines = ["| method | generated tokens / step | new tokens / sample | held-out start -> peak (final) | decoding FLOPs to "
             "GRPO's peak | vs GRPO | s / step (generate / score / train / sync) | the paper says |",
             "|-|-|-|-|-|-|-|-|"]
    for m, s in summary.items():
        ph = s["phase_seconds_per_step"]
        phase = " / ".join(f"{ph[p]:.2f}" for p in ("generate", "score", "train", "sync") if p in ph)
        if "critic" in ph:
            phase += f" (+ critic {ph['critic']:.2f})"
        lines.append(f"| {m} | {s['generated_tokens_per_step']:,.0f} | {s['new_tokens_per_sample']:.1f} | "
                     f"{s['start_score']:.3f} -> {s['peak_score']:.3f} ({s['final_score']:.3f}) | {fmt(s.get('flops_to_grpo_peak'))} | "
                     f"{fmt(s.get('flops_ratio_vs_grpo'), '{:.2f}x')} | {s['seconds_per_step']:.2f} ({phase}) | "
                     f"{PAPERS.get(m, 'the baseline' if m == 'GRPO' else '-')} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps({"steps": a.steps, "seeds": a.seeds, "methods": summary,
                                                  "wall_seconds": round(time.time() - t_start, 1),
                                                  "training_runs_seconds": round(run_seconds, 1)}, indent=2))
    print(table)
    print(f"\nwrote {out}/score_vs_flops.png, score_vs_steps.png, table.md, summary.json "
          f"({time.time() - t_start:.0f} s now; the training runs took {run_seconds:.0f} s)")


if __name__ == "__main__":
    main()
