"""The simulated rollout fleet (jaxflow.sim): cost model, versions, aborts, KV scheduling, lengths."""

import dataclasses
import math
import time

import numpy as np
import pytest

from jaxflow.sim import (
    InstanceSpec,
    LengthModel,
    SimFleet,
    Workload,
    describe,
    reasoning_lengths,
)
from rollout_bridge.engine import Request, SamplingParams, WeightsRejected

B = 256  # block_tokens
P = 256  # prompt_tokens
PREFILL = 25600.0  # tokens/s: a 256-token prompt prefills in 0.01 s
TICK = 0.05


BASE = InstanceSpec(step_s=0.01, per_seq_s=0.0, per_kv_token_s=0.0, kv_capacity=100_000, max_running=64,
                    prefill_tokens_per_s=PREFILL, sync_s=2.0)


def spec(**kw) -> InstanceSpec:
    return dataclasses.replace(BASE, **kw)


def fleet_of(*specs, group=(3072,), **kw) -> SimFleet:
    """Every prompt's sample i has length group[i % len(group)]."""
    model = LengthModel.empirical([list(group)], block_tokens=B, max_tokens=32768)
    return SimFleet(list(specs), Workload(model, prompt_tokens=P), **kw)


def req(prompt: int, sample: int, max_tokens: int = 32768, prefix=None) -> Request:
    return Request(f"p{prompt}:{sample}", [prompt], SamplingParams(max_tokens=max_tokens), prefix)


def run_until_done(fleet: SimFleet, engine, until: float = 500.0):
    """Advances in ticks until `engine` hands out a completion; (time, completion)."""
    while fleet.now < until:
        fleet.advance(fleet.now + TICK)
        done = engine.poll()
        if done:
            assert len(done) == 1
            return fleet.now, done[0]
    raise AssertionError("nothing finished")


def test_single_sequence_time_and_blocks():
    fleet = fleet_of(spec())
    eng = fleet.engines[0]
    eng.submit(req(0, 0))
    assert eng.load().running == 1
    t, c = run_until_done(fleet, eng)
    expected = P / PREFILL + 3072 * 0.01
    assert expected <= t < expected + TICK + 1e-9
    s = c.sample
    assert c.request_id == "p0:0" and s.finish_reason == "stop" and c.error is None
    assert len(s.tokens) == len(s.logprobs) == len(s.versions) == 3072 // B
    assert set(s.versions) == {0} and set(s.tokens) == {0} and set(s.logprobs) == {-1.0}


def test_kv_cost_matches_the_integral_of_the_step_time():
    a, c = 0.01, 2e-6
    fleet = fleet_of(spec(step_s=a, per_kv_token_s=c))
    fleet.engines[0].submit(req(0, 0))
    t, _ = run_until_done(fleet, fleet.engines[0])
    n = 3072  # sum over generated tokens x of a + c * (P + x)
    expected = P / PREFILL + n * (a + c * P) + c * n * n / 2
    assert t == pytest.approx(expected, rel=0.01)


def test_max_tokens_cap_gives_length():
    fleet = fleet_of(spec(), group=(3072, 1024))
    eng = fleet.engines[0]
    eng.submit(req(0, 0, max_tokens=1000))
    eng.submit(req(0, 1, max_tokens=1024))  # L == cap counts as "length"
    eng.submit(req(0, 3, max_tokens=2000))  # L = 1024 < cap: stops
    for _ in range(300):
        fleet.advance(fleet.now + 0.1)
    done = {c.request_id: c.sample for c in eng.poll()}
    assert done["p0:0"].finish_reason == "length" and len(done["p0:0"].tokens) == math.ceil(1000 / B)
    assert done["p0:1"].finish_reason == "length" and len(done["p0:1"].tokens) == 4
    assert done["p0:3"].finish_reason == "stop" and len(done["p0:3"].tokens) == 4


