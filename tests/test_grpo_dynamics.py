"""benchmarks/grpo_dynamics.py's weight movement: relative change and RMS, all weights and per kind of matrix."""

import sys

import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import grpo_dynamics


def test_relative_change_is_the_norm_of_the_change_over_the_norm_of_the_start_per_kind_and_overall():
    start = {"model.layers.0.self_attn.q_proj.weight": torch.tensor([[3.0, 4.0]]),
             "model.layers.0.mlp.down_proj.weight": torch.tensor([[0.0, 0.0, 1.0, 0.0]]),
             "model.norm.weight": torch.tensor([1.0, 1.0])}
    end = {"model.layers.0.self_attn.q_proj.weight": torch.tensor([[3.0, 5.0]]),  # change (0, 1): |dw| 1, |w| 5
           "model.layers.0.mlp.down_proj.weight": torch.tensor([[0.0, 0.0, 1.0, 2.0]]),  # |dw| 2, |w| 1
           "model.norm.weight": torch.tensor([1.0, 1.0])}
    moved = grpo_dynamics.movement(start, end)
    assert moved["q_proj"] == {"rel_change": 0.2, "rms_start": 3.536, "rms_change": 0.7071}  # sqrt(12.5), sqrt(0.5)
    assert moved["down_proj"]["rel_change"] == 2.0 and moved["down_proj"]["rms_start"] == 0.5
    assert moved["norm"]["rel_change"] == 0.0
    # all 8 weights: |dw| = sqrt(1 + 4), |w| = sqrt(25 + 1 + 2)
    assert moved["all"]["rel_change"] == 0.4226  # sqrt(5 / 28), to 4 significant digits
    assert moved["all"]["rms_start"] == 1.871  # sqrt(28 / 8)
    assert "k_proj" not in moved  # a kind the model lacks is left out, not reported as 0
