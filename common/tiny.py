"""The built-in tiny task and tiny model, so that every script runs (and visibly learns) on a laptop CPU.

Task (docs/reference.md, "The tiny task and model"): add 2-6 two-digit numbers, solved as running
sums, one per line, inside the thinking section, then the answer in \\boxed{}:

    user:       Add: 33+95+46
    assistant:  <think>
                33+95=128
                128+46=174
                </think>

                \\boxed{174}

The number of terms is the difficulty and spreads the response length (about 15-65 tokens), so prefixes,
chunks, truncation and packing all matter. The verifier gives 1 for the right boxed answer after
`</think>`, else 0. Correct traces double as reference "proofs" for AC2's critic.

Model: a Qwen3-architecture causal LM (so vLLM serves it natively) with a character-level tokenizer whose
chat template mimics Qwen3-Thinking's (`<|im_start|>`, `<|im_end|>`, `<think>`, `</think>` are single
tokens). It is warm-started by supervised training on traces in which each running-sum step is wrong
with probability `error_rate` (off by +-1 or +-10, later steps continuing from the wrong value): the
policy starts competent but error-prone -- greedy decoding is mostly right, sampling often is not -- and
RL has room to close that gap. Two other kinds of warm-start batches stand in for what a real LLM brings
before RL: partial traces in AC2's critic prompt (one batch in `format_every`), answered with the warm-start
policy's own rough chance of success (0 once a line is wrong, else 0.8 per line still to write) -- a prompted
LLM critic likewise starts roughly right, and AC2 must keep it right as the policy changes; and packed prompts
of 1-3 problems answered in CCR's format (thinking closed at once, then each problem solved and its
`Answer k: \\boxed{..}` line written, in the answer section ccr.py parses), three batches in every
`format_every`. So many because a packed problem's terms sit wherever the problems before it end: with fewer
packed batches the model learns to find a term by its place in the prompt, which packing moves, and solves no
packed problem at all (docs/results.md, Findings). The build is deterministic on one
machine but not across CPUs, so the built model ships in common/tiny_model/ (`tiny_model_path`); rebuilding
from the recipe takes about 20 minutes on 2 cores and is cached in ``$TINY_RL_CACHE`` or ``~/.cache/tiny-rl``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch

from common.judges import extract_final_answer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: dropped by skip_special_tokens
THINK_TOKENS = ["<think>", "</think>"]  # added but not special, as in Qwen3
CHARS = ["\n", " "] + [chr(c) for c in range(33, 127)]  # every printable ASCII character
# The tiny model's critic instruction (ac2.py --short-critic-instruction): the paper's is ~600 characters,
# i.e. ~600 tokens for a character-level model.
TINY_CRITIC_INSTRUCTION = "Value of this attempt?{reference}"
TINY_CRITIC_REFERENCE = " Reference:\n{reference_proof}"
CRITIC_TURN = ("<|im_end|>\n<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"
               "<think>\n\n</think>\n\nQ value: ")
# The tiny packed prompt of ccr.py (the paper's is ~300 characters); answers as in the paper's format.
TINY_PACK_TEMPLATE = "Solve each in order, {budget} tokens in all: {problems}"
TINY_PACK_PROBLEM, TINY_PACK_SEPARATOR = "{problem}", ";"
TINY_PACK_BUDGET = 192  # fits about two of the tiny problems (solved, with their check: lines, and answered)
VALUE_STRINGS = ["0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1"]
# Qwen3-Thinking-2507's template, reduced to what we use: the generation prompt opens the thinking section.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


@dataclasses.dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the tiny model; its hash names the cache folder."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention rejects head_dim=16 (docs/reference.md, "Running vLLM in-process")
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    error_rate: float = 0.2  # per running-sum step, in the warm-start traces
    check_rate: float = 0.5  # warm-start traces that copy their sums again after "check:" (verbosity)
    format_every: int = 8  # every N-th warm-start batch teaches AC2's critic format
    packed_per_cycle: int = 3  # and this many in every `format_every` teach CCR's packs of 1-3 problems
    format_batch: int = 32  # examples per format batch (they are 2-5x longer)
    sft_steps: int = 2000
    sft_batch: int = 64
    sft_lr: float = 3e-3
    sft_warmup: int = 50
    seed: int = 0
    version: int = 8  # bump when the task or the build changes


RECIPE = TinyRecipe()


# ----------------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------------
def tiny_problem(rng: random.Random) -> dict:
    """One problem: 2-6 numbers in 10..99. Fields follow the paper datasets' names where they exist."""
    numbers = [rng.randint(10, 99) for _ in range(rng.randint(2, 6))]
    return {
        "problem": "Add: " + "+".join(map(str, numbers)),
        "answer": str(sum(numbers)),
        "solution": tiny_solution(numbers),
        "difficulty": len(numbers),
    }


