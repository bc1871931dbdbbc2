"""The engine: Eq. 6 FLOPs constants, and weight sync between the trainer and the real vLLM engine."""

import pytest
import torch
from conftest import LOGPROB_GAP
from transformers import LlamaConfig, Qwen3Config
from vllm import SamplingParams

import grpo
from common import engine
from common.tiny import build_tokenizer


def test_flops_coefficients_reproduce_the_ac2_paper_for_qwen3_4b():
    config = Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936)
    assert engine.decoding_flops_coefficients(config) == (8_044_544_000, 589_824)


def test_flops_coefficients_llama_style_config_without_explicit_head_dim():
    # Llama-3-8B shapes; head_dim = hidden / heads = 128. Hand count (2 FLOPs per multiply-add):
    # per layer q,o 2*4096*4096 each, k,v 2*4096*1024 each, MLP 3*2*4096*14336; logits 2*4096*128256
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    per_layer = 2 * 2 * 4096 * 4096 + 2 * 2 * 4096 * 1024 + 6 * 4096 * 14336
    assert engine.decoding_flops_coefficients(config) == (32 * per_layer + 2 * 4096 * 128256, 32 * 4 * 32 * 128)


def test_decoding_flops_eq6_by_hand():
    # m = g - 1 = 3 decoding forwards attending to p+1, p+2, p+3 = 6, 7, 8 positions
    assert engine.decoding_flops(10, 2, p=5, g=4) == 10 * 3 + 2 * (6 + 7 + 8)
    assert engine.decoding_flops(10, 2, p=5, g=1) == 0  # the only token came from the prefill
    assert engine.decoding_flops(10, 2, p=5, g=0) == 0


def _trainer_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp, _ = grpo.sequence_logprobs(model, ids, [len(prompt)], [len(completion)], temperature, chunk=7)
    return lp


def _max_gap(llm, model, prompt, seed):
    params = SamplingParams(n=4, temperature=0.8, max_tokens=40, logprobs=0, seed=seed)
    gaps = []
    for c in engine.generate(llm, [prompt], params)[0]:
        assert len(c.logprobs) == len(c.token_ids) > 0
        trainer = _trainer_logprobs(model, prompt, c.token_ids, 0.8)
        gaps.append((trainer - torch.tensor(c.logprobs)).abs().max().item())
    return max(gaps)


def test_sync_weights_makes_vllm_logprobs_equal_the_trainers_twice_in_a_row(engine_and_model):
    llm, model = engine_and_model
    tok = build_tokenizer()
    prompt = grpo.encode_chat(tok, "Add: 12+34+56")
    engine.sync_weights(llm, model)
    assert _max_gap(llm, model, prompt, seed=1) < LOGPROB_GAP
    gen = torch.Generator().manual_seed(0)
    for round_ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stale = _max_gap(llm, model, prompt, seed=10 + round_)
        assert stale > 10 * LOGPROB_GAP, "the perturbation must be visible before the sync, or this test proves nothing"
        engine.sync_weights(llm, model)
        assert _max_gap(llm, model, prompt, seed=20 + round_) < LOGPROB_GAP


def test_generate_returns_finish_reasons_and_end_of_turn_token(engine_and_model, tiny_model):
    llm, _ = engine_and_model
    from transformers import AutoModelForCausalLM

    engine.sync_weights(llm, AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    tok = build_tokenizer()
    prompt = grpo.encode_chat(tok, "Add: 12+34")
    done, cut = engine.generate(llm, [prompt, prompt], [SamplingParams(temperature=0, max_tokens=100),
                                                        SamplingParams(temperature=0, max_tokens=3)])
    assert done[0].finish_reason == "stop" and done[0].token_ids[-1] == tok.eos_token_id
    assert cut[0].truncated and len(cut[0].token_ids) == 3


def test_log_probabilities_come_flat_and_compact_and_equal_the_per_token_dicts(engine_and_model):
    """At the papers' scale a step samples ~10^8 tokens: vLLM returns their log-probabilities flat (a few lists per
    request, not a dict and an object per token) and the engine keeps them as float32 arrays, the same values."""
    import array

    from vllm.inputs import TokensPrompt

    llm, _ = engine_and_model
    prompt = grpo.encode_chat(build_tokenizer(), "Add: 12+34+56")
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, logprobs=0, seed=7)
    [got] = engine.generate(llm, [prompt], params)
    assert engine.flat(params).flat_logprobs and not params.flat_logprobs  # the caller's request is left as it was
    [raw] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)  # per-token dicts
    for c, r in zip(got, raw.outputs):
        assert isinstance(c.logprobs, array.array) and c.logprobs.typecode == "f"
        assert c.token_ids == list(r.token_ids)
        assert list(c.logprobs) == [float(torch.tensor(d[t].logprob)) for d, t in zip(r.logprobs, r.token_ids)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode is a GPU feature (a no-op on CPU); "
                    "written for a machine with a GPU and vLLM (benchmarks/gpu_check.sh runs it there)")
def test_a_sync_after_a_real_sleep_and_wake_up_serves_the_new_weights(engine_and_model):
    """The order the scripts use on GPU: sleep (level 2 drops the engine's weights), the trainer's update, then
    wake_up -- weights back, the sync, the KV cache back -- and the engine samples from the new weights."""
    llm, model = engine_and_model
    prompt = grpo.encode_chat(build_tokenizer(), "Add: 12+34+56")
    engine.sync_weights(llm, model)
    engine.sleep(llm, level=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)).to(p.device))
    engine.wake_up(llm, model)
    assert _max_gap(llm, model, prompt, seed=31) < LOGPROB_GAP
