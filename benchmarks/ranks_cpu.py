"""One rank against two on this CPU: the same grpo.py --tiny run, plain and under `torchrun --nproc_per_node 2`.

    python benchmarks/ranks_cpu.py [--steps 10]

On 2 cores two ranks cannot be faster (each gets one thread; here the point is that they compute the same
thing, which tests/test_distributed.py pins); this measures what the distribution costs: seconds per step by
phase, from the runs' TensorBoard logs, steps 2.. (step 1 includes warm-up), and the held-out score both reach.
Writes benchmarks/results/ranks_cpu.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from tblog import read_scalars  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    args = ["--tiny", "--num-steps", str(a.steps), "--eval-every", str(a.steps), "--save-every", "0"]
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in (1, 2):
            cmd = [sys.executable, str(ROOT / "grpo.py")] if ranks == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                str(ROOT / "grpo.py")]
            env = dict(os.environ, PYTHONPATH=str(ROOT), **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {}))
            t0 = time.time()
            subprocess.run([*cmd, *args, "--run-name", f"r{ranks}"], cwd=tmp, env=env, check=True, capture_output=True)
            wall = time.time() - t0
            s = read_scalars(Path(tmp) / "runs" / f"r{ranks}")
            later = range(2, a.steps + 1)
            mean = {key: round(sum(s[key][k] for k in later) / len(later), 2)
                    for key in ("charts/step_time", "time/generate", "time/train", "time/sync")}
            result[f"{ranks} rank{'s' if ranks > 1 else ''}"] = {
                "wall_s": round(wall, 1), "step_s": mean["charts/step_time"], "generate_s": mean["time/generate"],
                "train_s": mean["time/train"], "sync_s": mean["time/sync"],
                "eval_start": round(s["eval/mean_score"][0], 3), "eval_end": round(s["eval/mean_score"][a.steps], 3),
                "generated_tokens": s["charts/generated_tokens"][a.steps]}
            print(ranks, result[list(result)[-1]], flush=True)
    out = ROOT / "benchmarks" / "results" / "ranks_cpu.json"
    out.write_text(json.dumps({"command": f"grpo.py {' '.join(args)}", **result}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
