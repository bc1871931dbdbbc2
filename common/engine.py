"""The generation engine: one in-process vLLM `LLM` whose weights follow the trainer's exactly.

What this module relies on (checked on CPU; docs/reference.md, "Running vLLM in-process"):
- `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine in the trainer's process, so weight sync is a plain
  function call on the worker (no pickling, no second process).
- On CPU, vLLM prepacks each linear layer's weight for oneDNN and drops `layer.weight`; weights loaded later
  would be ignored. `_keep_cpu_linear_weights` makes every linear layer use its live weight instead.
- On CPU, seeded requests crash vLLM when a prefill is chunked (a CPU `torch.Generator` has no offset), so
  chunked prefill is off there. We seed every request: that is what makes a resumed run sample exactly what
  an uninterrupted one would have.
- On GPU: bf16, and sleep mode so the trainer gets the memory of the KV cache and weights while it trains.
- Under torchrun, one engine per rank (`external_launcher`): common/parallel.py says how the work is shared.
"""

from __future__ import annotations

import array
import dataclasses
import os
import sys

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclasses.dataclass
class Completion:
    """One sampled continuation: its new token ids, their sampling log-probabilities and why it stopped."""

    token_ids: list[int]
    logprobs: array.array  # float32 log-probability of each sampled token under the sampler (after temperature)
    finish_reason: str  # "stop" (end of turn) or "length" (hit max_tokens)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def _keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU linear layers compute with `layer.weight` so `load_weights` takes effect."""
    import vllm.model_executor.layers.utils as layer_utils

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:  # replaces the prepacking dispatcher
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def on_gpu() -> bool:
    return torch.cuda.is_available()


def create_engine(
    model: str,
    *,
    max_model_len: int,
    seed: int,
    gpu_memory_utilization: float = 0.4,
    cpu_kv_cache_gib: int = 1,
    enable_prefix_caching: bool = True,
    max_num_seqs: int | None = None,
):
    """An in-process `vllm.LLM` for `model` (hub id or local folder): bf16 + sleep mode on GPU, fp32 on CPU.

    Under a process group (torchrun, or any GPU run: common/parallel.py) every rank builds its own engine at the
    same time with `external_launcher` and tensor parallel 1 -- vLLM joins the existing world and each rank
    samples independently; all ranks use the same seed (vLLM reseeds the whole process with it).
    `max_num_seqs`: sequences decoded at once (None: vLLM's default; the scripts derive it on GPU, common/plan.py).
    """
    gpu = on_gpu()
    if not gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        _keep_cpu_linear_weights()
    from vllm import LLM

    from common import parallel

    return LLM(
        model=model,
        dtype="bfloat16" if gpu else "float32",
        max_model_len=max_model_len,
        seed=seed,
        enforce_eager=not gpu,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=gpu,  # see the module docstring
        enable_sleep_mode=gpu,
        gpu_memory_utilization=gpu_memory_utilization,
        # log-probabilities of the distribution actually sampled from (after temperature / top-k / top-p),
        # so that they compare with the trainer's log_softmax(logits / T)
        logprobs_mode="processed_logprobs",
        **(dict(max_num_seqs=max_num_seqs) if max_num_seqs else {}),
        **(dict(distributed_executor_backend="external_launcher", tensor_parallel_size=1) if parallel._on else {}),
    )


def generate(llm, prompts: list[list[int]], params, progress: str | None = None) -> list[list[Completion]]:
    """Sample from token-id prompts. `params` is one `SamplingParams` or one per prompt (request `n` >= 1).

    Returns, per prompt, its `n` completions with new token ids (the end-of-turn token included when it
    was sampled), per-token sampling log-probabilities (request `logprobs=0`) and finish reasons. Log-probabilities
    are asked for flat (`flat_logprobs`: a few lists per request, not a dict and an object per token -- ~10^8
    tokens a step at the papers' scale) and kept as float32 arrays, 4 bytes a token.
    Under torchrun every rank calls it with the same prompts: each samples every WORLD-th one and all receive
    every result, so what is sampled depends only on each request's seed, not on the number of ranks.
    `progress` names a phase that may take a while (an evaluation, a cache's first answers): rank 0 then shows
    a progress bar with vLLM's time estimate, cleared when done.
    """
    from common import parallel

    per_prompt = [flat(sp) for sp in (params if isinstance(params, list) else [params] * len(prompts))]
    bar = False
    if progress and parallel.RANK == 0:
        from tqdm import tqdm

        every = 0.1 if sys.stderr.isatty() else 30.0  # a log file gets a line every 30 s, not a stream of them
        bar = lambda *a, **kw: tqdm(*a, **{**kw, "desc": progress, "leave": False, "mininterval": every})  # noqa: E731
    return parallel.shared_map(lambda share: _generate(llm, share, bar), list(zip(prompts, per_prompt)))


