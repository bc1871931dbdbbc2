"""benchmarks/gpu_check.sh's CPU twin: the same stages at a small shape, so that the GPU check cannot rot before a GPU
runs it -- the trainer stage with vLLM made unimportable (as on the lent GPUs), then the engine stages: the
random-weight model path, every script's memory logs and the report, written stage by stage."""

import json
import os
import subprocess

import pytest
from conftest import ROOT

PHASES = {"engine_start", "rollout", "old_logprobs", "backward", "optimizer_step", "wake_up"}


@pytest.mark.slow  # an end-to-end run: the full suite only (the fast tier: -m 'not slow')
def test_the_gpu_check_runs_at_a_small_shape_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    # without the tiny-task stages: this suite's end-to-end runs cover them, and the test below parses their flags
    env = dict(os.environ, GPU_CHECK_SMALL="1", GPU_CHECK_TINY="0", GPU_CHECK_OUT=str(out),
               TINY_RL_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    stages = {s["stage"]: s["status"] for s in report["stages"]}
    assert list(stages) == ["trainer", "engine_tests", "paper_grpo", "paper_ac2", "no_checkpoint_written"]
    assert set(stages.values()) == {"ok"}, stages
    # the trainer stage, through the scripts' own functions, without vLLM
    trainer = report["trainer"]["stages"]
    for length in (256, 512):
        assert trainer[f"old_logprobs_{length}"]["tokens_per_s"] > 0
        assert trainer[f"actor_update_{length}"]["stepped"] and trainer[f"actor_update_{length}"]["grad_norm"] > 0
        assert trainer[f"critic_step_{length}"]["state_between_steps_on"] == "cpu"  # offloaded but for its step
        assert 0 < trainer[f"critic_step_{length}"]["displacement"] < float("inf")
    assert trainer["logprobs_bf16_vs_fp32"]["max_abs_gap"] < 1e-4  # fp32 on both sides on a CPU
    runs = report["runs"]
    assert set(runs) == {"paper-grpo", "paper-ac2"}
    for name, run in runs.items():
        assert PHASES <= set(run["memory_gib"]), (name, run["memory_gib"])
        assert all(v > 0 for k, v in run["memory_gib"].items() if not k.endswith("_growth")), name
        assert len(run["step_time_s"]) == (2 if name == "paper-ac2" else 1), name
        assert all(0 <= v < 1e-3 for v in run["sampling/mismatch_kl"]), name  # the engine follows the trainer
    assert "critic_step" in runs["paper-ac2"]["memory_gib"]  # step 2 trains the critic
    assert report["config"] == "small-test.json" and report["seconds"] > 0
    # a random-weight model was built from the config and used: its vocabulary, not the tiny model's
    built = next((tmp_path / "cache").glob("random-qwen3-*"))
    assert json.loads((built / "config.json").read_text())["vocab_size"] == 512


def test_the_gpu_checks_tiny_task_stages_name_only_flags_their_scripts_take():
    """Stage 2 (each script on the tiny task) is skipped by the CPU twin above; its command lines must still parse,
    or a renamed flag would first show on a GPU."""
    import importlib
    import re
    import shlex

    import tyro

    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text().replace("\\\n", " ")
    commands = re.findall(r'stage tiny_\w+ python "\$ROOT/(\w+)\.py" (.*)', text)
    assert sorted(s for s, _ in commands) == ["ac2", "ccr", "grpo", "rpo"]
    for script, flags in commands:
        mod = importlib.import_module(script)
        args = tyro.cli(mod.Args, args=shlex.split(flags), default=mod.tiny_args())
        assert args.num_steps == 1 and args.dataset == "tiny" and args.eval_every == 0, script
