"""AC2's rules (docs/ac2.md) pinned to hand-computed values."""

import math

import numpy as np
import pytest
import torch

import ac2
from ac2 import Probe, ReadinessTracker
from common.tiny import build_tokenizer


@pytest.mark.parametrize("x,z", [(0.25, 0.2), (0.35, 0.3), (0.45, 0.4), (0.95, 0.9), (0.05, 0.0), (0.15, 0.1),
                                 (0.26, 0.3), (0.375, 0.4), (0.125, 0.1), (0.0, 0.0), (1.0, 1.0), (0.6875, 0.7),
                                 (3 / 8, 0.4), (5 / 8, 0.6), (0.5, 0.5)])
def test_round_to_grid_ties_down(x, z):
    assert ac2.round_to_grid(x) == z


@pytest.mark.parametrize("text,value", [("0.7", 0.7), (".7", 0.7), ("0.70", 0.7), ("1", 1.0), ("1.0", 1.0),
                                        ("0", 0.0), ("0.75", None), ("1.5", 1.0), (" 0.3\n", 0.3), ("abc", None),
                                        ("", None), ("2", None), ("0.7 because", 0.7), ("-0.1", None),
                                        ("1.00", 1.0), ("0.", 0.0), ("Q value: 0.5", None)])
def test_parse_critic_value(text, value):
    assert ac2.parse_critic_value(text) == value


def low(problem, v=0.5, z=0.5):
    return Probe(problem, v, z)


def test_gate_needs_a_full_window_and_pools_errors_per_prefix():
    t = ReadinessTracker(window=5, tau_global=0.2)
    for _ in range(4):
        assert t.update([low(1)], bank_before={1}) == set() and not t.gate_open()
    assert t.update([low(1)], bank_before={1}) == {1} and t.gate_open()
    # pooled mean vs mean of step means: step means (0.4 + 4 x 0.1) / 5 = 0.16 < 0.2 would open the gate,
    # but the pooled mean over 14 prefixes is (10 x 0.4 + 4 x 0.1) / 14 = 0.314 -> closed
    t = ReadinessTracker(window=5, tau_global=0.2)
    t.update([Probe(2, 0.4, 0.0)] * 10, set())
    for _ in range(4):
        t.update([Probe(2, 0.1, 0.0)], set())
    assert t.global_mae() == pytest.approx(4.4 / 14) and not t.gate_open()


def test_a_step_without_errors_still_takes_a_window_slot():
    t = ReadinessTracker(window=5)
    t.update([Probe(1, 0.9, 0.0)], set())  # error 0.9 in the oldest slot
    for _ in range(3):
        t.update([], set())
    assert not t.gate_open()  # 4 slots
    t.update([low(1)], {1})  # 5th slot: pooled (0.9 + 0) / 2 = 0.45
    assert not t.gate_open()
    t.update([low(1)], {1})  # the 0.9 step falls out: pooled 0 over 2 prefixes, 3 empty steps inside
    assert t.gate_open() and t.ready == {1}


def test_invalid_probe_is_error_one_overflow_and_no_target_are_no_observation():
    assert Probe(1, None, 0.3).error == 1.0
    assert Probe(1, 0.3, None).error is None  # fewer than min_valid valid rewards
    assert Probe(1, 0.3, 0.3, overflow=True).error is None
    t = ReadinessTracker(window=1, tau_global=0.2)
    assert t.update([Probe(1, None, 0.0), Probe(2, 0.0, 0.0)], {1, 2}) == set()
    assert t.global_mae() == 0.5


def test_transition_conditions_latch_bank_before_and_local_threshold():
    t = ReadinessTracker(window=1, tau_global=0.2, tau_local=0.18)
    newly = t.update([
        Probe(1, 0.5, 0.4),    # error 0.1, nonzero, in bank -> ready
        Probe(2, 0.5, 0.3),    # error 0.2 >= tau_local -> not ready
        Probe(3, 0.0, 0.0),    # error 0 but prediction 0: nonzero latch never set -> not ready
        Probe(4, 0.5, 0.5),    # not in the bank as it was before this step -> not ready
        Probe(5, None, 0.0),   # unparsable probe -> not ready (and error 1)
        Probe(6, 0.1, 0.1),    # latch set by this very probe (applied before transitions) -> ready
    ] + [Probe(9, 0.0, 0.0)] * 20, bank_before={1, 2, 3, 5, 6})
    assert newly == {1, 6} and t.ready == {1, 6}
    # problem 3 later gets a nonzero prediction at another prefix; a fresh passing probe then suffices
    assert t.update([Probe(3, 0.2, 0.9), Probe(3, 0.0, 0.0)] + [Probe(9, 0, 0)] * 40, {3}) == {3}