def tiny_solution(numbers: list[int], rng: random.Random | None = None, error_rate: float = 0.0,
                  check: bool = False) -> str:
    """The response after the generation prompt's `<think>\\n`: running sums, then the boxed total.

    With `error_rate` > 0 a step's result is off by +-1 or +-10 with that probability, and later steps
    continue from the wrong value, so the boxed answer agrees with the (wrong) trace. With `check`, the
    sums are copied once more after a `check:` line -- tokens that change nothing, like a thinking model's
    habit of re-verifying: only a length-aware reward (RPO) or a shared budget (CCR) makes them cost.
    """
    lines, total = _running_sums(numbers, rng, error_rate)
    lines += ["check:"] + lines if check else []
    return "\n".join(lines) + "\n</think>\n\n\\boxed{" + str(total) + "}"


def tiny_packed_solution(packed: list[list[int]], rng: random.Random | None = None, error_rate: float = 0.0,
                         checks: list[bool] | None = None) -> str:
    """The response to a packed prompt (ccr.py): the thinking section closes at once, then for each problem its
    running sums and its `Answer k: \\boxed{..}` line, in order. The answers sit in the answer section because
    that is all ccr.py parses once a `</think>` exists (docs/ccr.md, "Answer recovery": a draft inside the thinking
    must not count); solving in the answer section, problem by problem, keeps the credit of answers finished
    before the cap."""
    lines = []
    for k, numbers in enumerate(packed, 1):
        steps, total = _running_sums(numbers, rng, error_rate)
        steps += ["check:"] + steps if checks and checks[k - 1] else []
        lines += steps + [f"Answer {k}: \\boxed{{{total}}}"]
    return "</think>\n\n" + "\n".join(lines)


def tiny_pack_prompt(problems: list[str], budget: int = TINY_PACK_BUDGET) -> str:
    """The tiny packed prompt (ccr.py --tiny's --pack-template), problems in the given order."""
    listed = TINY_PACK_SEPARATOR.join(TINY_PACK_PROBLEM.format(k=k, problem=q) for k, q in enumerate(problems, 1))
    return TINY_PACK_TEMPLATE.format(n=len(problems), budget=budget, problems=listed)


def tiny_critic_context(tokenizer, problem: str, attempt: list[int], reference: str | None) -> list[int]:
    """AC2's critic prompt on the tiny task, as `ac2.critic_context` builds it with the short instruction (the
    warm start cannot import a script, so tests/test_tiny_model.py holds the two equal): the problem's turn, the
    attempt, `</think>` if it has none, the instruction (with the reference, if any), the forced prefill."""
    prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": problem}], tokenize=False,
                                                     add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    shown = TINY_CRITIC_REFERENCE.format(reference_proof=reference) if reference else ""
    turn = CRITIC_TURN.format(instruction=TINY_CRITIC_INSTRUCTION.format(reference=shown))
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    close = [] if think_end in attempt else [think_end]
    return prompt + attempt + close + tokenizer(turn, add_special_tokens=False)["input_ids"]


def _running_sums(numbers: list[int], rng: random.Random | None, error_rate: float) -> tuple[list[str], int]:
    lines, total = [], numbers[0]
    for x in numbers[1:]:
        new = total + x
        if rng is not None and rng.random() < error_rate:
            new += rng.choice([-10, -1, 1, 10])
        lines.append(f"{total}+{x}={new}")
        total = new
    return lines, total


