"""The built-in tiny model: its build record and its starting accuracy on the held-out split.

    python benchmarks/tiny_model.py [--samples 8]      # the shipped model (common/tiny_model/)
    python benchmarks/tiny_model.py --rebuild          # rebuild it from its recipe (~20 min on 2 cores) and compare
    python benchmarks/tiny_model.py --model tiny-ac2   # the tiny AC2 setting's model (common/tiny_ac2_model/)
    python benchmarks/tiny_model.py --model checkpoints/tiny_ac2_build    # a build of it (build_tiny_ac2.py --out)
    python benchmarks/tiny_model.py --model checkpoints/l2 --lsd          # a critic_probe.py --lsd --save folder

Reports the build's wall time and final SFT loss, then held-out accuracy sampling at T = 1 (what the tiny
configurations train and evaluate with), at the paper's evaluation settings (T 0.8 / top-p 0.95 / top-k 20) and
greedy, by difficulty (number of terms), with how many of the responses' first-pass additions are right and how
their first pass first goes wrong (off by 1 or 10, the warm start's slips, or otherwise). With
--rebuild, the model is rebuilt from scratch into the cache ($TINY_RL_CACHE or ~/.cache/tiny-rl) and compared with
the shipped weights: the build is deterministic on one machine but floating-point kernels differ between CPUs,
which is why the repository ships the weights.
Writes benchmarks/results/tiny_model.json (the shipped model), tiny_model_rebuild.json, tiny_model_tiny_ac2.json or
tiny_model_<folder>.json.
"""

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import engine
from common.tiny import SHIPPED, build_tokenizer, resolve_model, tiny_dataset, tiny_model_path, tiny_reward


def first_pass_sums(response: str, lsd: bool = False) -> list[tuple[int, int, int]]:
    """A tiny response's first-pass running sums: the lines `a+b=c` before `check:` or `</think>` (with `lsd`, each
    number written least-significant digit first, as critic_probe.py --lsd trains)."""
    first_pass = response.split("</think>")[0].split("check:")[0]
    return [tuple(int(g[::-1] if lsd else g) for g in m)
            for m in re.findall(r"^(\d+)\+(\d+)=(\d+)$", first_pass, re.M)]


def additions_right(response: str, lsd: bool = False) -> tuple[int, int]:
    """Of a response's first-pass running sums, how many add up, each judged on its own operands (a wrong sum carried
    forward does not make the next line wrong): whether a policy that misses the answer misses the arithmetic or
    something else."""
    sums = first_pass_sums(response, lsd)
    return sum(a + b == c for a, b, c in sums), len(sums)


def first_wrong_sum(response: str, lsd: bool = False) -> str:
    """How a response's first-pass running sums first go wrong: "adds up", "off by 1", "off by 10" (the warm start's
    slips, either sign), "off otherwise", or "no sums"."""
    sums = first_pass_sums(response, lsd)
    wrong = next((c - a - b for a, b, c in sums if a + b != c), None)
    if not sums:
        return "no sums"
    return "adds up" if wrong is None else f"off by {abs(wrong)}" if abs(wrong) in (1, 10) else "off otherwise"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=8, help="samples per held-out problem")
    ap.add_argument("--rebuild", action="store_true", help="rebuild from the recipe and compare with the shipped")
    ap.add_argument("--model", default="tiny", help="tiny, tiny-ac2 or a build's folder (benchmarks/build_tiny_ac2.py)")
    ap.add_argument("--lsd", action="store_true",
                    help="the model writes each running sum least-significant digit first (critic_probe.py --lsd)")
    args = ap.parse_args()
    t0 = time.time()
    if args.model == "tiny-ac2" and args.rebuild:
        ap.error("tiny-ac2 is rebuilt by benchmarks/build_tiny_ac2.py (~2 hours)")
    path = tiny_model_path(rebuild=args.rebuild) if args.model == "tiny" else resolve_model(args.model)
    record = Path(path) / "tiny_build.json"  # a critic_probe.py --save folder has none: its log is its record
    build = json.loads(record.read_text()) if record.exists() else {"build_seconds": None, "recipe": None}
    losses = f"SFT loss {build['sft_loss_first']} -> {build['sft_loss_last']}" if "sft_loss_last" in build else \
        "its phases' logs in build_logs/" if record.exists() else "no build record"
    print(f"{args.model} model at {path} (ready in {time.time() - t0:.1f}s; its build took {build['build_seconds']}s, "
          f"{losses})")
    from vllm import SamplingParams

    llm = engine.create_engine(path, max_model_len=512, seed=0)
    tok = build_tokenizer()
    test = tiny_dataset("test")
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p["problem"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in test]
    settings = {
        "sampled_T1": dict(n=args.samples, temperature=1.0),
        "sampled_T0.8_p0.95_k20": dict(n=args.samples, temperature=0.8, top_p=0.95, top_k=20),
        "greedy": dict(n=1, temperature=0.0),
    }
    result = {"model": args.model, "build_seconds": build["build_seconds"], "sft_loss_last": build.get("sft_loss_last"),
              "recipe": build["recipe"], "accuracy": {}}
    if args.rebuild:
        from safetensors.torch import load_file

        new, shipped = (load_file(str(Path(p) / "model.safetensors")) for p in (path, SHIPPED))
        diffs = {k: float((new[k] - shipped[k]).abs().max()) for k in shipped}
        result["against_shipped"] = {
            "identical_tensors": f"{sum(d == 0 for d in diffs.values())} of {len(diffs)}",
            "max_abs_weight_difference": max(diffs.values()),
            "shipped_sft_loss_last": json.loads((SHIPPED / "tiny_build.json").read_text())["sft_loss_last"]}
        print(json.dumps(result["against_shipped"]))
    for name, kw in settings.items():
        params = [SamplingParams(max_tokens=200, seed=i, **kw) for i in range(len(test))]
        groups = engine.generate(llm, prompts, params)
        by_difficulty, sums, kinds = {}, [0, 0], {}
        for p, g in zip(test, groups):
            for c in g:
                text = tok.decode(c.token_ids, skip_special_tokens=True)
                by_difficulty.setdefault(p["difficulty"], []).append(tiny_reward(text, p["answer"]))
                sums = [x + y for x, y in zip(sums, additions_right(text, args.lsd))]
                kind = first_wrong_sum(text, args.lsd)
                kinds[kind] = kinds.get(kind, 0) + 1
        acc = sum(sum(v) for v in by_difficulty.values()) / sum(len(v) for v in by_difficulty.values())
        result["accuracy"][name] = {"all": round(acc, 3), **{
            f"{k}_terms": round(sum(v) / len(v), 3) for k, v in sorted(by_difficulty.items())},
            "first_pass_additions_right": f"{sums[0]} of {sums[1]}",
            "first_pass": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}
        print(f"{name:>24}: {acc:.3f}  by terms: " + " ".join(
            f"{k}:{sum(v) / len(v):.2f}" for k, v in sorted(by_difficulty.items()))
            + f"  first-pass additions right: {sums[0]} of {sums[1]}; first pass: {kinds}")
    label = re.sub(r"\W+", "_", args.model).strip("_")
    suffix = "_rebuild" if args.rebuild else "" if args.model == "tiny" else f"_{label}"
    out = Path(__file__).parent / "results" / f"tiny_model{suffix}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
