"""Rollout correction (--rollout-correction) and the engine's old log-probabilities (--old-logprobs engine): the
weights by hand at each level, where each script's loss applies them, a real engine whose weights differ on purpose,
and the refusals. End to end, each mode runs in one script's own test run (grpo: token-truncate, ac2: token-mask,
rpo: sequence-truncate, ccr: sequence-mask; conftest.assert_rollout_weights_are_one), and the engine's old
log-probabilities in ac2's resume test, rpo's and ccr's two-rank state tests and grpo's two-rank engine test
(conftest.assert_trained_on_the_engines_old_logprobs)."""

import dataclasses
import math

import pytest
import torch
from conftest import LOGPROB_GAP
from vllm import SamplingParams

import ac2
import ccr
import grpo
import rpo
from common import engine
from common.tiny import build_tokenizer


def rows_with(old: list[float], sampled: list[float], n: int | None = None, advantage: float = 1.0):
    """A TrainRow whose last len(sampled) loss tokens were sampled, with these old log-probabilities."""
    n = n or len(old)
    return grpo.TrainRow(list(range(2 + n)), 2, n, advantage, sampled=sampled, old_logp=torch.tensor(old))


def correct(mode: str, cap: float | None, rows):
    return grpo.rollout_correction(rows, grpo.Args(rollout_correction=mode, rollout_correction_cap=cap))


def test_token_level_weights_truncated_and_masked_by_hand():
    old = [math.log(2.0), math.log(0.25), 0.0]  # against sampled log-probs of 0: w = 2, 0.25, 1
    rows = [rows_with(old, [0.0, 0.0, 0.0])]
    stats = correct("token-truncate", 1.5, rows)
    assert rows[0].is_weight.tolist() == pytest.approx([1.5, 0.25, 1.0])  # one-sided: min(w, C)
    assert stats["rollout/is_weight_mean"] == pytest.approx((2 + 0.25 + 1) / 3)  # raw, before the cap
    assert stats["rollout/is_weight_max"] == pytest.approx(2.0) and stats["rollout/is_truncated_frac"] == 1 / 3
    stats = correct("token-mask", 1.5, rows)
    assert rows[0].is_weight.tolist() == pytest.approx([0.0, 0.0, 1.0])  # outside [1/1.5, 1.5]: dropped
    assert stats["rollout/is_masked_frac"] == 2 / 3
    correct("token-truncate", None, rows)  # the default cap at token level is 3
    assert rows[0].is_weight.tolist() == pytest.approx([2.0, 0.25, 1.0])


def test_sequence_level_weights_use_the_geometric_mean_not_the_product():
    old = [math.log(2.0), math.log(0.25), 0.0]
    s = (2 * 0.25 * 1) ** (1 / 3)  # 0.794: the product, 0.5, would compound with every token
    rows = [rows_with(old, [0.0, 0.0, 0.0]), rows_with([0.001] * 4, [0.0] * 4)]
    stats = correct("sequence-truncate", None, rows)  # the default cap at sequence level: 1.01
    assert rows[0].is_weight.tolist() == pytest.approx([s] * 3)
    assert rows[1].is_weight.tolist() == pytest.approx([math.exp(0.001)] * 4)  # below the cap
    assert stats["rollout/is_truncated_frac"] == 0.0
    stats = correct("sequence-mask", None, rows)
    assert rows[0].is_weight.tolist() == [0.0] * 3 and rows[1].is_weight.tolist() == pytest.approx([1.001] * 4,
                                                                                                   abs=1e-6)
    assert stats["rollout/is_masked_frac"] == 0.5  # one sequence of two, counted once
    correct("sequence-mask", 1.3, rows)  # 1 / 1.3 = 0.769 < 0.794: kept, at its weight
    assert rows[0].is_weight.tolist() == pytest.approx([s] * 3)


def test_tokens_the_engine_did_not_sample_keep_weight_one():
    # RPO with --prefix-in-loss: 5 loss tokens, the last 2 sampled this step; the replayed prefix keeps weight 1
    row = rows_with([-1.0, -1.0, -1.0, math.log(2.0), math.log(4.0)], [0.0, 0.0], n=5)
    correct("token-truncate", 3.0, [row])
    assert row.is_weight.tolist() == pytest.approx([1.0, 1.0, 1.0, 2.0, 3.0])


