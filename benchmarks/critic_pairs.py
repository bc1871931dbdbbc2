"""Can AC2's critic tell a right prefix from a wrong one? Pairs of prefixes identical but for one wrong running sum.

    python benchmarks/critic_pairs.py                              # the tiny model AC2 uses (ac2.py --tiny)
    python benchmarks/critic_pairs.py --model checkpoints/<run>/step_50/policy --pairs 200
    python benchmarks/critic_pairs.py --model <folder> --critic-reference-first   # the reference before the attempt

Each pair is one held-out problem (the test split: never in the warm start, never trained on) with two attempts
cut at the same place: the right running sums, and the same with one sum wrong (the lines after it continue
from the wrong value, as the policy's own slips do). The critic is the model itself, asked with AC2's own prompt
and the correct trace as reference (`ac2.critic_context`, read greedily by `ac2.query_critic`: exactly what
ac2.py --tiny does); a pair counts when the right prefix gets the higher value (a tie fails). The sets:

    seen kind        the wrong sum off by +-1 or +-10 (the warm start's own slips), the prefix's last line or earlier
    unseen kinds     off by +-2/+-5/+-20, by +-100, two last digits swapped, or a term copied wrong (b+-1 in the line,
                     the sum right for the wrong term): kinds no warm-start example holds
    unseen position  the attempt stops inside the wrong number (its first differing digit): a warm-start pair
                     always holds the whole wrong sum
    no reference     the seen kind without the reference in the prompt (AC2 asks without one before the bank holds a
                     proof of the problem)

Writes benchmarks/results/critic_pairs.json (or --out).
"""

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ac2  # noqa: E402
from common import engine  # noqa: E402
from common.tiny import build_tokenizer, tiny_dataset, tiny_solution  # noqa: E402


def running_lines(numbers: list[int], wrong_line: int | None = None, slip=None, term_slip: int = 0) -> list[str]:
    """The running-sum lines; line `wrong_line` gets `slip(correct sum)` (or its term `term_slip` more, summed
    right), and later lines continue from what it wrote."""
    lines, total = [], numbers[0]
    for i, x in enumerate(numbers[1:]):
        if i == wrong_line and term_slip:
            x = x + term_slip
        new = total + x
        if i == wrong_line and slip is not None:
            new = slip(new)
        lines.append(f"{total}+{x}={new}")
        total = new
    return lines


def swap_last_digits(v: int) -> int:
    s = str(v)
    return int(s[:-2] + s[-1] + s[-2]) if len(s) >= 2 and s[-1] != s[-2] else v + 9


def off_by(choices: list[int]):
    """A slip maker: for each pair, draw one offset from `choices` and add it to the right sum."""
    def make(rng):
        offset = rng.choice(choices)
        return lambda v: v + offset
    return make


SLIPS = {  # set name -> what a wrong sum is
    "seen: +-1/+-10": off_by([-10, -1, 1, 10]),
    "unseen: +-2/+-5/+-20": off_by([-20, -5, -2, 2, 5, 20]),
    "unseen: +-100": off_by([-100, 100]),
    "unseen: digits swapped": lambda rng: swap_last_digits,
}


def make_pairs(kind: str, n: int, seed: int, where: str = "last") -> list[tuple[dict, str, str]]:
    """`n` (problem, right attempt, wrong attempt) on held-out problems. where: 'last' (the wrong sum is the last
    whole line, then a newline or the next line's first number), 'earlier' (1+ lines follow it) or 'inside' (the
    attempt stops at the wrong number's first differing digit)."""
    rng = random.Random(seed)
    pool = [p for p in tiny_dataset("test") if p["difficulty"] >= (3 if where == "earlier" else 2)]
    pairs = []
    while len(pairs) < n:
        p = rng.choice(pool)
        numbers = [int(x) for x in p["problem"][len("Add: "):].split("+")]
        n_lines = len(numbers) - 1
        j = rng.randrange(n_lines - 1) if where == "earlier" else rng.randrange(n_lines)
        if kind == "unseen: a term copied wrong":
            wrong = running_lines(numbers, j, term_slip=rng.choice([-1, 1]))
        else:
            wrong = running_lines(numbers, j, SLIPS[kind](rng))
        right = running_lines(numbers)
        if wrong == right:
            continue
        k = rng.randrange(j + 1, n_lines) if where == "earlier" else j  # the last whole line of the attempt
        r, w = "\n".join(right[: k + 1]), "\n".join(wrong[: k + 1])
        if where == "inside":
            at = next(i for i, (a, b) in enumerate(zip(r, w)) if a != b)
            r, w = r[: at + 1], w[: at + 1]
        elif k + 1 < n_lines and rng.random() < 0.5:
            r, w = r + "\n" + right[k + 1].split("+")[0], w + "\n" + wrong[k + 1].split("+")[0]
        else:
            r, w = r + "\n", w + "\n"
        pairs.append((p, r, w))
    return pairs


