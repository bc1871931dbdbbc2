#!/usr/bin/env bash
# A newcomer's first minutes, timed: `git clone`, the install the README gives, then `python grpo.py --tiny` until
# its first training step line -- with an empty model cache, so nothing is reused from earlier runs.
#
#   bash benchmarks/first_run.sh [repository, default: this one]
#
# Writes benchmarks/results/first_run.json (seconds for each part) into the repository it was run from.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
SRC=${1:-$HERE}
WORK=$(mktemp -d)
export TINY_RL_CACHE=$WORK/cache
cd "$WORK"
t0=$(date +%s.%N)
git clone -q "$SRC" repo
cd repo
t1=$(date +%s.%N)
python3 -m venv .venv && . .venv/bin/activate && bash install.sh cpu > install.log 2>&1
t2=$(date +%s.%N)
python grpo.py --tiny > run.log 2>&1 &
pid=$!
until grep -q "^step 1/" run.log 2>/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "grpo.py stopped before its first step:"; tail -20 run.log; exit 1; }
  sleep 0.2
done
t3=$(date +%s.%N)
kill $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
grep "^step" run.log
python - "$t0" "$t1" "$t2" "$t3" "$HERE/benchmarks/results/first_run.json" <<'PY'
import json, sys
t0, t1, t2, t3 = map(float, sys.argv[1:5])
r = {"clone_s": round(t1 - t0, 1), "install_s": round(t2 - t1, 1), "to_first_step_s": round(t3 - t2, 1),
     "total_s": round(t3 - t0, 1)}
open(sys.argv[5], "w").write(json.dumps(r, indent=1))
print(r)
PY
rm -rf "$WORK"
