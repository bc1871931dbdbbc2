"""How far GRPO moves a policy, step by step: what a run logged, and how much its weights changed.

    python grpo.py --tiny --model <folder> --seed 1 --num-steps 20 --eval-every 10 --save-every 10 --run-name <name>
    python benchmarks/grpo_dynamics.py --run <name> [--run <name> ...] [--out benchmarks/results/grpo_dynamics.json]

For each run (runs/<name> and checkpoints/<name>/step_<N>, both as grpo.py writes them), over its training steps:
the held-out score at each evaluation; the mean training reward; the share of groups with mixed rewards (1 -
train/zero_std_frac: only those carry a GRPO advantage); the mean gradient norm before clipping, the sampled entropy,
the approximate KL of each update and the clipped fraction; and from the saved weights, how far they moved: the
relative change ||w_N - w_0|| / ||w_0|| of the whole model and of each kind of matrix, beside the RMS of the starting
weights (AdamW's step is about the learning rate per element whatever the gradient's size, so the same steps move
small weights further in relative terms than large ones). The starting weights are the run's --model folder (read
from the run's logged hyperparameters). Written for docs/ac2.md's question of why GRPO moves some policies of the
tiny task five times as far as others that start at the same score.
"""

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tblog import read_scalars  # benchmarks/ is on sys.path when these run as scripts

from common.tiny import resolve_model

LOGGED = {"reward": "train/reward_mean", "mixed_groups": "train/zero_std_frac", "grad_norm": "losses/grad_norm",
          "entropy": "losses/entropy", "approx_kl": "losses/approx_kl", "clipfrac": "losses/clipfrac"}
KINDS = ("embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "norm")


def logged_model(run_dir: Path) -> str:
    """The --model a run started from, out of the hyperparameters table grpo.py logs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    table = acc.Tensors("hyperparameters/text_summary")[0].tensor_proto.string_val[0].decode()
    return resolve_model(re.search(r"\|model\|'([^']*)'\|", table).group(1))  # `tiny` under --tiny


def sig(x) -> float:
    """Four significant digits (KL per update is ~1e-5, weight RMS ~0.05: a fixed number of decimals fits neither)."""
    return float(f"{float(x):.4g}")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}


def kind(name: str) -> str:
    return next(k for k in KINDS if k in name) if any(k in name for k in KINDS) else "other"


def movement(start: dict[str, torch.Tensor], end: dict[str, torch.Tensor]) -> dict:
    """Relative change of all weights and of each kind of matrix, and the starting RMS of each kind."""
    out = {}
    for k in ("all",) + KINDS:
        names = [n for n in start if k == "all" or kind(n) == k]
        if not names:
            continue
        w0 = torch.cat([start[n].flatten() for n in names])
        dw = torch.cat([(end[n] - start[n]).flatten() for n in names])
        out[k] = {"rel_change": sig(dw.norm() / w0.norm()), "rms_start": sig(w0.pow(2).mean().sqrt()),
                  "rms_change": sig(dw.pow(2).mean().sqrt())}
    return out


def summarize(name: str, runs: Path, checkpoints: Path) -> dict:
    s = read_scalars(runs / name)
    steps = sorted(s[LOGGED["reward"]])
    evals = {str(k): round(v, 3) for k, v in sorted(s["eval/mean_score"].items())}
    row = {"run": name, "steps": len(steps), "eval": evals}
    for key, tag in LOGGED.items():
        values = np.array([s[tag][t] for t in steps])
        row[key] = sig(np.mean(1 - values if key == "mixed_groups" else values))
    model = logged_model(runs / name)
    row["model"] = model
    saved = sorted(checkpoints.glob(f"{name}/step_*/policy"), key=lambda p: int(p.parent.name.split("_")[1]))
    if saved:
        start = weights(Path(model))
        row["moved"] = {p.parent.name: movement(start, weights(p)) for p in saved}
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="a grpo.py --run-name (repeat for several)")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--checkpoint-dir", default="checkpoints")
    ap.add_argument("--out", default="benchmarks/results/grpo_dynamics.json")
    a = ap.parse_args()
    rows = [summarize(n, Path(a.runs_dir), Path(a.checkpoint_dir)) for n in a.run]
    print(f"{'run':<22} {'eval':<20} {'mixed':>6} {'grad':>7} {'entropy':>8} {'kl':>8} {'clip':>6} {'moved':>8} "
          f"{'rms':>6}")
    for r in rows:
        last = r.get("moved", {})
        moved = last[max(last, key=lambda k: int(k.split('_')[1]))]["all"] if last else {}
        print(f"{r['run']:<22} {'/'.join(f'{v:.3f}' for v in r['eval'].values()):<20} {r['mixed_groups']:>6.3f} "
              f"{r['grad_norm']:>7.3f} {r['entropy']:>8.4f} {r['approx_kl']:>8.2e} {r['clipfrac']:>6.4f} "
              f"{moved.get('rel_change', float('nan')):>8.5f} {moved.get('rms_start', float('nan')):>6.4f}")
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
