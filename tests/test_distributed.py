"""Data parallelism (common/parallel.py) on CPU: `torchrun --nproc_per_node 2`, gloo, FSDP2 and a real vLLM engine in
every rank, against the same thing in one plain process. The algorithm must not depend on the world size."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    CPU_ONLY,
    LOGPROB_GAP,
    ROOT,
    assert_trained_on_the_engines_old_logprobs,
    command,
    read_scalars,
    run_script,
    run_straight_and_resumed,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # end-to-end runs: the full suite only (the fast tier: -m 'not slow')


def run_worker(ranks: int, out, timeout: int = 900, torchrun: bool | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1" if ranks > 1 else os.environ.get(
        "OMP_NUM_THREADS", "2"))
    proc = subprocess.run(command("tests/dist_worker.py", [str(out)], ranks, torchrun), capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def plain_worker(tmp_path_factory) -> tuple[dict, Path]:
    """dist_worker.py in one plain process: the reference both tests below compare against, run once."""
    out = tmp_path_factory.mktemp("dist") / "plain"
    return run_worker(1, out), out


def test_two_ranks_sample_what_one_samples_and_every_engine_follows_the_sharded_trainer(plain_worker, tmp_path):
    (one, one_dir), two = plain_worker, run_worker(2, tmp_path / "two")
    assert two["world"] == 2 and len(two["gap_per_rank"]) == 2
    assert two["weights_read_by"] == [[0], []] and one["weights_read_by"] == [[0]]  # one full copy per node
    # request i was sampled by rank i % 2, seeded by its global index: the same text as in one process
    assert two["completions"] == one["completions"]
    assert sum(len(c) for g in one["completions"] for c in g) > 200
    for a, b in zip([x for g in one["logprobs"] for x in g], [x for g in two["logprobs"] for x in g]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    # after one sharded step and a sync, both ranks' engines sample from exactly the trainer's new weights ...
    assert max(two["gap_per_rank"]) < LOGPROB_GAP and max(one["gap_per_rank"]) < LOGPROB_GAP
    # ... which the step really changed (before the sync the engines were stale)
    assert two["stale_gap"] > 100 * LOGPROB_GAP
    # the step itself: gradients summed over ranks equal the one-process gradient
    w1, w2 = torch.load(one_dir / "weights.pt"), torch.load(tmp_path / "two/weights.pt")
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


# micro-batches of at most 300 padded tokens: the ranks end up with different numbers of them (measured: three
# idle passes with gradients and three without on rank 0), so the padding with idle passes is exercised too
def test_one_rank_under_torchrun_shards_and_computes_what_a_plain_process_does(plain_worker, tmp_path):
    # the path every GPU run takes, a single GPU included: a process group, FSDP2 over one rank, vLLM's external
    # launcher (on GPU it also computes in bf16, which a CPU cannot check)
    (plain, plain_dir), sharded = plain_worker, run_worker(1, tmp_path / "one", torchrun=True)
    assert sharded["completions"] == plain["completions"]
    assert max(sharded["gap_per_rank"]) < LOGPROB_GAP and sharded["stale_gap"] > 100 * LOGPROB_GAP
    w1, w2 = torch.load(plain_dir / "weights.pt"), torch.load(tmp_path / "one/weights.pt")
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


GRPO = ["--tiny", "--num-steps", "2", "--problems-per-step", "8", "--group-size", "4", "--eval-every", "2",
        "--eval-limit", "16", "--save-every", "2", "--micro-batch-tokens", "300"]


def test_grpo_on_two_ranks_equals_one_rank(tmp_path):
    """With --rollout-correction on: each rank weighs its own rows, and the weights' statistics gather over ranks."""
    rc = ["--rollout-correction", "sequence-truncate"]
    run_script("grpo.py", *GRPO, *rc, "--run-name", "one", cwd=tmp_path)
    run_script("grpo.py", *GRPO, *rc, "--run-name", "two", cwd=tmp_path, ranks=2)
    s1, s2 = read_scalars(tmp_path / "runs/one"), read_scalars(tmp_path / "runs/two")
    # step 1 samples exactly the same completions (global seeds): same tokens, lengths, rewards
    for key in ["charts/generated_tokens", "charts/decoding_flops", "train/reward_mean", "train/response_len_mean",
                "train/response_len_min", "train/response_len_max", "train/zero_std_frac"]:
        assert s2[key][1] == s1[key][1], key
    assert s2["eval/mean_score"][0] == s1["eval/mean_score"][0]
    # the loss is normalised over the global minibatch, so each step's statistics match too
    for key in ["losses/policy_loss", "losses/entropy", "losses/approx_kl", "losses/grad_norm", "losses/eps_high",
                "rollout/is_weight_mean", "rollout/is_weight_max"]:
        for step in (1, 2):
            assert math.isclose(s2[key][step], s1[key][step], rel_tol=1e-4, abs_tol=1e-6), (key, step)
    a, b = (load_file(str(tmp_path / f"checkpoints/{n}/step_2/policy/model.safetensors")) for n in ("one", "two"))
    assert a.keys() == b.keys() and "lm_head.weight" not in b  # the tie is saved once, as a plain process saves it
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # fp32: only the reduction order differs


