#!/usr/bin/env bash
# The GPU check: one prepared script for a machine with a GPU, in stages, each recorded as it finishes.
#
#   bash benchmarks/gpu_check.sh                      # one GPU: every stage that can run there
#   GPU_CHECK_SMALL=1 bash benchmarks/gpu_check.sh    # its CPU twin, the same stages at a small shape (a test runs it)
#   GPU_CHECK_TINY=0 ...                              # without stage 2 (the test suite's end-to-end runs cover it on a
#                                                     # CPU; the test runs the twin so, and parses stage 2's flags)
#
# 0. trainer (no vLLM needed: what the GPU machines this project is lent can run): benchmarks/gpu_trainer_check.py
#    -- a random-weight Qwen3-4B built on the GPU, FSDP2 in bf16, rows of 16k and 50k tokens through the scripts' own
#    old log-probs, actor update and AC2 critic step; device-level peak memory beside the plan, tokens/s, MFU.
#    ~3-5 minutes on an H200 by estimate.
# Then, where vLLM is installed (a user's machine after `bash install.sh gpu`; skipped otherwise):
# 1. the engine tests in bf16, the sync after a real sleep / wake-up among them;
# 2. each script on the tiny task, 1 step;
# 3. grpo.py (1 step) and ac2.py (2 steps: the second trains the critic) on a random-weight Qwen3-4B with rows of at
#    most GPU_CHECK_TOKENS (8,000) tokens -- random weights never stop, so every row is as long as allowed -- and no
#    checkpoint (at 4B one is ~48-80 GB: a 64 GiB disk would fill up).
# Every stage's outcome, the runs' memory/* logs (device-level on GPU), step / generation / training / sync times,
# sampling/mismatch_kl and the plan's prediction for the same flags go to benchmarks/results/gpu_check.json
# (GPU_CHECK_OUT), rewritten after each stage: a stage that fails is recorded and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH=$ROOT
SMALL=${GPU_CHECK_SMALL:-0}
OUT=${GPU_CHECK_OUT:-$ROOT/benchmarks/results/gpu_check.json}
WORK=$(mktemp -d)
STAGES=$WORK/stages.jsonl
if [ "$SMALL" = 1 ]; then
  CONFIG=$ROOT/benchmarks/configs/small-test.json; TOKENS=${GPU_CHECK_TOKENS:-48}; TRAINER=(--small)
  TESTS=(tests/test_engine.py::test_sync_weights_makes_vllm_logprobs_equal_the_trainers_twice_in_a_row)
else
  CONFIG=$ROOT/benchmarks/configs/qwen3-4b.json; TOKENS=${GPU_CHECK_TOKENS:-8000}; TRAINER=()
  TESTS=(tests/test_engine.py "tests/test_grpo_unit.py::test_chunked_logprobs_equal_the_naive_full_logits_values_and_gradients")
fi
SECONDS=0

stage() {  # stage NAME COMMAND...: run it, record its outcome and time, and rewrite the report
  local name=$1 start=$SECONDS status=ok
  shift
  echo "== $name ($SECONDS s so far)"
  "$@" || status="failed ($?)"
  printf '{"stage": "%s", "status": "%s", "seconds": %d}\n' "$name" "$status" $((SECONDS - start)) >> "$STAGES"
  report
}

report() {
  python "$ROOT/benchmarks/gpu_check_report.py" --runs "$WORK/runs" --stages "$STAGES" --out "$OUT" \
    --trainer "$WORK/trainer.json" --config "$CONFIG" --seconds "$SECONDS" --grpo-flags "${GRPO_FLAGS[*]}" \
    --ac2-flags "${AC2_FLAGS[*]}" > /dev/null
}

GRPO_FLAGS=(--dataset tiny --reward verifier --problems-per-step 1 --group-size 2 --max-response-tokens "$TOKENS"
            --save-every 0)
AC2_FLAGS=(--dataset tiny --n-refill 1 --n-batch 1 --group-size 2 --min-valid 2 --budget "$TOKENS"
           --chunk-tokens $((TOKENS / 5)) --cut-grid $((TOKENS / 5)) --save-every 0)
mkdir -p "$WORK/runs"
stage trainer env GPU_CHECK_OUT="$WORK/trainer.json" python "$ROOT/benchmarks/gpu_trainer_check.py" --without-vllm \
  "${TRAINER[@]}"
if python -c "import vllm" 2> /dev/null; then
  stage engine_tests python -m pytest -q -p no:cacheprovider "${TESTS[@]}"
  cd "$WORK"
  if [ "${GPU_CHECK_TINY:-1}" = 1 ]; then
    stage tiny_grpo python "$ROOT/grpo.py" --tiny --num-steps 1 --problems-per-step 8 --eval-every 0 \
      --run-name tiny-grpo
    stage tiny_ac2 python "$ROOT/ac2.py" --tiny --num-steps 1 --n-batch 8 --n-refill 8 --eval-every 0 \
      --run-name tiny-ac2
    stage tiny_rpo python "$ROOT/rpo.py" --tiny --train-limit 16 --problems-per-step 8 --num-steps 1 --eval-every 0 \
      --run-name tiny-rpo
    stage tiny_ccr python "$ROOT/ccr.py" --tiny --subset-size 24 --packs-per-step 8 --num-steps 1 --eval-every 0 \
      --run-name tiny-ccr
  fi
  stage paper_grpo python "$ROOT/grpo.py" --model "random:$CONFIG" "${GRPO_FLAGS[@]}" --num-steps 1 --eval-every 0 \
    --run-name paper-grpo
  stage paper_ac2 python "$ROOT/ac2.py" --model "random:$CONFIG" "${AC2_FLAGS[@]}" --num-steps 2 --eval-every 0 \
    --run-name paper-ac2
  stage no_checkpoint_written test ! -e "$WORK/checkpoints"
  cd "$ROOT"
else
  echo "vLLM is not installed here: the engine stages are skipped (the trainer stage above is what runs)"
  printf '{"stage": "engine stages", "status": "skipped: no vLLM", "seconds": 0}\n' >> "$STAGES"
fi
report
cat "$OUT"
! grep -q '"status": "failed' "$STAGES"  # the exit status: any stage failed (read before $WORK goes)
status=$?
rm -rf "$WORK"
exit $status
