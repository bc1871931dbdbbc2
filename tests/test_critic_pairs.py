"""The critic diagnostic's pairs (benchmarks/critic_pairs.py): each wrong attempt differs from its right twin in exactly
the slip its set names, on a held-out problem, with the later lines continuing from the wrong value."""

import math
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import critic_pairs

from common.tiny import SHIPPED, tiny_dataset, tiny_solution

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


def test_shrink_and_perturb_mixes_the_weights_with_a_fresh_initialization():
    # critic_probe.py --shrink 0.5 --perturb 0.1 (Ash & Adams 2020): w <- 0.5 w + 0.1 w0, w0 a fresh init of the config
    import critic_probe
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32)
    before = {n: w.clone() for n, w in model.named_parameters()}
    torch.manual_seed(3)
    critic_probe.shrink_perturb(model, 0.5, 0.0)
    for n, w in model.named_parameters():
        assert torch.equal(w, before[n] * 0.5), n
    torch.manual_seed(3)
    w0 = dict(AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).named_parameters())
    torch.manual_seed(3)
    critic_probe.shrink_perturb(model, 1.0, 0.1)  # the same seed: the same fresh initialization
    for n, w in model.named_parameters():
        assert torch.allclose(w, before[n] * 0.5 + 0.1 * w0[n], atol=1e-7), n
    norm = model.model.norm.weight  # norm weights initialize at 1: 0.5 * w + 0.1
    assert torch.allclose(norm, before["model.norm.weight"] * 0.5 + 0.1, atol=1e-7)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # still tied


def test_distillation_is_the_cross_entropy_from_the_teachers_next_token_distribution_on_labelled_tokens():
    # critic_probe.py --teacher: solve batches learn the teacher's whole next-token distribution
    import critic_probe

    # one row, 3 positions, vocabulary of 2; position t predicts token t + 1, so only position 1 counts here
    labels = torch.tensor([[-100, -100, 1]])
    teacher = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, -5.0]]])  # position 1: p = (1/4, 3/4)
    student = torch.tensor([[[9.0, 0.0], [0.0, 0.0], [-9.0, 9.0]]])  # position 1: q = (1/2, 1/2)
    assert critic_probe.distill_loss(student, teacher, labels).item() == pytest.approx(math.log(2.0))
    student = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0]]])  # q = (3/4, 1/4)
    want = -(0.25 * math.log(0.75) + 0.75 * math.log(0.25))
    assert critic_probe.distill_loss(student, teacher, labels).item() == pytest.approx(want)
    # a student equal to its teacher gets no gradient: the KL's minimum (the loss is then the teacher's entropy)
    logits = torch.randn(2, 5, 7)
    student = logits.clone().requires_grad_()
    labels = torch.tensor([[-100, 3, 1, 4, -100], [-100, -100, 2, 2, 6]])
    critic_probe.distill_loss(student, logits, labels).backward()
    assert student.grad.abs().max().item() < 1e-6

def test_freezing_keeps_the_embeddings_head_and_lower_layers_and_grown_layers_start_as_the_identity():
    # critic_probe.py --grow 4 --freeze 4: four new layers, and only they learn
    import critic_probe
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 40, 9, 33]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    critic_probe.grow(model, 4)
    critic_probe.freeze_below(model, 4)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5)  # zeroed outputs: the same function
    trained = {n for n, w in model.named_parameters() if w.requires_grad}
    assert trained and all(n.startswith(("model.layers.4.", "model.layers.5.", "model.layers.6.", "model.layers.7."))
                           for n in trained)
    assert len(model.model.layers) == 8 and not model.model.embed_tokens.weight.requires_grad
    assert not model.model.norm.weight.requires_grad and not model.lm_head.weight.requires_grad


def test_the_probes_dense_label_turns_on_at_the_first_wrong_digit_and_stays_on():
    # critic_probe.py --flag-weight: 1 from the token where the attempt leaves every correct trace (with or without
    # its `check:` copy), 0 before; on the attempt's tokens wherever the critic context puts them
    import critic_probe

    problem, nums = "Add: 33+95+46", [33, 95, 46]
    attempt = "33+95=129\n129+46=175"
    first_wrong = attempt.index("9\n")  # "33+95=12" is still on the right trace, its "9" is not
    try:
        for ref_first, ref in ((False, None), (True, tiny_solution(nums))):
            critic_probe.FORMAT["ref_first"] = ref_first
            ctx = critic_probe.critic_ids(problem, attempt, ref)
            flags = critic_probe.attempt_flags(ctx, attempt, nums)
            start = len(critic_probe.chat(problem)) + (len(critic_probe.enc(" Reference:\n" + ref)) if ref else 0)
            assert [pos for pos, _ in flags] == list(range(start, start + len(attempt)))
            assert critic_probe.TOK.decode([ctx[pos] for pos, _ in flags]) == attempt
            assert [y for _, y in flags] == [0.0] * first_wrong + [1.0] * (len(attempt) - first_wrong)
            # --flag-tail: every token after the attempt, up to where the value is read, carries the whole verdict
            tail = critic_probe.attempt_flags(ctx, attempt, nums, tail=True)
            assert tail[: len(flags)] == flags
            assert tail[len(flags):] == [(pos, 1.0) for pos in range(start + len(attempt), len(ctx))]
        for right in ("33+95=128\n128+46=174\n</think>", "33+95=128\n128+46=174\ncheck:\n33+9"):  # check: too
            ctx = critic_probe.critic_ids(problem, right, tiny_solution(nums))
            assert all(y == 0.0 for _, y in critic_probe.attempt_flags(ctx, right, nums))
    finally:
        critic_probe.FORMAT["ref_first"] = False


