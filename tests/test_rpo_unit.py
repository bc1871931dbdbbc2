"""RPO's rules (docs/rpo.md) pinned to hand-computed values."""

import itertools
import math

import numpy as np
import pytest
import torch

import rpo


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_length_aware_reward_by_hand():
    # lengths 100, 200, 300 (mean 200), all correct, alpha 0.01: sigma(1), sigma(0), sigma(-1) = .731, .5, .269
    got = rpo.length_aware_reward([1, 1, 1], [100, 200, 300], alpha=0.01, m=0.5, M=1.0)
    assert got == pytest.approx([sig(1.0), 0.5, 0.5])  # the longest clips up to m = 0.5
    # shorter than l_ref earns more; wrong answers get 0 however short (the released code's reading)
    got = rpo.length_aware_reward([0, 1, 1, 0], [50, 100, 300, 350], alpha=0.01, m=0.5, M=1.0)
    assert got == pytest.approx([0.0, sig(1.0), 0.5, 0.0])  # l_ref = mean over all four = 200


def test_length_aware_reward_all_wrong_all_right_alpha_zero_and_ref_correct():
    assert rpo.length_aware_reward([0, 0, 0], [10, 20, 30], 0.01, 0.5, 1.0) == [0.0, 0.0, 0.0]
    assert rpo.length_aware_reward([1, 1], [10, 10], 0.01, 0.5, 1.0) == pytest.approx([0.5, 0.5])
    assert rpo.length_aware_reward([1, 0, 1], [10, 500, 900], 0.0, 0.5, 1.0) == pytest.approx([0.5, 0.0, 0.5])
    # l_ref over the correct ones only: (100 + 300) / 2 = 200, the wrong 1000-token answer does not count
    got = rpo.length_aware_reward([1, 1, 0], [100, 300, 1000], 0.01, 0.5, 1.0, ref="correct")
    assert got == pytest.approx([sig(1.0), 0.5, 0.0])
    group = rpo.length_aware_reward([1, 1, 0], [100, 300, 1000], 0.01, 0.5, 1.0, ref="group")  # l_ref = 466.7
    assert group[0] == pytest.approx(min(1.0, sig(0.01 * (1400 / 3 - 100))))
    # M caps: a very short correct answer with a large alpha
    assert rpo.length_aware_reward([1, 1], [0, 1000], 1.0, 0.5, 0.9) == pytest.approx([0.9, 0.5])


def test_truncation_bounds():
    rng = np.random.default_rng(0)
    ms = [rpo.draw_truncation(30, 100, rng) for _ in range(2000)]
    assert min(ms) == 1 and max(ms) == 30  # U{1..L}
    assert all(rpo.draw_truncation(30, 7, rng) <= 7 for _ in range(200))  # clamped to the cached length
    a = rpo.Args()
    assert rpo.truncation_limit(a, cached_len=400, previous_shortest=None) == 200  # first visit: len(a_k)/2
    assert rpo.truncation_limit(a, cached_len=400, previous_shortest=151) == 75  # floor(shortest / 2)
    assert rpo.truncation_limit(rpo.Args(truncation="fixed", fixed_L=300), 400, 151) == 300
    assert rpo.truncation_limit(a, cached_len=1, previous_shortest=None) == 1  # never 0


def test_cache_update_picks_the_best_with_probability_epsilon():
    rng = np.random.default_rng(123)
    rewards = [0.2, 0.9, 0.5, 0.0, 0.9, 0.1]  # best = index 1 (first of the tie)
    picks = [rpo.pick_cache_entry(rewards, 0.1, rng) for _ in range(20000)]
    best = picks.count(1) / len(picks)
    # P(best) = eps + (1 - eps) * 0 = 0.1: the others are drawn among the G - 1 non-best responses
    assert best == pytest.approx(0.1, abs=0.01)
    others = [picks.count(i) / len(picks) for i in (0, 2, 3, 4, 5)]
    assert all(o == pytest.approx(0.9 / 5, abs=0.01) for o in others)
    assert {rpo.pick_cache_entry(rewards, 1.0, rng) for _ in range(50)} == {1}
    assert rpo.pick_cache_entry([0.3], 0.0, rng) == 0


def test_grpo_advantages_and_the_clipped_surrogate():
    adv = rpo.grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    s = math.sqrt(0.5)  # unbiased std of [1, 0]
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0])
    loss, st = rpo.ppo_loss(torch.log(torch.tensor([1.5, 0.5])), torch.zeros(2), torch.tensor([1.0, -1.0]), 0.2, 0.2)
    assert loss.tolist() == pytest.approx([-1.2, 0.8]) and (st["clip_low"] | st["clip_high"]).tolist() == [True, True]


def test_prefix_in_loss_changes_exactly_which_tokens_carry_loss():
    prompt, prefix, cont = [5] * 7, [6] * 4, [7] * 3
    seq = prompt + prefix + cont
    start, n = rpo.loss_span(len(prompt), len(prefix), len(cont), prefix_in_loss=True)
    assert seq[start : start + n] == prefix + cont and start + n == len(seq)
    start, n = rpo.loss_span(len(prompt), len(prefix), len(cont), prefix_in_loss=False)
    assert seq[start : start + n] == cont
    assert rpo.loss_span(7, 0, 3, True) == rpo.loss_span(7, 0, 3, False) == (7, 3)  # no prefix: same either way


def test_first_answers_are_as_long_as_the_maximum_generation_length_unless_asked():
    assert rpo.cache_init_limit(rpo.Args()) == rpo.Args().max_response_tokens == 4096
    assert rpo.cache_init_limit(rpo.Args(cache_init_max_tokens=2048)) == 2048  # the released code's limit
    assert rpo.cache_init_limit(rpo.tiny_args()) == 200


def test_learning_rate_warms_up_then_decays_by_cosine_to_a_tenth_of_the_peak():
    total, warmup = 100, 10
    f = [rpo.lr_factor(s, warmup, total, rpo.Args().min_lr_rate) for s in range(total)]
    assert f[0] == pytest.approx(0.1) and f[4] == pytest.approx(0.5) and f[9] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.1)  # the floor, not 0 (cosine_with_min_lr, min_lr_rate 0.1)
    mid = warmup - 1 + (total - warmup) // 2  # half way through the decay: (1 + 0.1) / 2
    assert f[mid] == pytest.approx(0.55)
    assert all(a >= b for a, b in itertools.pairwise(f[9:])) and min(f) == pytest.approx(0.1)
    assert rpo.lr_factor(total - 1, warmup, total, 0.0) == pytest.approx(0.0)  # min_rate 0: the old schedule