def tiny_dataset(split: str) -> list[dict]:
    """The fixed splits: 'train' (4,096 problems) and 'test' (256 held-out problems, none in train)."""
    if split not in ("train", "test"):
        raise ValueError(f"the tiny task has splits 'train' and 'test', not {split!r}")
    rng = random.Random(1234)
    test, seen = [], set()
    while len(test) < 256:
        p = tiny_problem(rng)
        if p["problem"] not in seen:
            seen.add(p["problem"])
            test.append(p)
    if split == "test":
        return test
    train = []
    while len(train) < 4096:
        p = tiny_problem(rng)
        if p["problem"] not in seen:
            seen.add(p["problem"])
            train.append(p)
    return train


def tiny_reward(response: str, answer: str) -> float:
    """The tiny task's verifier: 1.0 iff the last \\boxed{...} after the last `</think>` equals `answer`."""
    found = extract_final_answer(response)
    return float(found is not None and found.strip() == answer.strip())


# ----------------------------------------------------------------------------------------------------
# The tokenizer and the model
# ----------------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int | None = None):
    """A character-level `PreTrainedTokenizerFast` with Qwen3's special tokens and a Qwen3-like template.

    With `vocab_size`, the vocabulary is padded with filler tokens `<n>` up to that size, so that any id a model
    of that vocabulary samples decodes to something (text never encodes to them: there are no merges).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + THINK_TOKENS + CHARS)}
    vocab.update({f"<{i}>": i for i in range(len(vocab), vocab_size or 0)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def resolve_model(name: str) -> str:
    """What `--model` names: `tiny` (the built-in model), `tiny-ac2` (the tiny AC2 setting's), `random:<config.json>`
    (random weights of that shape) or a hub id / local folder, returned as is."""
    if name == "tiny":
        return tiny_model_path()
    if name == "tiny-ac2":
        return tiny_ac2_model_path()
    if name.startswith("random:"):
        return random_model_path(name[len("random:"):])
    return name


def random_model_path(config_file: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """A model folder with random weights of `config_file`'s shape (any local `config.json`, e.g. the paper models'
    in benchmarks/configs/) and the tiny tokenizer padded to its vocabulary: the paper shapes without a hub, for
    memory and speed checks. Random weights rarely stop, so rollouts run to max_tokens: the worst case for memory.
    Built once per config (seeded) and cached beside the tiny model; saved in the config's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config_file)
    if not path.is_file():
        raise SystemExit(f"--model random:{config_file}: no such config.json file.")
    spec = json.loads(path.read_text())
    root = Path(cache_dir or os.environ.get("TINY_RL_CACHE") or Path.home() / ".cache" / "tiny-rl")
    digest = hashlib.sha256(json.dumps([spec, seed], sort_keys=True).encode()).hexdigest()[:10]
    final = root / f"random-{spec.get('model_type', 'model')}-{digest}"
    if (final / "config.json").exists():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "config.json").exists():
            tokenizer = build_tokenizer(spec["vocab_size"])
            fields = {k: v for k, v in spec.items()
                      if not k.startswith("_") and k not in ("architectures", "transformers_version")}
            fields.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            dtype = getattr(torch, str(spec.get("torch_dtype") or spec.get("dtype") or "float32"))
            print(f"building a random-weight model of {path} ({dtype}) in {final} (once)...", flush=True)
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            tmp = root / f".{final.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, final)
    return str(final)


def recipe_hash(recipe: TinyRecipe = RECIPE) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode()).hexdigest()[:10]


SHIPPED = Path(__file__).parent / "tiny_model"  # the built model, in the repository: the same weights everywhere


