"""Probe: can more training, or more depth, teach the tiny model to judge a prefix against a reference solution?

    python benchmarks/critic_probe.py --cycle c --steps 750 --eval-every 250            # attempt A (docs/ac2.md)
    python benchmarks/critic_probe.py --grow 4 --cycle c --steps 1000 --eval-every 250  # attempt B: 8 layers
    python benchmarks/critic_probe.py --cycle c --pair-frac 1.0 --ref-prob 0.5 --flag-weight 1.0 \
        --schedule constant --steps 600 --eval-every 150                                # attempt E: a dense label
    python benchmarks/critic_probe.py --requote --requote-lm --cycle c --pair-frac 1.0 --ref-prob 1.0 \
        --flag-weight 1.0 --ref-flags --schedule constant --steps 900 --eval-every 150  # attempt H4: a repeat
    python benchmarks/critic_probe.py --ref-first --cycle c --pair-frac 1.0 --ref-prob 1.0 --flag-weight 1.0 \
        --short-steps 600 --schedule constant --steps 1200 --eval-every 300            # attempt J: reference first
    python benchmarks/critic_probe.py --init scratch --ref-first --cycle c --pair-frac 1.0 --ref-prob 1.0 \
        --flag-weight 1.0 --short-steps 600 --value-from 600 --schedule constant --steps 1500 --eval-every 300  # J3
    python benchmarks/critic_probe.py --init common/tiny_ac2_model --lsd --ref-first --pair-frac 1.0 --ref-prob 1.0 \
        --flag-weight 1.0 --cycle s --lr 3e-3 --schedule cosine --steps 1200 --save --out checkpoints/l1  # L1
    python benchmarks/critic_probe.py --baselines --pair-frac 1.0 --ref-prob 0.5  # what no skill scores (E's mix)
    python benchmarks/critic_probe.py --frozen-probe --steps 0   # which layer holds "this sum is wrong" (none)
    (every attempt's command, A-P, and what it reached: docs/ac2.md, "Can the tiny critic learn to judge?")

Fine-tunes the shipped tiny model (or `--init scratch`, or the shipped model with `--grow N` decoder layers appended
whose output projections start at zero, so the function is unchanged at step 0) on batches of the warm start's
kinds: `s` solve (the policy's own traces), `c` critic (AC2's `critic_context` with the reference solution in the
prompt, `--ref-prob`; a share `--pair-frac` of them as sibling pairs: a right prefix and the same with one running
sum off by +-1 or +-10, later lines continuing from it, cut at the same place), `p` packed (CCR's prompts). The label
is the warm start's: 0 once the attempt has left every correct trace, else 0.8^(lines left), rounded to a tenth.
Training-only linear probes add dense labels (never saved: the critic stays the plain model): `--flag-weight` "has
the attempt gone wrong by here", on the attempt's tokens or (`--ref-flags`) on the reference's; `--copy-weight`
"which token does the attempt have here", on the reference's. `--requote` quotes the attempt again after the
reference in the tiny critic prompt (a format change, for the probe only), and `--requote-lm` adds next-token loss
on that quote. `--ref-first` is ac2.py's `--critic-reference-first` (the reference closes the problem's turn, before
the attempt); `--short-steps N` draws 2-3-term problems only for the first N steps (compare_skill.py's curriculum).
`--lsd` writes every running sum's digits least-significant first (a format change, for the probe only).
`--shrink/--perturb` start a phase from shrunk weights (Ash & Adams 2020); `--teacher DIR` trains solve batches on a
model's next-token distribution instead of the traces' tokens (distillation); `--freeze N` trains only the layers
from the N-th on (with `--grow`: only the new ones).

Every `--eval-every` steps it prints, on held-out problems (the test split), how often the right prefix of a pair is
valued higher than the wrong one when read greedily (a tie fails): off by +-1/+-10 on the last line, on an earlier
line, off by +-2/+-5/+-20 (a kind training never shows), without the reference; the same from the probability of
"0" (`soft_*`: chance is 0.5); with `--flag-weight` on the attempt's tokens, how often the wrong prefix gets the
higher probe logit at its last token (`probe_*`, chance 50: whether the verdict has formed where the probe reads it,
before the value reads it; `--value-from N` trains the dense label alone for the first N steps); and the policy's
greedy accuracy. The full diagnostic with vLLM, as AC2 reads the
critic, is benchmarks/critic_pairs.py (`--model <the --save folder>`).
"""

import argparse
import copy
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from critic_pairs import running_lines as msd_lines

import ac2
from common.tiny import (
    SHIPPED,
    VALUE_STRINGS,
    build_tokenizer,
    tiny_dataset,
    tiny_pack_prompt,
    tiny_packed_solution,
    tiny_problem,
    tiny_reward,
)
from common.tiny import tiny_solution as msd_solution

TOK = build_tokenizer()
EOS = TOK.eos_token_id
HELD_OUT = {p["problem"] for p in tiny_dataset("test")}
HELD_OUT_LINES = [p for p in tiny_dataset("test") if p["difficulty"] >= 2]  # a wrong sum needs a line


