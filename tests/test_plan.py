"""The plan of a GPU step (common/plan.py): memory per phase, the start-up refusal, the engine's batch, the time a
step takes and the host's memory, pinned to hand-computed values; and the device-level memory reader, on a fake GPU."""

import dataclasses
import json
import types

import pytest
import torch
from conftest import ROOT

import ac2
import grpo
from common import parallel, plan

QWEN3_4B = ROOT / "benchmarks" / "configs" / "qwen3-4b.json"


@pytest.fixture(scope="module")
def qwen3_4b():
    return plan.model_shape(QWEN3_4B)


def test_the_model_shape_is_qwen3_4b(qwen3_4b):
    s = qwen3_4b
    assert s["params"] == 4_022_468_096  # tied embeddings counted once
    assert (s["layers"], s["hidden"], s["q"], s["kv"], s["vocab"]) == (36, 2560, 4096, 1024, 151_936)
    assert plan.kv_bytes_per_token(s) == 2 * 36 * 1024 * 2  # K and V, every layer, bf16


def test_ac2_at_table_4_is_refused_on_one_80_gb_gpu_with_the_flag_that_fits_named(qwen3_4b):
    a = ac2.Args()
    problem = plan.check_memory(a, qwen3_4b, 1, 79.6)
    assert problem is not None and "does not fit 1 x 80 GiB" in problem
    assert "`--offload-optimizer`" in problem and "2 GPUs" in problem and "--no-memory-check" in problem
    assert plan.check_memory(dataclasses.replace(a, offload_optimizer=True), qwen3_4b, 1, 79.6) is None
    assert plan.check_memory(a, qwen3_4b, 1, 139.8) is None  # an H200 holds it
    assert plan.check_memory(a, qwen3_4b, 8, 79.6) is None  # and so do 8 x 80 GB


def test_the_memory_plan_by_hand_for_the_optimizer_step(qwen3_4b):
    # fp32 weights, fp32 gradients and AdamW's two fp32 states: 16 bytes per parameter, over the ranks
    P = qwen3_4b["params"]
    for gpus in (1, 8):
        step = plan.memory_plan(grpo.Args(), qwen3_4b, gpus, 79.6)["optimizer_step"]
        assert sum(step.values()) == pytest.approx(16 * P / gpus / 2**30)


def _fake_gpu(monkeypatch, gib: float, name: str = "NVIDIA H100 80GB HBM3"):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: name)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("script", [grpo, ac2])
def test_a_run_that_does_not_fit_stops_before_any_weight_or_tokenizer_is_read(script, tmp_path, monkeypatch, capsys):
    """On CUDA the plan speaks right after the config: a folder holding only the config (no weights, no tokenizer)
    stops on the plan's sentence; with --no-memory-check the run goes on past it -- and prints the time plan --
    to the tokenizer, which is missing."""
    spec = json.loads(QWEN3_4B.read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in spec.items() if not k.startswith("_")}))
    _fake_gpu(monkeypatch, 79.6)
    args = script.Args(model=str(tmp_path))
    with pytest.raises(SystemExit, match=r"memory plan says this run does not fit 1 x 80 GiB.*--offload-optimizer"):
        script.load_policy(args, torch.device("cuda"), None)
    with pytest.raises(SystemExit, match="could not load model"):
        script.load_policy(dataclasses.replace(args, no_memory_check=True), torch.device("cuda"), None, 400)
    out = capsys.readouterr().out
    assert "time plan (an estimate" in out and "on 1 x H100" in out and "on 4 x 8" in out  # the H100 data sheet
    assert "each evaluation" in out


def test_the_engine_decodes_as_many_sequences_as_its_kv_cache_holds():
    s = {"params": 10**9, "layers": 10, "kv": 100, "q": 1000}  # 4,000 bytes of KV cache per token
    # (10 GiB - 2 GB of bf16 weights) / 4,000 B = 2,184,354 tokens; rows of 10,000 tokens: 218 at once
    assert plan.kv_cache_tokens(s, 10.0, 1.0) == pytest.approx((10 * 2**30 - 2e9) / 4000)
    assert plan.max_num_seqs(s, 10.0, 1.0, 10_000) == 218
    assert plan.max_num_seqs(s, 10.0, 1.0, 10) == 1024  # vLLM's default is the ceiling
    assert plan.max_num_seqs(s, 10.0, 0.19, 10**7) == 8  # and 8 the floor
    assert plan.expected_row_tokens(grpo.Args()) == 1024 + 25_000  # the prompt and half the 50,000-token limit
    assert plan.expected_row_tokens(ac2.Args()) == 1024 + 25_000
    assert plan.expected_row_tokens(grpo.tiny_args()) == 1024 + 100