# The tiny AC2 setting's model (`--model tiny-ac2`, docs/ac2.md "The tiny AC2 setting"): the tiny
# model's shape, built by benchmarks/build_tiny_ac2.py as phases of benchmarks/critic_probe.py, each from the last one's
# weights with a fresh optimizer. First the critic alone, with the reference before the attempt (ac2.py's
# --critic-reference-first) and a training-only dense label ("has the attempt gone wrong by here"); then solving beside
# it. The order matters: solving from the start erases the comparison (attempts N3, O2, O3, P2).
TINY_AC2_RECIPE = {
    "common": "--ref-first --pair-frac 1.0 --ref-prob 1.0 --flag-weight 1.0 --seed 0",
    "phases": [
        "--init scratch --cycle c --short-steps 600 --value-from 600 --lr 1e-3 --schedule constant --steps 3000",
        "--cycle cs --lr 3e-4 --schedule constant --steps 1200",
        "--cycle cs --lr 1e-3 --schedule constant --steps 900",
        "--cycle cs --lr 1e-3 --schedule constant --steps 1500",
        "--cycle cs --lr 3e-3 --warmup 50 --schedule cosine --steps 900",
        "--cycle cs --lr 3e-3 --warmup 50 --schedule cosine --steps 900",
        "--cycle s --lr 3e-3 --warmup 50 --schedule cosine --steps 1200",
        "--cycle cs --lr 1e-3 --warmup 50 --schedule cosine --steps 600",
    ],
    "version": 1,  # bump when critic_probe.py's training or the task changes
}
SHIPPED_AC2 = Path(__file__).parent / "tiny_ac2_model"


def tiny_ac2_model_path() -> str:
    """The shipped tiny AC2 model, checked against its recipe (it takes ~2.3 hours on 2 cores to build, so it is
    never built on first use: benchmarks/build_tiny_ac2.py builds it)."""
    record = SHIPPED_AC2 / "tiny_build.json"
    if not record.exists() or json.loads(record.read_text())["recipe"] != TINY_AC2_RECIPE:
        raise FileNotFoundError(f"{SHIPPED_AC2} is missing or was built from another recipe than TINY_AC2_RECIPE; "
                                f"build it with: python benchmarks/build_tiny_ac2.py --out {SHIPPED_AC2}")
    return str(SHIPPED_AC2)


def shipped_recipe_hash() -> str | None:
    """The recipe hash of the shipped model's build record (None if there is no shipped model)."""
    record = SHIPPED / "tiny_build.json"
    return recipe_hash(TinyRecipe(**json.loads(record.read_text())["recipe"])) if record.exists() else None


def tiny_model_path(cache_dir: str | os.PathLike | None = None, recipe: TinyRecipe = RECIPE,
                    rebuild: bool = False) -> str:
    """Path of the warm-started tiny model (HF format with tokenizer).

    The repository ships it (common/tiny_model/, built from RECIPE): floating-point kernels differ between
    CPUs, so a build is deterministic on one machine but not across machines, and shipping the weights is what
    makes every tiny-task number reproduce anywhere. A recipe without a shipped build is built from scratch on
    first use (~20 minutes on 2 cores, with progress) and cached in $TINY_RL_CACHE or
    ~/.cache/tiny-rl; safe against concurrent builders (a file lock) and a kill mid-build (built aside, renamed).
    `rebuild` builds from scratch even when a shipped or cached build exists (benchmarks/tiny_model.py --rebuild).
    """
    if not rebuild and recipe_hash(recipe) == shipped_recipe_hash():
        return str(SHIPPED)
    root = Path(cache_dir or os.environ.get("TINY_RL_CACHE") or Path.home() / ".cache" / "tiny-rl")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-qwen3-{recipe_hash(recipe)}"
    if (final / "config.json").exists() and not rebuild:
        return str(final)
    print(f"building the tiny model from its recipe into {final} (~20 minutes on 2 cores)...", flush=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild or not (final / "config.json").exists():
            tmp = root / f".{final.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            _build_tiny_model(tmp, recipe)
            shutil.rmtree(final, ignore_errors=True)  # rebuild: the earlier build goes only once the new one exists
            os.replace(tmp, final)
    return str(final)


def _build_tiny_model(out: Path, recipe: TinyRecipe) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.time()
    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=128,  # 101 tokens used; a round size
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = Qwen3ForCausalLM(config)
    losses = _warm_start(model, tokenizer, recipe)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"recipe": dataclasses.asdict(recipe), "build_seconds": round(time.time() - t0, 1),
            "sft_loss_first": losses[0], "sft_loss_last": losses[-1]}
    (out / "tiny_build.json").write_text(json.dumps(meta, indent=2))


