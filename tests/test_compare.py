"""benchmarks/compare.py's FLOPs-to-a-score reading: where a curve first reaches a score, and the ratio to GRPO's."""

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare


def test_flops_to_reach_interpolates_between_evaluations_and_the_ratio_is_grpos_over_the_methods():
    flops = [0.0, 1e9, 2e9, 3e9]
    assert compare.flops_to_reach([0.1, 0.3, 0.5, 0.4], flops, 0.5) == 2e9
    assert compare.flops_to_reach([0.1, 0.3, 0.5, 0.4], flops, 0.4) == 1.5e9  # halfway from 0.3 to 0.5
    assert compare.flops_to_reach([0.1, 0.3, 0.5, 0.4], flops, 0.6) is None
    grpo = compare.flops_to_reach([0.1, 0.2, 0.3, 0.5], [0.0, 2e9, 4e9, 6e9], 0.4)  # 5e9
    assert compare.flops_ratio(grpo, 2e9) == 2.5


def test_a_method_whose_peak_is_its_start_has_no_flops_ratio():
    # a run that only gets worse peaks at step 0, where both it and GRPO have spent 0 FLOPs: no ratio, no crash
    own = compare.flops_to_reach([0.045, 0.03, 0.01], [0.0, 1e9, 2e9], 0.045)
    assert own == 0.0
    assert compare.flops_ratio(compare.flops_to_reach([0.045, 0.04], [0.0, 1e9], 0.045), own) is None
    assert compare.flops_ratio(None, 1e9) is None  # GRPO never got there


def test_reference_first_reaches_the_critic_scripts_only_and_tiny_ac2_implies_it():
    flag = "--critic-reference-first"
    assert flag not in compare.script_flags("AC2", "checkpoints/z2")
    assert compare.script_flags("AC2", "checkpoints/z2", True)[-3:] == ["--model", "checkpoints/z2", flag]
    assert compare.script_flags("Prefix GRPO", "checkpoints/z2", True).count(flag) == 1
    assert flag not in compare.script_flags("GRPO on 128", "checkpoints/z2", True)  # grpo.py has no critic
    assert compare.script_flags("AC2", "tiny-ac2").count(flag) == 1
    assert compare.script_flags("AC2", "tiny-ac2", True).count(flag) == 1  # not twice


def test_a_run_with_the_critic_reference_first_is_not_reused_for_one_without():
    assert compare.run_name("AC2", 1, 100, "checkpoints/z2") == "cmp_ac2_checkpoints_z2_s1_n100"
    assert compare.run_name("AC2", 1, 100, "checkpoints/z2", True) == "cmp_ac2_checkpoints_z2_ref_s1_n100"
    # GRPO's flags do not change, so its run is shared; tiny-ac2 implies the order, so its names stay as they were
    assert compare.run_name("GRPO on 128", 1, 100, "checkpoints/z2", True) == "cmp_grpo_on_128_checkpoints_z2_s1_n100"
    assert compare.run_name("AC2", 2, 100, "tiny-ac2", True) == "cmp_ac2_tiny_ac2_s2_n100"
    assert compare.run_name("Prefix GRPO", 1, 100) == "cmp_prefix_grpo_s1_n100"
