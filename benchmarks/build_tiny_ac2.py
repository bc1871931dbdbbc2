"""Build the tiny AC2 setting's model (`--model tiny-ac2`) from its recipe, TINY_AC2_RECIPE in common/tiny.py.

    python benchmarks/build_tiny_ac2.py --out common/tiny_ac2_model     # ~2.3 hours on 2 cores (8,462 s)
    python benchmarks/build_tiny_ac2.py --dry-run                       # print the phases' commands
    python benchmarks/build_tiny_ac2.py --continue-from common/tiny_ac2_model --out common/tiny_ac2_model
                                        # a recipe that adds phases: run only the new ones, from the built model

Runs benchmarks/critic_probe.py once per phase, each from the last phase's weights (a fresh optimizer and a fresh
training-only probe every time), with the recipe's common flags. The first phase trains the critic alone from random
weights; the later ones add solve batches beside it (docs/ac2.md, "Can the tiny critic learn to judge?", attempts
O1 and P1-P8). Each phase's log (its held-out pair scores and policy accuracy) is kept beside the model in
`build_logs/`; the model is written aside and renamed into `--out` only once every phase has finished, so a kill
loses no earlier build. Floating-point kernels differ between CPUs, so a rebuild lands near the shipped weights, not
on them: that is why the repository ships them.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.tiny import TINY_AC2_RECIPE  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="checkpoints/tiny_ac2_build", help="where the built model goes")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (changes floats only)")
    ap.add_argument("--dry-run", action="store_true", help="print the phases' commands and exit")
    ap.add_argument("--continue-from", default=None,
                    help="a build whose recipe's phases begin this recipe's: run only the phases after them")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    work = out.parent / f".{out.name}.build-{os.getpid()}"
    commands, init, done, start = [], None, 0, None
    if args.continue_from:
        init = start = Path(args.continue_from).resolve()
        earlier = json.loads((start / "tiny_build.json").read_text())["recipe"]
        done = len(earlier["phases"])
        if {**earlier, "phases": None} != {**TINY_AC2_RECIPE, "phases": None} \
                or earlier["phases"] != TINY_AC2_RECIPE["phases"][:done]:
            sys.exit(f"{init} was not built from the first phases of TINY_AC2_RECIPE: build from scratch")
    for i, phase in enumerate(TINY_AC2_RECIPE["phases"][done:], start=done):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "critic_probe.py"), *shlex.split(TINY_AC2_RECIPE["common"]),
               *shlex.split(phase)]
        steps = int(cmd[cmd.index("--steps") + 1])
        if init is not None:
            cmd += ["--init", str(init)]
        init = work / f"phase_{i + 1}"
        cmd += ["--threads", str(args.threads), "--eval-every", str(steps), "--save", "--out", str(init)]
        commands.append(cmd)
    if args.dry_run:
        print("\n".join(shlex.join(c) for c in commands))
        return
    t0 = time.time()
    (work / "build_logs").mkdir(parents=True)
    if start:  # the earlier phases' logs and time carry over
        shutil.copytree(start / "build_logs", work / "build_logs", dirs_exist_ok=True)
        t0 -= json.loads((start / "tiny_build.json").read_text())["build_seconds"]
    for i, cmd in enumerate(commands, start=done):
        log = work / "build_logs" / f"phase_{i + 1}.log"
        shown = shlex.join(cmd[1:]).replace(f"{ROOT}/", "")  # the log ships: no path of the building machine
        print(f"phase {i + 1}/{done + len(commands)}: {shown}  (log: {log})", flush=True)
        with open(log, "w") as f:
            f.write(shown + "\n")
            f.flush()
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode:
                sys.exit(f"phase {i + 1} failed; its log: {log}")
        print(f"  done at {time.time() - t0:.0f}s: {log.read_text().splitlines()[-1][:300]}", flush=True)
    final = work / "model"
    shutil.copytree(init, final, ignore=shutil.ignore_patterns("step_*", "build_logs", "tiny_build.json"))
    shutil.copytree(work / "build_logs", final / "build_logs")
    record = {"recipe": TINY_AC2_RECIPE, "build_seconds": round(time.time() - t0, 1), "threads": args.threads}
    (final / "tiny_build.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)  # a rebuild: the earlier build goes only once the new one exists
    os.replace(final, out)
    shutil.rmtree(work)
    print(f"built {out} in {record['build_seconds']}s")


if __name__ == "__main__":
    main()
