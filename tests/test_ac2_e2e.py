"""ac2.py end to end on the tiny task with the real vLLM engine: long enough for the critic to be trusted.

With the paper's thresholds (tau_global 0.20, tau_local 0.18) readiness engages on the tiny task only after
30-50 steps (`python benchmarks/ac2_tiny.py`: the gate opens at step 51 with seed 1, 124 of 128 problems are
ready by step 100; step 32 with seed 2), 4-7 minutes -- too long for the suite. So that the ready path --
routing to chunks and audits, consumed critic values, the drop in decoding FLOPs -- is exercised end to end with
the real engine here, this run loosens both thresholds to 0.5 through their flags, halves the batches (8 problems
refilled and 8 slots a step, as the resume test has them: the gate still opens at step 5, in 3.4 minutes instead of 5)
and turns a rollout-correction mode on; everything else is the --tiny preset. The resume test trains on the engine's
old log-probabilities.
"""

import math

import pytest
from conftest import (
    CPU_ONLY,
    MISMATCH_KL,
    assert_rollout_weights_are_one,
    assert_trained_on_the_engines_old_logprobs,
    read_scalars,
    run_script,
    run_straight_and_resumed,
)

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier: -m 'not slow')

STEPS = 20
LONG = ["--tiny", "--num-steps", str(STEPS), "--n-batch", "8", "--n-refill", "8", "--tau-global", "0.5",
        "--tau-local", "0.5", "--eval-every", "0",
        "--log-completions-every", "10", "--rollout-correction", "token-mask"]  # its weights are 1 on a CPU


def test_ac2_tiny_run_critic_becomes_ready_and_chunks_replace_rollouts(tmp_path):
    run_script("ac2.py", *LONG, "--run-name", "e2e", cwd=tmp_path, timeout=1500)
    s = read_scalars(tmp_path / "runs/e2e")
    for key in ["charts/decoding_flops", "charts/generated_tokens", "train/reward_mean", "losses/policy_loss",
                "losses/clipfrac", "losses/approx_kl", "losses/entropy", "sampling/mismatch_kl", "time/generate",
                "time/score", "time/train", "time/sync", "ac2/eps_high", "ac2/critic_lr", "ac2/bank_size",
                "ac2/buffer_size", "ac2/consumed_rows", "ac2/judged_rows", "ac2/tokens_refill", "ac2/tokens_full"]:
        assert sorted(s[key]) == list(range(1, STEPS + 1)), key
        assert all(math.isfinite(v) for v in s[key].values()), key
    assert max(s["sampling/mismatch_kl"].values()) < MISMATCH_KL
    assert_rollout_weights_are_one(s, "token-mask", range(1, STEPS + 1))
    # step 1 is a cold start: no replay yet, full groups of fresh problems, no critic use
    assert s["ac2/tokens_cold"][1] > 0 and s["ac2/tokens_full"][1] == 0 and s["ac2/consumed_rows"][1] == 0
    # the global gate opens, problems become ready, and ready problems are routed to chunks and audits
    assert max(s["ac2/gate_open"].values()) == 1.0
    ready = s["ac2/ready_frac"]
    first_ready = min(k for k, v in ready.items() if v > 0)
    assert ready[STEPS] > 0 and max(ready.values()) >= 0.2
    assert sum(s["ac2/consumed_rows"][k] for k in range(first_ready, STEPS + 1)) > 0
    assert sum(s["ac2/tokens_short"][k] for k in range(first_ready, STEPS + 1)) > 0
    assert sum(s["ac2/tokens_audit"][k] for k in range(first_ready, STEPS + 1)) > 0
    assert all(s["ac2/consumed_rows"][k] == 0 for k in range(1, first_ready))  # no critic values before readiness
    # decoding FLOPs per step drop once chunks replace full rollouts
    flops = s["charts/decoding_flops"]
    per_step = {k: flops[k] - flops.get(k - 1, 0.0) for k in range(2, STEPS + 1)}
    before = [v for k, v in per_step.items() if k < first_ready]
    late = [per_step[k] for k in range(STEPS - 4, STEPS + 1)]
    assert sum(late) / len(late) < sum(before) / len(before)


SMALL = ["--tiny", "--num-steps", "4", "--n-batch", "8", "--n-refill", "8", "--eval-every", "2", "--eval-limit", "16",
         "--save-every", "2", "--old-logprobs", "engine"]  # the engine's old log-probabilities, resumed alike


@CPU_ONLY
def test_ac2_resume_after_kill_matches_the_uninterrupted_run(tmp_path):
    (a, sa), (b, sb) = run_straight_and_resumed("ac2.py", SMALL, 2, 4, tmp_path)
    for key in ("buffer", "readiness", "bank", "critic_fifo", "critic_lr", "ladder_streak", "entropy_k"):
        assert a[key] == b[key], key
    assert_trained_on_the_engines_old_logprobs(sa, "ac2.py", (1, 2, 3, 4))
    for key in ["train/reward_mean", "losses/policy_loss", "ac2/critic_loss", "ac2/probe_mae", "ac2/eps_high",
                "charts/decoding_flops"]:
        for step in (3, 4):
            va, vb = sa[key][step], sb[key][step]
            assert va == vb or (math.isnan(va) and math.isnan(vb)), (key, step)


def test_ac2_stale_buffer_holds_a_whole_refresh(tmp_path):
    # the paper's stale-buffer variant: a refresh's rollouts are the whole buffer, not a FIFO of --buffer-size (24)
    run_script("ac2.py", "--tiny", "--stale-every", "5", "--num-steps", "1", "--eval-every", "0",
               "--run-name", "stale", cwd=tmp_path)
    s = read_scalars(tmp_path / "runs/stale")
    assert s["ac2/buffer_size"][1] == 160  # --stale-size on tiny: more than the 128 problems, drawn in two passes
