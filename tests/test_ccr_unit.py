"""CCR's rules (docs/ccr.md) pinned to hand-computed values."""

import pytest
import torch

import ccr


@pytest.mark.parametrize("text,n,want", [
    # plain, in order
    ("Answer 1: \\boxed{3}\nAnswer 2: \\boxed{5}\nAnswer 3: \\boxed{7}", 3, ["3", "5", "7"]),
    # nested braces (brace-depth matching)
    ("Answer 1: \\boxed{\\frac{1}{2}} Answer 2: \\boxed{x^{2}}", 2, ["\\frac{1}{2}", "x^{2}"]),
    # truncated mid-answer: an open \boxed{ is missing, and so is everything after it
    ("Answer 1: \\boxed{3}\nAnswer 2: \\boxed{1", 3, ["3", None, None]),
    ("Answer 1: \\boxed{3}\n12+3", 3, ["3", None, None]),
    # a missing first answer ends the run even if later ones exist
    ("Answer 2: \\boxed{5}\nAnswer 3: \\boxed{7}", 3, [None, None, None]),
    ("Answer 1: \\boxed{3} Answer 3: \\boxed{7}", 3, ["3", None, None]),
    # repeated marker: the first wins
    ("Answer 1: \\boxed{3}\nAnswer 1: \\boxed{4}\nAnswer 2: \\boxed{5}", 2, ["3", "5"]),
    # out of order: answer 2 before answer 1 does not count as answer 2
    ("Answer 2: \\boxed{5}\nAnswer 1: \\boxed{3}", 2, ["3", None]),
    # a marker without its own boxed answer does not borrow the next problem's
    ("Answer 1: I am not sure.\nAnswer 2: \\boxed{5}", 2, [None, None]),
    # once thinking has ended only the answer section counts: drafts inside it do not
    ("<think>\n1+2=3\nAnswer 1: \\boxed{3}\n</think>\nAnswer 2: \\boxed{9}", 2, [None, None]),
    ("<think>Answer 1: 5 I think.</think>\nAnswer 1: \\boxed{5}\nAnswer 2: \\boxed{6}", 2, ["5", "6"]),
    ("<think>Answer 1: \\boxed{4}</think>\nAnswer 1: \\boxed{5}", 1, ["5"]),  # a draft box never beats the final
    ("Answer 1: \\boxed{1}</think>a</think>\nAnswer 1: \\boxed{2}", 1, ["2"]),  # after the *last* </think>
    # a truncated completion still thinking: the whole text is its answer section
    ("1+2=3\nAnswer 1: \\boxed{3}\n4+5=9\nAnswer 2: \\boxed{9}\n7+", 3, ["3", "9", None]),
    # the tiny model's layout: thinking closed at once, then each problem solved and answered in order
    ("</think>\n\n1+2=3\nAnswer 1: \\boxed{3}\n4+5=9\nAnswer 2: \\boxed{9}", 2, ["3", "9"]),
    # an empty box is no answer, and ends the run
    ("Answer 1: \\boxed{}\nAnswer 2: \\boxed{}\nAnswer 3: \\boxed{}", 3, [None, None, None]),
    ("Answer 1: \\boxed{3}\nAnswer 2: \\boxed{ }\nAnswer 3: \\boxed{7}", 3, ["3", None, None]),
    ("no answers at all", 2, [None, None]),
])
def test_parse_packed_answers(text, n, want):
    assert ccr.parse_packed_answers(text, n) == want


