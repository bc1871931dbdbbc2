"""GRPO, AC2, Prefix GRPO, RPO and CCR side by side on the tiny task, each beside GRPO on its own training problems.

    python benchmarks/compare.py                       # 7 runs x 2 seeds x 100 steps (the run time: docs/results.md)
    python benchmarks/compare.py --steps 20 --seeds 1  # a quick look
    python benchmarks/compare.py --model tiny-ac2 --methods AC2 "Prefix GRPO"   # the tiny AC2 setting's model

Every method runs its script's own `--tiny` configuration; they do not all train on the same problems (AC2 and
Prefix GRPO on 128, so that problems come back for readiness; RPO on 512, one cached answer each; GRPO and
CCR on all 4,096), so each is paired with grpo.py --tiny on exactly its training problems (`--train-limit`),
and the table reads a method against its matched GRPO. Everything else is shared: the model, the held-out set
and its evaluation sampler (256 problems x 4 samples at T = 1, max 200 tokens) every 10 steps, a fixed sample of
training problems evaluated the same way (eval/train_score: the train / held-out gap), the seeds. 100 steps, so
that AC2's critic becomes ready at the paper's thresholds inside the comparison; RPO and CCR stop at the end of
their epochs (96 and 100 steps). Nothing is tuned per method. The numbers come from the TensorBoard logs the
scripts write. AC2 keeps a checkpoint every 10 steps (benchmarks/ac2_advantage.py reads them). Writes, under
benchmarks/results/compare/: score_vs_flops.png, score_vs_steps.png, table.md and summary.json; finished runs
are reused unless --fresh. `--model tiny-ac2` runs every method from the tiny AC2 setting's model instead (its critic
was trained with the reference before the attempt, so AC2 and Prefix GRPO add --critic-reference-first) and writes
under benchmarks/results/compare_tiny_ac2/; it has not learned CCR's packed prompts, so leave CCR out there. A
model folder trained the same way (as critic_probe.py's `--ref-first` attempts are) takes `--model <folder>
--critic-reference-first --out <folder for the results>`.
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
METHODS = {  # name -> (script, extra flags, training problems, the GRPO run on the same problems)
    "GRPO": ("grpo.py", [], 4096, "GRPO"),
    "AC2": ("ac2.py", ["--save-every", "10", "--keep-checkpoints", "11"], 128, "GRPO on 128"),
    "Prefix GRPO": ("ac2.py", ["--prefix-grpo", "--exp-name", "prefix_grpo"], 128, "GRPO on 128"),
    "RPO": ("rpo.py", [], 512, "GRPO on 512"),
    "CCR": ("ccr.py", [], 4096, "GRPO"),
    "GRPO on 128": ("grpo.py", ["--train-limit", "128"], 128, "GRPO on 128"),
    "GRPO on 512": ("grpo.py", ["--train-limit", "512"], 512, "GRPO on 512"),
}
TOKENS_PER_SAMPLE = {  # the key each script logs for new tokens per sampled continuation
    "grpo.py": "train/response_len_mean", "ac2.py": "ac2/new_tokens_per_sample", "rpo.py": "rpo/new_tokens_per_sample",
    "ccr.py": "ccr/completion_len_mean",
}
PAPERS = {  # the papers' own headline numbers, where a comparable quantity exists
    "AC2": "2.5x fewer decoding FLOPs to GRPO's peak (0.79e20 vs 1.99e20)",
    "Prefix GRPO": "falls well behind AC2 in decoding FLOPs (Figure 1)",
    "RPO": "new tokens per sample ~5% of GRPO's (146 vs 2,690, L = 300)",
    "CCR": "-82.1% tokens per step vs GRPO with a 32k window (174,957 vs 975,464)",
}


MODEL_FLAGS = {"tiny-ac2": {"ac2.py": ["--critic-reference-first"]}}  # the prompt order its critic was trained on


def script_flags(method: str, model: str = "tiny", reference_first: bool = False) -> list[str]:
    """A method's own flags, then the model's: with --critic-reference-first (for a model folder whose critic was
    trained that way) AC2 and Prefix GRPO prompt the critic with the reference before the attempt."""
    script, extra, _, _ = METHODS[method]
    flags = [*extra, "--model", model, *MODEL_FLAGS.get(model, {}).get(script, [])]
    if reference_first and script == "ac2.py" and "--critic-reference-first" not in flags:
        flags.append("--critic-reference-first")
    return flags


def run_name(method: str, seed: int, steps: int, model: str = "tiny", reference_first: bool = False) -> str:
    """The run's folder under runs/: a finished run is reused only by the same method, model, flags, seed and steps
    (`_ref` where --critic-reference-first changed the script's flags)."""
    suffix = "" if model == "tiny" else "_" + re.sub("[^a-z0-9]+", "_", model.lower()).strip("_")
    if script_flags(method, model, reference_first) != script_flags(method, model):
        suffix += "_ref"
    return f"cmp_{re.sub('[^a-z0-9]+', '_', method.lower()).strip('_')}{suffix}_s{seed}_n{steps}"


def run(method: str, seed: int, steps: int, fresh: bool, model: str = "tiny", reference_first: bool = False) -> Path:
    script = METHODS[method][0]
    extra = script_flags(method, model, reference_first)
    name = run_name(method, seed, steps, model, reference_first)
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


def flops_to_reach(scores: list[float], flops: list[float], target: float) -> float | None:
    """Cumulative decoding FLOPs at which a score curve first reaches target (linear between evaluations)."""
    for i, v in enumerate(scores):
        if v >= target - 1e-9:
            if i == 0:
                return flops[0]
            frac = (target - scores[i - 1]) / (v - scores[i - 1])
            return flops[i - 1] + frac * (flops[i] - flops[i - 1])
    return None


def flops_ratio(matched: float | None, own: float | None) -> float | None:
    """The matched GRPO's decoding FLOPs over the method's, to the same score. None where it has no meaning: GRPO
    never reached that score, or the method's peak is its starting score (both spent nothing to get there)."""
    return None if matched is None or not own else matched / own


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--fresh", action="store_true", help="re-run even if a finished run exists")
    ap.add_argument("--model", default="tiny",
                    help="every run's --model: tiny, tiny-ac2 (the tiny AC2 setting's) or a model folder")
    ap.add_argument("--critic-reference-first", action="store_true",
                    help="AC2 and Prefix GRPO prompt the critic reference first (implied by --model tiny-ac2)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/compare (compare_tiny_ac2 for tiny-ac2)")
    a = ap.parse_args()
    if a.out is None:
        a.out = str(ROOT / "benchmarks" / "results" / "_".join(["compare", *[a.model.replace("-", "_")] * (
            a.model != "tiny")]))
    try:  # before hours of runs, not after
        import matplotlib
    except ImportError:
        sys.exit("compare.py draws its plots with matplotlib: pip install -e '.[plot]'")
    t_start = time.time()
    methods = list(dict.fromkeys(a.methods + [METHODS[m][3] for m in a.methods]))  # with their matched GRPO
    done = {(m, s): run(m, s, a.steps, a.fresh, a.model, a.critic_reference_first)  # seed by seed
            for s in a.seeds for m in methods}
    dirs = {m: [done[(m, s)] for s in a.seeds] for m in methods}
    logs = {m: [read_scalars(d) for d in ds] for m, ds in dirs.items()}
    run_seconds = sum(float((d / ".done").read_text()) for ds in dirs.values() for d in ds)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    summary = {}
    for m, runs in logs.items():
        eval_steps = sorted(set.intersection(*(set(r["eval/mean_score"]) for r in runs)))
        score = np.array([[r["eval/mean_score"][k] for k in eval_steps] for r in runs])  # seeds x evals
        train = np.array([[r["eval/train_score"][k] for k in eval_steps] for r in runs])
        flops = np.array([[r["charts/decoding_flops"].get(k, 0.0) for k in eval_steps] for r in runs])
        tokens = [r["charts/generated_tokens"] for r in runs]
        last = max(tokens[0])
        per_step = [(t[last] - t.get(0, 0.0)) / last for t in tokens]  # RPO's step-0 cache fill excluded
        # medians over steps: robust to a machine that was briefly busy with something else
        phases = {p: float(np.mean([np.median(list(r[f"time/{p}"].values())) for r in runs]))
                  for p in ("generate", "critic", "score", "train", "sync") if f"time/{p}" in runs[0]}
        script = METHODS[m][0]
        summary[m] = {
            "training_problems": METHODS[m][2], "matched_grpo": METHODS[m][3], "steps": last,
            "eval_steps": eval_steps, "score_mean": score.mean(0).tolist(), "score_min": score.min(0).tolist(),
            "score_max": score.max(0).tolist(), "train_score_mean": train.mean(0).tolist(),
            "flops_mean": flops.mean(0).tolist(), "peak_score": float(score.mean(0).max()),
            "final_score": float(score.mean(0)[-1]), "start_score": float(score.mean(0)[0]),
            "final_train_score": float(train.mean(0)[-1]), "final_gap": float(train.mean(0)[-1] - score.mean(0)[-1]),
            "generated_tokens_per_step": float(np.mean(per_step)),
            "new_tokens_per_sample": float(np.mean([np.mean(list(r[TOKENS_PER_SAMPLE[script]].values()))
                                                    for r in runs])),
            "seconds_per_step": float(np.mean([np.median(list(r["charts/step_time"].values())) for r in runs])),
            "phase_seconds_per_step": phases,
        }
        if m in ("AC2", "Prefix GRPO"):
            opened = [min((k for k, v in r["ac2/gate_open"].items() if v > 0), default=None) for r in runs]
            summary[m]["gate_opens_at"] = opened
            summary[m]["ready_frac_final"] = float(np.mean([r["ac2/ready_frac"][max(r["ac2/ready_frac"])]
                                                            for r in runs if "ac2/ready_frac" in r] or [0.0]))
            summary[m]["consumed_rows_per_step_last10"] = float(np.mean([
                np.mean([v for k, v in r["ac2/consumed_rows"].items() if k > last - 10]) for r in runs]))
    for s in summary.values():
        # decoding FLOPs to reach this method's own peak, and what its matched GRPO spent to reach the same score
        # (seed-mean curves, linear between evaluations): how much each costs at the level the method reaches
        base = summary[s["matched_grpo"]]
        s["flops_to_own_peak"] = flops_to_reach(s["score_mean"], s["flops_mean"], s["peak_score"])
        s["matched_flops_to_same_score"] = flops_to_reach(base["score_mean"], base["flops_mean"], s["peak_score"])
        s["flops_ratio_at_own_peak"] = flops_ratio(s["matched_flops_to_same_score"], s["flops_to_own_peak"])

    # plots: held-out score against decoding FLOPs (AC2 Figure 1's axis) and against steps, band = min..max
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for xkey, fname, xlabel in (("flops_mean", "score_vs_flops.png", "cumulative decoding FLOPs (Eq. 6)"),
                                ("eval_steps", "score_vs_steps.png", "training step")):
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        for m, s in summary.items():
            x = np.array(s[xkey], dtype=float)
            style = dict(ls="--", lw=1) if m.startswith("GRPO on") else dict(lw=1.6)
            ax.plot(x, s["score_mean"], label=f"{m} ({s['training_problems']:,} problems)", marker="o", ms=2.5,
                    **style)
            ax.fill_between(x, s["score_min"], s["score_max"], alpha=0.15)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out score (tiny task, T = 1)")
        ax.set_title(f"tiny task ({a.model} model), {len(a.seeds)} seed(s), band = min..max")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)

    fmt = lambda x, f="{:.3g}": "-" if x is None else f.format(x)  # noqa: E731
    lines = ["| method | training problems | held-out start -> peak (final) | train score (final) | train - held-out "
             "| generated tokens / step | new tokens / sample | decoding FLOPs to its peak: it / matched GRPO (ratio) "
             "| s / step (median) | the paper says |", "|-|-|-|-|-|-|-|-|-|-|"]
    for m, s in summary.items():
        ratio = "peak at the start" if s["flops_to_own_peak"] == 0 else fmt(s["flops_ratio_at_own_peak"], "{:.2f}x")
        lines.append(f"| {m} | {s['training_problems']:,} | {s['start_score']:.3f} -> {s['peak_score']:.3f} "
                     f"({s['final_score']:.3f}) | {s['final_train_score']:.3f} | {s['final_gap']:+.3f} | "
                     f"{s['generated_tokens_per_step']:,.0f} | {s['new_tokens_per_sample']:.1f} | "
                     f"{fmt(s['flops_to_own_peak'])} / {fmt(s['matched_flops_to_same_score'])} "
                     f"({ratio}) | {s['seconds_per_step']:.2f} | "
                     f"{PAPERS.get(m, 'the baseline' if m.startswith('GRPO') else '-')} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    (out / "summary.json").write_text(json.dumps({"steps": a.steps, "seeds": a.seeds, "model": a.model,
                                                  "methods": summary,
                                                  "wall_seconds": round(time.time() - t_start, 1),
                                                  "training_runs_seconds": round(run_seconds, 1)}, indent=2))
    print(table)
    print(f"\nwrote {out}/score_vs_flops.png, score_vs_steps.png, table.md, summary.json "
          f"({time.time() - t_start:.0f} s now; the training runs took {run_seconds:.0f} s)")


if __name__ == "__main__":
    main()
