#!/usr/bin/env bash
# The GPU check: one prepared script for the first machine with a GPU (after `bash install.sh gpu`).
#
#   bash benchmarks/gpu_check.sh                      # one GPU; ~10 minutes on an H200 (an estimate: never run yet)
#   GPU_CHECK_SMALL=1 bash benchmarks/gpu_check.sh    # its CPU twin, the same steps at a small shape (a test runs it)
#
# 1. the engine and log-prob tests (bf16 on GPU, with the suite's bf16 tolerances);
# 2. each script on the tiny task, 1 step;
# 3. grpo.py (1 step) and ac2.py (2 steps: the second trains the critic) on a random-weight Qwen3-4B at the
#    paper's lengths (50,000-token responses: random weights never stop, so every row is as long as allowed);
# then gathers each phase's peak memory (the scripts' memory/* logs: torch.cuda.max_memory_allocated), the step,
# generation, training and sync times, and benchmarks/memory_plan.py's prediction for the same flags, into
# benchmarks/results/gpu_check.json (GPU_CHECK_OUT). GPU_CHECK_TOKENS shortens the paper-length rows if the
# machine's time is short (generation dominates: ~100k tokens per step at 50,000).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH=$ROOT
SMALL=${GPU_CHECK_SMALL:-0}
OUT=${GPU_CHECK_OUT:-$ROOT/benchmarks/results/gpu_check.json}
WORK=$(mktemp -d)
if [ "$SMALL" = 1 ]; then
  CONFIG=$ROOT/benchmarks/configs/small-test.json; TOKENS=${GPU_CHECK_TOKENS:-48}
  TESTS=(tests/test_engine.py::test_sync_weights_makes_vllm_logprobs_equal_the_trainers_twice_in_a_row)
else
  CONFIG=$ROOT/benchmarks/configs/qwen3-4b.json; TOKENS=${GPU_CHECK_TOKENS:-50000}
  TESTS=(tests/test_engine.py "tests/test_grpo_unit.py::test_chunked_logprobs_equal_the_naive_full_logits_values_and_gradients")
fi
SECONDS=0
echo "== 1. engine and log-prob tests"
python -m pytest -q -p no:cacheprovider "${TESTS[@]}"
echo "== 2. each script on the tiny task ($SECONDS s so far)"
cd "$WORK"
python "$ROOT/grpo.py" --tiny --num-steps 1 --problems-per-step 8 --eval-every 0 --run-name tiny-grpo
python "$ROOT/ac2.py" --tiny --num-steps 1 --n-batch 8 --n-refill 8 --eval-every 0 --run-name tiny-ac2
python "$ROOT/rpo.py" --tiny --train-limit 16 --problems-per-step 8 --num-steps 1 --eval-every 0 --run-name tiny-rpo
python "$ROOT/ccr.py" --tiny --subset-size 24 --packs-per-step 8 --num-steps 1 --eval-every 0 --run-name tiny-ccr
echo "== 3. paper lengths on a random-weight $(basename "$CONFIG" .json) ($SECONDS s so far)"
GRPO_FLAGS=(--dataset tiny --reward verifier --problems-per-step 1 --group-size 2 --max-response-tokens "$TOKENS")
AC2_FLAGS=(--dataset tiny --n-refill 1 --n-batch 1 --group-size 2 --min-valid 2 --budget "$TOKENS"
           --chunk-tokens $((TOKENS / 5)) --cut-grid $((TOKENS / 5)))
python "$ROOT/grpo.py" --model "random:$CONFIG" "${GRPO_FLAGS[@]}" --num-steps 1 --eval-every 0 --run-name paper-grpo
python "$ROOT/ac2.py" --model "random:$CONFIG" "${AC2_FLAGS[@]}" --num-steps 2 --eval-every 0 --run-name paper-ac2
echo "== report ($SECONDS s so far)"
python "$ROOT/benchmarks/gpu_check_report.py" --runs "$WORK/runs" --out "$OUT" --config "$CONFIG" \
  --seconds "$SECONDS" --grpo-flags "${GRPO_FLAGS[*]}" --ac2-flags "${AC2_FLAGS[*]}"
rm -rf "$WORK"
