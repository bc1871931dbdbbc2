"""AC2's critic-valued advantages against Monte-Carlo ones: before readiness, at readiness, and late.

    python benchmarks/ac2_advantage.py                       # the AC2 run of benchmarks/compare.py (seed 1)
    python benchmarks/ac2_advantage.py --run checkpoints/<run> --steps 30 70 100 --groups 16 --rollouts 128
    python benchmarks/ac2_advantage.py --run checkpoints/cmp_ac2_tiny_ac2_s1_n100 --critic-reference-first  # tiny-ac2

For each chosen checkpoint of an `ac2.py --tiny` run (the policy, replay buffer, readiness table and reference
bank after step k) it builds replay groups as AC2's step k+1 does -- question-uniform slots from the buffer
(`fill_slots`), a cut on the tiny cut grid (`draw_cut`), g = 16 chunks of b = 16 tokens from each prefix at
T = 1 with the checkpoint's weights -- and keeps the chunks AC2 scores with its critic (`is_consumed`: they hit
the chunk cap below the remaining budget with no finished answer). Each kept chunk gets the critic's value
v_i (AC2's prompt and reference, greedy: `critic_context`, `query_critic`) and a Monte-Carlo value: R rollouts
from the chunk's endpoint to the end of the budget, scored by the tiny verifier (standard error at most
0.5 / sqrt(R): 0.044 at R = 128, against the value grid's 0.1). Rows that are not consumed (a finished answer)
carry their verifier reward in both. Per group, advantages A_i = v_i - mean_j v_j (AC2's lambda = 0 estimator)
from the critic against the same from the Monte-Carlo values, compared on the consumed rows: sign agreement
(where the Monte-Carlo advantage is at least half a grid step, 0.05, from 0), Pearson correlation, mean absolute
error; the share of chunks the critic gave no advantage at all (every chunk of the group valued alike; such a
chunk counts as a sign disagreement), split into those Monte Carlo also values alike (|A_MC| < 0.05: a right
tie, as in a group cut after a wrong sum) and those it does not (a miss), with the sign agreement where the critic
did give an advantage; the share of chunks from which no rollout finishes right; and the critic's value error.
Before readiness AC2 does not use the critic: those numbers say what trusting it then would have given. "ready"
restricts to problems the checkpoint's table holds ready.
Writes benchmarks/results/ac2_advantage.json (or --out).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]
from tblog import read_scalars  # noqa: E402

import ac2  # noqa: E402
from common import engine  # noqa: E402
from common.tiny import build_tokenizer, tiny_dataset, tiny_reward  # noqa: E402


def analyse(llm, ckpt: Path, groups: int, rollouts: int, seed: int, reference_first: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    args = ac2.tiny_args()
    args.critic_reference_first = reference_first  # the run's own flag: the critic is read in the order it learned
    tok = build_tokenizer()
    rows = tiny_dataset("train")[: args.train_limit]
    train = ac2.Problems(rows, [ac2.encode_chat(tok, args.prompt_template.format(problem=r["problem"])) for r in rows])
    buffer = ac2.ReplayBuffer(ac2.buffer_capacity(args))
    buffer.load_state_dict(state["buffer"])
    tracker = ac2.ReadinessTracker(args.window, args.tau_global, args.tau_local)
    tracker.load_state_dict(state["readiness"])
    bank = ac2.ReferenceBank()
    bank.load_state_dict(state["bank"])
    engine.sync_weights(llm, AutoModelForCausalLM.from_pretrained(ckpt / "policy", dtype=torch.float32))
    # replay groups as AC2's next step builds them, every one routed to chunks
    rng = np.random.default_rng([seed, state["step"]])
    sources = ac2.fill_slots(list(buffer.trajectories), groups, rng)
    replay = [ac2.Group(t.problem, t.tokens[: ac2.draw_cut(len(t.tokens), args.cut_grid, args.cut_max_frac, rng)],
                        "short", t) for t in sources]
    for g in replay:
        g.max_tokens = ac2.new_token_budget(g.lane, len(g.prefix), args)
    contexts = [train.prompts[g.problem] + g.prefix for g in replay]
    chunks = engine.generate(llm, contexts, [SamplingParams(n=args.group_size, temperature=args.temperature,
                                                            max_tokens=max(1, g.max_tokens), seed=1000 + i)
                                             for i, g in enumerate(replay)])
    for g, context, completions in zip(replay, contexts, chunks):
        g.samples = [ac2.Sample(g.problem, context, c) for c in completions]
        g.texts = [tok.decode(g.prefix + c.token_ids, skip_special_tokens=True) for c in completions]
        g.reference = ac2.critic_reference(g, bank)
        g.consumed = ac2.consumed_rows(g, args)
    # the critic values the consumed chunks (AC2's prompt and reference, greedy); the rest get the verifier's
    # reward, as AC2's judge gives them; then AC2's own endpoint values and advantages
    todo = [(g, i) for g in replay for i, used in enumerate(g.consumed) if used]
    contexts = [ac2.critic_context(train.prompts[g.problem], g.prefix + g.samples[i].completion.token_ids,
                                   g.reference, tok, args) for g, i in todo]
    values = [v for v, _ in ac2.query_critic(llm, contexts, tok, 1024)]
    for g in replay:
        g.critic = [None] * len(g.samples)
        verdicts, _ = ac2.grade(g.texts, [train.rows[g.problem]] * len(g.texts), args, judge=None)
        g.verdicts = [None if used else v for used, v in zip(g.consumed, verdicts)]
    for (g, i), v in zip(todo, values):
        g.critic[i] = v
    for g in replay:
        ac2.endpoint_values(g)
    # Monte Carlo: R rollouts from each consumed chunk's endpoint to the end of the budget
    mc_out = engine.generate(llm, [g.samples[i].context + g.samples[i].completion.token_ids for g, i in todo], [
        SamplingParams(n=rollouts, temperature=args.temperature,
                       max_tokens=args.budget - len(g.prefix) - len(g.samples[i].completion.token_ids), seed=5000 + k)
        for k, (g, i) in enumerate(todo)])
    mc = {(id(g), i): float(np.mean([tiny_reward(tok.decode(g.prefix + g.samples[i].completion.token_ids + o.token_ids,
                                                            skip_special_tokens=True), train.rows[g.problem]["answer"])
                                     for o in out])) for (g, i), out in zip(todo, mc_out)}
    rows_out = []  # (ready?, critic adv, mc adv, critic value, mc value)
    for g in replay:
        mc_values = [mc[(id(g), i)] if used else g.values[i] for i, used in enumerate(g.consumed)]
        ready = tracker.is_ready(g.problem)
        for i, (a, used) in enumerate(zip(ac2.group_advantages(g), g.consumed)):
            if used:
                rows_out.append((ready, a, mc_values[i] - np.mean(mc_values), g.values[i], mc_values[i]))
    report = {"step": state["step"], "gate_open": tracker.gate_open(), "ready_problems": len(tracker.ready),
              "groups": groups, "rollouts_per_endpoint": rollouts, "consumed_chunks": len(todo)}
    for name, sel in (("all", rows_out), ("ready", [r for r in rows_out if r[0]])):
        if len(sel) < 3:
            report[name] = {"chunks": len(sel)}
            continue
        a_c, a_m, v_c, v_m = (np.array([r[i] for r in sel]) for i in (1, 2, 3, 4))
        clear = np.abs(a_m) >= 0.05
        report[name] = {
            "chunks": len(sel),
            "sign_agreement": round(float(np.mean(np.sign(a_c[clear]) == np.sign(a_m[clear]))), 3) if clear.any()
            else None,
            "chunks_with_a_clear_mc_sign": int(clear.sum()),
            "critic_advantage_zero": round(float(np.mean(a_c == 0)), 3),  # the critic saw no difference
            # ...split by whether Monte Carlo saw one: a tie among siblings Monte Carlo also values alike (a group
            # cut after a wrong sum: every continuation is worth 0) is right; a tie where it does not is a miss
            "critic_advantage_zero_mc_flat": round(float(np.mean((a_c == 0) & ~clear)), 3),
            "critic_advantage_zero_mc_clear": round(float(np.mean((a_c == 0) & clear)), 3),
            "sign_agreement_where_critic_nonzero": round(float(np.mean(
                np.sign(a_c[clear & (a_c != 0)]) == np.sign(a_m[clear & (a_c != 0)]))), 3)
            if (clear & (a_c != 0)).any() else None,
            "mc_value_zero": round(float(np.mean(v_m == 0)), 3),  # no rollout of R finishes right from the chunk
            "advantage_correlation": round(float(np.corrcoef(a_c, a_m)[0, 1]), 3) if a_c.std() and a_m.std()
            else None,
            "advantage_mae": round(float(np.mean(np.abs(a_c - a_m))), 3),
            "mc_advantage_mean_abs": round(float(np.mean(np.abs(a_m))), 3),
            "value_mae": round(float(np.mean(np.abs(v_c - v_m))), 3),
        }
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", default=str(ROOT / "checkpoints" / "cmp_ac2_s1_n100"),
                    help="the checkpoint folder of an ac2.py --tiny run saved every 10 steps")
    ap.add_argument("--steps", type=int, nargs="*", help="checkpoints to analyse (default: 30, the first saved "
                    "after the gate opened, the last)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--critic-reference-first", action="store_true",
                    help="the run's ac2.py flag (with --model tiny-ac2): the reference closes the problem's turn")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ac2_advantage.json"))
    a = ap.parse_args()
    run = Path(a.run)
    saved = sorted(int(p.name[5:]) for p in run.glob("step_*"))
    steps = a.steps
    if not steps:
        gate = read_scalars(ROOT / "runs" / run.name)["ac2/gate_open"]
        opened = min((k for k, v in gate.items() if v > 0), default=None)
        at = next((s for s in saved if opened is not None and s >= opened), saved[-1])
        steps = sorted({30 if 30 in saved else saved[0], at, saved[-1]})
    result = {"run": run.name, "critic_reference_first": a.critic_reference_first, "phases": []}
    llm = engine.create_engine(str(run / f"step_{steps[0]}" / "policy"), max_model_len=1024, seed=a.seed)
    for s in steps:
        rep = analyse(llm, run / f"step_{s}", a.groups, a.rollouts, a.seed, a.critic_reference_first)
        print(json.dumps(rep), flush=True)
        result["phases"].append(rep)
    out = Path(a.out)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
