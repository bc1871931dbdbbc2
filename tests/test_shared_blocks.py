"""The shared machinery is the same code in every script that holds it, so that a diff between two scripts shows
the algorithm (CleanRL's rule), and the one PPO-loss semantics holds everywhere."""

import difflib
import math
import re

import pytest
import torch
from conftest import ROOT

SCRIPTS = ["grpo.py", "ac2.py", "rpo.py", "ccr.py"]
# a block opens with "# TRY NOT TO MODIFY: <name>. Identical in <scripts> (...)" and closes with "# --- end: <name>"
BLOCK = re.compile(r"^# =+\n# TRY NOT TO MODIFY: (?P<name>[^.\n]+)\.(?P<header>[^\n]*)\n.*?^# -+ end: (?P=name)\n",
                   re.M | re.S)


def blocks(script: str) -> dict[str, tuple[str, set[str]]]:
    """{name: (the block's text, the scripts its header says hold it)}."""
    return {m["name"]: (m[0], set(re.findall(r"\b\w+\.py\b", m["header"].split("(")[0])) & set(SCRIPTS))
            for m in BLOCK.finditer((ROOT / script).read_text())}


def test_every_marked_block_is_identical_in_every_script_its_header_names():
    found = {s: blocks(s) for s in SCRIPTS}
    names = {name for b in found.values() for name in b}
    assert {"the shared machinery", "the PPO update", "the data order"} <= names
    for name in sorted(names):
        holders = [s for s in SCRIPTS if name in found[s]]
        text, where = found[holders[0]][name]
        assert set(holders) == where, f"{name!r}: held by {holders}, its header names {sorted(where)}"
        for s in holders[1:]:
            other = found[s][name][0]
            diff = "".join(difflib.unified_diff(text.splitlines(True), other.splitlines(True), holders[0], s, n=1))
            assert other == text, f"the block {name!r} drifted:\n{diff[:4000]}"
    assert all("the shared machinery" in found[s] for s in SCRIPTS)


@pytest.mark.parametrize("script", ["grpo", "ac2"])
def test_dual_clip_zero_means_off_in_every_script_that_has_one(script):
    # c = 0 turns the dual clip off: negative-advantage tokens keep their PPO loss
    module = __import__(script)
    logp, adv = torch.log(torch.tensor([1.0, 1.1, 0.9])), torch.tensor([-1.0, -1.0, 1.0])
    loss, st = module.ppo_loss(logp, torch.zeros(3), adv, 0.2, 0.28, 0.0)
    assert loss.tolist() == pytest.approx([1.0, 1.1, -0.9])
    assert not st["clip_dual"].any()


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_ppo_loss_semantics_and_one_set_of_statistics(script):
    """Every script's PPO loss gives the same values and the same statistics on the same inputs (rpo.py and ccr.py
    have no dual clip: their loss is the dual-clipped one's with c = 0)."""
    module = __import__(script[:-3])
    logp, old = torch.log(torch.tensor([1.5, 0.5, 0.5, 5.0, math.exp(30.0)])), torch.zeros(5)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    dual = script in ("grpo.py", "ac2.py")
    loss, st = module.ppo_loss(logp, old, adv, 0.2, 0.28, *([3.0] if dual else []))
    # A>0, r=1.5: -1.28 (clip-high); A>0, r=0.5: -0.5; A<0, r=0.5: 0.8 (clip-low); A<0, r=5: 5, or 3 with the dual
    # clip; A>0, r=e^20 (the log-ratio clamped at 20): -1.28
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 0.8, 3.0 if dual else 5.0, -1.28])
    assert st["clip_high"].tolist() == [True, False, False, False, True]
    assert st["clip_low"].tolist() == [False, False, True, False, False]
    assert st["approx_kl"][0].item() == pytest.approx(0.5 - math.log(1.5))
    assert set(st) == {"clip_low", "clip_high", "approx_kl"} | ({"clip_dual"} if dual else set())
