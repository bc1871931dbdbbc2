"""Data parallelism: one process per GPU under `torchrun`, an FSDP2-sharded trainer and a vLLM engine per rank.

`python grpo.py ...` on a CPU is one process and nothing here communicates. `torchrun --nproc_per_node 8
grpo.py ...` (or `--nnodes N ...`) runs one process per GPU, each with its own in-process vLLM engine -- the
layout TRL calls "colocate" (what was verified on CPU, and the init order that works: docs/scaling.md). The algorithm is
written once, for the whole batch, and reads the same at any world size because:

- **Every rank holds all of the algorithm's state, identical everywhere.** Each rank samples and scores its
  share of a step's requests (every WORLD-th, `shared_map`), with seeds from each request's *global* index, and
  receives everyone's results; buffers, readiness tables, caches and packs then evolve alike on every rank.
- **Each rank trains its share of the rows** (`mine`), with loss denominators counted over the global batch,
  and FSDP2 *sums* gradients over ranks, so an update equals the one-process update. Ranks run as many
  micro-batches as each other (`even`, `idle_pass`): FSDP's collectives must match.
- **Rank 0 writes** logs and the HF-format policy; optimizer states are saved sharded
  (`torch.distributed.checkpoint`), so a run resumes at any world size.

On a GPU every run is sharded, a single GPU too (a one-process group): FSDP2 keeps fp32 master weights and
optimizer states, computes in bf16 and reduces gradients in fp32. On a CPU under torchrun, fp32 throughout.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import pickle
import random
import shutil
import socket
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

RANK, WORLD = 0, 1  # this process's rank and the number of processes (set by `init`)
_on = False  # a process group is up and the trainer is sharded
_cpu_group = None  # gloo group for Python objects and scalars (off the GPU even when training uses NCCL)


def init(timeout_s: float = 86_400.0) -> tuple[int, int, torch.device]:
    """Rank, world size and device of this process; starts the process group when there is one to start.

    Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR... in the environment): NCCL on GPUs, gloo on CPUs. A plain
    `python` run on a GPU gets a one-process group, so that the GPU path is always FSDP2 in bf16; on a CPU it
    stays a plain process. Call it before building the engine (vLLM joins the existing world).
    `timeout_s` is how long a rank waits for the others at a collective before the run fails: `shared_map` waits
    through a step's generation and judge grading, hours apart between ranks at 50,000-token responses, so
    PyTorch's default of 30 minutes would kill a healthy run.
    """
    global RANK, WORLD, _on, _cpu_group
    gpu = torch.cuda.is_available()
    if "RANK" not in os.environ and not gpu:
        return 0, 1, torch.device("cpu")
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if gpu else "gloo", device_id=device if gpu else None, timeout=timeout)
    RANK, WORLD, _on = dist.get_rank(), dist.get_world_size(), True
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if gpu else dist.group.WORLD
    return RANK, WORLD, device


def shard(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The trainer on `device`: as is in a plain process; else FSDP2 -- each decoder layer, then the root.

    On GPU the parameters stay fp32 (the optimizer's master copy) and are gathered in bf16 for compute, with
    fp32 gradient reduction. Gradients are summed over ranks, not averaged: each rank's loss is already its
    share of the global minibatch's mean, so the sum is the one-process gradient.
    """
    if not _on:
        return model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (WORLD,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, final norm, LM head (moves shards to device)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


def load_model(path, device: torch.device, gradient_checkpointing: bool = False):
    """The fp32 trainer from `path`, sharded (`shard`), with gradient checkpointing if asked. Under a process group
    of more than one rank only rank 0 reads the weights into host memory; every other rank builds the model on the
    meta device and receives its shard from rank 0 -- so a node holds one full fp32 copy at start-up, not one per
    rank (8 x 16 GB for Qwen3-4B on a node of 8)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def checkpointing(model):
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        return model

    if not _on or WORLD == 1:
        return shard(checkpointing(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)), device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if RANK == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    model = shard(checkpointing(model), device)
    model.to_empty(device=device)
    weights = full_model.state_dict() if RANK == 0 else {}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # buffers (the rotary frequencies) are not in the state dict: rank 0's, broadcast like the weights
    source = dict(full_model.named_buffers()) if RANK == 0 else {}
    for name, buffer in model.named_buffers():
        if RANK == 0:
            buffer.copy_(source[name])
        staged = buffer.detach().cpu() if buffer.device.type == "cuda" else buffer
        dist.broadcast(staged, src=0, group=_cpu_group)
        buffer.copy_(staged)
    del full_model, weights, source
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a sharded one (an all-gather: every rank must call it), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (no communication), or `t` itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reshard(model: torch.nn.Module) -> None:
    """Back to shards. FSDP2 keeps the root's parameters (embeddings, LM head) gathered after a forward pass, for
    the backward it expects; after a no-grad pass (old log-probs) nothing reshards them, and `local` would see
    whole tensors where the next update leaves shards."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


# ----------------------------------------------------------------------------------------------------
# Sharing the work of a step
# ----------------------------------------------------------------------------------------------------
def shared_map(fn, items: list) -> list:
    """`fn` over this rank's share of `items` (every WORLD-th, from RANK), everyone's results gathered back in
    order: every rank calls it with the same items and gets the results for all of them."""
    if WORLD == 1:
        return fn(items)
    parts: list = [None] * WORLD
    dist.all_gather_object(parts, fn(items[RANK::WORLD]), group=_cpu_group)
    out: list = [None] * len(items)
    for r, part in enumerate(parts):
        out[r::WORLD] = part
    return out


def mine(indices) -> list[int]:
    """The rows this rank trains: row i belongs to rank i % WORLD, whatever subset a minibatch holds."""
    return [i for i in indices if i % WORLD == RANK]


def even(micro_batches: list[list[int]]) -> list[list[int]]:
    """This rank's micro-batches, padded with empty ones to the largest count of any rank (run `idle_pass` for
    those): FSDP gathers and reduces at every forward and backward, and a rank that skips one hangs the others."""
    if WORLD == 1:
        return micro_batches
    n = torch.tensor([len(micro_batches)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=_cpu_group)
    return micro_batches + [[] for _ in range(int(n) - len(micro_batches))]


def idle_pass(model: torch.nn.Module) -> None:
    """A forward on one token (and, with gradients on, a backward of zero): it changes nothing but keeps this
    rank's FSDP collectives in step with ranks that still have rows."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=local(next(model.parameters())).device)
    logits = model(input_ids=ids, logits_to_keep=1).logits
    if torch.is_grad_enabled():
        (logits.sum() * 0.0).backward()


def sum_all(x: float) -> float:
    """x summed over ranks (every rank must call it)."""
    if WORLD == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, group=_cpu_group)
    return float(t)


def max_all(x: float) -> float:
    """The largest x of any rank (every rank must call it)."""
    if WORLD == 1:
        return float(x)
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group)
    return float(t)


def mean_all(values: torch.Tensor, default: float = 0.0) -> float:
    """The mean of every rank's `values` together (not a mean of means); `default` when there are none."""
    total, count = sum_all(float(values.double().sum()) if len(values) else 0.0), sum_all(len(values))
    return total / count if count else default


def from_rank0(obj):
    """Rank 0's value of `obj` on every rank (e.g. a run name made from the clock)."""
    if WORLD == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group)
    return box[0]


def barrier() -> None:
    if WORLD > 1:
        dist.barrier(group=_cpu_group)


def offload_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move an optimizer's state (AdamW: two fp32 tensors per parameter) to `device`, e.g. to the CPU while it
    is idle and back for its step. Nothing to do on a CPU machine. The copies to the CPU are non-blocking, so
    PyTorch puts them in pinned (page-locked) host memory: 8 bytes per parameter / ranks per offloaded optimizer,
    which the host's memory must hold beside everything else (the plan counts it: common/plan.py, `host_plan`)."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.device != torch.device(device) and k != "step":
                state[k] = v.to(device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def optimizer_step(optimizer: torch.optim.Optimizer, device: torch.device, offload: bool) -> None:
    """`optimizer.step()`; with `offload`, the state comes to `device` for the step and goes back to CPU memory."""
    if offload:
        offload_state(optimizer, device)
    optimizer.step()
    if offload:
        offload_state(optimizer, "cpu")


def device_used_gib() -> float:
    """What the GPU has in use, every process and allocator included (total - free), GiB."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


class Peaks:
    """Peak memory of each phase of a step, GiB, for the `memory/<phase>` logs (common/plan.py predicts them,
    benchmarks/gpu_check.sh records them); `memory/<phase>_growth` is the peak less what was in use when the phase
    began. `start()` before a phase, `end(name)` after it.

    On GPU the figure is device-level -- what the GPU has in use, as the plan counts it -- not the CUDA allocator's
    peak: a sleeping vLLM unmaps its weights and KV cache but its tensors stay allocated in its pool, so the
    allocator would count ~50 GiB that the GPU does not hold while the trainer works. The peak is what was in use
    at the start, plus what the allocator took from the GPU during the phase (its reserved memory's growth: the
    sleeping tensors cancel out, and freed blocks it reuses from its cache are already in the start's figure, so
    they are not counted twice), and at least what is in use at the end (vLLM resets the allocator's peak counters
    while it starts up, so `engine_start` is a lower bound). On CPU it is the process's peak resident set (Linux)."""

    def __init__(self):
        self.peaks: dict[str, float] = {}
        self.at_start = self.reserved_at_start = 0.0

    def start(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.reserved_at_start = torch.cuda.memory_reserved() / 2**30
            self.at_start = device_used_gib()
        else:
            try:  # "5" resets the kernel's peak-RSS counter (VmHWM) of this process
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
            self.at_start = _proc_status_gib("VmRSS")

    def end(self, phase: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            grown = max(0.0, torch.cuda.max_memory_reserved() / 2**30 - self.reserved_at_start)
            peak = max(device_used_gib(), self.at_start + grown)
        else:
            peak = _proc_status_gib("VmHWM")
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), peak)
        self.peaks[f"{phase}_growth"] = max(self.peaks.get(f"{phase}_growth", 0.0), peak - self.at_start)

    def pop(self) -> dict[str, float]:
        """The phases' peaks since the last pop, the largest of any rank's (every rank must call it)."""
        out, self.peaks = {f"memory/{k}": max_all(v) for k, v in sorted(self.peaks.items())}, {}
        return out


def _proc_status_gib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM), GiB; 0 where there is none."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 2**20 for line in lines if line.startswith(field + ":")), 0.0)


# ----------------------------------------------------------------------------------------------------
# Checkpoints: written aside then renamed, so a kill mid-save never spoils the last good one
# ----------------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizers: dict, state: dict, keep: int) -> Path:
    """Everything a run needs to continue, as `run_dir/step_<step>` (every rank must call it).

    policy/: the weights in HF format, gathered and written by rank 0; trainer_state.pt: the step and `state`
    (the algorithm's, identical on every rank), by rank 0; optimizer/: each optimizer's state through
    torch.distributed.checkpoint, every rank its shard (loadable at any world size); rng_<rank>.pt: each rank's
    random states. Under torchrun across nodes `run_dir` must be on a filesystem every node sees.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    final, tmp = run_dir / f"step_{step}", run_dir / f".step_{step}.tmp"
    # an optimizer that has not stepped yet has no state to save (asking torch for its state dict would create
    # one with a step taken, and change the run: AdamW's bias correction counts steps)
    stepped = [name for name, opt in optimizers.items() if opt.state]
    if RANK == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if _on else None  # a collective; rank 0 receives the full weights on CPU
    if weights is not None and getattr(model.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # the embedding's tie: a plain process's save has it once, and so here
    if RANK == 0:
        model.save_pretrained(tmp / "policy", state_dict=weights)
        tokenizer.save_pretrained(tmp / "policy")
        torch.save({"step": step, "world_size": WORLD, "optimizers_saved": stepped, **state}, tmp / "trainer_state.pt")
    with warnings.catch_warnings():  # one process: DCP says it saves without a process group, as it should
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save({name: get_optimizer_state_dict(model, opt) for name, opt in optimizers.items() if name in stepped},
                 checkpoint_id=tmp / "optimizer", process_group=_cpu_group, no_dist=not _on)
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng_{RANK}.pt")
    # every rank's fingerprint of the state it holds: they must all agree (tests/test_distributed.py checks)
    (tmp / f"state_{RANK}.sha256").write_text(hashlib.sha256(pickle.dumps(state)).hexdigest())
    barrier()
    if RANK == 0:
        if final.exists():  # re-saving a step after a resume: swap, never leave no checkpoint behind
            os.replace(final, run_dir / f".step_{step}.old")
        os.replace(tmp, final)
        shutil.rmtree(run_dir / f".step_{step}.old", ignore_errors=True)
        for old in sorted(run_dir.glob("step_*"), key=lambda p: int(p.name[5:]))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        print(f"saved {final}", flush=True)
    barrier()
    return final


def find_checkpoint(path: str) -> Path:
    """A step_<N> folder, or a run folder's latest complete one."""
    p = Path(path)
    if (p / "trainer_state.pt").exists():
        return p
    steps = sorted((d for d in p.glob("step_*") if (d / "trainer_state.pt").exists()), key=lambda d: int(d.name[5:]))
    if not steps:
        raise SystemExit(f"--resume {path!r}: no checkpoint there (expected trainer_state.pt or step_<N> folders).")
    return steps[-1]


def read_state(folder: Path) -> dict:
    """A checkpoint's trainer_state.pt (the step and the algorithm's state), on the CPU."""
    return torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=False)


def load_checkpoint(folder: Path, model, optimizers: dict, offload: tuple[str, ...] = ()) -> None:
    """Restore the optimizers' states (resharded to this world size; each lands where its parameters are, then
    those named in `offload` move to CPU memory) and this rank's random states (rank 0's when the checkpoint had
    fewer ranks). One optimizer at a time, so that only one state is ever on the GPU. The weights are loaded by
    the caller, from folder/policy, before sharding."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    for name in read_state(folder)["optimizers_saved"]:  # those that had stepped when it was saved
        state = {name: get_optimizer_state_dict(model, optimizers[name])}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.load(state, checkpoint_id=folder / "optimizer", process_group=_cpu_group, no_dist=not _on)
        set_optimizer_state_dict(model, optimizers[name], state[name])
        if name in offload:
            offload_state(optimizers[name], "cpu")
    rng_file = folder / f"rng_{RANK}.pt"
    rng = torch.load(rng_file if rng_file.exists() else folder / "rng_0.pt", map_location="cpu", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
