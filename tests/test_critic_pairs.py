"""The critic diagnostic's pairs (benchmarks/critic_pairs.py): each wrong attempt differs from its right twin in exactly
the slip its set names, on a held-out problem, with the later lines continuing from the wrong value."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import critic_pairs

from common.tiny import tiny_dataset, tiny_solution

TEST_PROBLEMS = {p["problem"] for p in tiny_dataset("test")}


def terms(problem: dict) -> list[int]:
    return [int(x) for x in problem["problem"][len("Add: "):].split("+")]


def whole_lines(attempt: str) -> list[tuple[int, int, int]]:
    """(total, term, sum) of each complete `a+b=c` line of an attempt."""
    out = []
    for line in attempt.split("\n"):
        if "=" in line and line.split("=")[1]:
            left, right = line.split("=")
            a, b = left.split("+")
            out.append((int(a), int(b), int(right)))
    return out


@pytest.mark.parametrize("where", ["last", "earlier"])
def test_a_seen_slip_is_one_sum_off_by_1_or_10_and_the_later_lines_continue_from_it(where):
    for p, right, wrong in critic_pairs.make_pairs("seen: +-1/+-10", 60, seed=7, where=where):
        assert p["problem"] in TEST_PROBLEMS  # held out of the warm start
        assert tiny_solution(terms(p)).startswith(right)  # the right attempt is a prefix of the correct trace
        r, w = whole_lines(right), whole_lines(wrong)
        assert len(r) == len(w) >= 1
        slips = [i for i, (a, b, c) in enumerate(w) if a + b != c]
        assert len(slips) == 1, (right, wrong)  # one wrong sum; every other line adds up
        i = slips[0]
        assert w[i][2] - r[i][2] in (-10, -1, 1, 10)
        assert all(w[k + 1][0] == w[k][2] for k in range(len(w) - 1))  # each line starts from what the last wrote
        if where == "earlier":
            assert i < len(w) - 1  # at least one whole line follows the wrong one
        else:
            assert i == len(w) - 1


def test_a_term_copied_wrong_is_summed_right_and_stopping_inside_the_number_leaves_one_digit_apart():
    for _, right, wrong in critic_pairs.make_pairs("unseen: a term copied wrong", 40, seed=3):
        r, w = whole_lines(right), whole_lines(wrong)
        assert w[-1][0] == r[-1][0] and abs(w[-1][1] - r[-1][1]) == 1 and w[-1][0] + w[-1][1] == w[-1][2]
        assert w[:-1] == r[:-1]
    for p, right, wrong in critic_pairs.make_pairs("seen: +-1/+-10", 40, seed=5, where="inside"):
        assert len(right) == len(wrong) and right[:-1] == wrong[:-1] and right[-1] != wrong[-1]
        assert tiny_solution(terms(p)).startswith(right)


def test_swapping_the_last_two_digits_always_changes_the_value():
    assert critic_pairs.swap_last_digits(1234) == 1243
    assert critic_pairs.swap_last_digits(1233) == 1233 + 9  # equal digits: still wrong, by another slip
    assert critic_pairs.swap_last_digits(7) == 16