def chat(user):
    return TOK(TOK.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


REQUOTE = "\nAttempt:\n"
FORMAT = {"requote": False, "ref_first": False, "lsd": False}
SUM_LINE = re.compile(r"^(\d+)\+(\d+)=(\d+)$", re.M)


def lsd(text):
    """`--lsd`: every running-sum line's numbers written least-significant digit first ("47+35=82" becomes
    "74+53=28"), so that a sum's digits come in the order its carries are computed (Lee et al. 2023, "Teaching
    arithmetic to small transformers": reversed digits make addition learnable where the plain order is not); the
    problem and the boxed answer stay as they are, so the verifier is unchanged. Off without the flag."""
    if not FORMAT["lsd"]:
        return text
    return SUM_LINE.sub(lambda m: "{}+{}={}".format(*(g[::-1] for g in m.groups())), text)


def tiny_solution(nums, rng=None, error_rate=0.0, check=False):
    """common.tiny's trace, in `--lsd`'s digit order when it is on."""
    return lsd(msd_solution(nums, rng, error_rate, check))


def running_lines(nums, wrong_line=None, slip=None):
    """critic_pairs' running-sum lines (line `wrong_line` off by `slip`), in `--lsd`'s digit order when it is on."""
    return [lsd(line) for line in msd_lines(nums, wrong_line, slip)]


def critic_ids(problem, attempt_text, reference_text):
    """Exactly ac2.critic_context with the tiny instruction; with `--requote` the attempt is quoted again after the
    reference (`Attempt:`), so that a right attempt repeats the reference's beginning token for token."""
    args = ac2.tiny_args()
    args.critic_reference_first = FORMAT["ref_first"]
    attempt = TOK(attempt_text, add_special_tokens=False)["input_ids"]
    if FORMAT["requote"] and reference_text is not None:
        reference_text = reference_text + REQUOTE + attempt_text
    return ac2.critic_context(chat(problem), attempt, reference_text, TOK, args)


KINDS = {"pm1_10": [1, -1, 10, -10], "pm2_5_20": [2, -2, 5, -5, 20, -20]}


def make_pairs(kind, n, seed, position="last", problems=None):
    """(problem, right prefix, wrong prefix, reference) on held-out problems with >= 3 terms.
    position 'last': the wrong sum is the prefix's last complete line, cut right after it (or partway into the next);
    'earlier': 1-2 lines continue after the wrong one (from the wrong value); 'first': the first line is wrong."""
    rng = random.Random(seed)
    pool = [p for p in (problems or tiny_dataset("test")) if p["difficulty"] >= 3]
    out = []
    while len(out) < n:
        p = rng.choice(pool)
        nums = terms(p)
        nl = len(nums) - 1
        if position == "first":
            j = k = 0
        elif position == "last":
            j = rng.randrange(nl)
            k = j
        else:
            if nl < 2:
                continue
            j = rng.randrange(nl - 1)
            k = rng.randrange(j + 1, nl)
        d = rng.choice(KINDS[kind])
        right, wrong = running_lines(nums), running_lines(nums, j, lambda v, d=d: v + d)
        if right == wrong:
            continue
        tail = ""
        if k + 1 < nl and rng.random() < 0.5:  # partway into the next line: its first operand
            tail = None
        r = "\n".join(right[: k + 1]) + "\n"
        w = "\n".join(wrong[: k + 1]) + "\n"
        if tail is None:
            r += right[k + 1].split("+")[0]
            w += wrong[k + 1].split("+")[0]
        ref = tiny_solution(nums, check=rng.random() < 0.5)
        out.append((p["problem"], r, w, ref))
    return out


@torch.no_grad()
def greedy_texts(model, contexts, max_new_tokens, batch=64):
    """Greedy continuations of token-id contexts (left-padded batches), decoded."""
    model.eval()
    texts = []
    for i in range(0, len(contexts), batch):
        chunk = contexts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), TOK.pad_token_id)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, c in enumerate(chunk):
            ids[r, width - len(c):] = torch.tensor(c)
            mask[r, width - len(c):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)
        texts += [TOK.decode(out[r, width:], skip_special_tokens=True) for r in range(len(chunk))]
    return texts


def greedy_values(model, contexts):
    return [ac2.parse_critic_value(t) for t in greedy_texts(model, contexts, 4)]


def pair_report(model, pairs, with_reference=True):
    ctx = []
    for prob, r, w, ref in pairs:
        shown = ref if with_reference else None
        ctx += [critic_ids(prob, r, shown), critic_ids(prob, w, shown)]
    v = greedy_values(model, ctx)
    right, wrong = v[0::2], v[1::2]
    higher = sum(a is not None and b is not None and a > b for a, b in zip(right, wrong))
    alike = sum(a == b for a, b in zip(right, wrong))
    return {"pairs": len(pairs), "right_higher": higher, "alike": alike, "acc": round(higher / len(pairs), 3),
            "mean_right": round(sum(x or 0 for x in right) / len(right), 3),
            "mean_wrong": round(sum(x or 0 for x in wrong) / len(wrong), 3)}


@torch.no_grad()
def probe_pairs(model, probe, pairs, layer, at_value=False):
    """Pairs whose wrong prefix gets the higher --flag-weight probe logit at its last attempt token (or, `at_value`,
    at the context's last token, where the value is read; a tie fails): whether the verdict has formed there, read
    where the probe reads it, beside the value's own pairs."""
    model.eval()
    right_wrong = []
    for prob, r, w, ref in pairs:
        for attempt in (r, w):
            ctx = critic_ids(prob, attempt, ref)
            last = len(ctx) - 1 if at_value else attempt_start(ctx) + len(enc(attempt)) - 1
            hidden = model(input_ids=torch.tensor([ctx]), output_hidden_states=True).hidden_states[layer]
            right_wrong.append(probe(hidden[0, last]).item())
    return sum(w > r for r, w in zip(right_wrong[0::2], right_wrong[1::2]))


def policy_greedy_acc(model, n=64):
    test = tiny_dataset("test")[:n]
    texts = greedy_texts(model, [chat(p["problem"]) for p in test], 200, batch=32)
    return sum(tiny_reward(t, p["answer"]) for t, p in zip(texts, test)) / n


