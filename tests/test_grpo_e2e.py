"""grpo.py end to end on the tiny task with the real vLLM engine, and resume equivalence after a kill."""

import math
from pathlib import Path

import pytest
import torch
from conftest import (
    CPU_ONLY,
    MISMATCH_KL,
    MISMATCH_MAX,
    assert_rollout_weights_are_one,
    read_scalars,
    run_straight_and_resumed,
    straight_run,
)
from safetensors.torch import load_file

# with one rollout-correction mode on (each script's run has another): its weights are 1 on a CPU
SMALL = ["--tiny", "--num-steps", "4", "--problems-per-step", "8", "--group-size", "4", "--eval-every", "2",
         "--eval-limit", "16", "--save-every", "2", "--log-completions-every", "2",
         "--rollout-correction", "token-truncate"]
SHARED_KEYS = ["charts/decoding_flops", "charts/generated_tokens", "charts/step_time", "train/reward_mean",
               "losses/policy_loss", "losses/clipfrac", "losses/approx_kl", "losses/entropy",
               "sampling/mismatch_kl", "time/generate", "time/score", "time/train", "time/sync"]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The SMALL run, straight through: the end-to-end checks below and the resume test's uninterrupted run."""
    return straight_run("grpo.py", SMALL, tmp_path_factory.mktemp("grpo_small"))


def test_grpo_tiny_run_logs_every_metric_and_changes_the_weights(small_run, tiny_model):
    s = read_scalars(small_run / "runs" / "straight")
    for key in SHARED_KEYS + ["train/zero_std_frac", "train/truncated_frac", "losses/clipfrac_dual",
                              "losses/eps_high", "sampling/mismatch_max", "train/response_len_mean"]:
        assert sorted(s[key]) == [1, 2, 3, 4], key
        assert all(math.isfinite(v) for v in s[key].values()), key
    assert sorted(s["eval/mean_score"]) == [0, 2, 4]
    assert 0.1 < s["eval/mean_score"][0] < 0.9  # the warm start is competent but error-prone
    tokens, flops = s["charts/generated_tokens"], s["charts/decoding_flops"]
    assert all(tokens[i + 1] > tokens[i] and flops[i + 1] > flops[i] for i in (1, 2, 3))
    # 32 responses per step of ~15-65 tokens each
    assert 32 * 10 < tokens[1] < 32 * 150
    # the engine samples from exactly the trainer's weights, step after step
    assert max(s["sampling/mismatch_kl"].values()) < MISMATCH_KL
    assert max(s["sampling/mismatch_max"].values()) < MISMATCH_MAX
    assert_rollout_weights_are_one(s, "token-truncate", (1, 2, 3, 4))
    assert abs(s["losses/eps_high"][1] - (0.28 + 0.08)) < 1e-6 # k0 = 0.06, tiny entropy is below H* = 0.28: +0.02
    assert 0 < s["train/response_len_mean"][1] < 150
    before, after = weights(Path(tiny_model)), weights(small_run / "checkpoints/straight/step_4/policy")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), "every parameter tensor should have moved"


@pytest.mark.slow
@CPU_ONLY
def test_resume_after_kill_matches_the_uninterrupted_run(tmp_path, small_run):
    # the same run, killed (SIGKILL) once its step-2 checkpoint exists, then resumed from it
    (_, sa), (_, sb) = run_straight_and_resumed("grpo.py", SMALL, 2, 4, tmp_path, straight=small_run)
    for key in ["train/reward_mean", "losses/policy_loss", "losses/entropy", "losses/eps_high",
                "charts/decoding_flops", "charts/generated_tokens", "train/response_len_mean"]:
        assert sorted(sb[key]) == [3, 4], key
        for step in (3, 4):
            assert sb[key][step] == sa[key][step], (key, step)
    assert sb["eval/mean_score"][4] == sa["eval/mean_score"][4]
