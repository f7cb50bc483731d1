"""The pod planner on the tiny model and 8 fake devices: it compiles the train step from abstract shapes, and
its compiled state bytes match the analytic count.

It runs in a subprocess: the planner sets the device count before JAX starts, and this process's JAX has
started already. The HLO reader is checked on a hand-written module.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hlo_stats  # noqa: E402
import pod_plan  # noqa: E402

TOP_KEYS = ("state_bytes_vs_analytic", "temp_bytes", "analytic_activation_bytes", "fits_h100", "compile_s")


def test_tiny_plan_on_8_devices(tmp_path):
    out = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/pod_plan.py", "--model", "tiny", "--mesh", "data=2,fsdp=4",
                           "--seq", "64", "--skip-engine", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in TOP_KEYS:
        assert key in result, key
    assert result["devices"] == 8
    assert abs(result["state_bytes_vs_analytic"] - 1) < 0.1
    assert result["fits_h100"] is True
    # The engine's programs are left out to keep the test cheap; the committed sweep compiles them.
    assert set(result["programs"]) == {"train_step"}
    for name, program in result["programs"].items():
        memory = program["memory"]
        assert memory["argument_bytes"] > 0 and memory["output_bytes"] > 0, name
        assert memory["needed_bytes"] > 0, name
        assert set(program["roofline"]) == set(pod_plan.ACCELERATORS), name
    train = result["programs"]["train_step"]
    assert train["memory"]["temp_bytes"] > 0 and train["matmul_flops"] > 0
    # data=2 x fsdp=4: the gradients are reduced across the 8 devices and the fsdp weights gathered.
    assert {"all-gather"} <= set(train["collectives"])
    assert result["analytic_activation_bytes"] > 0
    assert "meta" in result


HLO = """HloModule m, num_partitions=4

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %w = f32[16,16]{1,0} constant({...})
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = f32[8,16]{1,0} all-reduce(%d), replica_groups=[1,4]<=[4], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %ar)
}

ENTRY %main (a: f32[8,16]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%z, %a)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body, TRIPS
  %ag = f32[32,16]{1,0} all-gather(%a), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
""".replace("TRIPS", 'backend_config={"known_trip_count":{"n":"5"}}')


def test_hlo_costs_count_loop_bodies_by_trip_count():
    costs = hlo_stats.program_costs(HLO)
    assert costs["matmul_flops"] == 5 * 2 * 8 * 16 * 16
    ar, ag = costs["collectives"]["all-reduce"], costs["collectives"]["all-gather"]
    assert ar["count"] == 5 and ar["operand_bytes"] == 5 * 8 * 16 * 4
    assert ar["wire_bytes"] == 5 * 2 * 8 * 16 * 4 * 3 / 4
    assert ag["count"] == 1 and ag["wire_bytes"] == 8 * 16 * 4 * 3
    assert costs["loops_without_trip_count"] == 0


def test_mesh_argument_names_a_bad_axis():
    assert pod_plan.parse_mesh("data=2,fsdp=4") == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    assert pod_plan.parse_mesh("fsdp=2,expert=4")["expert"] == 4
    with pytest.raises(ValueError, match="pipeline"):
        pod_plan.parse_mesh("pipeline=2")
