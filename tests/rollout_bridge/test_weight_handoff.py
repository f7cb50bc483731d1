"""The in-process weight hand-off: a JaxEngine given DeviceWeights (a trainer's params on another mesh,
moved device to device) serves exactly what it serves after the HF host path with the same weights; the
swap keeps requests in flight; bad DeviceWeights are refused with nothing changed; vLLM refuses them;
and benchmarks/weight_handoff.py runs at a tiny size."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from engine_helpers import lively_tiny_model, perturbed, poll_all, prompts, run
from flax import nnx

from jaxflow import sharding
from jaxflow.data.device_params import DeviceParamSource, reshard
from jaxflow.data.reshard import route as reshard_route
from jaxflow.models.hf_io import load_model
from jaxflow.models.tiny import write_tiny_model
from rollout_bridge.engine import Request, SamplingParams, WeightsRejected
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end

ENGINE_KW = dict(max_slots=4, max_len=128, decode_chunk=8, prefill_buckets=(16, 32, 64))
ROOT = pathlib.Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def no_host_transfers():
    """Explicit host->device transfers refused in this thread (device to device stays allowed), on the
    reshard route accelerators take (CPU devices take jax.device_put's): the HF path places every tensor
    from the host, so it cannot pass (test_device_params checks that)."""
    with jax.transfer_guard_host_to_device("disallow_explicit"), \
            jax.transfer_guard_device_to_host("disallow_explicit"), reshard_route("program"):
        yield


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def new_weights(qwen3_dir):
    """(model, HF tensors) of the next policy version: what a trainer step produced."""
    return perturbed(load_model(qwen3_dir), seed=3)


def trainer_params(model, mesh):
    """The model's params laid out on a trainer mesh, as fresh arrays (what a train step returns)."""
    params = nnx.state(model, nnx.Param)
    return reshard(params, sharding.state_shardings(params, mesh), copy=True)


def engine_mesh():
    """Two of the eight devices, split by tensor: not the trainer's layout."""
    return sharding.make_mesh(fsdp=1, tensor=2, devices=jax.devices()[4:6])


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("register_target", [True, False])
def test_device_weights_serve_exactly_what_the_host_path_serves(qwen3_dir, new_weights, register_target):
    new_model, tensors = new_weights
    host = JaxEngine(qwen3_dir, mesh=engine_mesh(), **ENGINE_KW)
    device = JaxEngine(qwen3_dir, mesh=engine_mesh(), **ENGINE_KW)
    try:
        before = [c.sample.tokens for c in run(device, prompts(), tag="before")]
        source = DeviceParamSource()
        if register_target:  # placed on the engine's layout at publish; else resharded at pull
            source.add_target(device.param_shardings)
        source.publish(1, trainer_params(new_model, sharding.make_mesh(fsdp=8)))
        with no_host_transfers():
            device.update_weights(*source.pull())
        host.update_weights(1, tensors)
        assert device.version == host.version == 1
        assert leaves_equal(device._params, host._params)
        for got, want in zip(jax.tree.leaves(device._params), jax.tree.leaves(host._params)):
            assert got.sharding == want.sharding  # the layout the engine compiled for: no recompile
        ours, theirs = run(device, prompts(), tag="after"), run(host, prompts(), tag="after")
        assert [c.sample.tokens for c in ours] == [c.sample.tokens for c in theirs]
        assert [c.sample.logprobs for c in ours] == [c.sample.logprobs for c in theirs]
        assert all(c.sample.versions == [1] * len(c.sample.tokens) for c in ours)
        assert [c.sample.tokens for c in ours] != before  # the new weights changed the output
    finally:
        host.close()
        device.close()


def test_swap_from_device_weights_keeps_requests_in_flight(qwen3_dir, new_weights):
    engine = JaxEngine(qwen3_dir, **ENGINE_KW)
    source = DeviceParamSource()
    source.publish(1, trainer_params(new_weights[0], sharding.make_mesh(fsdp=8)))
    reqs = [Request(f"k{i}", p, SamplingParams(max_tokens=60, temperature=0.0))
            for i, p in enumerate(prompts(2, lens=(5, 20, 9)))]
    try:
        for r in reqs:
            engine.submit(r)
        engine.update_weights(*source.pull())
        done = poll_all(engine, len(reqs))
    finally:
        engine.close()
    for r in reqs:
        s = done[r.request_id].sample
        assert len(s.tokens) == 60 and s.finish_reason == "length"
        swap = s.versions.index(1) if 1 in s.versions else 60
        assert s.versions == [0] * swap + [1] * (60 - swap)  # one boundary, never back


def test_bad_device_weights_are_refused_and_nothing_changes(qwen3_dir, tmp_path, new_weights):
    engine = JaxEngine(qwen3_dir, **ENGINE_KW)
    try:
        reference = [c.sample.tokens for c in run(engine, prompts(), tag="ref")]
        good = nnx.state(new_weights[0], nnx.Param)
        weights = DeviceParamSource().publish(1, good)
        with pytest.raises(WeightsRejected, match="device weights of version 1 handed over as version 2"):
            engine.update_weights(2, weights)
        other = load_model(write_tiny_model(tmp_path / "other", num_layers=3))
        with pytest.raises(WeightsRejected, match=r"parameter \['layers'\]\['down_proj'\].* has shape "
                                                  r"\(3, .*expected \(2, "):
            engine.update_weights(1, DeviceParamSource().publish(1, nnx.state(other, nnx.Param)))
        with pytest.raises(WeightsRejected, match="parameter tree"):
            engine.update_weights(1, DeviceParamSource().publish(1, {"w": jax.numpy.zeros(3)}))
        half = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16), good)
        with pytest.raises(WeightsRejected, match=r"\['embed'\].* has dtype bfloat16, expected float32 "
                                                  r"\(the serving dtype; casting was not asked for\)"):
            engine.update_weights(1, DeviceParamSource().publish(1, half))
        assert engine.version == 0
        assert [c.sample.tokens for c in run(engine, prompts(), tag="after")] == reference
    finally:
        engine.close()
    casting = JaxEngine(qwen3_dir, cast_weights=True, warmup=False, **ENGINE_KW)
    try:
        casting.update_weights(1, DeviceParamSource().publish(1, half))
        assert casting.version == 1
        assert leaves_equal(casting._params, jax.tree.map(lambda a: a.astype(np.float32), half))
        assert all(a.dtype == np.float32 for a in jax.tree.leaves(casting._params))
        for got, want in zip(jax.tree.leaves(casting._params), jax.tree.leaves(casting.param_shardings)):
            assert got.sharding == want
    finally:
        casting.close()


def test_vllm_engine_refuses_device_weights(new_weights):
    from rollout_bridge.vllm_engine import VllmEngine

    weights = DeviceParamSource().publish(4, nnx.state(new_weights[0], nnx.Param))
    engine = VllmEngine.__new__(VllmEngine)  # the refusal comes before anything of a running engine
    with pytest.raises(WeightsRejected, match="DeviceWeights .*vLLM engine loads HF-named host tensors"):
        engine.update_weights(4, weights)


def test_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "handoff.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "benchmarks/weight_handoff.py", "--size", "tiny", "--repeats", "2",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    cases = figures["cases"]
    assert {c["case"] for c in cases} >= {"one device (as the rl job)", "8 fsdp -> 2 of them tp2 (subset)"}
    for c in cases:
        assert c["device_put_s"] > 0 and c["handoff_s"] > 0 and c["host_roundtrip_s"] > 0
    assert figures["inprocess_sync_vs_device_put"] == min(c["device_put_s"] / c["handoff_s"] for c in cases)
    assert figures["host_roundtrip_vs_device_put"] == min(c["device_put_s"] / c["host_roundtrip_s"]
                                                          for c in cases)
    assert "hand-off" in proc.stdout