@torch.no_grad()
def zero_logprob(model, contexts, batch=64):
    """log P(value "0" then end-of-turn | context), right-padded batch."""
    zero = TOK("0", add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    out = []
    model.eval()
    for i in range(0, len(contexts), batch):
        chunk = [c + zero for c in contexts[i:i + batch]]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), TOK.pad_token_id)
        for r, c in enumerate(chunk):
            ids[r, :len(c)] = torch.tensor(c)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        for r, c in enumerate(chunk):
            n = len(c)
            out.append(float(logp[r, n - 3, zero[0]] + logp[r, n - 2, zero[1]]))
    return out


def soft_pairs(model, pairs):
    ctx = []
    for prob, r, w, ref in pairs:
        ctx += [critic_ids(prob, r, ref), critic_ids(prob, w, ref)]
    z = zero_logprob(model, ctx)
    return round(sum(b > a for a, b in zip(z[0::2], z[1::2])) / len(pairs), 3)


def terms(p):
    return [int(x) for x in p["problem"][len("Add: "):].split("+")]


def draw_held_out(rng):
    """A test-split problem with 2+ terms and its terms."""
    p = rng.choice(HELD_OUT_LINES)
    return p, terms(p)


def draw(rng, max_terms=6):
    """A training problem (never one of the test split's) with at most `max_terms` terms, and its terms."""
    while True:
        p = tiny_problem(rng)
        if p["problem"] not in HELD_OUT and len(terms(p)) <= max_terms:
            return p, terms(p)


def enc(t):
    return TOK(t, add_special_tokens=False)["input_ids"]


def left_every_trace(attempt, nums):
    return not any(tiny_solution(nums, check=c).startswith(attempt) for c in (False, True))


def value_of(attempt, nums, label_rate):
    """The warm start's label (as an index into VALUE_STRINGS): 0 once the attempt has left every correct trace,
    else (1 - label_rate)^(lines left)."""
    if left_every_trace(attempt, nums):
        return 0
    remaining = len(nums) - 1 - attempt.split("check:")[0].count("\n")
    return round(10 * (1 - label_rate) ** max(remaining, 0))


def attempt_start(ctx):
    """Where the attempt's tokens begin in a critic context: after the problem's turn (and, with `--ref-first`,
    the reference that closes it)."""
    marker = enc("<|im_start|>assistant\n<think>\n")
    return next(i + len(marker) for i in range(len(ctx)) if ctx[i:i + len(marker)] == marker)


def attempt_flags(ctx, attempt, nums, tail=False):
    """(position in the critic context, 1 if the attempt up to that token has left every correct trace) for each
    attempt token: the dense labels of `--flag-weight`. With `tail` (`--flag-tail`), every token after the attempt
    too (its turn's end, the instruction, the forced prefill) carries the verdict on the whole attempt, so that it
    is formed where the value is read."""
    start, ids = attempt_start(ctx), enc(attempt)
    assert ctx[start:start + len(ids)] == ids
    flags = [(start + i, float(left_every_trace(TOK.decode(ids[: i + 1]), nums))) for i in range(len(ids))]
    end = float(left_every_trace(attempt, nums))
    return flags + [(i, end) for i in range(start + len(ids), len(ctx))] * tail


def wait_trace(nums, rng, slip_rate):
    """A solving trace that notices every slip (--wait): the wrong line, then `wait: ` and the line with the right
    sum, and the trace goes on from the right value, so that writing `wait` needs knowing the sum just read is wrong."""
    lines, total = [], nums[0]
    for x in nums[1:]:
        if rng.random() < slip_rate:
            lines += [f"{total}+{x}={total + x + rng.choice([-10, -1, 1, 10])}", f"wait: {total}+{x}={total + x}"]
        else:
            lines.append(f"{total}+{x}={total + x}")
        total += x
    return "\n".join(lines) + "\n</think>\n\n\\boxed{" + str(total) + "}"


def reference_start(ctx):
    """Where the reference's tokens begin in a critic context."""
    marker = enc(" Reference:\n")
    return next(i + len(marker) for i in range(len(ctx)) if ctx[i:i + len(marker)] == marker)


def reference_flags(ctx, attempt, ref):
    """(position in the critic context, 1 if the attempt has, within its first j+1 tokens, differed from the
    reference's) for each reference token j: the dense labels of `--ref-flags`. Unlike `attempt_flags` they sit
    where the comparison can be made, after both texts; past the attempt's end the verdict carries on. With
    `--requote` they sit on the quoted attempt's tokens instead."""
    a, r = enc(attempt), enc(ref)
    start = reference_start(ctx)
    assert ctx[start:start + len(r)] == r
    out, diverged = [], False
    if FORMAT["requote"]:  # on the quoted attempt's tokens: has it, by this token, differed from the reference?
        start += len(r) + len(enc(REQUOTE))
        assert ctx[start:start + len(a)] == a
        for j, t in enumerate(a):
            diverged = diverged or j >= len(r) or r[j] != t
            out.append((start + j, float(diverged)))
        return out
    for j, t in enumerate(r):
        diverged = diverged or (j < len(a) and a[j] != t)
        out.append((start + j, float(diverged)))
    return out


def copy_targets(ctx, attempt, ref):
    """(position of reference token j, the attempt's token j) while the attempt lasts: `--copy-weight`'s labels,
    what the lookup behind the comparison must fetch."""
    a, start = enc(attempt), reference_start(ctx)
    return [(start + j, a[j]) for j in range(min(len(a), len(enc(ref))))]