def test_the_reference_side_label_sits_on_the_quoted_tokens_and_turns_on_where_the_texts_part():
    # critic_probe.py --ref-flags: on each reference token j (or, with --requote, each token j of the attempt quoted
    # again after it), 1 once the attempt has differed from the reference within its first j+1 tokens
    import critic_probe

    problem, ref = "Add: 33+95+46", tiny_solution([33, 95, 46])
    wrong, right = "33+95=129\n129+46=175\n", "33+95=128\n"
    part = wrong.index("9\n")  # the first token where the two texts differ (one token a character up to there)
    try:
        for requote in (False, True):
            critic_probe.FORMAT["requote"] = requote
            ctx = critic_probe.critic_ids(problem, wrong, ref)
            flags = critic_probe.reference_flags(ctx, wrong, ref)
            quoted = wrong if requote else ref  # the tokens the labels sit on
            assert critic_probe.TOK.decode([ctx[pos] for pos, _ in flags]) == quoted
            assert [y for _, y in flags] == [0.0] * part + [1.0] * (len(critic_probe.enc(quoted)) - part)
            ctx = critic_probe.critic_ids(problem, right, ref)  # a right prefix never parts from the reference
            assert all(y == 0.0 for _, y in critic_probe.reference_flags(ctx, right, ref))
    finally:
        critic_probe.FORMAT["requote"] = False


