"""The shipped tiny model is what every run uses; a recipe without a shipped build is built, once, with progress."""

import dataclasses
import json
from pathlib import Path

from conftest import ROOT

from common.tiny import RECIPE, SHIPPED, TinyRecipe, recipe_hash, shipped_recipe_hash, tiny_model_path


def test_the_shipped_model_is_used_and_is_the_recipes(tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_RL_CACHE", str(tmp_path))  # an empty cache: nothing may be built or read there
    path = Path(tiny_model_path())
    assert path == SHIPPED == ROOT / "common" / "tiny_model"
    assert shipped_recipe_hash() == recipe_hash(RECIPE)
    record = json.loads((path / "tiny_build.json").read_text())
    assert record["recipe"] == dataclasses.asdict(RECIPE)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).stat().st_size > 0, name
    assert list(tmp_path.iterdir()) == []


def test_another_recipe_is_built_into_the_cache_once_with_progress(tmp_path, capsys):
    recipe = TinyRecipe(sft_steps=4, sft_batch=4, format_batch=2, format_every=2, packed_per_cycle=1,
                        sft_warmup=1)
    assert recipe_hash(recipe) != recipe_hash(RECIPE)
    path = Path(tiny_model_path(tmp_path, recipe))
    out = capsys.readouterr().out
    assert "building the tiny model from its recipe" in out and "step 1/4, loss" in out  # says what it does
    assert path.parent == tmp_path and path.name == f"tiny-qwen3-{recipe_hash(recipe)}"
    record = json.loads((path / "tiny_build.json").read_text())
    assert record["recipe"] == dataclasses.asdict(recipe)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    before = (path / "model.safetensors").read_bytes()
    assert Path(tiny_model_path(tmp_path, recipe)) == path  # the second call reuses the build
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert capsys.readouterr().out == ""
    # rebuild: from scratch although a build exists (for RECIPE: although one ships), the same weights on one machine
    assert tiny_model_path(tmp_path, recipe, rebuild=True) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns != stamp
    assert (path / "model.safetensors").read_bytes() == before


def test_the_warm_starts_critic_prompt_is_ac2s():
    # the warm start teaches exactly the context ac2.py --tiny asks the critic with (ac2.critic_context)
    import ac2
    from common.tiny import build_tokenizer, tiny_critic_context, tiny_solution

    tok, args = build_tokenizer(), ac2.tiny_args()
    reference = tiny_solution([33, 95, 46], check=True)
    for text in ("", "33+95=12", "33+95=128\n128+46=174\n</think>\n\n\\boxed{174}"):
        attempt = tok(text, add_special_tokens=False)["input_ids"]
        for ref in (None, reference):
            ids = tiny_critic_context(tok, "Add: 33+95+46", attempt, ref)
            assert ids == ac2.critic_context(ac2.encode_chat(tok, "Add: 33+95+46"), attempt, ref, tok, args)
            assert tok.decode(ids).count("Reference") == (ref is not None)  # so both cases were really built