STATE_RUNS = [
    ("ac2.py", ["--tiny", "--num-steps", "3", "--n-batch", "8", "--n-refill", "8", "--tau-global", "0.5",
                "--tau-local", "0.5", "--window", "1", "--eval-every", "0"],
     ["buffer", "readiness", "bank", "critic_fifo", "critic_lr", "ladder_streak", "entropy_k", "decoding_flops"]),
    ("rpo.py", ["--tiny", "--train-limit", "32", "--problems-per-step", "16", "--epochs", "2", "--num-steps", "3",
                "--eval-every", "0", "--old-logprobs", "engine", "--no-prefix-in-loss"],
     ["cache", "cache_correct", "cache_finished", "previous_shortest", "decoding_flops", "generated_tokens"]),
    ("ccr.py", ["--tiny", "--subset-size", "48", "--packs-per-step", "8", "--epochs", "2", "--num-steps", "3",
                "--eval-every", "0", "--old-logprobs", "engine"],
     ["packs", "packs_epoch", "decoding_flops", "generated_tokens"]),
]


@pytest.mark.parametrize("script,args,keys", STATE_RUNS, ids=[s for s, _, _ in STATE_RUNS])
def test_two_ranks_hold_one_algorithm_state_and_the_one_rank_state(script, args, keys, tmp_path):
    every = ["--save-every", "1", "--keep-checkpoints", "10"]
    run_script(script, *args, *every, "--run-name", "one", cwd=tmp_path)
    run_script(script, *args, *every, "--run-name", "two", cwd=tmp_path, ranks=2)
    for step in (1, 2, 3):
        one, two = (tmp_path / f"checkpoints/{n}/step_{step}" for n in ("one", "two"))
        # both ranks hold the same state, step after step ...
        assert (two / "state_0.sha256").read_text() == (two / "state_1.sha256").read_text(), step
        # ... and it is the state one process holds
        a, b = (torch.load(d / "trainer_state.pt", weights_only=False) for d in (one, two))
        for key in keys:
            assert a[key] == b[key], (step, key)
    if script == "ac2.py":  # the critic took part: records were made and the bank filled
        assert len(b["critic_fifo"]) > 0 and len(b["buffer"]) > 0
    else:  # RPO and CCR run on the engine's old log-probabilities here
        assert_trained_on_the_engines_old_logprobs(read_scalars(tmp_path / "runs/one"), script, (1, 2, 3))


@CPU_ONLY
def test_a_two_rank_run_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    args = ["--tiny", "--num-steps", "4", "--problems-per-step", "8", "--group-size", "4", "--eval-every", "0",
            "--save-every", "2"]
    (a, sa), (b, sb) = run_straight_and_resumed("grpo.py", args, 2, 4, tmp_path, ranks=2)
    for key in ["train/reward_mean", "losses/policy_loss", "losses/entropy", "charts/generated_tokens"]:
        assert [sb[key][k] for k in (3, 4)] == [sa[key][k] for k in (3, 4)], key
    assert a["entropy_k"] == b["entropy_k"] and b["world_size"] == 2
    # the same checkpoint continues on one rank: the optimizer state is resharded, and step 3 samples what the
    # two-rank continuation sampled (same weights, same global seeds)
    run_script("grpo.py", *args, "--resume", str(tmp_path / "checkpoints/killed/step_2"), "--run-name", "on_one",
               cwd=tmp_path)
    s1 = read_scalars(tmp_path / "runs/on_one")
    for key in ["charts/generated_tokens", "train/reward_mean", "train/response_len_mean"]:
        assert s1[key][3] == sb[key][3], key


def test_a_rank_waits_as_long_as_the_collective_timeout_says(tmp_path):
    """shared_map waits through a step's generation and judge grading on the slowest rank: with a 2 s timeout a rank
    6 s late kills the run, with --collective-timeout-s long enough it is fine (PyTorch's default is 30 minutes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def launch(timeout_s: float):
        return subprocess.run(command("tests/timeout_worker.py", [str(timeout_s), "6"], 2), cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    late = launch(2)
    assert late.returncode != 0 and "gathered" not in late.stdout
    patient = launch(60)
    # on failure, enough of stderr to hold the failing rank's own error, not only torchrun's summary
    assert patient.returncode == 0 and patient.stdout.count("gathered [10, 20, 30, 40]") == 2, \
        "\n".join(line for line in patient.stderr.splitlines() if "Warning" not in line)[-8000:]


def test_a_hung_run_fails_its_test_with_every_ranks_stack(tmp_path):
    """run_script's timeout (conftest.py): rank 1 still sleeping in its share of a shared_map, rank 0 waiting at the
    gather -- the failure names both places, so that a hang in CI says where it hung."""
    with pytest.raises(AssertionError) as failed:
        run_script("tests/timeout_worker.py", "600", "300", cwd=tmp_path, timeout=20, ranks=2)
    message = str(failed.value)
    assert "still running after 20 s" in message
    assert "in slow_on_rank_1" in message and "in shared_map" in message, message[-3000:]


def test_the_engines_old_logprobs_on_two_ranks_equal_one_rank(tmp_path):
    """--old-logprobs engine under torchrun (--rollout-correction: test_grpo_on_two_ranks_equals_one_rank): the run is
    the one-process run."""
    args = [*GRPO[:-2], "--save-every", "0", "--eval-every", "0", "--old-logprobs", "engine",
            "--no-entropy-control"]  # plain micro-batches
    run_script("grpo.py", *args, "--run-name", "one", cwd=tmp_path)
    run_script("grpo.py", *args, "--run-name", "two", cwd=tmp_path, ranks=2)
    s1, s2 = read_scalars(tmp_path / "runs/one"), read_scalars(tmp_path / "runs/two")
    assert_trained_on_the_engines_old_logprobs(s1, "grpo.py", (1, 2))
    for key in ["losses/policy_loss", "losses/approx_kl"]:
        for step in (1, 2):
            assert math.isclose(s2[key][step], s1[key][step], rel_tol=1e-4, abs_tol=1e-6), (key, step)
