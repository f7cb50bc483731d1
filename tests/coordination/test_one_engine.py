"""A coordinator over one JAX engine (a rollout worker), against the real data services: groups flow end
to end, the sync options fire when they should, both sync modes keep v_start and per-token versions
right, `stop` hands in-flight groups back or lets them finish as asked, and a worker runs as its own
process against served services."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from compile_level import SUITE_OPT_LEVEL
from service_placements import SERVICE_METHODS
from waiting import wait_until

from jaxflow.coordination import Coordination, Coordinator
from jaxflow.data.param_service import RPC_METHODS, ParameterService
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.transport import rpc
from rollout_bridge import jax_decode
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end


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


def worker(engine, traj, params, *, max_tokens, max_running, eta=1, **strategy):
    """A coordinator over `engine` alone; `strategy` overrides the sync options (default: sync "all")."""
    s = Coordination(max_running=max_running, **{"sync": "all", **strategy})
    return Coordinator("w0", [engine], traj, params, strategy=s, eta=eta,
                       sampling=SamplingParams(max_tokens=max_tokens), reward_fn=length_reward)


@pytest.fixture(autouse=True)
def stop_coordinators(monkeypatch):
    """Every coordinator a test makes is stopped afterwards, so the shared engine starts each test empty."""
    made = []
    original = Coordinator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Coordinator, "__init__", init)
    yield
    for c in made:
        c.stop(abort_in_flight=True)


@pytest.fixture
def held_decode(monkeypatch):
    """Makes the engine's decode calls wait for `release` (entered is set once one waits), so a group
    stays in flight for as long as a test needs, however fast the engine generates."""
    release, entered, decode = threading.Event(), threading.Event(), jax_decode.decode

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return decode(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", held)
    yield release, entered
    release.set()


class FakeClock:
    t = 0.0

    def __call__(self):
        return self.t


def run_until(coordinator, condition, timeout=60):
    def stepped():
        if condition():
            return True
        coordinator.step()
        return False
    wait_until(stepped, timeout, lambda: f"the condition; coordinator stats {coordinator.stats()}", interval=0.005)


def reset(engine, weights):
    engine.update_weights(0, weights[0])


def fill_buffer(traj, step, version):
    """A scripted second worker: short groups until buffer `step` is ready."""
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
    w = worker(engine, traj, params, max_tokens=6, max_running=8)
    run_until(w, lambda: traj.buffer_state() == "ready")
    batch = traj.consume(0, timeout=1)
    assert len(batch.groups) == 2
    for g in batch.groups:
        assert g.v_start == 0 and len(g.samples) == 2
        for s in g.samples:
            assert len(s.tokens) == 6 and s.finish_reason == "length"
            assert s.versions == [0] * 6 and np.isfinite(s.logprobs).all()
        assert g.rewards == [float(len(s.tokens) % 2) for s in g.samples]
    assert w.counts["groups_finished"] >= 2


@pytest.mark.parametrize("strategy, syncs_at", [
    ({"sync": "all"}, 1),  # every version at once
    ({"sync": "selective", "sync_idle_below": -1, "sync_max_lag": 2}, 2),  # on a lag of 2 only
])
def test_sync_options(engine, weights, strategy, syncs_at):
    reset(engine, weights)
    traj, params = services(eta=3)
    params.publish(0, weights[0])
    w = worker(engine, traj, params, max_tokens=4, max_running=4, eta=3, **strategy)
    w.step()
    for v in range(1, 3):
        run_until(w, lambda: traj.buffer_state() == "ready")
        traj.consume(v - 1, timeout=1)
        traj.mark_published(v)
        params.publish(v, weights[v % 2])
        w.step()
        assert engine.version == (v if v >= syncs_at else 0), (strategy, v)
    assert w.counts["syncs"] == 3 - syncs_at


def test_idle_sync_waits_for_an_empty_engine(engine, weights, held_decode):
    release, _ = held_decode
    reset(engine, weights)
    traj, params = services(eta=2)
    params.publish(0, weights[0])
    w = worker(engine, traj, params, max_tokens=60, max_running=2, eta=2, sync="selective",
               sync_idle_below=0, sync_max_lag=100)
    w.step()  # a long group in flight
    assert w.in_flight() == 1
    fill_buffer(traj, 0, 0)
    traj.consume(0, timeout=5)
    traj.mark_published(1)
    params.publish(1, weights[1])
    w.step()
    assert engine.version == 0 and w.counts["syncs"] == 0  # busy: no sync yet
    release.set()
    run_until(w, lambda: w.counts["syncs"] > 0)
    assert engine.version == 1 and w.counts["groups_finished"] >= 1


@pytest.mark.parametrize("mode", ["keep", "keep_kv", "abort"])
def test_sync_with_a_group_in_flight(engine, weights, held_decode, mode, monkeypatch):
    # Exact per-token version tagging across a swap is proven in the engine tests; here: the coordinator
    # syncs while a group is in flight, and the group keeps its v_start (keep, keep_kv: not interrupted,
    # its KV recomputed or kept; abort: its requests stopped and resumed from their tokens so far under
    # the new weights).
    release, entered = held_decode
    reset(engine, weights)
    swaps, swap = [], engine._swap_weights
    monkeypatch.setattr(engine, "_swap_weights", lambda *args: (swaps.append(args[2]), swap(*args))[1])
    traj, params = services(eta=2, batch=2)
    params.publish(0, weights[0])
    w = worker(engine, traj, params, max_tokens=120, max_running=2, eta=2, sync_mode=mode)
    w.step()
    (gid,) = w._groups  # noqa: SLF001 - the group to follow
    entered.wait(30)
    fill_buffer(traj, 0, 0)  # the trainer gets buffer 0 from elsewhere, trains, publishes 1
    traj.consume(0, timeout=5)
    traj.mark_published(1)
    params.publish(1, weights[1])
    # The sync (and, in abort mode, the abort) waits for the held decode call to end.
    threading.Timer(0.2, release.set).start()
    w.step()
    assert w.counts["syncs"] == 1 and engine.version == 1 and swaps == [mode == "keep_kv"]
    assert w.counts["requests_resumed"] == (2 if mode == "abort" else 0)
    run_until(w, lambda: traj.stats()["counts"]["rewarded"] >= 3)
    fill_buffer(traj, 1, 1)
    batch = traj.consume(1, timeout=5)
    (ours,) = [g for g in batch.groups if g.group_id == gid]
    assert ours.v_start == 0  # admitted at version 0, trained at version 1: staleness 1 <= eta
    for s in ours.samples:
        assert len(s.tokens) == 120 and s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
        assert 1 in s.versions  # the held call ran before the sync; the rest under version 1
    assert traj.stats()["counts"]["requeued"] == 0  # the group never went back to the service


@pytest.mark.parametrize("threaded", [False, True], ids=["stepped", "threaded"])
@pytest.mark.parametrize("abort_in_flight", [True, False], ids=["abort", "drain"])
def test_stop_aborts_or_drains_the_groups_in_flight(engine, weights, held_decode, abort_in_flight, threaded):
    release, entered = held_decode
    reset(engine, weights)
    traj, params = services(eta=2)
    params.publish(0, weights[0])
    w = worker(engine, traj, params, max_tokens=60, max_running=2, eta=2)
    if threaded:
        w.start(tick_s=0.005)
    else:
        w.step()
    assert entered.wait(30)  # one group (2 samples, the whole of max_running) is generating
    (gid,) = w._groups  # noqa: SLF001
    # stop waits on the engine, which waits for the held decode call: let it go after a moment.
    threading.Timer(0.2, release.set).start()
    w.stop(abort_in_flight=abort_in_flight)
    stats = traj.stats()
    assert stats["groups"]["running"] == 0 and w.in_flight() == 0, stats
    assert stats["counts"]["created"] == 1  # nothing admitted after the stop began
    if abort_in_flight:
        assert w.counts["groups_aborted"] == 1 and w.counts["groups_finished"] == 0
        assert stats["counts"]["requeued"] == 1
        (task,) = traj.dispatch("other", 0, 1)  # handed back with its tokens so far
        assert task.group_id == gid and task.partial is not None
        # The sample in the held decode call has its first tokens; the other may not have started.
        assert all(len(s.tokens) < 60 and not s.done for s in task.partial)
        assert any(s.tokens for s in task.partial)
    else:
        assert w.counts["groups_aborted"] == 0 and w.counts["groups_finished"] == 1
        assert stats["counts"]["rewarded"] == 1 and stats["counts"]["requeued"] == 0


@pytest.mark.parametrize("handed_back_by", ["release_worker", "lease expiry"])
def test_a_dead_workers_groups_resume_elsewhere_from_the_tokens_it_reported(engine, weights, monkeypatch,
                                                                          handed_back_by):
    """A worker dies mid-generation (no abort, no release from it): the service requeues its group with
    the tokens its last `renew` reported, another worker resumes from them, and with greedy sampling the
    result equals an uninterrupted run."""
    reset(engine, weights)
    clock = FakeClock()
    records = [{"prompt": [5, 6, 7, 8], "meta": {"i": 0}}]
    traj = TrajectoryService(PromptSource(records, shuffle=False), batch_groups=1, group_size=2, eta=0,
                             lease_s=10.0, clock=clock)
    params = ParameterService(keep=2)
    params.publish(0, weights[0])
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    (reference,) = engine.generate([Request("uninterrupted", [5, 6, 7, 8], greedy)])

    def greedy_worker(name):
        return Coordinator(name, [engine], traj, params, strategy=Coordination(max_running=2), eta=0,
                           sampling=greedy, reward_fn=length_reward, clock=clock, renew_every_s=0.0)

    # Hold the engine loop inside its third decode call, after two calls' tokens (2 x decode_chunk) landed.
    decode, calls, held = jax_decode.decode, [], threading.Event()

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            held.set()
            while not engine._commands:  # noqa: SLF001 - until the test kills the worker's requests
                time.sleep(0.001)
        return decode(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", counted)
    dead = greedy_worker("dead")
    dead.step()  # admits the group, submits its 2 samples
    (gid,) = dead._groups  # noqa: SLF001
    assert held.wait(30)
    dead.step()  # renews, reporting 8 tokens per sample
    reported = [dict(s) for s in traj.snapshot()["groups"][0]["samples"]]
    assert [len(s["tokens"]) for s in reported] == [8, 8] and dead.counts["progress_reports"] == 1
    assert all(s["tokens"] == reference.sample.tokens[:8] and s["versions"] == [0] * 8 for s in reported)
    # The worker's process dies: its requests vanish from the engine and nothing reaches the service.
    engine.abort([rid for g in dead._groups.values() for rid in g.live.values()])  # noqa: SLF001
    monkeypatch.setattr(jax_decode, "decode", decode)
    if handed_back_by == "release_worker":
        assert traj.release_worker("dead", "rollout actor died") == 1
    else:
        clock.t = 11.0  # the lease (10 s) runs out; the next call hands the group back
    dispatched = []
    dispatch = traj.dispatch
    monkeypatch.setattr(traj, "dispatch", lambda *a: dispatched.extend(out := dispatch(*a)) or out)
    alive = greedy_worker("alive")
    run_until(alive, lambda: traj.buffer_state(0) == "ready")
    (task,) = dispatched
    assert task.group_id == gid and [s.tokens for s in task.partial] == [s["tokens"] for s in reported]
    assert alive.counts["requests_submitted"] == 2
    counts = traj.stats()["counts"]
    assert counts["recovered_tokens"] == 16 and counts["expired"] == (handed_back_by == "lease expiry")
    (group,) = traj.consume(0, timeout=5).groups
    for s, before in zip(group.samples, reported):
        assert s.tokens == reference.sample.tokens and s.finish_reason == "length"
        assert s.logprobs[:8] == before["logprobs"] and s.versions == [0] * 40
        np.testing.assert_allclose(s.logprobs, reference.sample.logprobs, atol=1e-4, rtol=0)


def run_worker_process(model_dir, traj, params, *extra):
    """A rollout worker process (the CLI) against `traj` and `params` served over RPC, until the first
    batch is consumed, then SIGTERM; (the batch, the process's output, its exit code)."""
    token = "worker-test-token"
    with rpc.Server(traj, SERVICE_METHODS["TrajectoryService"], token=token).start() as ts, \
            rpc.Server(params, RPC_METHODS, token=token).start() as ps:
        # One device, compiled at the suite's level (tests/compile_level.py).
        env = {**os.environ, "JAXFLOW_TOKEN": token, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_backend_optimization_level={SUITE_OPT_LEVEL}"}
        cmd = [sys.executable, "-m", "jaxflow.jobs.rollout_worker",
               "--trajectories", f"{ts.address[0]}:{ts.address[1]}",
               "--params", f"{ps.address[0]}:{ps.address[1]}", "--model", str(model_dir),
               "--name", "proc0", "--max-tokens", "6", "--slots", "4", "--max-len", "64",
               "--reward", "jaxflow.tasks.arithmetic:reward", *extra]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            batch = traj.consume(0, timeout=120)
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=60)
    return batch, out, proc.returncode


def test_worker_process_against_served_services(model_dir, weights, tmp_path):
    traj, params = services(eta=1, batch=2)
    params.publish(0, weights[0])
    batch, out, returncode = run_worker_process(model_dir, traj, params)
    assert len(batch.groups) == 2, out
    assert all(len(s.tokens) == 6 for g in batch.groups for s in g.samples)
    assert "stopped" in out and returncode == 0, out
    # Its in-flight groups went back to the service on SIGTERM, not lost.
    stats = traj.stats()
    assert stats["groups"]["running"] == 0, stats


def test_worker_process_serves_lora_adapters_published_alone(model_dir, tmp_path):
    """A worker process started with --lora-rank takes each version as the adapters alone (what a trainer
    with trainer.lora publishes to engines that apply adapters): its samples' behaviour log-probs are
    jaxflow's forward with those adapters, not the base's."""
    from engine_helpers import adapted, teacher_forced

    from jaxflow.models import lora
    from jaxflow.models.lora import LoRASpec

    spec = LoRASpec(rank=4, alpha=8.0)
    model, base = adapted(model_dir, spec, seed=3), load_model(model_dir)
    traj, params = services(eta=1, batch=2)
    params.publish(0, lora.peft_tensors(model.layers))
    batch, out, returncode = run_worker_process(model_dir, traj, params, "--lora-rank", "4", "--lora-alpha", "8")
    assert len(batch.groups) == 2, out
    assert returncode == 0, out
    gap = 0.0
    for g in batch.groups:
        for s in g.samples:
            ours, _ = teacher_forced(model, g.prompt, s.tokens)
            np.testing.assert_allclose(s.logprobs, ours, atol=1e-4, rtol=0)
            gap = max(gap, float(np.abs(teacher_forced(base, g.prompt, s.tokens)[0] - ours).max()))
    assert gap > 1e-2  # the adapters change the log-probs: the check above could fail