def test_compare_skill_labels_turn_on_where_the_attempt_parts_from_the_reference_in_either_order():
    # benchmarks/compare_skill.py: the bare comparison, labels on the second text's tokens
    import compare_skill

    ref = tiny_solution([33, 95, 46])  # "33+95=128\n128+46=174\n</think>..."
    wrong, right = "33+95=129\n129+46=175\n", "33+95=128\n128+4"
    part = wrong.index("9\n")  # one token a character up to there
    ids, labels = compare_skill.example(wrong, ref, "ref-first")
    assert compare_skill.TOK.decode([ids[pos] for pos, _ in labels]) == wrong  # on the attempt, after the reference
    assert compare_skill.TOK.decode(ids[: labels[0][0]]) == "R:" + ref + "\nQ:"
    assert [y for _, y in labels] == [0.0] * part + [1.0] * (len(wrong) - part)
    ids, labels = compare_skill.example(wrong, ref, "attempt-first")  # AC2's order: on the reference, verdict carried
    assert compare_skill.TOK.decode([ids[pos] for pos, _ in labels]) == ref
    n_ref = len(compare_skill.enc(ref))
    assert [y for _, y in labels] == [0.0] * part + [1.0] * (n_ref - part)
    ids, labels = compare_skill.example(wrong, ref, "critic", nums=[33, 95, 46])  # in AC2's prompt, reference first
    assert compare_skill.TOK.decode([ids[pos] for pos, _ in labels]) == wrong
    assert compare_skill.TOK.decode(ids[: labels[0][0]]).endswith(
        "Add: 33+95+46 Reference:\n" + ref + "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert [y for _, y in labels] == [0.0] * part + [1.0] * (len(wrong) - part)
    ids, labels = compare_skill.example(wrong, ref, "ref-first", clutter=True)
    assert compare_skill.TOK.decode(ids[: labels[0][0]]) == "A:" + wrong + "\nR:" + ref + "\nQ:"
    for order in ("ref-first", "attempt-first"):  # a right prefix never departs
        assert all(y == 0.0 for _, y in compare_skill.example(right, ref, order)[1])
    # an attempt running past the reference's end has departed (ref-first); past the attempt's end nothing new is
    # compared (attempt-first)
    cut = "33+95=129"  # parts at its very last token
    assert [y for _, y in compare_skill.example(cut, ref, "attempt-first")[1]][len(cut) - 2:len(cut) + 1] == [0, 1, 1]
    long = ref + "x"
    assert compare_skill.example(long, ref, "ref-first")[1][-1][1] == 1.0
    assert compare_skill.example(long, ref, "ref-first")[1][-2][1] == 0.0


@pytest.mark.slow  # a vLLM engine (the shared one, its weights swapped for tiny-ac2's and back)
def test_the_tiny_ac2_critic_ranks_the_right_prefix_higher_and_its_policy_adds(engine_and_model):
    # the shipped tiny-ac2 model through vLLM, ac2.critic_context with --critic-reference-first and ac2.query_critic:
    # on held-out problems with one sum off by +-1/+-10 on an earlier line, the right prefix is valued higher in most
    # pairs (benchmarks/results/critic_pairs_tiny_ac2.json); without the reference, or read in the paper's order it
    # did not learn, it cannot tell them apart. The shipped tiny model cannot either way (docs/ac2.md).
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    import ac2
    from common import engine
    from common.tiny import build_tokenizer, resolve_model, tiny_dataset, tiny_reward

    llm, tiny = engine_and_model
    tok, args = build_tokenizer(), ac2.tiny_args()
    pairs = critic_pairs.make_pairs("seen: +-1/+-10", 40, seed=11, where="earlier")

    def right_higher(with_reference, reference_first):  # (right valued higher, lower, outputs that are no value)
        args.critic_reference_first = reference_first
        right, wrong = critic_pairs.critic_values(llm, tok, args, pairs, with_reference)
        valued = [(r, w) for r, w in zip(right, wrong) if r is not None and w is not None]
        return sum(r > w for r, w in valued), sum(r < w for r, w in valued), (right + wrong).count(None)

    assert right_higher(True, True)[0] <= 4  # the shipped tiny model: blind (measured: 0 of 40)
    engine.sync_weights(llm, AutoModelForCausalLM.from_pretrained(resolve_model("tiny-ac2"), dtype=torch.float32))
    try:
        higher, lower, no_value = right_higher(True, True)
        assert higher >= 32 and lower == 0 and no_value == 0, (higher, lower, no_value)  # measured: 36, 0, 0
        assert right_higher(False, True)[0] <= 6  # without the reference (measured: 2)
        assert right_higher(True, False)[0] <= 6  # the paper's order, which it never saw (measured: 3)
        # and its policy adds (phases 7-8; the six-phase build solved 0.062 greedily): greedy on 32 held-out problems
        problems = tiny_dataset("test")[:32]
        outs = engine.generate(llm, [ac2.encode_chat(tok, args.prompt_template.format(problem=r["problem"]))
                                     for r in problems], SamplingParams(temperature=0.0, max_tokens=200))
        solved = sum(tiny_reward(tok.decode(o[0].token_ids, skip_special_tokens=True), r["answer"])
                     for o, r in zip(outs, problems))
        assert solved >= 20, solved  # measured: 26 (0.828 of 256: tiny_model_tiny_ac2.json)
    finally:
        engine.sync_weights(llm, tiny)  # the other engine tests expect the shipped tiny model


def test_lsd_writes_every_running_sums_digits_least_significant_first_and_keeps_the_answer():
    # critic_probe.py --lsd: 47+35=82, 82+20=102 becomes 74+53=28, 28+02=201; the boxed answer and a slip's value stay
    import critic_probe

    try:
        critic_probe.FORMAT["lsd"] = True
        assert critic_probe.tiny_solution([47, 35, 20], check=True) == (
            "74+53=28\n28+02=201\ncheck:\n74+53=28\n28+02=201\n</think>\n\n\\boxed{102}")
        # a slip of +10 on the first line (92), and the next line continues from it (112)
        assert critic_probe.running_lines([47, 35, 20], 0, lambda v: v + 10) == ["74+53=29", "29+02=211"]
        assert critic_probe.value_of("74+53=28\n", [47, 35, 20], 0.2) == 8  # one line left: 0.8
        assert critic_probe.value_of("74+53=29\n", [47, 35, 20], 0.2) == 0  # has left every correct trace
    finally:
        critic_probe.FORMAT["lsd"] = False
    assert critic_probe.tiny_solution([47, 35, 20]) == "47+35=82\n82+20=102\n</think>\n\n\\boxed{102}"


def test_compare_skill_switches_the_training_order_and_reads_the_pairs_in_both():
    # benchmarks/compare_skill.py --switch-step: attempt I2 trains the reference-first order, then AC2's, in one model
    import subprocess

    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare_skill.py"), "--order", "ref-first", "--steps", "4",
           "--eval-every", "2", "--switch-step", "2", "--switch-order", "attempt-first", "--batch", "2",
           "--hidden", "32", "--heads", "1", "--layers", "1", "--inter", "64", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    steps = [line.split() for line in out if line.startswith("step ")]
    assert [s[:3] for s in steps] == [["step", "2", "ref-first"], ["step", "4", "attempt-first"]]
    for s in steps:  # last / earlier, read in the first order, then in the second
        assert [s[i + 2] for i, w in enumerate(s) if w in ("last", "earlier")] == [
            "(ref-first)", "(ref-first)", "(attempt-first)", "(attempt-first)"]
    bad = subprocess.run(cmd[:2] + ["--switch-step", "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--switch-step and --switch-order go together" in bad.stderr
