"""The GPU check's trainer stage: everything of a training step that runs without vLLM, on one GPU, through the
scripts' own functions -- for the GPU machines this project can be lent, which have no vLLM (docs/scaling.md).

    python benchmarks/gpu_trainer_check.py                    # one GPU: a random-weight Qwen3-4B, rows of 16k and 50k
    python benchmarks/gpu_trainer_check.py --small --without-vllm   # its CPU twin (tests/test_gpu_check.py)

One rank under FSDP2 (common/parallel.py: bf16 mixed precision, fp32 master weights, fused AdamW), gradient
checkpointing, and a random-weight model of the config built on the device itself (never on the CPU, never
saved). For each row length, two rows of it:

- the old log-probabilities (`grpo.old_logprobs`), one actor update (`grpo.ppo_update` around grpo's own
  `micro_batch_loss`: the dual-clip PPO loss) and one AC2 critic step (`ac2.critic_step`, its AdamW state kept in
  CPU memory but for the step), each timed, with its peak memory at device level (`parallel.Peaks`: what the GPU has
  in use, the way common/plan.py counts it) beside the plan's prediction for the same phase and flags;
- training tokens/s and MFU: (6 + 2 for the recomputed forward) x parameters x tokens plus attention, against the
  data sheet's 989 TFLOP/s and the ~790 measured on these machines (prime-rl's trainer, the anchor: ~3.4k tokens/s
  per GPU at 14.7% MFU, Qwen3-4B at 16k tokens on 8 x H200);
- then the chunked bf16 log-probabilities of a 2k-token row against an fp32 forward with full logits.

The JSON is written after every stage (GPU_CHECK_OUT, default benchmarks/results/gpu_trainer_check.json), so a
timeout still leaves what finished. Missing small packages (tyro...) are installed from benchmarks/wheels/ if they
are there (`bash benchmarks/gpu_wheels.sh` fetches them on a machine with a registry).
"""

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bring_wheels() -> None:
    """tyro and its small dependencies, from benchmarks/wheels/, if this Python lacks them (a bare GPU machine)."""
    try:
        import tyro  # noqa: F401
    except ImportError:
        wheels, target = ROOT / "benchmarks" / "wheels", Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-check-site"
        found = sorted(wheels.glob("*.whl"))
        if not found:
            raise SystemExit("tyro is not installed and benchmarks/wheels/ is empty: run `bash "
                             "benchmarks/gpu_wheels.sh` where a package registry is reachable, then send the tree "
                             "again") from None
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
                               "--target", str(target), *map(str, found)]).returncode == 0
        # without pip, pure-Python wheels import straight from their zip files
        sys.path[:0] = [str(target)] if done else [str(w) for w in found]


def train_flops(params: int, layers: int, q: int, tokens: int, context: float, checkpointing: bool) -> float:
    """An update's FLOPs over `tokens` attending to `context` on average: forward 2N + attention 4 L q ctx per token,
    backward twice the forward, and one more forward with gradient checkpointing."""
    forward = 2 * params * tokens + 4 * layers * q * context * tokens
    return forward * (4 if checkpointing else 3)


def allocator_peaks(parallel):
    """parallel.Peaks that also keeps, per phase, the CUDA allocator's own peaks: what tensors held (allocated) and
    what the allocator had taken from the GPU (reserved). The device-level peak less `reserved` is what lies outside
    the allocator (CUDA context, NCCL); `reserved` less `allocated` is its cache of freed blocks."""

    class AllocatorPeaks(parallel.Peaks):
        def __init__(self):
            super().__init__()
            self.allocator: dict[str, tuple[float, float]] = {}

        def end(self, name: str) -> None:
            super().end(name)
            import torch

            if torch.cuda.is_available():
                now = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30)
                self.allocator[name] = tuple(map(max, self.allocator.get(name, (0.0, 0.0)), now))

    return AllocatorPeaks()