def critic_example(p, nums, attempt, ref, a):
    ctx = critic_ids(p["problem"], attempt, ref)
    if not a.flag_weight:
        flags = []
    elif a.ref_flags:
        flags = reference_flags(ctx, attempt, ref) if ref else []
    else:
        flags = attempt_flags(ctx, attempt, nums, a.flag_tail)
    copies = copy_targets(ctx, attempt, ref) if a.copy_weight and ref else []
    if a.copy_lm and ref and a.ref_first:  # next-token loss on the attempt's tokens while it is still right
        lm = [pos for pos, wrong in attempt_flags(ctx, attempt, nums) if not wrong]
    else:
        lm = []
    loss_from = len(ctx)
    if a.requote_lm and ref:  # next-token loss on the quoted attempt too (from its second token), then the turn's
        # end and the forced prefill: the quote is an exact repeat of the attempt, what copying attention learns from
        loss_from = reference_start(ctx) + len(enc(ref)) + len(enc(REQUOTE)) + 1
    return ctx + enc(VALUE_STRINGS[value_of(attempt, nums, a.label_rate)]) + [EOS], loss_from, flags, copies, lm


def pair_prefixes(nums, d, rng, max_line=None):
    """A right prefix and the same with running sum j off by d (later lines continue from it), cut alike; with
    `max_line`, the wrong sum and the cut both lie in the first `max_line` lines (a curriculum's first stage)."""
    nl = len(nums) - 1
    if max_line:
        nl = min(nl, max_line)
    j = rng.randrange(nl)
    k = rng.randrange(j, nl)
    lr, lw = running_lines(nums), running_lines(nums, j, lambda v: v + d)
    r, w = "\n".join(lr[: k + 1]), "\n".join(lw[: k + 1])
    if k + 1 < len(nums) - 1:
        c = rng.randint(0, min(len(lr[k + 1]), len(lw[k + 1])))
        r, w = r + "\n" + lr[k + 1][:c], w + "\n" + lw[k + 1][:c]
    elif rng.random() < 0.75:
        r, w = r + "\n", w + "\n"
    return r, w


def example(kind, rng, a):
    """(token ids, where the loss starts) for one example of a batch kind: s solve, c critic, p packed."""
    if kind == "p":
        pack = [draw(rng) for _ in range(rng.choice([1, 2, 3]))]
        ctx = chat(tiny_pack_prompt([p["problem"] for p, _ in pack]))
        checks = [rng.random() < 0.5 for _ in pack]
        resp = tiny_packed_solution([n for _, n in pack], rng, a.error_rate, checks)
        return [(ctx + enc(resp) + [EOS], len(ctx), [], [], [])]
    p, nums = draw(rng, 3 if a.step < a.short_steps else 6)
    check = rng.random() < 0.5
    if kind == "s":
        ctx = chat(p["problem"])
        text = wait_trace(nums, rng, a.error_rate) if a.wait else tiny_solution(nums, rng, a.error_rate, check)
        return [(ctx + enc(text) + [EOS], len(ctx), [], [], [])]
    ref = tiny_solution(nums, check=rng.random() < 0.5) if rng.random() < a.ref_prob else None
    if rng.random() < a.pair_frac and len(nums) >= 2:
        max_line = a.pair_max_line if a.step < a.curriculum_steps else None
        r, w = pair_prefixes(nums, rng.choice([-10, -1, 1, 10]), rng, max_line)
        return [critic_example(p, nums, r, ref, a), critic_example(p, nums, w, ref, a)]
    text = tiny_solution(nums, rng, a.error_rate, check)
    ids = enc(text)
    attempt = TOK.decode(ids[: rng.randint(0, len(ids))])
    return [critic_example(p, nums, attempt, ref, a)]


def baselines(a, n=3000):
    """What no skill scores, on the probe's own sibling pairs: the value loss of a critic that knows how many lines
    are left but not whether they are right (each pair's two label strings equally likely, token by token), any
    line and first line only; and --flag-weight's label base rate with a constant guess's loss."""
    out = {}
    for name, max_line in (("value_loss_any_line", None), ("value_loss_first_line", 1)):
        rng, total, count = random.Random(0), 0.0, 0
        for _ in range(n):
            _, nums = draw(rng)
            r, w = pair_prefixes(nums, rng.choice([-10, -1, 1, 10]), rng, max_line)
            seqs = [enc(VALUE_STRINGS[value_of(x, nums, a.label_rate)]) + [EOS] for x in (r, w)]
            for q in seqs:
                for i, t in enumerate(q):
                    alike = [o for o in seqs if o[:i] == q[:i]]
                    total -= math.log(sum(len(o) > i and o[i] == t for o in alike) / len(alike))
                    count += 1
        out[name] = round(total / count, 4)
    rng, ys, by_offset = random.Random(5), [], {}
    a.flag_weight, a.step = 1.0, 0
    for _ in range(400):
        for ex in example("c", rng, a):
            for pos, y in ex[2]:
                ys.append(y)
                by_offset.setdefault(pos - ex[2][0][0], []).append(y)

    def entropy(q):
        return 0.0 if q in (0.0, 1.0) else -(q * math.log(q) + (1 - q) * math.log(1 - q))

    rate = sum(ys) / len(ys)
    out["flag_rate"] = round(rate, 3)
    out["flag_loss_constant"] = round(entropy(rate), 4)
    # a guess that knows only how far into the labelled text the token is: what position alone tells
    out["flag_loss_position_only"] = round(sum(len(v) * entropy(sum(v) / len(v)) for v in by_offset.values())
                                           / len(ys), 4)
    print(json.dumps(out))


