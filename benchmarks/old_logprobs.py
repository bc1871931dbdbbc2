"""What --old-logprobs engine saves: the same --tiny run with the trainer's recomputed old log-probabilities and with
the engine's, side by side in one invocation, the median over steps of each phase's seconds.

    python benchmarks/old_logprobs.py                  # ccr.py --tiny, 12 steps each way
    python benchmarks/old_logprobs.py --script ac2 --steps 12

The trainer's pass is a forward over every token of the step (time/train includes it, with the update). ccr.py and
rpo.py --no-prefix-in-loss skip it entirely; ac2.py still scores its empty-prefix rows for Eq. 9's entropy; grpo.py
needs --no-entropy-control. The two runs go one after the other on the same machine with the same seed; steps 1-2
(warm-up) are left out of the medians. Writes benchmarks/results/old_logprobs.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from tblog import read_scalars  # noqa: E402

FLAGS = {"ccr": [], "ac2": [], "rpo": ["--no-prefix-in-loss"], "grpo": ["--no-entropy-control"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--script", choices=sorted(FLAGS), default="ccr")
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    result = {"script": f"{a.script}.py --tiny {' '.join(FLAGS[a.script])}", "steps": a.steps, "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("trainer", "engine"):
            subprocess.run([sys.executable, str(ROOT / f"{a.script}.py"), "--tiny", "--num-steps", str(a.steps),
                            "--eval-every", "0", "--old-logprobs", mode, *FLAGS[a.script], "--run-name", mode],
                           cwd=tmp, check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            s = read_scalars(Path(tmp) / "runs" / mode)
            steps = [k for k in sorted(s["charts/step_time"]) if k > 2]
            result["modes"][mode] = {key: round(statistics.median(s[key][k] for k in steps), 3)
                                     for key in ("charts/step_time", "time/train", "time/generate") if key in s}
    t, e = result["modes"]["trainer"], result["modes"]["engine"]
    result["train_saved_s"] = round(t["time/train"] - e["time/train"], 3)
    result["train_saved_frac"] = round(1 - e["time/train"] / t["time/train"], 3)
    out = ROOT / "benchmarks" / "results" / "old_logprobs.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
