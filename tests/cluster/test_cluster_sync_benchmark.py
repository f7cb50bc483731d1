"""benchmarks/cluster_sync.py runs at a tiny size on a two-engine Ray cluster and reports what it measured.

The engines check what they pulled against what was published (a mismatch fails the run)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import ray  # noqa: F401  (the `cluster` extra, which the setup script installs: never skipped)

pytestmark = pytest.mark.slow  # Ray clusters and actors

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "cluster_sync.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "benchmarks/cluster_sync.py", "--params", "tiny", "--engines", "2",
                           "--repeats", "1", "--gap-s", "0", "--node-store-gb", "0.2", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    cases = figures["cases"]
    transports = {"ray_object", "ray_tensors", "shm", "shm_push", "stream"}
    assert {(c["transport"], c["engines"], c["same_node"]) for c in cases} == (
        {(t, 2, False) for t in transports} | {(t, 1, True) for t in transports})
    for c in cases:
        assert c["host_s_median"] > 0 and c["device_s_median"] > 0
        assert 0 <= c["notify_s_median"] < c["host_s_median"]
        assert isinstance(c["device_aliases_host"], bool)
        assert c["vs_memcpy"] == figures["memcpy_s"] / c["host_s_median"]
    cross = [c for c in cases if not c["same_node"]]
    assert figures["cluster_sync_vs_memcpy"] == max(c["vs_memcpy"] for c in cross)
    assert figures["best_transport"] == max(cross, key=lambda c: c["vs_memcpy"])["transport"]
    assert "cluster_sync_vs_memcpy" in proc.stdout
    assert figures["gap_s"] == 0 and len(figures["load_average_before"]) == 3