@pytest.mark.parametrize("keep_kv", [False, True])
def test_weight_update_switches_versions_at_the_sync_block_and_stalls(keep_kv):
    fleet = fleet_of(spec(sync_s=2.0))
    eng = fleet.engines[0]
    eng.submit(req(0, 0))
    fleet.advance(P / PREFILL + 1000 * 0.01)  # 1000 tokens generated
    tokens = fleet.stats()["total"]["tokens"]
    assert tokens == pytest.approx(1000)
    eng.update_weights(1, None, keep_kv=keep_kv)
    assert eng.version == 1
    fleet.advance(fleet.now + 2.0)  # within sync_s (+ the recompute unless keep_kv): nothing generated
    assert fleet.stats()["total"]["tokens"] == pytest.approx(tokens)
    t, c = run_until_done(fleet, eng)
    stall = 2.0 + (0.0 if keep_kv else (P + 1000) / PREFILL)
    assert t == pytest.approx(P / PREFILL + stall + 3072 * 0.01, abs=TICK + 1e-6)
    assert c.sample.versions == [0] * (1000 // B) + [1] * (12 - 1000 // B)
    st = fleet.stats()["engines"][0]
    assert st["syncs"] == 1 and st["stall_s"] == pytest.approx(P / PREFILL + stall)


def test_update_weights_rejects_bad_versions():
    fleet = fleet_of(spec(), start_version=3)
    eng = fleet.engines[0]
    with pytest.raises(ValueError, match="older"):
        eng.update_weights(2, None)
    with pytest.raises(WeightsRejected, match="int"):
        eng.update_weights(4.0, None)
    eng.update_weights(3, {})
    assert eng.version == 3


def test_abort_and_resume_on_another_engine():
    fleet = fleet_of(spec(), spec())
    a, b = fleet.engines
    a.submit(req(0, 0))
    fleet.advance(P / PREFILL + 1000 * 0.01)
    b.update_weights(1, None)  # b is idle: only sync_s
    [partial] = a.abort(["p0:0", "unknown:1"])
    assert a.abort(["p0:0"]) == [] and a.load().running == 0
    s = partial.sample
    assert s.finish_reason == "abort" and len(s.tokens) == 1000 // B and s.versions == [0] * 3
    fleet.advance(fleet.now + 2.0)  # b's sync done
    t0 = fleet.now
    b.submit(req(0, 0, prefix=s))
    t, c = run_until_done(fleet, b)
    prefill = (P + 3 * B) / PREFILL
    assert t - t0 == pytest.approx(prefill + (3072 - 3 * B) * 0.01, abs=TICK + 1e-6)
    assert c.sample.finish_reason == "stop" and c.sample.versions == [0] * 3 + [1] * 9
    assert fleet.stats()["engines"][1]["stall_s"] == pytest.approx(2.0 + prefill)
    assert a.poll() == []


def test_per_sequence_speed_falls_with_batch_and_with_a_slow_instance():
    fleet = fleet_of(spec(per_seq_s=0.001), spec(per_seq_s=0.001, speed=0.5))
    fast, slow = fleet.engines
    fast.submit(req(0, 0))
    slow.submit(req(0, 0))
    fleet.advance(1.0)
    rate_one = fast.load().tokens_per_s
    for i in range(1, 10):
        fast.submit(req(i, 0))
    fleet.advance(fleet.now + 0.5)  # prefill of the 9 newcomers
    fleet.advance(fleet.now + 1.0)
    rate_ten = fast.load().tokens_per_s / 10
    assert rate_one == pytest.approx(1 / 0.011, rel=0.02)
    assert rate_ten == pytest.approx(1 / 0.020, rel=1e-6)
    fleet2 = fleet_of(spec(per_seq_s=0.001), spec(per_seq_s=0.001, speed=0.5))
    times = []
    for eng in fleet2.engines:
        eng.submit(req(0, 0))
    finished = {}
    while len(finished) < 2:
        fleet2.advance(fleet2.now + TICK)
        for i, eng in enumerate(fleet2.engines):
            if eng.poll():
                finished[i] = fleet2.now
    times = [finished[0], finished[1]]
    assert times[1] == pytest.approx(2 * times[0], abs=2 * TICK)


def test_kv_capacity_admission_and_preemption():
    fleet = fleet_of(spec(kv_capacity=1600), group=(1024,))
    eng = fleet.engines[0]
    for i in range(7):
        eng.submit(req(i, 0))
    assert (eng.load().running, eng.load().waiting) == (6, 1)  # 7 * 256 > 1600
    done = []
    for _ in range(4000):
        fleet.advance(fleet.now + TICK)
        assert eng.load().kv_used <= 1.0
        done += eng.poll()
        if len(done) == 7:
            break
    st = fleet.stats()["engines"][0]
    assert len(done) == 7 and st["preemptions"] > 0 and st["completions"] == 7
    assert all(len(c.sample.tokens) == 4 and c.sample.finish_reason == "stop" for c in done)


def test_pause_keep_and_abort():
    fleet = fleet_of(spec(max_running=1))
    eng = fleet.engines[0]
    eng.submit(req(0, 0))
    eng.submit(req(1, 0))
    fleet.advance(3.0)
    assert eng.pause("keep") == [] and eng.paused
    tokens = fleet.stats()["total"]["tokens"]
    fleet.advance(10.0)
    assert fleet.stats()["total"]["tokens"] == tokens and fleet.stats()["engines"][0]["idle_s"] == 7.0
    eng.resume()
    fleet.advance(11.0)
    assert fleet.stats()["total"]["tokens"] == pytest.approx(tokens + 100)
    out = eng.pause("abort")
    assert sorted(c.request_id for c in out) == ["p0:0", "p1:0"]
    assert [len(c.sample.tokens) for c in sorted(out, key=lambda c: c.request_id)] == [(299 + 100) // B, 0]
    assert eng.load().running == eng.load().waiting == 0
    with pytest.raises(ValueError):
        eng.pause("drop")


def test_submit_errors():
    fleet = fleet_of(spec(kv_capacity=2000))
    eng = fleet.engines[0]
    eng.submit(req(0, 0, max_tokens=1000))
    with pytest.raises(ValueError, match="p0:0"):
        eng.submit(req(0, 0))
    eng.submit(Request("no-sample-index", [0]))
    eng.submit(req(1, 0))  # 256 + 3072 > kv_capacity
    errors = eng.poll()
    assert [c.sample.finish_reason for c in errors] == ["error", "error"]
    assert "sample index" in errors[0].error and "kv_capacity" in errors[1].error


def test_stats_account_for_all_time():
    fleet = fleet_of(spec(), spec(speed=0.5, max_running=2), group=(512, 3072, 1024))
    rng = np.random.default_rng(0)
    for k in range(400):
        eng = fleet.engines[k % 2]
        if k % 20 in (0, 1):  # both engines
            eng.submit(req(k, k % 3))
        if k % 97 == 0:
            eng.update_weights(eng.version + 1, None)
        if k % 53 == 0:
            eng.abort([f"p{k - 20}:{(k - 20) % 3}", f"p{k - 21}:{(k - 21) % 3}"])
        fleet.advance(fleet.now + rng.uniform(0.05, 2.0))
    for st in fleet.stats()["engines"]:
        assert st["decode_s"] + st["stall_s"] + st["idle_s"] == pytest.approx(fleet.now)
        assert st["decode_s"] > 0 and st["idle_s"] > 0 and st["stall_s"] > 0
    with pytest.raises(ValueError, match="back in time"):
        fleet.advance(fleet.now - 1)


def test_lengths_deterministic_and_order_independent():
    model = reasoning_lengths(seed=7)
    pairs = [(p, s) for p in range(50) for s in range(8)]
    forward = {k: Workload(model).length(*k) for k in pairs}
    w = Workload(model)
    backward = {k: w.length(*k) for k in reversed(pairs)}
    assert forward == backward == {k: model.length(*k) for k in pairs}
    assert all(x % 256 == 0 and 256 <= x <= 32768 for x in forward.values())
    assert reasoning_lengths(seed=8).length(0, 0) != model.length(0, 0) or \
        reasoning_lengths(seed=8).length(1, 0) != model.length(1, 0)


def test_reasoning_preset_shape_and_group_correlation():
    d = describe(reasoning_lengths(), n=8000)
    assert 1200 <= d["median"] <= 2000 and 8000 <= d["p99"] <= 20000 and d["max"] <= 32768
    assert d["median"] < d["mean"] < d["p90"] < d["p99"] <= d["max"]
    model = reasoning_lengths()
    g = np.log(np.stack([model.group_lengths(p, 2) for p in range(2000)]))
    assert np.corrcoef(g[:, 0], g[:, 1])[0, 1] > 0.4  # 0.7^2 / (0.7^2 + 0.6^2) = 0.58
    flat = LengthModel(sigma_prompt=0.0, sigma_sample=0.6)
    g = np.log(np.stack([flat.group_lengths(p, 2) for p in range(2000)]))
    assert abs(np.corrcoef(g[:, 0], g[:, 1])[0, 1]) < 0.1


def test_empirical_lengths_and_records():
    groups = [[100, 300], [1000, 2000, 3000]]
    model = LengthModel.empirical(groups, block_tokens=B)
    assert model.max_tokens == 3072
    seen = set()
    for p in range(40):
        lengths = model.group_lengths(p, 6).tolist()
        assert lengths in ([256, 512] * 3, [1024, 2048, 3072] * 2)
        seen.add(lengths[0])
    assert seen == {256, 1024}
    records = Workload(model).records(3)
    assert records[2] == {"prompt": [2], "meta": {"prompt_index": 2}}
    with pytest.raises(ValueError, match="max_tokens"):
        LengthModel(max_tokens=1000, block_tokens=256)
    with pytest.raises(ValueError, match="kv_capacity"):
        InstanceSpec(kv_capacity=0)
    with pytest.raises(ValueError, match="speed"):
        InstanceSpec(speed=0.0)


if __name__ == "__main__":  # the cost of one advance of 512 busy instances x 128 running sequences
    fleet = SimFleet([InstanceSpec(max_running=128)] * 512, Workload(reasoning_lengths()))
    for i, eng in enumerate(fleet.engines):
        for s in range(128):
            eng.submit(Request(f"p{i * 16 + s // 8}:{s % 8}", [i * 16 + s // 8], SamplingParams(max_tokens=32768)))
    fleet.advance(3.0)
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        fleet.advance(fleet.now + 0.5)
        times.append(time.perf_counter() - t0)
        for eng in fleet.engines:
            eng.poll()
    print(f"advance(0.5 s), 512 x 128: median {np.median(times) * 1e3:.2f} ms, max {max(times) * 1e3:.2f} ms")
