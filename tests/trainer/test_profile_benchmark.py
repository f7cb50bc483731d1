"""benchmarks/profile_step.py: the trace summary's arithmetic, and a small real run read back."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from compile_level import SUITE_OPT_LEVEL

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step  # noqa: E402

pytestmark = pytest.mark.slow  # the profiling benchmark at a tiny size


def _op(name, ts, dur, tid=1, run="r1", module="jit_decode"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": {"hlo_module": module, "hlo_op": name, "run_id": run}}


def test_nested_ops_count_once_and_calls_are_run_ids():
    events = [
        # call r1: a conditional running two fusions on thread 1, a third op on thread 2
        _op("cond.1", 0, 100), _op("fusion.a", 10, 30), _op("fusion.b", 50, 40),
        _op("fusion.a", 20, 10, tid=2),
        # call r2: one op
        _op("fusion.b", 1000, 50, run="r2"),
        # another program, and the runtime's own events: not counted
        _op("fusion.a", 0, 500, module="jit_prefill"),
        {"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0, "dur": 2000, "pid": 1, "tid": 1},
    ]
    s = profile_step.summarise(events, r"^jit_decode$", top=10)
    assert s["calls"] == 2
    own = {r["op"]: r["ms_per_call"] for r in s["top_ops"]}
    assert "cond.1" not in own  # a container's time is its children's
    assert own == pytest.approx({"fusion.a": 40 / 2 / 1e3, "fusion.b": 90 / 2 / 1e3})
    # wall: r1 spans 0..100, r2 1000..1050; some op runs over 10..40, 50..90 and 1000..1050
    assert s["wall_ms_per_call"] == pytest.approx(150 / 2 / 1e3)
    assert s["op_busy_frac"] == pytest.approx((30 + 40 + 50) / 150)
    assert s["by_jax_op"] == pytest.approx({"?": 130 / 2 / 1e3})


def test_a_small_run_profiles_the_step_and_the_decode_chunk(tmp_path):
    out = tmp_path / "profile.json"
    # One device (the engine's and the step's default mesh), compiled at the suite's level (compile_level.py):
    # the summary reads the ops' metadata, which XLA's HLO passes set alike at any LLVM level.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_backend_optimization_level={SUITE_OPT_LEVEL}"}
    proc = subprocess.run([sys.executable, "benchmarks/profile_step.py", "--sequences", "16", "--seq-len", "64",
                           "--steps", "2", "--requests", "16", "--slots", "8", "--max-tokens", "32",
                           "--trace-dir", str(tmp_path / "trace"), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    train, decode = figures["train_step"], figures["decode"]
    assert train["calls"] == 2 and decode["calls"] >= 2  # 16 requests of up to 32 tokens: 2+ chunks of 16
    for s in (train, decode):
        assert s["wall_ms_per_call"] > 0 and 0 < s["op_busy_frac"] <= 1.0 + 1e-9
        assert s["top_ops"] and all(r["ms_per_call"] >= 0 for r in s["top_ops"])
    # XLA's metadata leads the ops back to our source: the model's layers in both programs
    assert any(r["source"].startswith("jaxflow/models/transformer.py") for r in train["top_ops"])
    assert any(r["source"].startswith(("rollout_bridge/jax_decode.py", "jaxflow/models/transformer.py"))
               for r in decode["top_ops"])
    assert 0 < decode["decode_frac_of_round"] <= 1.0
    assert list((tmp_path / "trace" / "train_step").rglob("perfetto_trace.json.gz"))
    assert "train step" in proc.stdout and "decode chunk" in proc.stdout