def test_decoding_time_by_hand():
    s = {"params": 10**9, "layers": 10, "kv": 100, "q": 1000}
    gpu = plan.GPU("test", 10.0, 1e12, 1e15, 1e15)
    # 4 rows fit at once; 10 iterations, each reading the bf16 weights (2 GB) and 4 x 105 positions x 4,000 B of KV
    # cache at 1 TB/s, plus the per-iteration overhead; the FLOPs (8.02e9 per iteration at 1e15/s) are not the bound
    t = plan.decode_seconds(4, 100, 10, s, gpu, utilization=1.0, max_num_seqs=1024)
    assert t == pytest.approx(10 * ((2e9 + 4 * 105 * 4000) / 1e12 + plan.DECODE_ITERATION_S))
    # two waves when only 2 fit at a time
    assert plan.decode_seconds(4, 100, 10, s, gpu, 1.0, max_num_seqs=2) == pytest.approx(
        2 * 10 * ((2e9 + 2 * 105 * 4000) / 1e12 + plan.DECODE_ITERATION_S))


def test_a_step_of_the_papers_configurations_takes_hours_on_one_gpu_and_less_on_thirty_two(qwen3_4b):
    h200 = plan.GPUS["H200"]
    for a in (grpo.Args(), ac2.Args()):
        one = sum(plan.time_plan(a, qwen3_4b, 1, h200).values())
        assert one > 10 * 3600  # the practical problem: more than 10 hours a step on one H200
        assert sum(plan.time_plan(a, qwen3_4b, 32, h200).values()) < one / 16
        assert sum(plan.time_plan(a, qwen3_4b, 1, h200, frac=1.0).values()) > one  # longer responses, longer steps
    ready = sum(plan.time_plan(ac2.Args(), qwen3_4b, 1, h200, ready=True).values())
    assert ready < sum(plan.time_plan(ac2.Args(), qwen3_4b, 1, h200).values())  # chunks save decoding
    line = plan.time_summary(ac2.Args(), qwen3_4b, 1, h200, eval_problems=60)
    assert line.startswith("time plan (an estimate") and "on 1 x H200" in line and "once every problem is ready" in line


def test_the_host_memory_of_a_node_by_hand(qwen3_4b):
    P = qwen3_4b["params"]
    a = ac2.Args(offload_optimizer=True)
    host = plan.host_plan(a, qwen3_4b, gpus=8, ranks_per_node=8)
    assert host["rank 0's full fp32 weights (start-up, checkpoints)"] == pytest.approx(4 * P / 2**30)
    # the actor's and the critic's AdamW states, 8 bytes per parameter / 8 ranks each, on every one of 8 ranks
    assert host["offloaded AdamW states (pinned)"] == pytest.approx(2 * 8 * P / 2**30)
    assert host["the LR ladder's snapshot (pinned)"] == pytest.approx(4 * P / 2**30)
    assert "offloaded AdamW states (pinned)" not in plan.host_plan(grpo.Args(), qwen3_4b, 8)


def test_the_memory_logs_are_device_level_not_the_allocators(monkeypatch):
    """A sleeping vLLM keeps ~50 GiB reserved in its pool while its pages are unmapped: the allocator says 60 GiB
    reserved, the device 12 in use. A phase that takes 5 more GiB from the GPU peaks at 17 GiB, not 65."""
    assert _phase_peak(monkeypatch, "backward", device=[12, 14], reserved=[60, 65]) == {"memory/backward": 17.0,
                                                                            "memory/backward_growth": 5.0}


def test_blocks_reused_from_the_allocators_cache_are_not_counted_twice(monkeypatch):
    """Measured on an H200 (benchmarks/gpu_check.sh): the critic step began with 85 GiB in use on the device, 24 of
    them the allocator's cache of freed blocks, and its tensors grew by 30 GiB, mostly into that cache: the
    allocator took only 10 GiB more from the GPU. The device peaked near 95 GiB; counting the tensors' growth on top
    of the start said 115."""
    assert _phase_peak(monkeypatch, "critic_step", device=[85, 94], reserved=[84, 94]) == {"memory/critic_step": 95.0,
                                                                            "memory/critic_step_growth": 10.0}


def _phase_peak(monkeypatch, name: str, device: list[float], reserved: list[float]) -> dict:
    """One phase's logged peaks, with the device's use and the allocator's reserve given at its start and end (GiB;
    the allocator's tensors move by 30 GiB meanwhile, which must not matter)."""
    gib = 2**30
    device_used, reserve = iter(device), iter(reserved)
    peak_reserved = max(reserved)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 30 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 60 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: next(reserve) * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: peak_reserved * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: ((141 - next(device_used)) * gib, 141 * gib))
    monkeypatch.setattr(parallel, "max_all", float)
    peaks = parallel.Peaks()
    peaks.start()
    peaks.end(name)
    return peaks.pop()


def test_the_ladders_snapshot_is_one_buffer_refilled_and_measures_the_change():
    model = torch.nn.Linear(3, 2)
    snap = ac2.Snapshot()
    snap.take(model)
    buffers = [b.data_ptr() for b in snap.buffers]
    with torch.no_grad():
        model.weight.add_(torch.full_like(model.weight, 0.5))  # 6 entries moved by 0.5: sqrt(6 x 0.25)
    assert snap.displacement(model) == pytest.approx(6**0.5 / 2)
    snap.take(model)
    assert [b.data_ptr() for b in snap.buffers] == buffers and snap.displacement(model) == 0.0
