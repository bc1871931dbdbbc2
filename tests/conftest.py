"""Shared fixtures. Everything runs offline on a CPU with the built-in tiny model (built once, cached)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on these machines: fail fast instead of retrying
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model():
    from common.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def engine_and_model(tiny_model):
    """One in-process vLLM engine + a trainer copy of the tiny model, shared by the engine tests."""
    import torch
    from transformers import AutoModelForCausalLM

    from common import engine

    llm = engine.create_engine(tiny_model, max_model_len=1024, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return llm, model


GPU = torch.cuda.is_available()
# vLLM's sampling log-probabilities against the trainer's on the same tokens: equal to fp32 rounding on CPU; on
# GPU the engine computes in bf16 while the test trainers are fp32
# (the GPU values are allowances for bf16 rounding, not yet checked on a GPU: benchmarks/gpu_check.sh runs them)
LOGPROB_GAP = 0.25 if GPU else 1e-4  # largest gap over one short completion
MISMATCH_KL = 1e-2 if GPU else 1e-4  # k3 KL over a step's tokens
MISMATCH_MAX = 1.0 if GPU else 1e-3  # largest gap over a step's tokens
CPU_ONLY = pytest.mark.skipif(GPU, reason="bit-for-bit equality: GPU kernels are not bitwise "
                                                        "deterministic; the CPU suite pins it")


def command(script: str, args, ranks: int = 1, torchrun: bool | None = None) -> list[str]:
    """`python script args`, or `torchrun --nproc_per_node ranks script args` (standalone rendezvous; by default
    when ranks > 1)."""
    if not (ranks > 1 if torchrun is None else torchrun):
        return [sys.executable, str(ROOT / script), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            str(ROOT / script), *args]


def run_script(script: str, *args: str, cwd: Path, timeout: int = 900, ranks: int = 1) -> subprocess.CompletedProcess:
    """Run one of the trainers as a user would, in `cwd` (its runs/ and checkpoints/ land there); with `ranks`
    > 1 under torchrun, one thread per rank (2 cores here). A run still going after `timeout` seconds fails the test
    with every process's Python stacks at that moment (`stop_with_stacks`), so that a hang says where it hung."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1",
               **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {}))
    cmd = command(script, args, ranks)
    popen = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stacks = stop_with_stacks(popen)
        raise AssertionError(f"{script} {' '.join(args)} still running after {timeout} s; its last output:\n"
                             f"{stdout[-2000:]}\nwhere each process was:\n{stacks[-12000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """All scalars of a TensorBoard run folder: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def stop_with_stacks(popen: subprocess.Popen) -> tuple[str, str]:
    """Stop a run started in its own session (`run_script`) and return (stdout, every process's Python stacks): under
    torchrun the launcher is frozen first (else it would stop the other ranks as soon as one dies), then each rank in
    turn gets SIGABRT, on which Python's faulthandler (PYTHONFAULTHANDLER) writes its threads' stacks to stderr;
    then SIGKILL to whatever is left."""
    import signal
    import time

    import psutil

    root = psutil.Process(popen.pid)
    if "torch.distributed.run" in popen.args:
        root.suspend()
        dump = root.children()
    else:
        dump = [root]
    for p in dump:
        try:
            p.send_signal(signal.SIGABRT)
            time.sleep(1)  # its dump before the next one's, not interleaved
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    stdout, stderr = popen.communicate()
    first = stderr.find("Fatal Python error")
    stacks = stderr[first:] if first >= 0 else stderr
    return stdout, "\n".join(line for line in stacks.splitlines() if not line.startswith("Extension modules"))


def run_killed_after(script: str, args: list[str], marker: Path, cwd: Path, timeout: int = 900, ranks: int = 1) -> None:
    """Start a trainer and SIGKILL it (with its process group: every rank) as soon as `marker` exists."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT), **({"OMP_NUM_THREADS": "1"} if ranks > 1 else {}))
    proc = subprocess.Popen(command(script, args, ranks), cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + timeout
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), f"{script} never wrote {marker}"


def assert_same_weights(a_dir: Path, b_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def run_straight_and_resumed(script: str, args: list[str], kill_after: int, last: int, tmp_path: Path, ranks: int = 1,
                             straight: Path | None = None):
    """The resume contract: a run straight to step `last`, and the same run SIGKILLed once its step
    `kill_after` checkpoint exists, then resumed from it. Asserts the final weights are bit-identical and
    returns the two runs' final trainer states and logged scalars, (straight, resumed), for script-specific checks.
    `straight`: a folder where `args` already ran straight to `last` as run "straight" (`straight_run`), reused."""
    import torch

    if straight is None:
        straight = tmp_path
        run_script(script, *args, "--run-name", "straight", cwd=tmp_path, ranks=ranks)
    ckpt = tmp_path / f"checkpoints/killed/step_{kill_after}"
    run_killed_after(script, [*args, "--run-name", "killed"], ckpt / "trainer_state.pt", tmp_path, ranks=ranks)
    run_script(script, *args, "--resume", str(ckpt), "--run-name", "resumed", cwd=tmp_path, ranks=ranks)
    where = {"straight": straight, "resumed": tmp_path}
    final = {name: where[name] / f"checkpoints/{name}/step_{last}" for name in where}
    assert_same_weights(final["straight"] / "policy", final["resumed"] / "policy")
    states = [torch.load(final[n] / "trainer_state.pt", weights_only=False) for n in where]
    scalars = [read_scalars(where[n] / f"runs/{n}") for n in where]
    return (states[0], scalars[0]), (states[1], scalars[1])


def straight_run(script: str, args: list[str], cwd: Path) -> Path:
    """Run `args` straight through as run "straight" in `cwd` and return `cwd`: one run that a file's end-to-end checks
    and its resume test (`run_straight_and_resumed(..., straight=...)`) both read, instead of running it twice."""
    run_script(script, *args, "--run-name", "straight", cwd=cwd)
    return cwd


def assert_rollout_weights_are_one(s: dict, mode: str, steps) -> None:
    """A run with `--rollout-correction mode` on a CPU: fp32 on both sides, so the engine and the trainer agree to the
    suite's tolerances, every weight is within 1e-3 of 1 and nothing is truncated or masked."""
    verb = "truncated" if mode.endswith("truncate") else "masked"
    for step in steps:
        assert abs(s["rollout/is_weight_mean"][step] - 1) < 1e-3 and abs(s["rollout/is_weight_max"][step] - 1) < 1e-3
        assert s[f"rollout/is_{verb}_frac"][step] == 0.0, step


def assert_trained_on_the_engines_old_logprobs(s: dict, script: str, steps) -> None:
    """A run with `--old-logprobs engine`: it trains, and the trainer's old log-prob pass is skipped (so the
    engine-trainer gap goes unmeasured), except that AC2 still scores its empty-prefix rows for Eq. 9's entropy."""
    assert all(math.isfinite(s["losses/policy_loss"][k]) for k in steps)
    assert all(math.isnan(s["sampling/mismatch_kl"][k]) for k in steps)  # not measured: no trainer pass
    if script == "ac2.py":
        assert all(0 < s["losses/entropy"][k] < 5 for k in steps) and "memory/old_logprobs" in s
    if script in ("ccr.py", "grpo.py"):
        assert "memory/old_logprobs" not in s  # the pass was skipped entirely