def phase(peaks, planned: dict, name: str) -> dict:
    """A phase's device-level peak (GiB), on GPU the allocator's (allocated, reserved) and the plan's prediction."""
    allocated, reserved = getattr(peaks, "allocator", {}).get(name, (None, None))
    return {"memory_gib": round(peaks.peaks.get(name, 0.0), 2),
            **({"allocated_gib": round(allocated, 2), "reserved_gib": round(reserved, 2)} if allocated else {}),
            **({"plan_gib": round(sum(planned[name].values()), 2)} if name in planned else {})}


def old_logprobs_stage(model, rows, args, peaks, planned, shape) -> dict:
    import grpo

    t = time.time()
    grpo.old_logprobs(model, rows, args.temperature, args, peaks)
    seconds = time.time() - t
    flops = sum(2 * shape["params"] * len(r.ids) + 2 * shape["layers"] * shape["q"] * len(r.ids) ** 2 for r in rows)
    return {"seconds": round(seconds, 2), "tokens_per_s": round(sum(len(r.ids) for r in rows) / seconds),
            "tflop_s": round(flops / seconds / 1e12, 1), **phase(peaks, planned, "old_logprobs")}


def actor_update_stage(model, optimizer, rows, args, peaks, planned, shape, gpu: bool) -> dict:
    import torch

    import grpo

    t = time.time()
    loss = functools.partial(grpo.micro_batch_loss, clip_high=0.28, args=args)
    losses = grpo.ppo_update(model, optimizer, rows, loss, grpo.STATS, args, peaks)
    if gpu:
        torch.cuda.synchronize()
    seconds = time.time() - t
    tokens = sum(len(r.ids) for r in rows)
    flops = train_flops(shape["params"], shape["layers"], shape["q"], tokens, len(rows[0].ids) / 2, gpu)
    return {"seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds),
            "loss": losses["losses/policy_loss"], "grad_norm": losses["losses/grad_norm"],
            "stepped": not losses["losses/skipped_steps"], "tflop_s": round(flops / seconds / 1e12, 1),
            "mfu_vs_989": round(flops / seconds / 989e12, 4), "mfu_vs_790": round(flops / seconds / 790e12, 4),
            "backward": phase(peaks, planned, "backward"), "optimizer_step": phase(peaks, planned, "optimizer_step")}


def critic_stage(model, critic_opt, rows, cargs, peaks, planned) -> dict:
    import ac2
    import grpo

    length = len(rows[0].ids)
    critic_rows = [grpo.TrainRow(r.ids, length - 4, 4, weight=0.5) for r in rows]  # 4 target tokens, as a value's
    t = time.time()
    loss, displacement = ac2.critic_step(model, critic_opt, critic_rows, len(rows), 1e-7, cargs, peaks,
                                         ac2.Snapshot())
    state = next(iter(critic_opt.state.values()), {})
    return {"seconds": round(time.time() - t, 2), "loss": loss, "displacement": displacement,
            "state_between_steps_on": str(state["exp_avg"].device) if "exp_avg" in state else None,
            **phase(peaks, planned, "critic_step")}


