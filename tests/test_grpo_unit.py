"""GRPO's rules pinned to hand-computed values."""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import grpo
from common import parallel


def test_group_advantages_mean_only_and_std():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert grpo.group_advantages(r, 4, std_normalize=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    got = grpo.group_advantages(r, 4, std_normalize=True)
    assert got[:4].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4),
                                                                                          0.5 / (std + 1e-4)])
    assert got[4:].tolist() == [0, 0, 0, 0]  # equal rewards: no signal, no division by zero


def test_ppo_loss_clip_higher_dual_clip_by_hand():
    ratios = torch.tensor([1.5, 0.5, 0.5, 5.0, 2.0, 1.3, math.exp(30.0)])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 1.0])
    old = torch.zeros(7)
    logp = torch.log(ratios)
    logp[-1] = 30.0  # log-ratio clamped to 20 before exp
    loss, st = grpo.ppo_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # A>0, r=1.5: max(-1.5, -1.28) = -1.28 (clip-high)   A>0, r=0.5: max(-0.5, -0.8) = -0.5
    # A<0, r=0.5: max(0.5, 0.8) = 0.8 (clip-low)          A<0, r=5: max(5, 1.28) = 5 -> dual cap 3
    # A<0, r=2: max(2, 1.28) = 2 (below the cap)          A=0: 0        A>0, r=e^20: -1.28
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 0.8, 3.0, 2.0, 0.0, -1.28])
    assert st["clip_high"].tolist() == [True, False, False, False, False, False, True]
    assert st["clip_low"].tolist() == [False, False, True, False, False, False, False]
    assert st["clip_dual"].tolist() == [False, False, False, True, False, False, False]
    assert st["approx_kl"][0].item() == pytest.approx(0.5 - math.log(1.5))
    no_dual, _ = grpo.ppo_loss(logp, old, adv, 0.2, 0.28, dual_clip=0.0)
    assert no_dual[3].item() == pytest.approx(5.0)


def test_ppo_loss_gradient_vanishes_when_clipped():
    logp = torch.log(torch.tensor([1.5, 1.1])).requires_grad_()
    loss, _ = grpo.ppo_loss(logp, torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2, 0.28, 3.0)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, -1.1])  # d(-A r)/d logp = -A r where unclipped


def test_entropy_offset_update_eq9():
    a = grpo.Args()
    assert grpo.update_entropy_offset(0.06, 0.10, a) == pytest.approx(0.08)  # below target: widen eps_high
    assert grpo.update_entropy_offset(0.08, 0.10, a) == pytest.approx(0.08)  # clipped at +0.08
    assert grpo.update_entropy_offset(0.06, 0.50, a) == pytest.approx(0.04)  # above target: narrow
    assert grpo.update_entropy_offset(-0.07, 1.0, a) == pytest.approx(-0.08)
    assert grpo.update_entropy_offset(0.06, 0.28, a) == pytest.approx(0.06)  # sign(0) = 0


def test_aggregation_token_mean_vs_sequence_mean_and_micro_batch_accumulation():
    tok = torch.tensor([4.0, 1.0, 1.0, 1.0])  # sequences of 1 and 3 tokens
    assert grpo.aggregate_loss(tok, [1, 3], "token-mean", denom=4).item() == pytest.approx(7 / 4)
    assert grpo.aggregate_loss(tok, [1, 3], "seq-mean-token-mean", denom=2).item() == pytest.approx((4 + 1) / 2)
    # split over two micro-batches, the shares add up to the same minibatch loss
    for agg, denom in (("token-mean", 4), ("seq-mean-token-mean", 2)):
        whole = grpo.aggregate_loss(tok, [1, 3], agg, denom)
        parts = grpo.aggregate_loss(tok[:1], [1], agg, denom) + grpo.aggregate_loss(tok[1:], [3], agg, denom)
        assert parts.item() == pytest.approx(whole.item())