def _warm_start(model, tokenizer, recipe: TinyRecipe) -> list[float]:
    """Supervised warm start on freshly generated noisy traces; loss on response tokens only."""
    rng = random.Random(recipe.seed)

    def chat(user: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def draw() -> tuple[dict, list[int]]:
        while True:
            p = tiny_problem(rng)
            if p["problem"] not in held_out:  # never train on the held-out split
                return p, [int(x) for x in p["problem"][len("Add: "):].split("+")]

    def example(kind: str) -> tuple[list[int], int]:
        """(token ids, length of the context that gets no loss)."""
        if kind == "packed":
            pack = [draw() for _ in range(rng.choice([1, 2, 3]))]
            context = chat(tiny_pack_prompt([p["problem"] for p, _ in pack]))
            checks = [rng.random() < recipe.check_rate for _ in pack]
            response = tiny_packed_solution([nums for _, nums in pack], rng, recipe.error_rate, checks)
            return context + tokenizer(response, add_special_tokens=False)["input_ids"] + [eos], len(context)
        p, numbers = draw()
        prompt = chat(p["problem"])
        check = rng.random() < recipe.check_rate
        text = tiny_solution(numbers, rng, recipe.error_rate, check)
        response = tokenizer(text, add_special_tokens=False)["input_ids"]
        if kind == "solve":
            return prompt + response + [eos], len(prompt)
        # AC2's critic prompt (tested equal to ac2.critic_context's): a partial attempt, with a correct trace as
        # reference half the time
        attempt = response[: rng.randint(0, len(response))]
        reference = tiny_solution(numbers) if rng.random() < 0.5 else None
        context = tiny_critic_context(tokenizer, p["problem"], attempt, reference)
        value = tokenizer(VALUE_STRINGS[prior_value(tokenizer.decode(attempt), numbers)], add_special_tokens=False)
        return context + value["input_ids"] + [eos], len(context)

    def prior_value(attempt: str, numbers: list[int]) -> int:
        """A hand estimate of the warm-start policy's chance to finish right, on the grid (tenths): 0 once the
        attempt has left every correct trace, else (1 - error_rate) ** (sum lines still to write). The 0 is low:
        by Monte Carlo the built policy still wins about 0.2 from one wrong sum, its check: pass re-adding the terms
        (docs/ac2.md, "Can the tiny critic learn to judge?")."""
        if not any(tiny_solution(numbers, check=c).startswith(attempt) for c in (False, True)):
            return 0
        remaining = len(numbers) - 1 - attempt.split("check:")[0].count("\n")
        return round(10 * (1 - recipe.error_rate) ** max(remaining, 0))

    eos = tokenizer.eos_token_id

    held_out = {p["problem"] for p in tiny_dataset("test")}
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / recipe.sft_warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / recipe.sft_steps))),
    )
    model.train()
    losses, t0 = [], time.time()
    for step in range(recipe.sft_steps):
        # the longer format examples come in batches of their own, to keep padding low
        phase = step % recipe.format_every  # of 8: 1 critic; 3, 5, 7 packed, between the solve batches
        packed_phases = range(3, 3 + 2 * recipe.packed_per_cycle, 2)
        kind = "critic" if phase == 1 else "packed" if phase in packed_phases else "solve"
        batch = [example(kind) for _ in range(recipe.sft_batch if kind == "solve" else recipe.format_batch)]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (ids, n_prompt) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        # right padding only: positions 0..n-1 match what vLLM sees
        # (causal attention never lets a real token see the pads after it, so no mask is needed)
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(loss.item(), 4))
        if (step + 1) % 100 == 0 or step == 0:  # a 20-minute build must not run in silence
            spent = time.time() - t0
            left = spent / (step + 1) * (recipe.sft_steps - step - 1)
            print(f"building the tiny model: step {step + 1}/{recipe.sft_steps}, loss {losses[-1]:.3f}, "
                  f"{spent / 60:.1f} min so far, ~{left / 60:.0f} min left", flush=True)
    model.eval()
    return losses