def test_low_error_while_the_gate_is_closed_does_not_flip_later():
    t = ReadinessTracker(window=2, tau_global=0.2)
    t.update([Probe(1, 0.5, 0.5)], {1})  # perfect probe, but the window is not full: closed
    assert t.ready == set()
    assert t.update([Probe(2, 0.5, 0.5)], {1, 2}) == {2}  # gate opens; problem 1 was not probed this step
    assert t.ready == {2}
    t.update([Probe(2, 0.0, 1.0)], {2})  # monotone: a bad probe later does not undo readiness
    assert t.is_ready(2) and not t.gate_open()


def test_global_readiness_ablation_makes_everything_ready_once_the_gate_opens():
    t = ReadinessTracker(window=1, tau_global=0.2, local=False)
    t.update([Probe(1, 0.0, 0.0)], set())  # no latch, no bank: irrelevant in the ablation
    assert t.is_ready(12345) and t.all_ready
    t.update([Probe(1, 0.0, 1.0)], set())
    assert t.is_ready(7)  # latched


def test_tracker_state_round_trip():
    t = ReadinessTracker(window=3)
    t.update([Probe(1, 0.2, 0.2), Probe(2, 0.0, 0.5)], {1})
    u = ReadinessTracker(window=3)
    u.load_state_dict(t.state_dict())
    assert u.state_dict() == t.state_dict() and list(u.errors) == list(t.errors)


def test_routing_counts_audits_over_ready_slots():
    rng = np.random.default_rng(0)
    ready = [True] * 7 + [False] * 3
    routes = ac2.route_slots(ready, 0.25, rng)
    assert routes.count("audit") == 2 and routes.count("short") == 5 and routes[7:] == ["full"] * 3  # ceil(1.75)
    assert ac2.route_slots([True] * 8, 0.25, rng).count("audit") == 2  # ceil(2.0) = 2, not 3
    assert ac2.route_slots([True] * 9, 0.25, rng).count("audit") == 3  # ceil(2.25)
    assert ac2.route_slots([False] * 4, 0.25, rng) == ["full"] * 4
    assert ac2.route_slots([True] * 4, 0.0, rng) == ["short"] * 4  # no-audit variant


def test_fill_slots_question_uniform_with_wrap_around():
    T = ac2.Trajectory
    buffer = [T(3, [1], None), T(5, [2], None), T(3, [3], None), T(9, [4], None)]
    slots = ac2.fill_slots(buffer, 7, np.random.default_rng(1))
    problems = [s.problem for s in slots]
    assert sorted(set(problems[:3])) == [3, 5, 9]  # one pass over a permutation of the distinct problems
    assert problems[3:6] == problems[:3] and problems[6] == problems[0]  # then wrap around
    assert all(s in buffer and s.problem == p for s, p in zip(slots, problems))


def test_draw_cut_on_the_grid_up_to_the_max_fraction():
    rng = np.random.default_rng(0)
    cuts = {ac2.draw_cut(100, 10, 0.9, rng) for _ in range(500)}
    assert cuts == {0, 10, 20, 30, 40, 50, 60, 70, 80, 90}
    assert {ac2.draw_cut(5, 10, 0.9, rng) for _ in range(50)} == {0}
    assert {ac2.draw_cut(10, 10, 1.0, rng) for _ in range(100)} == {0, 9}  # then min(cut, L - 1)


def test_consumed_needs_cap_hit_cap_below_remaining_and_no_finished_answer():
    assert ac2.is_consumed(16, 16, 16, remaining=100, has_finished_answer=False)
    assert not ac2.is_consumed(12, 16, 16, 100, False)  # finished before the cap: judged
    assert not ac2.is_consumed(16, 16, 16, 16, False)  # the chunk reaches the end of the budget: judged
    assert not ac2.is_consumed(10, 10, 16, 10, False)  # cap cut by the budget
    assert not ac2.is_consumed(16, 16, 16, 100, True)  # a finished proof goes to the judge


def test_invalid_critic_values_replaced_by_valid_group_mean_with_zero_weight():
    v, w = ac2.replace_invalid_values([0.5, None, 1.0], [True, False, True])
    assert v == [0.5, 0.75, 1.0] and w == [1.0, 0.0, 1.0]
    v, w = ac2.replace_invalid_values([None, None], [False, False])
    assert v == [0.0, 0.0] and w == [0.0, 0.0]
    # an invalid judge verdict (0.0, not valid) keeps its 0 and full weight but is not part of the mean
    v, w = ac2.replace_invalid_values([0.0, None, 0.6], [False, False, True])
    assert v == [0.0, 0.6, 0.6] and w == [1.0, 0.0, 1.0]