@torch.no_grad()
def frozen_probe(model, where="digit", n_train=2000, n_test=500):
    """Where in the frozen model is "this sum is wrong" readable? Attempts cut at the first digit where a wrong sum
    differs from the right one (`where` 'digit'), or right after the wrong line's newline ('line_end', where a trace
    that notices its slip writes `wait`), and the same cut of the right twin, in the plain solving context; a logistic
    regression on each layer's output at that last token, fitted on training problems and scored on held-out ones.
    Beside it, at the digit, the policy's own surprise: the log-probability its prediction a token earlier gave it."""
    def cuts(rng, n, drawn):
        out = []
        while len(out) < n:
            p, nums = drawn(rng)
            if len(nums) < 2:
                continue
            j = rng.randrange(len(nums) - 1)
            d = rng.choice([-10, -1, 1, 10])
            r, w = "\n".join(running_lines(nums)), "\n".join(running_lines(nums, j, lambda v, d=d: v + d))
            at = next(i for i, (x, y) in enumerate(zip(r, w)) if x != y)
            if where == "digit":
                r, w = r[: at + 1], w[: at + 1]
            else:  # each through its own newline: a slip can change the sum's length
                r, w = ((t + "\n")[: (t + "\n").index("\n", at) + 1] for t in (r, w))
            out += [(chat(p["problem"]) + enc(r), 0.0), (chat(p["problem"]) + enc(w), 1.0)]
        return out

    def features(examples):
        layers, surprise = [], []
        for ids, _ in examples:
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
            layers.append(torch.stack([h[0, -1] for h in out.hidden_states]))  # embeddings, layers 1..L (normed)
            logp = torch.log_softmax(out.logits[0, -2].float(), -1)
            surprise.append(float(logp[ids[-1]]))
        return torch.stack(layers), torch.tensor(surprise)

    model.eval()
    train, test = cuts(random.Random(7), n_train, draw), cuts(random.Random(8), n_test, draw_held_out)
    (xa, sa), (xb, sb) = features(train), features(test)
    ya, yb = torch.tensor([y for _, y in train]), torch.tensor([y for _, y in test])
    report = {}
    for layer in range(xa.shape[1]):
        mu, sd = xa[:, layer].mean(0), xa[:, layer].std(0) + 1e-6
        fa, fb = (xa[:, layer] - mu) / sd, (xb[:, layer] - mu) / sd
        with torch.enable_grad():
            lin = torch.nn.Linear(fa.shape[1], 1)
            opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-4)
            for _ in range(300):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(fa).squeeze(-1), ya)
                opt.zero_grad()
                loss.backward()
                opt.step()
        acc = [round(float(((lin(f).squeeze(-1) > 0).float() == y).float().mean()), 3) for f, y in ((fb, yb), (fa, ya))]
        last = layer == xa.shape[1] - 1
        report["embeddings" if layer == 0 else f"layer_{layer}" + (" (after the final norm)" if last else "")] = acc
    if where == "digit":
        cut = sa.median()  # the surprise alone, one threshold fitted on the training examples
        report["policy_surprise"] = [round(float(((x < cut).float() == y).float().mean()), 3)
                                     for x, y in ((sb, yb), (sa, ya))]
    print(json.dumps({"probe_at": where, "accuracy_held_out_and_train": report, "train": len(train),
                      "test": len(test)}), flush=True)


