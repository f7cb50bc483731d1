"""Rollout workers against the real data services and the JAX engine: groups flow end to end, sync
policies fire when they should, both sync modes keep v_start and per-token versions right, and a worker
runs as its own process against served services."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxflow.transport import rpc
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.data.param_service import RPC_METHODS, ParameterService
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.trajectory_service import TrajectoryService
from rollout_bridge import jax_decode
from rollout_bridge.engine import SamplingParams
from rollout_bridge.jax_engine import JaxEngine
from rollout_bridge.worker import RolloutWorker, SyncPolicy

from service_placements import SERVICE_METHODS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("worker_model"))


@pytest.fixture(scope="module")
def weights(model_dir):
    """HF tensors of version 0 (on disk) and version 1 (visibly different)."""
    v0 = dict(iter_hf_tensors(load_model(model_dir)))
    rng = np.random.default_rng(0)
    v1 = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in v0.items()}
    return v0, v1


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = JaxEngine(model_dir, max_slots=8, max_len=128, decode_chunk=4)
    yield eng
    eng.close()


def services(eta=1, batch=2, n=2, prompts=40):
    records = [{"prompt": [5 + i % 30, 6, 7, 8 + i % 5], "meta": {"i": i}} for i in range(prompts)]
    traj = TrajectoryService(PromptSource(records, shuffle=False), batch_groups=batch, group_size=n, eta=eta)
    return traj, ParameterService(keep=2)


def length_reward(task, samples):
    return [float(len(s.tokens) % 2) for s in samples]


@pytest.fixture(autouse=True)
def stop_workers(monkeypatch):
    """Every worker a test makes is stopped afterwards, so the shared engine starts each test empty."""
    made = []
    original = RolloutWorker.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(RolloutWorker, "__init__", init)
    yield
    for w in made:
        w.stop(abort_in_flight=True)


def run_until(worker, condition, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out; worker counts {worker.counts}"
        worker.step(poll_timeout=0.02)


def reset(engine, weights):
    engine.update_weights(0, weights[0])


def fill_buffer(traj, step, version):
    """A scripted second worker: short groups until buffer `step` is ready."""
    from jaxflow.data.records import Sample

    for _ in range(100):
        if traj.buffer_state(step) == "ready":
            return
        for task in traj.dispatch("scripted", version, 1):
            done = [Sample([9], [-1.0], [version], "stop") for _ in range(task.n)]
            traj.finish(task.group_id, "scripted", done, rewards=[0.0] * task.n)
    raise AssertionError(f"buffer {step} never filled: {traj.stats()}")


def test_groups_flow_end_to_end(engine, weights):
    reset(engine, weights)
    traj, params = services()
    params.publish(0, weights[0])
    worker = RolloutWorker("w0", engine, traj, params, sampling=SamplingParams(max_tokens=6), max_groups=4,
                           reward_fn=length_reward)
    run_until(worker, lambda: traj.buffer_state() == "ready")
    batch = traj.consume(0, timeout=1)
    assert len(batch.groups) == 2
    for g in batch.groups:
        assert g.v_start == 0 and len(g.samples) == 2
        for s in g.samples:
            assert len(s.tokens) == 6 and s.finish_reason == "length"
            assert s.versions == [0] * 6 and np.isfinite(s.logprobs).all()
        assert g.rewards == [float(len(s.tokens) % 2) for s in g.samples]
    assert worker.counts["groups_finished"] >= 2


@pytest.mark.parametrize("when, lag, syncs_at", [("every", 1, 1), ("lag", 2, 2)])
def test_sync_policies(engine, weights, when, lag, syncs_at):
    reset(engine, weights)
    traj, params = services(eta=3)
    params.publish(0, weights[0])
    worker = RolloutWorker("w0", engine, traj, params, sampling=SamplingParams(max_tokens=4),
                           sync=SyncPolicy(when, lag), max_groups=2, reward_fn=length_reward)
    worker.step()
    for v in range(1, 3):
        run_until(worker, lambda: traj.buffer_state() == "ready")
        traj.consume(v - 1, timeout=1)
        traj.mark_published(v)
        params.publish(v, weights[v % 2])
        worker.step()
        assert engine.version == (v if v >= syncs_at else 0), (when, v)


def test_idle_policy_waits_for_an_empty_engine(engine, weights, monkeypatch):
    reset(engine, weights)
    traj, params = services(eta=2)
    params.publish(0, weights[0])
    # The engine's decode calls wait for `release`, so that the group is still in flight at the second
    # step however fast the engine generates its 60 tokens.
    release, decode = threading.Event(), jax_decode.decode

    def held(*args, **kwargs):
        release.wait(30)
        return decode(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", held)
    worker = RolloutWorker("w0", engine, traj, params, sampling=SamplingParams(max_tokens=60),
                           sync=SyncPolicy("idle"), max_groups=1, reward_fn=length_reward)
    worker.step()  # a long group in flight
    fill_buffer(traj, 0, 0)
    traj.consume(0, timeout=5)
    traj.mark_published(1)
    params.publish(1, weights[1])
    worker.step()
    assert engine.version == 0  # busy: no sync yet
    release.set()
    run_until(worker, lambda: worker.counts["syncs"] > 0)
    assert engine.version == 1


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_sync_with_a_group_in_flight(engine, weights, mode):
    # Exact per-token version tagging across a swap is proven in the engine tests; here: the worker
    # syncs while a group is in flight, and the group keeps its v_start (keep: not interrupted;
    # abort: requeued with its partial sample and resumed under the new weights).
    reset(engine, weights)
    traj, params = services(eta=2, batch=2)
    params.publish(0, weights[0])
    worker = RolloutWorker("w0", engine, traj, params, sampling=SamplingParams(max_tokens=120),
                           sync=SyncPolicy("every", mode=mode), max_groups=1, reward_fn=length_reward)
    worker.step(poll_timeout=0.0)
    (gid,) = worker._groups  # noqa: SLF001 - the group to follow
    fill_buffer(traj, 0, 0)  # the trainer gets buffer 0 from elsewhere, trains, publishes 1
    traj.consume(0, timeout=5)
    traj.mark_published(1)
    params.publish(1, weights[1])
    in_flight = gid in worker._groups  # noqa: SLF001
    worker.step(poll_timeout=0.0)
    assert worker.counts["syncs"] == 1 and engine.version == 1
    if in_flight:  # the usual case: 120 tokens take far longer than the lines above
        assert worker.counts["groups_aborted"] == (1 if mode == "abort" else 0)
    run_until(worker, lambda: traj.stats()["counts"]["rewarded"] >= 3)
    fill_buffer(traj, 1, 1)
    batch = traj.consume(1, timeout=5)
    (ours,) = [g for g in batch.groups if g.group_id == gid]
    assert ours.v_start == 0  # admitted at version 0, trained at version 1: staleness 1 <= eta
    for s in ours.samples:
        assert len(s.tokens) == 120 and s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
    if mode == "abort" and in_flight:
        assert traj.stats()["counts"]["requeued"] == 1
        assert any(1 in s.versions for s in ours.samples)  # resumed under the new weights


def test_worker_process_against_served_services(model_dir, weights, tmp_path):
    traj, params = services(eta=1, batch=2)
    params.publish(0, weights[0])
    token = "worker-test-token"
    with rpc.Server(traj, SERVICE_METHODS["TrajectoryService"], token=token).start() as ts, \
            rpc.Server(params, RPC_METHODS, token=token).start() as ps:
        env = {**os.environ, "JAXFLOW_TOKEN": token, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        cmd = [sys.executable, "-m", "jaxflow.jobs.rollout_worker",
               "--trajectories", f"{ts.address[0]}:{ts.address[1]}",
               "--params", f"{ps.address[0]}:{ps.address[1]}", "--model", str(model_dir),
               "--name", "proc0", "--max-tokens", "6", "--slots", "4", "--max-len", "64",
               "--reward", "jaxflow.tasks.arithmetic:reward"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            batch = traj.consume(0, timeout=120)
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
    assert len(batch.groups) == 2, out
    assert all(len(s.tokens) == 6 for g in batch.groups for s in g.samples)
    assert "stopped" in out and proc.returncode == 0, out
    # Its in-flight groups went back to the service on SIGTERM, not lost.
    stats = traj.stats()
    assert stats["groups"]["running"] == 0, stats