@pytest.mark.parametrize("script", ["grpo", "ac2", "rpo", "ccr"])
def test_each_scripts_loss_weighs_its_policy_term_token_by_token(script):
    """The corrected loss is sum_t w_t * l_t / denominator, l_t the script's own PPO loss per token; AC2 weighs its
    actor's loss (the critic's has no sampled tokens), RPO and CCR the tokens they train on, GRPO its policy term but
    not the KL penalty."""
    module = {"grpo": grpo, "ac2": ac2, "rpo": rpo, "ccr": ccr}[script]
    off, on = module.Args(), module.Args(rollout_correction="token-truncate")
    rows = [rows_with([-1.0, -2.0, -0.5], [-1.2, -1.9, -0.5], advantage=1.0),
            rows_with([-0.3, -0.7], [-0.1, -0.9], advantage=-1.0)]
    grpo.rollout_correction(rows, on)
    logp = torch.tensor([-1.1, -1.8, -0.6, -0.2, -0.8])
    w = torch.cat([r.is_weight for r in rows])
    assert w.tolist() == pytest.approx(torch.exp(torch.tensor([0.2, -0.1, 0.0, -0.2, 0.2])).tolist(), rel=1e-6)
    adv = torch.tensor([1.0] * 3 + [-1.0] * 2)
    if script == "ac2":
        loss = lambda a: module.actor_loss(rows, logp, 0.28, 5, a)[0]  # noqa: E731
        per_token = module.ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, 0.2, 0.28, 3.0)[0]
    elif script == "grpo":
        loss = lambda a: module.micro_batch_loss(rows, logp, rows, 0.28, a)[0]  # noqa: E731
        per_token = module.ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, 0.2, 0.28, 3.0)[0]
    else:
        loss = lambda a: module.micro_batch_loss(rows, logp, rows, dataclasses.replace(  # noqa: E731
            a, **({"objective": "dapo"} if script == "rpo" else {})))[0]
        per_token = module.ppo_loss(logp, torch.cat([r.old_logp for r in rows]), adv, 0.2,
                                    0.28 if script == "rpo" else 0.2)[0]
    assert loss(off).item() == pytest.approx(per_token.sum().item() / 5)
    assert loss(on).item() == pytest.approx((per_token * w).sum().item() / 5)
    if script == "grpo":  # the k3 KL to the reference is not weighed
        for r, ref in zip(rows, ([-1.0, -2.0, -0.4], [-0.3, -0.6])):
            r.ref_logp = torch.tensor(ref)
        d = torch.tensor([-1.0, -2.0, -0.4, -0.3, -0.6]) - logp
        kl = torch.exp(d) - d - 1
        with_kl = module.micro_batch_loss(rows, logp, rows, 0.28, dataclasses.replace(on, kl_coef=0.5))[0]
        assert with_kl.item() == pytest.approx(((per_token * w).sum() + 0.5 * kl.sum()).item() / 5)


def test_the_refused_combinations_say_why_in_one_sentence():
    with pytest.raises(SystemExit, match="every weight 1"):
        grpo.check_flags(grpo.Args(rollout_correction="token-mask", old_logprobs="engine"))
    with pytest.raises(SystemExit, match=r"top-p / top-k.*--top-p 1 --top-k -1"):
        grpo.check_flags(grpo.Args(rollout_correction="token-mask", top_p=0.95))
    with pytest.raises(SystemExit, match="top-p / top-k"):
        ccr.check_flags(ccr.Args(old_logprobs="engine", top_k=20))
    for script, needs in ((grpo, "--no-entropy-control"), (rpo, "--no-prefix-in-loss")):
        with pytest.raises(SystemExit, match=needs):
            script.main(script.Args(old_logprobs="engine"))
    grpo.check_flags(grpo.Args(old_logprobs="engine", entropy_control=False))  # fine: nothing else needs the pass
    ccr.check_flags(ccr.Args(old_logprobs="engine"))
    ac2.check_flags(ac2.Args(old_logprobs="engine"))  # AC2 still scores its empty-prefix rows for Eq. 9


def test_the_engines_log_probabilities_have_the_temperature_applied(engine_and_model):
    """The trainer's old log-probabilities are log_softmax(logits / T): the engine's must be of the same tempered
    distribution (`logprobs_mode="processed_logprobs"`), or every ratio would be off at T != 1."""
    llm, model = engine_and_model
    engine.sync_weights(llm, model)
    prompt = grpo.encode_chat(build_tokenizer(), "Add: 45+67+12")
    [[c]] = engine.generate(llm, [prompt], SamplingParams(temperature=0.5, max_tokens=30, logprobs=0, seed=3))
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        at = {t: grpo.sequence_logprobs(model, ids, [len(prompt)], [len(c.token_ids)], t, 64)[0] for t in (0.5, 1.0)}
    vllm = torch.tensor(c.logprobs)
    assert (at[0.5] - vllm).abs().max() < LOGPROB_GAP
    assert (at[1.0] - vllm).abs().max() > 100 * LOGPROB_GAP  # so the first comparison could have failed


def test_an_engine_with_other_weights_gives_the_weights_exp_old_minus_vllm(engine_and_model):
    """The engine's weights perturbed on purpose, the trainer's not: the mismatch is real, and the weights are
    exp(trainer's old - engine's) token by token."""
    llm, model = engine_and_model
    perturbed = type(model)(model.config)
    perturbed.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    engine.sync_weights(llm, perturbed)
    try:
        prompt = grpo.encode_chat(build_tokenizer(), "Add: 12+34+56")
        [group] = engine.generate(llm, [prompt], SamplingParams(n=4, temperature=1.0, max_tokens=40, logprobs=0,
                                                                seed=9))
    finally:
        engine.sync_weights(llm, model)  # the shared engine serves the trainer's weights again
    rows = [grpo.TrainRow(prompt + c.token_ids, len(prompt), len(c.token_ids), 1.0, sampled=c.logprobs)
            for c in group]
    args = grpo.Args(rollout_correction="token-truncate", rollout_correction_cap=1e9)
    grpo.old_logprobs(model, rows, 1.0, args, grpo.parallel.Peaks())
    stats = grpo.rollout_correction(rows, args)
    for r in rows:
        want = torch.exp(r.old_logp - torch.tensor(r.sampled))
        assert torch.allclose(r.is_weight, want, rtol=1e-5, atol=1e-6)
    assert abs(stats["rollout/is_weight_mean"] - 1) > 1e-3  # a real gap, not the CPU's agreement to 1e-6
    assert grpo.sampler_gap(rows, args)["sampling/mismatch_kl"] > 1e-4