def says_wait(model, n=200):
    """How often the greedy policy writes `wait` right after a wrong line, and after a right one (held-out)."""
    rng, ctx, wrong = random.Random(9), [], []
    while len(ctx) < n:
        p, nums = draw_held_out(rng)
        j, d = rng.randrange(len(nums) - 1), rng.choice([-10, -1, 1, 10])
        for lines, bad in ((running_lines(nums), False), (running_lines(nums, j, lambda v, d=d: v + d), True)):
            ctx.append(chat(p["problem"]) + enc("\n".join(lines[: j + 1]) + "\n"))
            wrong.append(bad)
    said = [t.startswith("wait") for t in greedy_texts(model, ctx, 4)]
    print(json.dumps({"says_wait_after_a_wrong_line": sum(s for s, b in zip(said, wrong) if b),
                      "after_a_right_line": sum(s for s, b in zip(said, wrong) if not b), "pairs": n // 2}), flush=True)


@torch.no_grad()
def mc_pairs(model, pair_sets, k, seed=0):
    """What Monte-Carlo labels would say about the probe's pairs: the policy's success rate over k samples at T = 1
    (max 200 new tokens, as the evaluation samples) from each prefix, right and wrong, in the plain solving context."""
    torch.manual_seed(seed)
    model.eval()
    answers = {p["problem"]: p["answer"] for p in tiny_dataset("test")}
    report = {}
    for name in ("last", "earlier"):
        rates, repaired = {"right": [], "wrong": []}, []
        for prob, r, w, _ in pair_sets[name]:
            for side, prefix in (("right", r), ("wrong", w)):
                ids = torch.tensor([chat(prob) + enc(prefix)] * k)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=200,
                                     pad_token_id=TOK.pad_token_id, eos_token_id=EOS)
                texts = [prefix + TOK.decode(o[ids.shape[1]:], skip_special_tokens=True) for o in out]
                wins = [t for t in texts if tiny_reward(t, answers[prob])]
                rates[side].append(len(wins) / k)
                repaired += ["check:" in t for t in wins] if side == "wrong" else []
        n = len(rates["right"])
        report[f"pm1_10_{name}"] = {
            "mean_right": round(sum(rates["right"]) / n, 3), "mean_wrong": round(sum(rates["wrong"]) / n, 3),
            "wrong_ever_right": sum(x > 0 for x in rates["wrong"]),
            "wrong_wins_through_check": f"{sum(repaired)} of {len(repaired)}",  # the check: pass re-adds the terms
            "right_higher": sum(x > y for x, y in zip(rates["right"], rates["wrong"])), "pairs": n}
    print(json.dumps({"mc_samples_per_prefix": k, **report}), flush=True)


def batch_of(kind, rng, a):
    n = a.solve_batch if kind == "s" else a.batch
    out = []
    while len(out) < n:
        out += example(kind, rng, a)
    return out[:n]


def grow(model, n):
    """Append n decoder layers whose attention and MLP outputs start at zero: the function is unchanged."""
    layers = model.model.layers
    for _ in range(n):
        new = copy.deepcopy(layers[-1])
        for m in new.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, std=0.02)
        torch.nn.init.zeros_(new.self_attn.o_proj.weight)
        torch.nn.init.zeros_(new.mlp.down_proj.weight)
        layers.append(new)
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(layers)
    model.config.layer_types = ["full_attention"] * len(layers)


def evaluate(model, step, pair_sets, a, t0, probe=None):
    rep = {"step": step, "t": round(time.time() - t0)}
    if a.flag_weight and not a.ref_flags and step:
        rep["probe_last"] = probe_pairs(model, probe, pair_sets["last"], a.flag_layer)
        rep["probe_earlier"] = probe_pairs(model, probe, pair_sets["earlier"], a.flag_layer)
        if a.flag_tail:
            rep["probe_last_at_value"] = probe_pairs(model, probe, pair_sets["last"], a.flag_layer, at_value=True)
    rep["pm1_10_last"] = pair_report(model, pair_sets["last"])
    rep["pm1_10_earlier"] = pair_report(model, pair_sets["earlier"])
    rep["pm1_10_first"] = pair_report(model, pair_sets["first"])
    rep["pm2_5_20_last"] = pair_report(model, pair_sets["new"])
    rep["soft_last"] = soft_pairs(model, pair_sets["last"])
    rep["soft_earlier"] = soft_pairs(model, pair_sets["earlier"])
    rep["no_ref"] = pair_report(model, pair_sets["last"], with_reference=False)["acc"]
    if "s" in a.cycle or step == 0 or a.freeze:  # frozen layers: does the policy survive the new ones?
        rep["policy_greedy"] = policy_greedy_acc(model, 64)
    print(json.dumps(rep), flush=True)
    model.train()


def distill_loss(logits, teacher_logits, labels):
    """Mean over the labelled tokens of the cross-entropy from the teacher's next-token distribution to the
    student's (Hinton et al. 2015, at temperature 1): the forward KL plus the teacher's entropy, so its gradient is
    the KL's. Shifted as the causal-LM loss is: position t predicts token t + 1, labels of -100 count nothing."""
    keep = labels[:, 1:] >= 0
    target = torch.softmax(teacher_logits[:, :-1], -1)
    return -(target * torch.log_softmax(logits[:, :-1], -1)).sum(-1)[keep].mean()


def freeze_below(model, n):
    """Only decoder layers n, n + 1, ... keep learning: the embeddings (the output head is tied to them), the first n
    layers and the final norm are frozen, so whatever they compute stays as it was (`--freeze`)."""
    trained = tuple(f"model.layers.{i}." for i in range(n, len(model.model.layers)))
    for name, w in model.named_parameters():
        w.requires_grad_(name.startswith(trained))


@torch.no_grad()
def shrink_perturb(model, shrink, perturb):
    """w <- shrink * w + perturb * w0 (Ash & Adams 2020, "On warm-starting neural network training"): a trained
    network that has lost the plasticity to learn a second skill gets it back while keeping much of the first. w0 is
    a fresh initialization of the same config (norm weights 1, matrices N(0, 0.02)); the seed is --seed's."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    w0 = dict(fresh.named_parameters())
    for name, w in model.named_parameters():
        w.mul_(shrink).add_(w0[name], alpha=perturb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default=str(SHIPPED), help="a model folder, or 'scratch'")
    ap.add_argument("--layers", type=int, default=4, help="with --init scratch")
    ap.add_argument("--hidden", type=int, default=128, help="with --init scratch")
    ap.add_argument("--inter", type=int, default=384, help="with --init scratch")
    ap.add_argument("--heads", type=int, default=4, help="with --init scratch")
    ap.add_argument("--grow", type=int, default=0, help="append this many decoder layers (outputs zeroed)")
    ap.add_argument("--freeze", type=int, default=0,
                    help="train only the decoder layers from this one on: the embeddings (tied to the output head), "
                         "the first N layers and the final norm keep their weights (what they compute cannot be "
                         "erased; with --grow N, only the new layers learn)")
    ap.add_argument("--shrink", type=float, default=1.0,
                    help="shrink and perturb the --init weights first (Ash & Adams 2020): w <- shrink * w + perturb * "
                         "w0, w0 a fresh initialization of the same shape (attempts V and U, docs/ac2.md)")
    ap.add_argument("--perturb", type=float, default=0.0, help="with --shrink: the fresh initialization's share")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--schedule", default="cosine", help="cosine, or anything else for constant")
    ap.add_argument("--batch", type=int, default=32, help="critic and packed batches")
    ap.add_argument("--solve-batch", type=int, default=64)
    ap.add_argument("--cycle", default="c", help="batch kinds per cycle: s solve, c critic, p packed")
    ap.add_argument("--pair-frac", type=float, default=0.5, help="critic examples that come as right/wrong pairs")
    ap.add_argument("--ref-prob", type=float, default=1.0, help="critic examples with the reference in the prompt")
    ap.add_argument("--error-rate", type=float, default=0.2, help="per-line slips in sampled traces")
    ap.add_argument("--label-rate", type=float, default=0.2, help="per-line error rate in the value formula")
    ap.add_argument("--pair-max-line", type=int, default=1,
                    help="during the curriculum, pairs' wrong sum and cut lie in the first this-many lines")
    ap.add_argument("--curriculum-steps", type=int, default=0, help="steps of the curriculum's first stage (0: none)")
    ap.add_argument("--flag-weight", type=float, default=0.0,
                    help="weight of a dense auxiliary loss: at every attempt token of a critic example, a linear probe "
                         "on --flag-layer's output predicts whether the attempt has left every correct trace")
    ap.add_argument("--ref-flags", action="store_true",
                    help="with --flag-weight: the probe's labels sit on the reference's tokens instead (has the "
                         "attempt, up to this token, differed from the reference?), where the comparison is possible")
    ap.add_argument("--flag-tail", action="store_true",
                    help="with --flag-weight on the attempt's tokens: the tokens after the attempt (up to where the "
                         "value is read) carry the verdict on the whole attempt as well")
    ap.add_argument("--requote", action="store_true",
                    help="the tiny critic prompt quotes the attempt again after the reference (a format change)")
    ap.add_argument("--ref-first", action="store_true",
                    help="ac2's --critic-reference-first: the reference closes the problem's turn, before the attempt")
    ap.add_argument("--value-from", type=int, default=0,
                    help="the value's (and any solve / packed) loss counts from this step on; before it the dense "
                         "labels alone train")
    ap.add_argument("--copy-lm", action="store_true",
                    help="with --ref-first: next-token loss on the attempt's tokens while it is still on a correct "
                         "trace (a right attempt continues the reference, so this rewards copying it)")
    ap.add_argument("--split-opt", action="store_true",
                    help="two AdamW states over the same weights, one stepped on solve batches, one on the rest")
    ap.add_argument("--teacher", default="",
                    help="a model folder: solve batches train on its next-token distribution over the same traces "
                         "(distillation: the cross-entropy with its softmax) instead of the traces' own tokens")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--late-from", type=int, default=-1, help="from this step on, the batches follow --late-*")
    ap.add_argument("--late-cycle", default="cs", help="the cycle from --late-from on")
    ap.add_argument("--late-pair-frac", type=float, default=0.75, help="--pair-frac from --late-from on")
    ap.add_argument("--late-ref-prob", type=float, default=0.9, help="--ref-prob from --late-from on")
    ap.add_argument("--short-steps", type=int, default=0,
                    help="for the first this-many steps, problems have 2-3 terms only (then 2-6)")
    ap.add_argument("--requote-lm", action="store_true",
                    help="with --requote: next-token loss on the quoted attempt as well (a curriculum for copying)")
    ap.add_argument("--copy-weight", type=float, default=0.0,
                    help="weight of a dense auxiliary loss: at reference token j, a linear probe on --copy-layer's "
                         "output names the attempt's token j (the lookup the comparison needs)")
    ap.add_argument("--copy-layer", type=int, default=-2, help="the probed layer output (negative: from the top)")
    ap.add_argument("--flag-layer", type=int, default=-1, help="the probed layer output (negative: from the top)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", action="store_true", help="save the model to --out at the end")
    ap.add_argument("--out", default="checkpoints/critic_probe")
    ap.add_argument("--frozen-probe", action="store_true",
                    help="fit a linear probe on each layer of the frozen model for 'this sum is wrong', before "
                         "training and after it (--steps 0: before only)")
    ap.add_argument("--lsd", action="store_true",
                    help="traces write each running sum's digits least-significant first (a format change, for the "
                         "probe only; the boxed answer stays as it is)")
    ap.add_argument("--wait", action="store_true",
                    help="solve traces notice every slip: a 'wait: ' line with the right sum follows it")
    ap.add_argument("--mc-pairs", type=int, default=0,
                    help="print the policy's Monte-Carlo success from each pair's two prefixes (this many samples "
                         "each) and exit: what Monte-Carlo labels would be")
    ap.add_argument("--baselines", action="store_true", help="print what no skill scores (the losses above) and exit")
    a = ap.parse_args()
    if a.ref_first and (a.requote or a.ref_flags):
        ap.error("--ref-first puts the reference before the attempt: --requote and --ref-flags assume it after")
    if a.lsd and (a.wait or "p" in a.cycle or a.teacher):
        ap.error("--lsd rewrites solve and critic traces only: not --wait's, packed ones, or a --teacher's")
    FORMAT["requote"], FORMAT["ref_first"], FORMAT["lsd"] = a.requote, a.ref_first, a.lsd
    a.step = 0
    if a.baselines:
        return baselines(a)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(a.seed)
    if a.init == "scratch":
        cfg = Qwen3Config(vocab_size=128, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                          num_attention_heads=a.heads, num_key_value_heads=max(1, a.heads // 2), head_dim=32,
                          max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0,
                          bos_token_id=None, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id,
                          dtype="float32")
        model = Qwen3ForCausalLM(cfg)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.init, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).eval() if a.teacher else None
    if a.shrink != 1.0 or a.perturb:
        shrink_perturb(model, a.shrink, a.perturb)
    if a.grow:
        grow(model, a.grow)
    if a.freeze:
        freeze_below(model, a.freeze)
    if a.frozen_probe:
        for where in ("digit", "line_end"):
            frozen_probe(model, where)
        if not a.steps:
            return
    print("params", sum(p.numel() for p in model.parameters()), flush=True)
    rng = random.Random(a.seed)
    pair_sets = {"last": make_pairs("pm1_10", 100, 1, "last"), "earlier": make_pairs("pm1_10", 100, 2, "earlier"),
                 "new": make_pairs("pm2_5_20", 100, 3, "last"), "first": make_pairs("pm1_10", 100, 4, "first")}
    if a.mc_pairs:
        return mc_pairs(model, pair_sets, a.mc_pairs)
    if a.flag_layer < 0:
        a.flag_layer += len(model.model.layers)  # hidden_states[i] is the output of layer i (0: the embeddings)
    if a.copy_layer < 0:
        a.copy_layer += len(model.model.layers)
    probe = torch.nn.Linear(model.config.hidden_size, 1)  # training only: never saved, never read by the critic
    copy_probe = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)  # the same
    def adamw():
        return torch.optim.AdamW([*model.parameters(), *probe.parameters(), *copy_probe.parameters()], lr=a.lr,
                                 weight_decay=a.wd)

    # --split-opt: with one AdamW, the solve batches' gradients (a loss on every response token) fill the second
    # moments, and a critic batch's step shrinks; two states give each kind its own step size (attempt O)
    opts = {"s": adamw(), "rest": adamw()} if a.split_opt else {"rest": adamw()}

    def lr_factor(s):  # warm-up, then cosine (or constant)
        if a.schedule != "cosine":
            return 1.0
        return min(1.0, (s + 1) / a.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, a.steps))))

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_factor) for o in opts.values()]
    t0 = time.time()
    evaluate(model, 0, pair_sets, a, t0)
    losses, flag_losses, copy_losses, lm_losses = [], [], [], []
    for step in range(a.steps):
        a.step = step
        if step == a.late_from:  # --late-from: the second stage's batch mix
            a.cycle, a.pair_frac, a.ref_prob = a.late_cycle, a.late_pair_frac, a.late_ref_prob
        kind = a.cycle[step % len(a.cycle)]
        opt = opts.get(kind, opts["rest"])
        b = batch_of(kind, rng, a)
        width = max(len(x) for x, *_ in b)
        ids = torch.full((len(b), width), TOK.pad_token_id)
        labels = torch.full((len(b), width), -100)
        lm_labels = torch.full((len(b), width), -100)
        for r, (x, n, _, _, lm) in enumerate(b):
            ids[r, : len(x)] = torch.tensor(x)
            labels[r, n: len(x)] = torch.tensor(x[n:])
            for pos in lm:
                lm_labels[r, pos] = x[pos]
        model.train()
        out = model(input_ids=ids, labels=labels, output_hidden_states=bool(a.flag_weight or a.copy_weight))
        if teacher is not None and kind == "s":  # --teacher: the solver's whole distribution, not one sampled token
            with torch.no_grad():
                teacher_logits = teacher(input_ids=ids).logits
            out.loss = distill_loss(out.logits, teacher_logits, labels)
        loss = out.loss * (step >= a.value_from)  # --value-from: the dense label alone first
        if a.copy_lm and (lm_labels >= 0).any():  # --copy-lm counts from the first step
            lm_loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), lm_labels[:, 1:].flatten())
            lm_losses.append(lm_loss.item())
            loss = loss + lm_loss
        copies = [(r, pos, y) for r, (_, _, _, c, _) in enumerate(b) for pos, y in c]
        if copies:  # the lookup alone: at reference token j, a linear probe names the attempt's token j
            rows, cols, ys = (torch.tensor(v) for v in zip(*copies))
            copy_loss = torch.nn.functional.cross_entropy(copy_probe(out.hidden_states[a.copy_layer][rows, cols]), ys)
            copy_losses.append(copy_loss.item())
            loss = loss + a.copy_weight * copy_loss
        flags = [(r, pos, y) for r, (_, _, f, _, _) in enumerate(b) for pos, y in f]
        if flags:  # the dense auxiliary loss: a linear probe reads "left every correct trace" at each attempt token
            rows, cols, ys = (torch.tensor(v) for v in zip(*flags))
            logit = probe(out.hidden_states[a.flag_layer][rows, cols]).squeeze(-1)
            flag_loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, ys.float())
            flag_losses.append(flag_loss.item())
            loss = loss + a.flag_weight * flag_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for sched in scheds:
            sched.step()
        losses.append(out.loss.item())  # the value tokens (and any solve / packed tokens) only
        if (step + 1) % 50 == 0:
            flag = f" flag loss {sum(flag_losses[-50:]) / len(flag_losses[-50:]):.4f}" if flag_losses else ""
            flag += f" copy loss {sum(copy_losses[-50:]) / len(copy_losses[-50:]):.4f}" if copy_losses else ""
            flag += f" lm loss {sum(lm_losses[-50:]) / len(lm_losses[-50:]):.4f}" if lm_losses else ""
            print(f"step {step + 1} loss {sum(losses[-50:]) / 50:.4f}{flag} {time.time() - t0:.0f}s", flush=True)
        if (step + 1) % a.eval_every == 0:
            evaluate(model, step + 1, pair_sets, a, t0, probe)
            if a.save:
                model.save_pretrained(f"{a.out}/step_{step + 1}")
                TOK.save_pretrained(f"{a.out}/step_{step + 1}")
    if a.wait:
        says_wait(model)
    if a.frozen_probe:
        for where in ("digit", "line_end"):
            frozen_probe(model, where)
    if a.save:
        model.save_pretrained(a.out)
        TOK.save_pretrained(a.out)


if __name__ == "__main__":
    main()
