"""Can the tiny model's architecture learn the comparison at all? The skill AC2's tiny critic lacks, on its own.

    python benchmarks/compare_skill.py --order attempt-first --steps 1200 --short-steps 600  # AC2's order
    python benchmarks/compare_skill.py --order ref-first --steps 600                         # reference first
    python benchmarks/compare_skill.py --order ref-first --steps 1200 --short-steps 600      # + short problems first
    python benchmarks/compare_skill.py --order ref-first --clutter --steps 1200 --short-steps 600  # + a decoy copy
    python benchmarks/compare_skill.py --order ref-first --probe-layer 3 --steps 1200 --short-steps 600  # 3 layers
    python benchmarks/compare_skill.py --order critic --probe-layer 3 --steps 1200 --short-steps 600  # AC2's prompt
    python benchmarks/compare_skill.py --order attempt-first --steps 1800 --short-steps 600 --hidden 256 --heads 8 \
        --inter 768                                                # AC2's order, 4x the parameters
    python benchmarks/compare_skill.py --order ref-first --steps 2400 --short-steps 600 --switch-step 1200 \
        --switch-order attempt-first                               # AC2's order after the skill in the other one
    (what each reached: docs/ac2.md, "Can the tiny critic learn to judge?", attempts I and I2)

No chat, no problem, no value, no arithmetic: a fresh model of the tiny model's shape (common/tiny.py's recipe:
4 layers, 128 wide, head_dim 32; `--hidden`, `--heads`, `--layers` change it) reads a reference trace and an attempt
(one of a sibling pair: a right prefix of the trace, or the same with one running sum off by +-1/+-10, later lines
continuing from it, cut alike), and a linear probe on its last layer says at each labelled token whether the
attempt has, by there, departed from the reference. In AC2's prompt the attempt comes first (`--order
attempt-first`): the labels sit on the reference's tokens, as critic_probe.py's `--ref-flags`. With `--order
ref-first` the reference comes first and the labels sit on the attempt's tokens; `--clutter` writes the attempt once
more before the reference, as `critic_probe.py --requote` has it (the copy a lookup can take that carries no verdict).
`--order critic` wraps them in the whole of AC2's tiny critic prompt with `--critic-reference-first` (chat, the
problem and the reference in its turn, the attempt, the instruction), labels as ref-first's.
`--short-steps N`: for the first N steps problems have 2-3 terms only (1-2 lines to compare), then 2-6 again.
`--switch-step N --switch-order O`: from step N on, train in order O (the same model and probe), to ask whether the
skill learned in one order carries over to the other; the held-out pairs are then read in both orders.

Every `--eval-every` steps: the probe's loss and accuracy on the batch (fresh problems each step) beside the
share of 1-labels, and, on 100 held-out pairs a set (test-split problems with 3+ terms), how often the wrong attempt
gets the higher "departed" probability at the last labelled token (a tie fails): its wrong sum on the last line
(`last`) or 1-2 lines before (`earlier`). Chance is 50%; 100% is the skill.
"""

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from critic_pairs import running_lines
from critic_probe import HELD_OUT, TOK, attempt_start, chat, enc, terms

import ac2
from common.tiny import RECIPE, tiny_dataset, tiny_problem, tiny_solution


def sibling_pair(nums, rng, position="any"):
    """(right prefix, wrong prefix): line j's sum off by +-1/+-10 (later lines continue from it), both cut at the
    same place at or after the wrong sum's end; `position` 'last' cuts right after the wrong line, 'earlier' 1-2
    lines later."""
    nl = len(nums) - 1
    j = rng.randrange(nl - 1) if position == "earlier" else rng.randrange(nl)
    k = j if position == "last" else rng.randrange(j + 1, nl) if position == "earlier" else rng.randrange(j, nl)
    right = running_lines(nums)
    wrong = running_lines(nums, j, lambda v: v + rng.choice([-10, -1, 1, 10]))
    r, w = "\n".join(right[: k + 1]) + "\n", "\n".join(wrong[: k + 1]) + "\n"
    if position == "any" and k + 1 < nl:  # partway into the next line
        c = rng.randint(0, len(right[k + 1]))
        r, w = r + right[k + 1][:c], w + wrong[k + 1][:c]
    return r, w


def example(attempt, reference, order, clutter=False, nums=None):
    """(token ids, [(position, label)]): label 1 once the attempt has departed from the reference.

    attempt-first (AC2's order): `A:attempt\\nR:reference\\nQ:`, a label at reference token j: do the attempt's first
    j+1 tokens differ from the reference's (past the attempt's end the verdict carries on)?
    ref-first: `R:reference\\nQ:attempt` (with `clutter`, `A:attempt\\n` before it), a label at attempt token j: do its
    first j+1 tokens differ from the reference's (or run past its end)?
    critic: AC2's tiny critic prompt with the reference first (`nums`: the problem's terms), labels as ref-first's."""
    a, r = enc(attempt), enc(reference)
    labels, departed = [], False
    if order == "attempt-first":
        ids = enc("A:" + attempt + "\nR:")
        start = len(ids)
        for j, t in enumerate(r):
            departed = departed or (j < len(a) and a[j] != t)
            labels.append((start + j, float(departed)))
        return ids + r + enc("\nQ:"), labels
    if order == "critic":  # the whole of ac2.critic_context with --critic-reference-first, labels as ref-first's
        args = ac2.tiny_args()
        args.critic_reference_first = True
        ids = ac2.critic_context(chat("Add: " + "+".join(map(str, nums))), a, reference, TOK, args)
        start = attempt_start(ids)
    else:
        ids = enc(("A:" + attempt + "\n" if clutter else "") + "R:" + reference + "\nQ:")
        start = len(ids)
        ids = ids + a
    for j, t in enumerate(a):
        departed = departed or j >= len(r) or r[j] != t
        labels.append((start + j, float(departed)))
    return ids, labels


