"""benchmarks/soak.py at a small operation count, so that the soak cannot rot: every fault kind happens, the
invariants hold and the refusals are counted; and its verdict fails a run on each broken invariant."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402


@pytest.mark.slow  # 20-45 s: a served service, episodes, an isolated environment process, checkpoints
def test_a_short_soak_holds_its_invariants(tmp_path):
    out_path = tmp_path / "soak.json"
    assert soak.main(["--ops", "300", "--seed", "1", "--json", str(out_path)]) == 0
    out = json.loads(out_path.read_text())
    assert out["operations"] >= 300 and out["missing_faults"] == [] and min(out["faults"].values()) > 0
    assert (out["groups_lost"], out["groups_trained_twice"], out["staleness_violations"]) == (0, 0, 0)
    assert out["refusals_injected"] == out["refusals_counted"] and out["violations_total"] == 0
    assert out["env_process_hung"] == out["faults"]["env_hang"] >= 1
    assert all(r["restored_step"] < r["damaged_step"] for r in out["resumes"]) and out["resumes"]
    assert "meta" in out


def _clean():
    return {"groups_lost": 0, "groups_trained_twice": 0, "staleness_violations": 0, "refusals_match": True,
            "refusals_injected": {"token_id": 1}, "refusals_counted": {"token_id": 1}, "missing_faults": [],
            "operations": 300, "ops_target": 300, "violations_total": 0, "violations": [],
            "env_process_hung": 1, "faults": {"env_hang": 1}}


@pytest.mark.parametrize("change", [
    {"groups_lost": 1}, {"groups_trained_twice": 2}, {"staleness_violations": 1},
    {"refusals_match": False, "refusals_counted": {"token_id": 0}}, {"missing_faults": ["env_hang"]},
    {"operations": 299}, {"violations_total": 1, "violations": ["step 3: group 7 is not what its worker sent"]},
    {"env_process_hung": 0},
])
def test_the_verdict_fails_a_run_on_each_broken_invariant(change):
    assert soak.failures(_clean()) == []
    assert len(soak.failures({**_clean(), **change})) == 1