def test_problems_for_step_epochs_are_permutations_and_deterministic():
    steps = [grpo.problems_for_step(5, 3, s, seed=7) for s in (1, 2, 3, 4)]
    flat = [i for s in steps for i in s]
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert steps == [grpo.problems_for_step(5, 3, s, seed=7) for s in (1, 2, 3, 4)]
    assert steps != [grpo.problems_for_step(5, 3, s, seed=8) for s in (1, 2, 3, 4)]
    assert grpo.problems_for_step(2, 5, 1, seed=0).count(0) >= 2  # more per step than rows: wraps epochs


def test_micro_batches_respect_the_token_budget():
    assert grpo.make_micro_batches([0, 1, 2, 3], [10, 3, 7, 2], budget=20) == [[0, 2], [1, 3]]
    assert grpo.make_micro_batches([0], [50], budget=20) == [[0]]  # one long row goes alone


def test_request_seeds_differ_and_repeat():
    assert grpo.request_seed(1, 2, 3) == grpo.request_seed(1, 2, 3)
    assert len({grpo.request_seed(1, s, j) for s in range(20) for j in range(20)}) == 400
    assert 0 <= grpo.request_seed(5, -1, 0) < 2**31


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float()


def test_chunked_logprobs_equal_the_naive_full_logits_values_and_gradients(small_model):
    ids = torch.randint(1, 50, (2, 12))
    starts, lengths, T = [4, 6], [8, 5], 0.8  # row 1 has 1 pad at the end
    naive = torch.log_softmax(small_model(ids).logits.float() / T, -1)
    want = torch.cat([naive[b, s - 1 : s - 1 + n].gather(-1, ids[b, s : s + n, None])[:, 0]
                      for b, (s, n) in enumerate(zip(starts, lengths))])
    got, ent = grpo.sequence_logprobs(small_model, ids, starts, lengths, T, chunk=3, with_entropy=True)
    assert torch.allclose(got, want, atol=1e-5)
    p = naive.exp()
    want_ent = torch.cat([-(p[b, s - 1 : s - 1 + n] * naive[b, s - 1 : s - 1 + n]).sum(-1)
                          for b, (s, n) in enumerate(zip(starts, lengths))])
    assert torch.allclose(ent, want_ent, atol=1e-5)
    # gradients through the checkpointed chunks equal those of the naive computation
    small_model.zero_grad()
    want.sum().backward()
    g_naive = [q.grad.clone() for q in small_model.parameters()]
    small_model.zero_grad()
    got2, _ = grpo.sequence_logprobs(small_model, ids, starts, lengths, T, chunk=3)
    got2.sum().backward()
    for a, b in zip(g_naive, (q.grad for q in small_model.parameters())):
        assert torch.allclose(a, b, atol=1e-5)


def test_checkpoint_is_atomic_when_killed_mid_save(tmp_path, small_model, monkeypatch):
    from common.tiny import build_tokenizer

    tok = build_tokenizer()
    opt = torch.optim.AdamW(small_model.parameters())
    good = parallel.save_checkpoint(tmp_path, 2, small_model, tok, {"optimizer": opt}, {"entropy_k": 0.1}, keep=2)
    # an optimizer that has not stepped is not saved, and saving gives it no state (AdamW counts its steps)
    assert not opt.state and torch.load(good / "trainer_state.pt", weights_only=False)["optimizers_saved"] == []
    real_save = torch.save

    def dying_save(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        raise KeyboardInterrupt("killed mid-checkpoint")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        parallel.save_checkpoint(tmp_path, 4, small_model, tok, {"optimizer": opt}, {"entropy_k": 0.2}, keep=2)
    monkeypatch.setattr(torch, "save", real_save)
    assert not (tmp_path / "step_4").exists()
    assert parallel.find_checkpoint(str(tmp_path)) == good
    assert torch.load(good / "trainer_state.pt", weights_only=False)["entropy_k"] == 0.1
    # a later save cleans the leftovers and rotation keeps the newest `keep`
    for s in (4, 6, 8):
        parallel.save_checkpoint(tmp_path, s, small_model, tok, {"optimizer": opt}, {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_6", "step_8"]
    with pytest.raises(SystemExit, match="no checkpoint"):
        parallel.find_checkpoint(str(tmp_path / "nothing"))