def train_example(rng, max_terms, order, clutter):
    while True:
        p = tiny_problem(rng)
        nums = terms(p)
        if p["problem"] not in HELD_OUT and len(nums) <= max_terms:
            break
    reference = tiny_solution(nums, check=rng.random() < 0.5)
    right, wrong = sibling_pair(nums, rng)
    return example(wrong if rng.random() < 0.5 else right, reference, order, clutter, nums)


def held_out_pairs(position, n=100, seed=1):
    rng = random.Random(seed)
    pool = [p for p in tiny_dataset("test") if p["difficulty"] >= 3]
    out = []
    for _ in range(n):
        nums = terms(rng.choice(pool))
        out.append((*sibling_pair(nums, rng, position), tiny_solution(nums, check=rng.random() < 0.5), nums))
    return out


def run_model(model, probe, batch, layer=-1):
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), TOK.pad_token_id)  # right padding: causal attention never sees it
    for i, (x, _) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
    rows, cols, ys = zip(*[(i, pos, y) for i, (_, lab) in enumerate(batch) for pos, y in lab])
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[layer]
    return probe(hidden[list(rows), list(cols)]).squeeze(-1), torch.tensor(ys), list(rows)


@torch.no_grad()
def pairs_right(model, probe, pairs, a, order):
    """Pairs whose wrong attempt gets the higher 'departed' logit at its last labelled token (a tie fails)."""
    model.eval()
    batch = [example(att, ref, order, a.clutter, nums) for right, wrong, ref, nums in pairs
             for att in (right, wrong)]
    logits, _, rows = run_model(model, probe, batch, a.probe_layer)
    last = {}
    for k, r in enumerate(rows):
        last[r] = logits[k].item()
    model.train()
    return sum(last[2 * i + 1] > last[2 * i] for i in range(len(pairs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--order", choices=["attempt-first", "ref-first", "critic"], default="attempt-first")
    ap.add_argument("--clutter", action="store_true", help="ref-first: the attempt also before the reference")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--short-steps", type=int, default=0, help="first steps on 2-3-term problems only")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=RECIPE.hidden_size)
    ap.add_argument("--heads", type=int, default=RECIPE.num_heads)
    ap.add_argument("--layers", type=int, default=RECIPE.num_layers)
    ap.add_argument("--inter", type=int, default=RECIPE.intermediate_size)
    ap.add_argument("--probe-layer", type=int, default=-1,
                    help="the probed hidden state: -1 the last layer's (normed) output, 3 the third layer's, 0 the "
                         "embeddings (AC2's critic must read the verdict from a layer below its last)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--switch-step", type=int, default=0, help="from this step on, train in --switch-order")
    ap.add_argument("--switch-order", choices=["attempt-first", "ref-first", "critic"], default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.clutter and a.order != "ref-first":
        ap.error("--clutter goes with --order ref-first")
    if (a.switch_order is None) != (a.switch_step == 0):
        ap.error("--switch-step and --switch-order go together")
    orders = [a.order] + ([a.switch_order] if a.switch_order else [])
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cfg = Qwen3Config(vocab_size=128, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=max(1, a.heads // 2), head_dim=RECIPE.head_dim,
                      max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None,
                      eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id, dtype="float32")
    model, probe = Qwen3ForCausalLM(cfg), torch.nn.Linear(a.hidden, 1)
    opt = torch.optim.AdamW([*model.parameters(), *probe.parameters()], lr=a.lr, weight_decay=0.01)
    rng = random.Random(a.seed)
    sets = {"last": held_out_pairs("last", seed=1), "earlier": held_out_pairs("earlier", seed=2)}
    print(" ".join(sys.argv), flush=True)
    t0, window = time.time(), []
    for step in range(a.steps):
        max_terms = 3 if step < a.short_steps else 6
        order = a.switch_order if a.switch_order and step >= a.switch_step else a.order
        logits, ys, _ = run_model(model, probe, [train_example(rng, max_terms, order, a.clutter)
                                                 for _ in range(a.batch)], a.probe_layer)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append((loss.item(), ((logits > 0).float() == ys).float().mean().item(), ys.mean().item()))
        if (step + 1) % a.eval_every == 0:
            n = len(window)
            loss_, acc, base = (sum(w[i] for w in window) / n for i in range(3))
            held = " ".join(f"{k} {pairs_right(model, probe, v, a, o)}/100" + (f" ({o})" if len(orders) > 1 else "")
                            for o in orders for k, v in sets.items())
            print(f"step {step + 1} {order} terms 2-{max_terms} loss {loss_:.4f} acc {acc:.3f} (1-labels {base:.3f}) "
                  f"held-out pairs right: {held} {time.time() - t0:.0f}s", flush=True)
            window = []


if __name__ == "__main__":
    main()
