"""benchmarks/step_vs_commit.py: the medians it reads from metrics.jsonl, and the baseline tree it extracts."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_vs_commit  # noqa: E402


def _metrics(path, step_times):
    """A run's records: the base eval, then one train record a step, with a held-out eval logged after step 5
    (same step number, a later time): evals are not steps."""
    rows = [{"step": 0, "time_s": 0.5, "eval_accuracy": 0.3, "eval_s": 0.5}]
    for step, t in enumerate(step_times):
        rows.append({"step": step, "time_s": t, "loss": 0.1, "step_s": 0.4 + step / 100,
                     "trained_tokens": 100 + step, "consumed_tokens": 200, "response_tokens_mean": 20.0})
        if step == 5:
            rows.append({"step": 5, "time_s": t + 50.0, "eval_accuracy": 0.4, "eval_s": 0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_step_medians_leave_out_the_first_steps_and_the_evals(tmp_path):
    # Steps 0-2 are slow (compiles); from step 3 on the loop takes 1, 1, 3, 1, 1, 1, 1 s a step.
    times = [10.0, 20.0, 30.0, 31.0, 32.0, 35.0, 36.0, 37.0, 38.0, 39.0]
    stats = step_vs_commit.step_stats(_metrics(tmp_path / "m.jsonl", times), skip=3)
    assert stats["steps_measured"] == 7
    assert stats["median_step_s"] == pytest.approx(1.0)
    assert stats["mean_step_s"] == pytest.approx(9.0 / 7)
    assert stats["median_update_s"] == pytest.approx(0.46)  # steps 3..9: 0.43..0.49
    assert stats["trained_tokens_per_step"] == 106
    # tokens of steps 3..9 over the loop's time from the end of step 2 to the end of step 9
    assert stats["trained_tokens_per_s"] == pytest.approx(sum(range(103, 110)) / 9.0)
    # --skip 0: step 0 has no step before it, so the loop time and the tokens/s start at step 1
    stats = step_vs_commit.step_stats(_metrics(tmp_path / "m0.jsonl", times), skip=0)
    assert stats["steps_measured"] == 9 and stats["trained_tokens_per_s"] == pytest.approx(sum(range(101, 110)) / 29.0)


def test_too_few_steps_is_refused_by_name(tmp_path):
    path = _metrics(tmp_path / "m.jsonl", [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(SystemExit, match="only 1 steps after step 3"):
        step_vs_commit.step_stats(path, skip=3)


def test_baseline_tree_is_the_commits_files_and_is_reused(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    tree = step_vs_commit.baseline_tree("HEAD", tmp_path / "base")
    assert (tree / ".commit").read_text().strip() == head.stdout.strip()
    committed = subprocess.run(["git", "show", "HEAD:pyproject.toml"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    assert (tree / "pyproject.toml").read_text() == committed
    (tree / "runs").mkdir()  # a base model built there by an earlier run survives the next call
    assert step_vs_commit.baseline_tree("HEAD", tmp_path / "base") == tree and (tree / "runs").is_dir()


def test_unknown_baseline_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="'no-such-commit' is not a commit"):
        step_vs_commit.baseline_tree("no-such-commit", tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_a_directory_it_did_not_extract_is_never_emptied(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    with pytest.raises(SystemExit, match="holds files this script did not extract"):
        step_vs_commit.baseline_tree("HEAD", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"