def test_critic_rows_two_at_half_weight_with_reference_one_without():
    R = ac2.CriticRecord
    recs = [R(1, [], 0.5, "own proof"), R(2, [], 0.1, None), R(3, [], 1.0, None), R(4, [9] * 99, 0.0, None)]
    bank = {3: "bank proof", 1: "other"}
    fits = lambda rec, ref: len(rec.prefix) < 50  # noqa: E731
    rows, used = ac2.select_critic_rows(recs, [3, 0, 1, 2], bank, sample=3, fits=fits)
    assert used == 3  # record 4 overflows and is skipped, not counted
    assert [(r.problem, ref, w) for r, ref, w in rows] == [
        (1, "own proof", 0.5), (1, None, 0.5), (2, None, 1.0), (3, "bank proof", 0.5), (3, None, 0.5)]
    rows, used = ac2.select_critic_rows(recs, [0, 1, 2], bank, sample=1, fits=fits)
    assert used == 1 and len(rows) == 2


def test_critic_learning_rate_ladder_halves_after_two_high_steps_with_a_floor():
    a = ac2.Args()
    lr0 = a.critic_lr
    assert ac2.critic_ladder(lr0, 0, 2.0, a) == (lr0, 1)
    assert ac2.critic_ladder(lr0, 1, 2.0, a) == (lr0 / 2, 0)  # second consecutive: halve, streak restarts
    assert ac2.critic_ladder(lr0, 1, 1.0, a) == (lr0, 0)  # not consecutive
    assert ac2.critic_ladder(lr0, 1, None, a) == (lr0, 0)  # no critic step: the streak breaks
    assert ac2.critic_ladder(a.critic_lr_floor * 1.5, 1, 5.0, a) == (a.critic_lr_floor, 0)  # floor
    assert ac2.critic_ladder(lr0, 1, math.sqrt(2), a) == (lr0, 0)  # strictly above sqrt(2)


def test_entropy_offset_and_dual_clip_loss():
    a = ac2.Args()
    assert ac2.update_entropy_offset(0.06, 0.1, a) == pytest.approx(0.08)
    assert ac2.update_entropy_offset(-0.08, 0.9, a) == pytest.approx(-0.08)
    ratios = torch.tensor([1.5, 0.5, 5.0])
    loss, st = ac2.ppo_loss(torch.log(ratios), torch.zeros(3), torch.tensor([1.0, -1.0, -1.0]), 0.2, 0.36, 3.0)
    assert loss.tolist() == pytest.approx([-1.36, 0.8, 3.0])
    assert (st["clip_low"] | st["clip_high"]).tolist() == [True, True, False]
    assert st["clip_dual"].tolist() == [False, False, True]


def test_critic_context_and_target_tokens():
    tok = build_tokenizer()
    args = ac2.Args(short_critic_instruction=False)
    prompt = tok("<|im_start|>user\nP<|im_end|>\n<|im_start|>assistant\n<think>\n",
                 add_special_tokens=False)["input_ids"]
    attempt = tok("12+3=15\n", add_special_tokens=False)["input_ids"]
    text = tok.decode(ac2.critic_context(prompt, attempt, "REF", tok, args))
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nQ value: ")
    assert "12+3=15\n</think><|im_end|>\n<|im_start|>user\nPause here" in text  # </think> added once
    assert "reference correct proof here:\n\nREF\n\nDon't think" in text
    plain = tok.decode(ac2.critic_context(prompt, attempt, None, tok, args))
    assert "reference" not in plain and "credit.\n\nDon't think" in plain
    done = tok("1+2=3\n</think>\n\n\\boxed{3}", add_special_tokens=False)["input_ids"]
    text = tok.decode(ac2.critic_context(prompt, done, None, tok, args))
    assert text.count("</think>") == 2  # the attempt's own + the prefill's; none added
    assert tok.decode(ac2.critic_target(0.7, tok)) == "0.7<|im_end|>"
    assert tok.decode(ac2.critic_target(1.0, tok)) == "1<|im_end|>"
    assert tok.decode(ac2.critic_target(0.0, tok)) == "0<|im_end|>"


def test_the_tiny_ac2_model_read_in_the_other_order_is_refused_before_anything_loads(tmp_path, monkeypatch):
    # its critic learned the reference before the attempt; read the paper's way it is blind (docs/ac2.md)
    monkeypatch.chdir(tmp_path)
    args = ac2.tiny_args()
    args.model = "tiny-ac2"
    with pytest.raises(SystemExit, match="add --critic-reference-first"):
        ac2.main(args)
    assert list(tmp_path.iterdir()) == []  # no run folder, no checkpoint