def precision_stage(model, config, shape, device) -> dict:
    """The trainer's chunked log-probabilities (bf16 compute on GPU) against an fp32 copy with full logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import grpo
    from common import parallel

    length = 2048 if device.type == "cuda" else 128
    ids = torch.randint(5, shape["vocab"], (1, length), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad(), grpo.autocast(device):
        got, _ = grpo.sequence_logprobs(model, ids, [1], [length - 1], 1.0, 1024)
    with torch.device(device):
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.load_state_dict({n: parallel.full(p.detach()).float() for n, p in model.state_dict().items()})
    with torch.no_grad():
        logits = reference(input_ids=ids).logits.float()[0, :-1]
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    gap = (got.float() - want).abs()
    return {"tokens": length - 1, "max_abs_gap": round(float(gap.max()), 4),
            "mean_abs_gap": round(float(gap.mean()), 5)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "benchmarks" / "configs" / "qwen3-4b.json"))
    ap.add_argument("--rows", type=int, nargs="*", default=[16_384, 50_000], help="row lengths, tokens")
    ap.add_argument("--small", action="store_true", help="the CPU twin: a small random model, rows of 256 and 512")
    ap.add_argument("--without-vllm", action="store_true", help="make `import vllm` fail, as on the lent GPUs")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", str(ROOT / "benchmarks" / "results" /
                                                                            "gpu_trainer_check.json")))
    a = ap.parse_args()
    if a.without_vllm:
        sys.modules["vllm"] = None  # any `import vllm` now raises ImportError
    if a.small:
        a.config, a.rows = str(ROOT / "benchmarks" / "configs" / "small-test.json"), [256, 512]
    bring_wheels()
    sys.path.insert(0, str(ROOT))
    t_start = time.time()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    import ac2
    import grpo
    from common import parallel, plan

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"torch": torch.__version__, "transformers": transformers.__version__, "config": Path(a.config).name,
              "stages": {}}

    def run(stage: str, fn) -> None:
        """Run one stage and write the JSON; a stage that fails is recorded, and the next one still runs."""
        try:
            result = fn()
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        report["stages"][stage], report["seconds"] = result, round(time.time() - t_start, 1)
        out.write_text(json.dumps(report, indent=1))
        print(f"{stage}: {json.dumps(result)[:2000]}", flush=True)

    _, world, device = parallel.init()
    gpu = device.type == "cuda"
    report["device"] = torch.cuda.get_device_name(device) if gpu else f"CPU ({platform.processor() or 'unknown'})"
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if gpu else 0.0
    shape = plan.model_shape(a.config)
    spec = {k: v for k, v in json.loads(Path(a.config).read_text()).items()
            if not k.startswith("_") and k != "architectures"}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    peaks = allocator_peaks(parallel)

    def build():
        peaks.start()
        t0 = time.time()
        with torch.device(device):  # built where it trains: a 4B model in fp32 is 16 GB, too slow to build on a CPU
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if gpu:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        built["model"] = parallel.shard(model, device)
        peaks.end("model")
        return {"params": shape["params"], "seconds": round(time.time() - t0, 1), "world": world,
                "memory_gib": round(peaks.peaks["model"], 2)}

    built = {}
    run("model", build)
    model = built["model"]
    # the actor's AdamW state exists from the first step on: make it now, so that every phase sees the steady state
    optimizer, critic_opt = grpo.adamw(model, 1e-7, 0.0, device), grpo.adamw(model, 1e-7, 0.0, device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # zero gradients and no weight decay: the weights do not move
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(0)
    for length in a.rows:
        prompt = 1024 if length > 4096 else 64
        args = grpo.Args(max_response_tokens=length - prompt, num_minibatches=1, entropy_control=False)
        cargs = ac2.Args(budget=length - prompt, critic_context_extra=0)
        planned = {**plan.memory_plan(cargs, shape, 1, gpu_gib), **plan.memory_plan(args, shape, 1, gpu_gib)} \
            if gpu else {}
        rows = [grpo.TrainRow(torch.randint(5, shape["vocab"], (length,), generator=g).tolist(), prompt,
                              length - prompt, advantage=sign) for sign in (1.0, -1.0)]
        run(f"old_logprobs_{length}", functools.partial(old_logprobs_stage, model, rows, args, peaks, planned, shape))
        run(f"actor_update_{length}", functools.partial(actor_update_stage, model, optimizer, rows, args, peaks,
                                                        planned, shape, gpu))
        run(f"critic_step_{length}", functools.partial(critic_stage, model, critic_opt, rows, cargs, peaks, planned))
        model.zero_grad(set_to_none=True)
        peaks.pop()
        peaks.allocator = {}
        if gpu:
            torch.cuda.empty_cache()
    del optimizer, critic_opt
    run("logprobs_bf16_vs_fp32", functools.partial(precision_stage, model, config, shape, device))
    print(f"wrote {out} ({report['seconds']} s)")
    sys.exit(1 if any("error" in r for r in report["stages"].values()) else 0)


if __name__ == "__main__":
    main()