def critic_values(llm, tok, args, pairs, with_reference: bool) -> tuple[list, list]:
    """The critic's values of each pair's right and wrong prefix, read as AC2 reads them (`critic_context` with the
    problem's reference solution or none, `query_critic`: greedy, None where the output is not a value)."""
    contexts = []
    for p, right, wrong in pairs:
        prompt = ac2.encode_chat(tok, args.prompt_template.format(problem=p["problem"]))
        numbers = [int(x) for x in p["problem"][len("Add: "):].split("+")]
        reference = tiny_solution(numbers) if with_reference else None
        for attempt in (right, wrong):
            contexts.append(ac2.critic_context(prompt, tok(attempt, add_special_tokens=False)["input_ids"],
                                               reference, tok, args))
    values = [v for v, _ in ac2.query_critic(llm, contexts, tok, 1024)]
    return values[0::2], values[1::2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model folder or tiny-ac2 (default: the model ac2.py --tiny uses)")
    ap.add_argument("--pairs", type=int, default=120, help="pairs per set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--critic-reference-first", action="store_true",
                    help="ac2.py's flag: the reference closes the problem's turn, before the attempt")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "critic_pairs.json"))
    a = ap.parse_args()
    args = ac2.tiny_args()
    args.critic_reference_first = a.critic_reference_first
    model = ac2.resolve_model(a.model or args.model)
    llm = engine.create_engine(model, max_model_len=1024, seed=a.seed)
    tok = build_tokenizer()
    sets = {"seen: +-1/+-10, last line": ("seen: +-1/+-10", "last", True),
            "seen: +-1/+-10, an earlier line": ("seen: +-1/+-10", "earlier", True),
            "unseen: +-2/+-5/+-20": ("unseen: +-2/+-5/+-20", "last", True),
            "unseen: +-100": ("unseen: +-100", "last", True),
            "unseen: digits swapped": ("unseen: digits swapped", "last", True),
            "unseen: a term copied wrong": ("unseen: a term copied wrong", "last", True),
            "unseen position: inside the wrong number": ("seen: +-1/+-10", "inside", True),
            "no reference: +-1/+-10, last line": ("seen: +-1/+-10", "last", False)}
    shown = Path(model).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    result = {"model": str(shown), "pairs_per_set": a.pairs, "critic_reference_first": a.critic_reference_first,
              "sets": {}}
    for s, (name, (kind, where, with_reference)) in enumerate(sets.items()):
        pairs = make_pairs(kind, a.pairs, seed=1000 * a.seed + s, where=where)
        right_v, wrong_v = critic_values(llm, tok, args, pairs, with_reference)
        values = right_v + wrong_v
        higher = sum(r is not None and w is not None and r > w for r, w in zip(right_v, wrong_v))
        result["sets"][name] = {
            "pairs": len(pairs), "right_higher": higher, "accuracy": round(higher / len(pairs), 3),
            "alike": sum(r == w for r, w in zip(right_v, wrong_v)),
            "right_lower": sum(r is not None and w is not None and r < w for r, w in zip(right_v, wrong_v)),
            "invalid": sum(v is None for v in values),
            "mean_value_right": round(sum(v or 0 for v in right_v) / len(pairs), 3),
            "mean_value_wrong": round(sum(v or 0 for v in wrong_v) / len(pairs), 3)}
        r = result["sets"][name]
        print(f"{name:>42}: right higher in {r['right_higher']:>3} of {r['pairs']} ({r['accuracy']:.3f}), "
              f"alike {r['alike']}, mean value right {r['mean_value_right']:.2f} / wrong {r['mean_value_wrong']:.2f}",
              flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