def test_critic_reference_first_closes_the_problems_turn_and_leaves_the_instruction_without_it():
    tok = build_tokenizer()
    args = ac2.Args(short_critic_instruction=True, critic_reference_first=True)
    prompt = tok("<|im_start|>user\nAdd: 1+2<|im_end|>\n<|im_start|>assistant\n<think>\n",
                 add_special_tokens=False)["input_ids"]
    attempt = tok("1+2=4\n", add_special_tokens=False)["input_ids"]
    got = tok.decode(ac2.critic_context(prompt, attempt, "1+2=3", tok, args))
    assert got == ("<|im_start|>user\nAdd: 1+2 Reference:\n1+2=3<|im_end|>\n<|im_start|>assistant\n<think>\n"
                   "1+2=4\n</think><|im_end|>\n<|im_start|>user\nValue of this attempt?<|im_end|>\n"
                   "<|im_start|>assistant\n<think>\n\n</think>\n\nQ value: ")
    # without a reference it is the plain prompt, as with the flag off
    assert ac2.critic_context(prompt, attempt, None, tok, args) == ac2.critic_context(
        prompt, attempt, None, tok, ac2.Args(short_critic_instruction=True))


def test_tiny_models_critic_warm_start_format_is_ac2s_short_critic_prompt():
    from common import tiny

    tok = build_tokenizer()
    args = ac2.Args(short_critic_instruction=True)
    prompt = tok("<|im_start|>user\nAdd: 1+2<|im_end|>\n<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    attempt = tok("1+2=3\n", add_special_tokens=False)["input_ids"]
    got = tok.decode(ac2.critic_context(prompt["input_ids"], attempt, "REF", tok, args))
    ref = tiny.TINY_CRITIC_REFERENCE.format(reference_proof="REF")
    want = tok.decode(prompt["input_ids"] + attempt) + "</think>" + tiny.CRITIC_TURN.format(
        instruction=tiny.TINY_CRITIC_INSTRUCTION.format(reference=ref))
    assert got == want
    assert tiny.VALUE_STRINGS == ac2.GRID_STRINGS


def test_stale_buffer_holds_every_rollout_of_a_refresh():
    # the paper's variant: 1,920 fresh rollouts every 10 steps *are* the buffer
    assert ac2.buffer_capacity(ac2.Args(stale_every=10)) == 1920
    assert ac2.buffer_capacity(ac2.Args()) == 256
    assert ac2.buffer_capacity(ac2.tiny_args()) == 24 and ac2.buffer_capacity(ac2.Args(**{
        **vars(ac2.tiny_args()), "stale_every": 5})) == 160


def test_fresh_problems_without_replacement_and_more_passes_when_asked_for_more_than_the_set():
    a = ac2.draw_fresh(128, 32, np.random.default_rng([1, 1]))
    b = np.random.default_rng([1, 1]).choice(128, size=32, replace=False).tolist()
    assert a == b  # within the data set's size: exactly the old draw, so default runs are unchanged
    many = ac2.draw_fresh(128, 160 + 16, np.random.default_rng(0))
    assert len(many) == 176 and sorted(many[:128]) == list(range(128)) and len(set(many[128:])) == 48


def test_group_size_one_is_the_whole_w_o_group_and_audit_variant():
    assert ac2.audit_fraction(ac2.Args()) == 0.25
    assert ac2.audit_fraction(ac2.Args(group_size_one=True)) == 0.0  # one switch
    assert ac2.audit_fraction(ac2.Args(group_size_one=True, audit_frac=0.5)) == 0.5  # explicit wins
    assert ac2.audit_fraction(ac2.Args(audit_frac=0.0)) == 0.0


def test_a_skipped_non_finite_critic_step_counts_toward_halving():
    a = ac2.Args()
    lr0 = a.critic_lr
    assert ac2.ladder_ratio(math.inf, [1.0, 1.0]) == math.inf  # skipped: over the threshold (released code)
    assert ac2.ladder_ratio(None, [1.0, 1.0]) is None  # no critic step at all
    assert ac2.ladder_ratio(3.0, [1.0, 0.5]) == pytest.approx(2.0)
    assert ac2.ladder_ratio(3.0, [0.0, 0.0]) is None
    lr, streak = ac2.critic_ladder(lr0, 0, ac2.ladder_ratio(math.inf, [1.0, 1.0]), a)
    assert (lr, streak) == (lr0, 1)
    assert ac2.critic_ladder(lr, streak, ac2.ladder_ratio(math.inf, [0.0, 0.0]), a) == (lr0 / 2, 0)