def flat(params):
    """The same request, with its log-probabilities returned flat (vLLM's FlatLogprobs)."""
    if params.logprobs is None or params.flat_logprobs:
        return params
    params = params.clone()
    params.flat_logprobs = True
    return params


def sampled_logprobs(logprobs, token_ids: list[int]) -> array.array:
    """The sampled tokens' log-probabilities, from vLLM's per-position logprobs (flat or a dict per position)."""
    out = array.array("f")
    if logprobs is None:
        return out
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: position i's entries are [start_i, end_i)
        for i, t in enumerate(token_ids):
            entries = range(logprobs.start_indices[i], logprobs.end_indices[i])
            out.append(next(logprobs.logprobs[k] for k in entries if logprobs.token_ids[k] == t))
        return out
    out.extend(d[t].logprob for d, t in zip(logprobs, token_ids))
    return out


def _generate(llm, requests: list, bar=False) -> list[list[Completion]]:
    from vllm.inputs import TokensPrompt

    if not requests:
        return []
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests], [sp for _, sp in requests],
                           use_tqdm=bar)
    result = []
    for out in outputs:
        group = []
        for c in out.outputs:
            ids = list(c.token_ids)
            group.append(Completion(ids, sampled_logprobs(c.logprobs, ids), c.finish_reason or "length"))
        result.append(group)
    return result


def sync_weights(llm, model: torch.nn.Module) -> None:
    """Push the trainer's current weights into the engine (in place), then drop stale cached prefixes.

    One parameter at a time, cast to the engine's dtype as it goes (bf16 on GPU): from a sharded trainer each
    is gathered whole just before it is loaded and freed after, so no second full copy of the weights ever
    exists. Every rank must call it (the gathers are collectives), with the same model.
    """
    from common import parallel

    dtype = torch.bfloat16 if on_gpu() else torch.float32
    tied = getattr(model.config, "tie_word_embeddings", False)

    def weights():
        # with tied embeddings vLLM has no separate lm_head weight to load (docs/reference.md, "Running vLLM")
        for name, p in model.named_parameters():
            if not (tied and name == "lm_head.weight"):
                yield name, parallel.full(p.detach().to(dtype))

    llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(weights=weights()))
    llm.reset_prefix_cache()


def sleep(llm, level: int = 2) -> None:
    """Free the engine's GPU memory for training. Level 2 (the default) drops its weights as well as its KV
    cache -- the sync after the update overwrites every weight anyway -- where level 1 would copy them to CPU
    memory and back every step. No-op on CPU (sleep mode is a GPU feature)."""
    if on_gpu():
        llm.sleep(level=level)


def wake_up(llm, model: torch.nn.Module | None = None) -> None:
    """Bring the engine back; with `model`, sync its weights before re-allocating the KV cache. On GPU the
    trainer's allocator first hands back the freed blocks it keeps cached -- up to 15 GiB at 4B on an H200
    (benchmarks/results/gpu_check.json, reserved less allocated) that the engine's memory would otherwise not find."""
    if on_gpu():
        torch.cuda.empty_cache()
        llm.wake_up(tags=["weights"])
    if model is not None:
        sync_weights(llm, model)
    if on_gpu():
        llm.wake_up(tags=["kv_cache"])


# ----------------------------------------------------------------------------------------------------
# Decoding FLOPs (AC2 paper, Appendix B, Eq. 6)
# ----------------------------------------------------------------------------------------------------
def decoding_flops_coefficients(config) -> tuple[int, int]:
    """(A, B) of Eq. 6 for a Qwen/Llama-style decoder config (multiply + add = 2 FLOPs).

    A: per decoding forward, the q/k/v/o projections, the gated MLP (gate, up, down) and the vocabulary logits.
    B: per context position per decoding forward, the attention matmuls q.k and attn.v over all heads.
    For Qwen3-4B this gives the paper's A = 8,044,544,000 and B = 589,824.
    """
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = 2 * h * q + 2 * 2 * h * kv + 2 * q * h  # q, k, v, o projections
    mlp = 3 * 2 * h * c.intermediate_size  # gate, up, down
    A = layers * (attention + mlp) + 2 * h * c.vocab_size
    B = layers * 2 * (2 * heads * head_dim)  # q.k^T and attn.v, per context position
    return A, B


def decoding_flops(A: int, B: int, p: int, g: int) -> int:
    """Eq. 6: F(p, g) = A*m + B*(m*p + m(m+1)/2), m = max(g-1, 0); p = prompt(+prefix) tokens, g = new tokens.

    The first new token comes from the prefill, which is not counted; each later one is a decoding forward
    that attends to p + (tokens so far) positions.
    """
    m = max(g - 1, 0)
    return A * m + B * (m * p + m * (m + 1) // 2)
