"""benchmarks/mismatch_learning.py without running it: each run's overrides, the config check of every run
before the first starts, and the figures it derives from runs."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mismatch_learning  # noqa: E402
import results_tables  # noqa: E402


def test_each_run_trains_in_float32_with_prox_recomputed():
    ref = mismatch_learning.run_overrides(None)
    icepop = mismatch_learning.run_overrides("icepop")
    for run in (ref, icepop):
        assert run["model.compute_dtype"] == "float32" and run["trainer.prox"] == "recompute"
    assert (ref["rollout.compute_dtype"], ref["trainer.loss.mismatch"]) == ("float32", "none")
    assert (icepop["rollout.compute_dtype"], icepop["trainer.loss.mismatch"]) == ("bfloat16", "icepop")


def test_the_reference_and_the_uncorrected_run_check_on_any_tree():
    info = mismatch_learning.check_configs(["single_turn"], ["none"], {"eval.every": 3})
    assert info["single_turn"]["eval_prompts"] >= 1


def test_every_correction_checks_and_a_bad_override_is_named_before_any_run():
    mismatch_learning.check_configs(list(mismatch_learning.TASKS), list(mismatch_learning.CORRECTIONS), {})
    with pytest.raises(mismatch_learning.RunRefused, match=r"trainer\.loss\.mismatch_high"):
        mismatch_learning.check_configs(["tools"], ["icepop"], {"trainer.loss.mismatch_high": "0.1"})


def test_gaps_noise_and_flat_figures():
    def run(name, accuracy):
        return {"task": "tools", "run": name, "rollout_compute_dtype": "bfloat16", "final_accuracy": accuracy,
                "step_s": 1.0, "mismatch_kl_mean": None}

    runs = {"reference": run("reference", 0.5), "none": run("none", 0.4), "tis": run("tis", 0.49)}
    mismatch_learning.compare(runs, n=256)
    assert runs["none"]["gap_points"] == pytest.approx(10.0)
    assert not runs["none"]["same_within_noise"] and runs["tis"]["same_within_noise"]
    assert "gap_points" not in runs["reference"]
    flat = mismatch_learning.flat_figures({"tools": runs})
    assert flat["tools_reference_final_accuracy"] == 0.5 and flat["tools_tis_gap_points"] == pytest.approx(1.0)
    # The docs' table reads what the script writes.
    result = {"steps": 6, "eval_prompts": {"tools": 256}, **flat,
              "summary": mismatch_learning.summary({"tools": runs})}
    for figure in results_tables.HEADLINES["mismatch_learning"]:
        figure.text(result)
    assert "| tools | none | bfloat16 | 40.0% | 10.0 |" in results_tables.TABLES["mismatch_learning"].text(result)