def test_three_empty_boxes_score_nothing_while_one_correct_answer_then_a_cut_scores():
    n_eff = lambda ans: next((k for k, a in enumerate(ans) if a is None), len(ans))  # noqa: E731 - as score_packs
    empty = ccr.parse_packed_answers("Answer 1: \\boxed{}\nAnswer 2: \\boxed{}\nAnswer 3: \\boxed{}", 3)
    assert ccr.packed_reward([0.0] * 3, n_eff(empty), 3, 1.0, 0.5)[0] == 0.0  # was 0.5 (N_eff 3, r_fmt 1)
    one = ccr.parse_packed_answers("Answer 1: \\boxed{3}\nAnswer 2: \\boxed{1", 3)
    assert ccr.packed_reward([1.0, 0.0, 0.0], n_eff(one), 3, 1.0, 0.5)[0] == pytest.approx(1 / 3 + 0.5 / 3)


def test_advantages_divide_by_a_stabilised_group_std_by_default():
    assert ccr.Args().std_normalize  # the paper's Section 2
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = ccr.group_advantages(r, 4, ccr.Args().std_normalize)
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item()  # unbiased: 0.5
    assert adv.tolist() == pytest.approx([0.75 / (std + 1e-4), -0.25 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 2
                                         + [0.0] * 4)  # equal rewards: 0, not a division by zero
    assert ccr.group_advantages(r, 4, False).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_batch_defaults_follow_the_papers_tokens_per_step_and_step_count():
    a = ccr.Args()
    # ~175k tokens per step (4B) at ~5.5k tokens per completion = 32 completions; 1,000 packs, steps 1-1,000
    assert a.packs_per_step * a.group_size == 32 and 174_957 / 32 == pytest.approx(5_467, abs=1)
    steps_per_epoch = -(-(a.subset_size // a.pack_size) // a.packs_per_step)
    assert a.epochs * steps_per_epoch == 1000


def test_reward_values_including_truncated_after_two_correct_answers():
    # N = 3, truncated after two correct answers: r_acc = 2/3 (normalised by N, not N_eff), r_fmt = 2/3
    R, r_acc, r_fmt = ccr.packed_reward([1.0, 1.0, 0.0], n_eff=2, n=3, w_acc=1.0, w_fmt=0.5)
    assert (r_acc, r_fmt) == pytest.approx((2 / 3, 2 / 3)) and R == pytest.approx(2 / 3 + 0.5 * 2 / 3)
    # one of two completed answers wrong
    assert ccr.packed_reward([0.0, 1.0, 1.0], 2, 3, 1.0, 0.5)[:2] == pytest.approx((0.5 * 2 / 3 + 1 / 3, 1 / 3))
    # correctness after N_eff never counts (an answer found past the first missing one)
    assert ccr.packed_reward([1.0, 1.0, 1.0], 1, 3, 1.0, 0.0)[0] == pytest.approx(1 / 3)
    assert ccr.packed_reward([0.0, 0.0, 0.0], 0, 3, 1.0, 0.5) == (0.0, 0.0, 0.0)
    assert ccr.packed_reward([1.0, 1.0, 1.0], 3, 3, 1.0, 0.5) == pytest.approx((1.5, 1.0, 1.0))


def test_stratified_packs_one_problem_per_stratum_shuffled_and_redrawn():
    difficulties = [float(i % 9) for i in range(90)]  # 9 levels, 10 problems each
    packs = ccr.make_packs(difficulties, 3, epoch=0, seed=1)
    assert len(packs) == 30 and all(len(p) == 3 for p in packs)
    assert sorted(i for p in packs for i in p) == list(range(90))  # every problem exactly once
    order = sorted(range(90), key=lambda i: (difficulties[i], i))
    stratum = {i: order.index(i) // 30 for i in range(90)}
    assert all(sorted(stratum[i] for i in p) == [0, 1, 2] for p in packs)  # one per stratum
    assert any([stratum[i] for i in p] != [0, 1, 2] for p in packs)  # order shuffled inside packs
    assert packs == ccr.make_packs(difficulties, 3, 0, 1)  # seeded
    assert packs != ccr.make_packs(difficulties, 3, 1, 1)  # re-drawn next epoch
    assert len(ccr.make_packs(difficulties[:91] + [0.0], 3, 0, 1)) == 30  # leftovers dropped
