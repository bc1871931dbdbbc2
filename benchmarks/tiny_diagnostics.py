"""What the warm-started tiny model brings to AC2's critic and to CCR's packs: two measurements.

    python benchmarks/tiny_diagnostics.py [--problems 256] [--packs 64]

critic: cut one sampled answer per training problem on AC2's tiny cut grid, sample g = 16 continuations of
    each prefix, and compare against the tie-down-rounded group mean (AC2's probe target) (a) the warm-started
    critic's greedy value (ac2.py's prompt, with the reference trace) and (b) an oracle that knows the
    warm-start odds: 0 once a line is wrong, else 0.8 per line still to write. Errors by kind of prefix.
packing: greedy accuracy per position of packed prompts of N = 1..3 held-out problems in several layouts, as
    ccr.py parses them and, ignoring the `Answer k:` markers, by the k-th \\boxed{} of the completion.
Writes benchmarks/results/tiny_diagnostics.json.
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import ac2  # noqa: E402
import ccr  # noqa: E402
from common import engine  # noqa: E402
from common.tiny import (  # noqa: E402
    RECIPE,
    TINY_PACK_BUDGET,
    build_tokenizer,
    tiny_dataset,
    tiny_model_path,
    tiny_pack_prompt,
    tiny_reward,
    tiny_solution,
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--packs", type=int, default=64)
    a = ap.parse_args()
    from vllm import SamplingParams

    llm = engine.create_engine(tiny_model_path(), max_model_len=1024, seed=0)
    tok = build_tokenizer()
    enc = lambda user: tok(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,  # noqa: E731
                                                   add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    targs = ac2.tiny_args()

    # --- AC2's critic against its probe targets ---
    rows = tiny_dataset("train")[: a.problems]
    prompts = [enc(r["problem"]) for r in rows]
    first = engine.generate(llm, prompts, SamplingParams(temperature=1.0, max_tokens=targs.budget, seed=3))
    rng = np.random.default_rng(0)
    cuts = [ac2.draw_cut(len(f[0].token_ids), targs.cut_grid, targs.cut_max_frac, rng) for f in first]
    prefixes = [f[0].token_ids[:c] for f, c in zip(first, cuts)]
    conts = engine.generate(llm, [p + x for p, x in zip(prompts, prefixes)], [
        SamplingParams(n=targs.group_size, temperature=1.0, max_tokens=targs.budget - len(x), seed=i)
        for i, x in enumerate(prefixes)])
    contexts = [ac2.critic_context(p, x, tiny_solution(numbers(r)), tok, targs)
                for p, x, r in zip(prompts, prefixes, rows)]
    values = ac2.query_critic(llm, contexts, tok, 1024)
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for r, x, c, (v, _) in zip(rows, prefixes, conts, values):
        z = ac2.round_to_grid(float(np.mean([tiny_reward(tok.decode(x + o.token_ids, skip_special_tokens=True),
                                                         r["answer"]) for o in c])))
        text = tok.decode(x, skip_special_tokens=True)
        on_track = any(tiny_solution(numbers(r), check=ch).startswith(text) for ch in (False, True))
        left = len(numbers(r)) - 1 - text.split("check:")[0].count("\n")
        oracle = round(10 * (1 - RECIPE.error_rate) ** max(left, 0)) / 10 if on_track else 0.0
        kind = "empty" if not text else "after a wrong line" if not on_track else "check section" if "check:" in text \
            else "on track"
        by_kind.setdefault(kind, []).append((abs(oracle - z), 1.0 if v is None else abs(v - z)))
    critic = {k: {"prefixes": len(v), "oracle_mae": round(float(np.mean([e[0] for e in v])), 3),
                  "critic_mae": round(float(np.mean([e[1] for e in v])), 3)} for k, v in sorted(by_kind.items())}
    every = [e for v in by_kind.values() for e in v]
    critic["all"] = {"prefixes": len(every), "oracle_mae": round(float(np.mean([e[0] for e in every])), 3),
                     "critic_mae": round(float(np.mean([e[1] for e in every])), 3)}

    # --- CCR's packs: accuracy per position, by layout ---
    test = tiny_dataset("test")
    layouts = {
        "tiny preset (';', with the budget preamble)": lambda qs: tiny_pack_prompt(qs),
        "';', no preamble": lambda qs: ";".join(qs),
        "newline-separated, no preamble": lambda qs: "\n".join(qs),
        "the paper's layout (ccr.PACK_TEMPLATE, 'Problem k:')": lambda qs: ccr.PACK_TEMPLATE.format(
            n=len(qs), budget=TINY_PACK_BUDGET, problems="\n\n".join(f"Problem {k}: {q}" for k, q in enumerate(qs, 1))),
    }
    packing, prng = {}, random.Random(0)
    for name, layout in layouts.items():
        for n in (1, 2, 3):
            packs = [prng.sample(test, n) for _ in range(a.packs)]
            outs = engine.generate(llm, [enc(layout([p["problem"] for p in pk])) for pk in packs],
                                   SamplingParams(temperature=0.0, max_tokens=300))
            hits, boxed_hits = np.zeros(n), np.zeros(n)
            for o, pk in zip(outs, packs):
                text = tok.decode(o[0].token_ids, skip_special_tokens=True)
                got = ccr.parse_packed_answers(text, n)
                hits += [g is not None and g.strip() == p["answer"] for g, p in zip(got, pk)]
                boxed = re.findall(r"\\boxed\{([^{}]*)\}", text) + [None] * n  # the k-th answer, markers or not
                boxed_hits += [b is not None and b.strip() == p["answer"] for b, p in zip(boxed, pk)]
            packing[f"{name}, N={n}"] = {"parsed": [round(float(h) / a.packs, 3) for h in hits],
                                         "kth_boxed": [round(float(h) / a.packs, 3) for h in boxed_hits]}
    result = {"critic_vs_probe_targets": critic, "packed_greedy_accuracy_by_position": packing}
    out = ROOT / "benchmarks" / "results" / "tiny_diagnostics.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


def numbers(row: dict) -> list[int]:
    return [int(x) for x in row["problem"][len("Add: "):].split("+")]


if __name__ == "__main__":
    main()
