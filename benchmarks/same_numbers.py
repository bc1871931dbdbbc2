"""A refactor changes no number: run each script's `--tiny` configurations on an earlier commit and on this tree,
and compare every logged TensorBoard scalar (every key, every step) but wall-clock times and memory.

    python benchmarks/same_numbers.py --base HEAD~1                 # every configuration below, both trees
    python benchmarks/same_numbers.py --base 913711c --only grpo_eval ac2_ready
    python benchmarks/same_numbers.py --base 913711c --rename losses/entropy=ac2/entropy_empty_prefix

The base commit is checked out once into a git worktree beside the repository's checkout (under
$TMPDIR/same_numbers/<commit>) and its runs are cached there, so that re-checking after an edit runs only this
tree. TensorBoard stores scalars as float32: "the same" means equal float32 values (NaN equals NaN). A key that
only one side logs is listed, not a failure (new keys may be added); `--rename old=new` compares a renamed key.
Run both sides on one machine: floating-point kernels differ between CPUs. Writes
benchmarks/results/same_numbers.json. Exit status 1 when a number moved.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from tblog import read_scalars  # noqa: E402

EVAL = ["--eval-every", "2", "--eval-limit", "32", "--train-eval-problems", "32"]
# name -> (script, flags): short runs that together pass through every stage and variant of the four loops
CONFIGS = {
    "grpo_eval": ("grpo.py", ["--tiny", "--num-steps", "3", *EVAL]),
    "grpo_kl_seqmean": ("grpo.py", ["--tiny", "--num-steps", "2", "--kl-coef", "0.05", "--loss-agg",
                                    "seq-mean-token-mean", "--std-normalize", "--problems-per-step", "16",
                                    "--micro-batch-tokens", "2000", "--eval-every", "0"]),
    "ac2_eval": ("ac2.py", ["--tiny", "--num-steps", "3", *EVAL]),
    "ac2_ready": ("ac2.py", ["--tiny", "--num-steps", "16", "--tau-global", "0.5", "--tau-local", "0.5",
                             "--eval-every", "0", "--log-completions-every", "5"]),
    "ac2_group_size_one": ("ac2.py", ["--tiny", "--num-steps", "12", "--group-size-one", "--tau-global", "0.5",
                                      "--tau-local", "0.5", "--eval-every", "0", "--num-minibatches", "1"]),
    "ac2_prefix_grpo_stale": ("ac2.py", ["--tiny", "--num-steps", "3", "--prefix-grpo", "--stale-every", "2",
                                         "--eval-every", "0"]),
    "ac2_correct_global": ("ac2.py", ["--tiny", "--num-steps", "12", "--buffer-admit", "correct", "--readiness",
                                      "global", "--tau-global", "0.5", "--eval-every", "0"]),
    "rpo_eval": ("rpo.py", ["--tiny", "--num-steps", "3", *EVAL]),
    "rpo_dapo_variants": ("rpo.py", ["--tiny", "--num-steps", "3", "--objective", "dapo", "--no-prefix-in-loss",
                                     "--cache-init", "lazy", "--length-ref", "correct", "--eval-every", "0"]),
    "rpo_fixed_loose": ("rpo.py", ["--tiny", "--num-steps", "3", "--truncation", "fixed", "--fixed-L", "24",
                                   "--continuation-budget", "loose", "--num-minibatches", "2", "--eval-every", "0"]),
    "ccr_eval": ("ccr.py", ["--tiny", "--num-steps", "3", *EVAL]),
    "ccr_variants": ("ccr.py", ["--tiny", "--num-steps", "2", "--no-std-normalize", "--num-minibatches", "2",
                                "--micro-batch-tokens", "3000", "--eval-every", "0"]),
}
IGNORED_PREFIXES = ("time/", "memory/", "charts/step_time")


def run_config(tree: Path, name: str, out: Path) -> dict:
    """Run one configuration with the scripts of `tree`, in a fresh folder; {key: {step: float32 value}}."""
    script, flags = CONFIGS[name]
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=out))
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(tree / script), *flags, "--run-name", name], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed in {tree}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(f"  {name}: {time.time() - t0:.0f} s ({tree})", flush=True)
    return {k: {str(s): v for s, v in steps.items()} for k, steps in read_scalars(work / "runs" / name).items()}


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def compare(base: dict, new: dict, renames: dict[str, str]) -> dict:
    """Keys compared, keys that moved (with the first differing step), keys only one side has."""
    new = dict(new)
    for old, renamed in renames.items():
        if renamed in new and old in base and renamed not in base:
            new[old] = new.pop(renamed)
    keys = [k for k in base if not k.startswith(IGNORED_PREFIXES)]
    moved = {}
    for k in keys:
        if k not in new:
            continue
        diff = [s for s in base[k] if s not in new[k] or not same(base[k][s], new[k][s])]
        diff += [s for s in new[k] if s not in base[k]]
        if diff:
            s = sorted(diff, key=int)[0]
            moved[k] = {"step": s, "base": base[k].get(s), "new": new[k].get(s)}
    return {"compared": sum(k in new for k in keys), "moved": moved,
            "only_base": sorted(k for k in keys if k not in new),
            "only_new": sorted(k for k in new if k not in base and not k.startswith(IGNORED_PREFIXES))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. the one before a refactor)")
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="these configurations only")
    ap.add_argument("--rename", nargs="*", default=[], help="old=new: a key renamed on purpose")
    ap.add_argument("--fresh", action="store_true", help="rerun the base commit's configurations too")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    home = Path(os.environ.get("TMPDIR", "/tmp")) / "same_numbers"
    base_tree = home / commit
    if not base_tree.exists():
        home.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
    renames = dict(r.split("=", 1) for r in a.rename)
    report, failed = {"base": commit, "configs": {}}, False
    for name in a.only or list(CONFIGS):
        cached = home / f"{commit}-{name}.json"
        if a.fresh or not cached.exists():
            cached.write_text(json.dumps(run_config(base_tree, name, home)))
        base = json.loads(cached.read_text())
        result = compare(base, run_config(ROOT, name, home), renames)
        report["configs"][name] = result
        failed |= bool(result["moved"])
        verdict = "same" if not result["moved"] else f"MOVED: {sorted(result['moved'])}"
        print(f"{name}: {result['compared']} keys compared, {verdict}; only in base: {result['only_base']}; "
              f"new: {result['only_new']}", flush=True)
    out = ROOT / "benchmarks" / "results" / "same_numbers.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
