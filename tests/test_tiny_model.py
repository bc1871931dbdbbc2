"""The shipped tiny model is what every run uses; a recipe without a shipped build is built, once, with progress."""

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from conftest import ROOT

import common.tiny
from common.tiny import (
    RECIPE,
    SHIPPED,
    SHIPPED_AC2,
    TINY_AC2_RECIPE,
    TinyRecipe,
    recipe_hash,
    resolve_model,
    shipped_recipe_hash,
    tiny_model_path,
    tiny_solution,
)


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


def test_the_tiny_ac2_model_ships_with_its_recipe_and_each_phases_log():
    assert Path(resolve_model("tiny-ac2")) == SHIPPED_AC2 == ROOT / "common" / "tiny_ac2_model"
    record = json.loads((SHIPPED_AC2 / "tiny_build.json").read_text())
    assert record["recipe"] == TINY_AC2_RECIPE
    logs = sorted((SHIPPED_AC2 / "build_logs").glob("phase_*.log"))
    assert len(logs) == len(TINY_AC2_RECIPE["phases"]) == 8
    for log, phase in zip(logs, TINY_AC2_RECIPE["phases"]):  # each log is headed by the command that ran it
        command = log.read_text().splitlines()[0]
        assert command.split()[0].endswith("critic_probe.py")
        assert shlex.join(shlex.split(TINY_AC2_RECIPE["common"]) + shlex.split(phase)) in command
    # the tiny model's shape and tokenizer: vLLM serves it as it serves `tiny`, and the tiny task's prompts are its own
    ac2_config, config = (json.loads((d / "config.json").read_text()) for d in (SHIPPED_AC2, SHIPPED))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "eos_token_id"):
        assert ac2_config[key] == config[key], key
    assert (SHIPPED_AC2 / "tokenizer.json").read_text() == (SHIPPED / "tokenizer.json").read_text()
    assert (SHIPPED_AC2 / "model.safetensors").stat().st_size < 16e6


def test_a_missing_or_stale_tiny_ac2_build_is_refused_with_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(common.tiny, "SHIPPED_AC2", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"python benchmarks/build_tiny_ac2\.py --out"):
        resolve_model("tiny-ac2")
    stale = {**TINY_AC2_RECIPE, "phases": TINY_AC2_RECIPE["phases"][:-1]}
    (tmp_path / "tiny_build.json").write_text(json.dumps({"recipe": stale}))
    with pytest.raises(FileNotFoundError, match="another recipe"):
        resolve_model("tiny-ac2")


def test_the_tiny_ac2_builder_chains_the_phases_and_continues_only_a_build_of_the_recipes_first_phases(tmp_path):
    import subprocess
    import sys

    script = ROOT / "benchmarks" / "build_tiny_ac2.py"
    dry = subprocess.run([sys.executable, script, "--dry-run", "--out", tmp_path / "m"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(dry) == len(TINY_AC2_RECIPE["phases"])
    outs = [shlex.split(c)[shlex.split(c).index("--out") + 1] for c in dry]
    inits = [shlex.split(c)[shlex.split(c).index("--init") + 1] for c in dry]
    assert inits == ["scratch", *outs[:-1]]  # each phase starts from the last one's weights
    for command, phase in zip(dry, TINY_AC2_RECIPE["phases"]):
        assert shlex.join(shlex.split(TINY_AC2_RECIPE["common"]) + shlex.split(phase)) in command
    # the shipped build has every phase: nothing to continue; a build of other phases is refused
    assert subprocess.run([sys.executable, script, "--dry-run", "--continue-from", SHIPPED_AC2], capture_output=True,
                          text=True, check=True).stdout.strip() == ""
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiny_build.json").write_text(json.dumps(
        {"recipe": {**TINY_AC2_RECIPE, "phases": ["--cycle c --steps 10"]}, "build_seconds": 1.0}))
    refused = subprocess.run([sys.executable, script, "--dry-run", "--continue-from", other], capture_output=True,
                             text=True)
    assert refused.returncode != 0 and "was not built from the first phases" in refused.stderr


def test_tiny_model_counts_the_first_pass_additions_each_on_its_own_operands():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tiny_model import additions_right

    assert additions_right(tiny_solution([24, 10, 21], check=True)) == (2, 2)  # 24+10=34, 34+21=55; the check ignored
    # 24+10=39 is wrong; 39+21=60 adds up on its own operands although it carries the slip; the check pass and the
    # answer section are not counted
    wrong = "24+10=39\n39+21=60\ncheck:\n24+10=39\n39+21=61\n</think>\n\n\\boxed{60}\n1+1=3"
    assert additions_right(wrong) == (1, 2)
    assert additions_right("I think it is 55\n</think>\n\n\\boxed{55}") == (0, 0)


def test_the_first_wrong_sum_is_classified_by_its_offset_from_its_own_operands():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tiny_model import first_wrong_sum

    assert first_wrong_sum(tiny_solution([24, 10, 21], check=True)) == "adds up"
    assert first_wrong_sum("<think>\n24+10=44\n44+21=65\n</think>") == "off by 10"  # the next line adds up
    assert first_wrong_sum("<think>\n24+10=34\n34+21=54\n</think>") == "off by 1"
    assert first_wrong_sum("<think>\n24+10=43\n43+21=64\n</think>") == "off otherwise"  # digits swapped: +9
    assert first_wrong_sum("<think>\n24+10=34\n34+21=55\ncheck:\n24+10=35\n</think>") == "adds up"  # the check
    assert first_wrong_sum("I think it is 55\n</think>\n\n\\boxed{55}") == "no sums"
    # least-significant digit first (critic_probe.py --lsd): 24+10=44 is written 42+01=44, 34+21=54 is 43+12=45
    assert first_wrong_sum("<think>\n42+01=44\n44+12=56\n</think>", lsd=True) == "off by 10"
    assert first_wrong_sum("<think>\n42+01=43\n43+12=45\n</think>", lsd=True) == "off by 1"
    assert first_wrong_sum("<think>\n42+01=43\n43+12=55\n</think>", lsd=True) == "adds up"
