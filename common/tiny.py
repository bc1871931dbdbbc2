"""The built-in tiny task and tiny model, so that every script runs (and visibly learns) on a laptop CPU.

Task (spec/overview.md, "The built-in tiny task and model"): add 2-6 two-digit numbers, solved as running
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
RL has room to close that gap. The build is deterministic given the recipe, takes a few minutes on 2
cores, and is cached on disk (``$TINY_RL_CACHE`` or ``~/.cache/tiny-rl``) for every script and test.
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
    head_dim: int = 32  # vLLM's CPU attention rejects head_dim=16 (notes/vllm-cpu.md)
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    error_rate: float = 0.2  # per running-sum step, in the warm-start traces
    sft_steps: int = 1200
    sft_batch: int = 64
    sft_lr: float = 3e-3
    sft_warmup: int = 50
    seed: int = 0
    version: int = 1  # bump when the task or the build changes


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


def tiny_solution(numbers: list[int], rng: random.Random | None = None, error_rate: float = 0.0) -> str:
    """The response after the generation prompt's `<think>\\n`: running sums, then the boxed total.

    With `error_rate` > 0 a step's result is off by +-1 or +-10 with that probability, and later steps
    continue from the wrong value, so the boxed answer agrees with the (wrong) trace.
    """
    lines, total = [], numbers[0]
    for x in numbers[1:]:
        new = total + x
        if rng is not None and rng.random() < error_rate:
            new += rng.choice([-10, -1, 1, 10])
        lines.append(f"{total}+{x}={new}")
        total = new
    return "\n".join(lines) + "\n</think>\n\n\\boxed{" + str(total) + "}"


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
def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` with Qwen3's special tokens and a Qwen3-like template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + THINK_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def recipe_hash(recipe: TinyRecipe = RECIPE) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode()).hexdigest()[:10]


def tiny_model_path(cache_dir: str | os.PathLike | None = None, recipe: TinyRecipe = RECIPE) -> str:
    """Path of the warm-started tiny model (HF format with tokenizer), building it on first use.

    Safe against concurrent builders (a file lock) and against a kill mid-build (built aside, then renamed).
    """
    root = Path(cache_dir or os.environ.get("TINY_RL_CACHE") or Path.home() / ".cache" / "tiny-rl")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-qwen3-{recipe_hash(recipe)}"
    if (final / "config.json").exists():
        return str(final)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "config.json").exists():
            tmp = root / f".{final.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            _build_tiny_model(tmp, recipe)
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
    prompt_cache: dict[str, list[int]] = {}

    def encode(p: dict, numbers: list[int]) -> tuple[list[int], int]:
        if p["problem"] not in prompt_cache:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": p["problem"]}], tokenize=False, add_generation_prompt=True
            )
            prompt_cache[p["problem"]] = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = prompt_cache[p["problem"]]
        response = tokenizer(tiny_solution(numbers, rng, recipe.error_rate), add_special_tokens=False)
        return prompt + response["input_ids"] + [tokenizer.eos_token_id], len(prompt)

    held_out = {p["problem"] for p in tiny_dataset("test")}
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / recipe.sft_warmup)
        * 0.5 * (1 + math.cos(math.pi * min(1.0, s / recipe.sft_steps))),
    )
    model.train()
    losses = []
    for step in range(recipe.sft_steps):
        batch = []
        while len(batch) < recipe.sft_batch:
            p = tiny_problem(rng)
            if p["problem"] in held_out:  # never train on the held-out split
                continue
            numbers = [int(x) for x in p["problem"][len("Add: "):].split("+")]
            batch.append(encode(p, numbers))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (ids, n_prompt) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        # right padding only: positions 0..n-1 match what vLLM sees (notes/tiny-task-calibration.md)
        # (causal attention never lets a real token see the pads after it, so no mask is needed)
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(round(loss.item(), 4))
    model.eval()
    return losses
