"""A mixture-of-experts policy's routing records (`Sample.routes`) through the data path: the trajectory
service keeps them bit-exact from `finish` to `consume`, through an abort and a resumed prefix, through its
JSON snapshot and across the process boundary (the wire); bad routes are refused by name before anything
changes."""

import base64
import copy
import dataclasses
import json

import numpy as np
import pytest
from service_placements import PLACEMENTS, placed
from waiting import wait_until

from jaxflow.data import checks
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import ConsumedBatch, FinishedGroup, RouteSpec, Sample, fit_routes, route_dtype
from jaxflow.data.service_snapshot import encode_routes
from jaxflow.data.trajectory_service import SampleRefused, TrajectoryService
from jaxflow.envs.base import Step
from jaxflow.jobs.resume import ExtraCheck
from jaxflow.models.config import ModelConfig
from jaxflow.transport import wire
from rollout_bridge.engine import Request, SamplingParams, copy_prefix, in_flight_copy, request_error
from rollout_bridge.episodes import EpisodeEngine
from rollout_bridge.scripted import CharTokenizer, ScriptedEngine

# A tiny Qwen3-MoE shape: 3 layers, the middle one dense (so 2 sparse layers), 4 experts, top-2.
SPEC = RouteSpec(layers=2, top_k=2, num_experts=4)


def records(n):
    return [{"prompt": [1 + i % 50, 2 + i % 7], "meta": {"index": i}} for i in range(n)]


def make(route_spec=SPEC, **kw):
    kw.setdefault("batch_groups", 2)
    kw.setdefault("group_size", 2)
    kw.setdefault("eta", 1)
    return TrajectoryService(PromptSource(records(50), shuffle=False, num_epochs=1), route_spec=route_spec, **kw)


def routes(n, seed, dtype=np.int8, spec=SPEC):
    """n rows of expert ids for `spec`, some -1 (not recorded)."""
    rng = np.random.default_rng(seed)
    return rng.integers(-1, spec.num_experts, size=spec.shape(n)).astype(dtype)


def sample(n, seed, version=0, finish="stop", **kw):
    return Sample([3 + i for i in range(n)], [-0.5] * n, [version] * n, finish,
                  routes=kw.pop("routes", routes(n, seed)), **kw)


def assert_same_routes(got, want):
    """Bit-exact: the same dtype, shape and values (or both None)."""
    if want is None:
        assert got is None
        return
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.fixture(params=PLACEMENTS)
def place(request):
    with placed(request.param) as p:
        yield p


# ---- the spec -------------------------------------------------------------------------------------------

def test_route_spec_of_a_model_config():
    moe = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=3, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, mlp_only_layers=(1,))
    assert RouteSpec.of(moe) == SPEC and SPEC.dtype == np.int8 and SPEC.shape(5) == (5, 2, 2)
    dense = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    assert RouteSpec.of(dense) is None
    assert RouteSpec(1, 8, 256).dtype == route_dtype(256) == np.int16
    with pytest.raises(ValueError, match="top_k"):
        RouteSpec(layers=2, top_k=5, num_experts=4)
    with pytest.raises(TypeError, match="RouteSpec.layers"):
        RouteSpec(layers=2.0, top_k=2, num_experts=4)
    with pytest.raises(TypeError, match="route_spec"):
        make(route_spec=(2, 2, 4))


# ---- finish -> consume, abort -> resume -------------------------------------------------------------------

def test_routes_travel_from_finish_to_consume_bit_exact(place):
    svc = place(make())
    t1, t2 = svc.dispatch("w0", 0, 2)
    sent = {t1.group_id: [sample(3, 1), sample(5, 2)], t2.group_id: [sample(4, 3), sample(2, 4, routes=None)]}
    for t in (t1, t2):
        svc.finish(t.group_id, "w0", sent[t.group_id], [1.0, 0.0])
    batch = svc.consume(0, timeout=5)
    assert sorted(g.group_id for g in batch.groups) == sorted(sent)
    for g in batch.groups:
        for got, want in zip(g.samples, sent[g.group_id], strict=True):
            assert got.tokens == want.tokens
            assert_same_routes(got.routes, want.routes)


def test_the_service_keeps_its_own_copy_in_the_specs_dtype():
    """Routes handed in as any integer array are kept as a copy in route_dtype: a worker that reuses its
    buffer afterwards changes nothing stored, and a consumer gets the compact dtype."""
    svc = make(batch_groups=1)
    (t,) = svc.dispatch("w0", 0, 1)
    wide = routes(4, 5).astype(np.int64)
    samples = [sample(4, 0, routes=wide), sample(4, 6)]
    want = [wide.astype(np.int8), samples[1].routes.copy()]
    svc.finish(t.group_id, "w0", samples, [1.0, 0.0])
    wide[:] = 3  # the worker reuses its arrays
    samples[1].routes[:] = 0
    (g,) = svc.consume(0, timeout=5).groups
    for got, expected in zip(g.samples, want):
        assert_same_routes(got.routes, expected)


def test_a_resumed_prefix_keeps_its_routes_and_the_continuation_appends(place):
    """An aborted group's partial routes come back with its task; the engine's copy of the prefix keeps
    them (a copy, not the task's array), the continuation appends its rows, and the finished sample holds
    the prefix's routes followed by the new ones."""
    svc = place(make(batch_groups=1))
    (t,) = svc.dispatch("w0", 0, 1)
    partial = [sample(3, 7, finish="abort"), Sample()]
    svc.abort(t.group_id, "w0", partial)
    (again,) = svc.dispatch("w1", 0, 1)
    prefix = again.partial[0]
    assert_same_routes(prefix.routes, partial[0].routes)
    assert again.partial[1].routes is None
    request = Request("r0", list(again.prompt), prefix=prefix)
    assert request_error(request, vocab_size=64, context=32, context_name="context",
                         route_shape=(SPEC.layers, SPEC.top_k), num_experts=SPEC.num_experts) is None
    resumed = copy_prefix(request)
    assert not np.shares_memory(resumed.routes, prefix.routes)
    new = routes(2, 8)  # what the engine records for its two new tokens
    resumed.tokens += [40, 41]
    resumed.logprobs += [-0.1, -0.2]
    resumed.versions += [0, 0]
    resumed.routes = np.concatenate([resumed.routes, new])
    resumed.finish_reason = "stop"
    assert_same_routes(prefix.routes, partial[0].routes)  # the task's prefix is untouched
    svc.finish(t.group_id, "w1", [resumed, sample(2, 9)], [1.0, 0.0])
    (g,) = svc.consume(0, timeout=5).groups
    assert_same_routes(g.samples[0].routes, np.concatenate([partial[0].routes, new]))
    assert g.samples[0].tokens == partial[0].tokens + [40, 41]


def test_engine_copies_fit_routes_to_the_tokens():
    """A prefix whose routes do not match its tokens is a per-request error; an in-flight copy (and an
    episode's observation) gets one row per token, -1 where none is recorded yet."""
    s = sample(3, 10, finish=None)
    for bad in (s.routes[:2], s.routes.astype(np.float32), s.routes.tolist()):
        request = Request("r", [1, 2], prefix=dataclasses.replace(s, routes=bad))
        why = request_error(request, vocab_size=64, context=32, context_name="context",
                            route_shape=(SPEC.layers, SPEC.top_k), num_experts=SPEC.num_experts)
        assert why.startswith("prefix routes: routes ")
        assert copy_prefix(request).routes is None or len(copy_prefix(request).routes) == 3  # no crash
    s.tokens.append(9)  # the engine took a token whose routes it has not written yet
    copied = in_flight_copy(s)
    assert copied.routes.shape == (4, 2, 2) and (copied.routes[3] == -1).all()
    np.testing.assert_array_equal(copied.routes[:3], s.routes)
    assert not np.shares_memory(copied.routes, s.routes)
    assert fit_routes(None, 3) is None
    np.testing.assert_array_equal(fit_routes(s.routes, 2), s.routes[:2])


def expert_row(token):
    """The experts a scripted engine records for `token`: [sparse layer, k] ids, a function of the token."""
    return np.array([[token % 4, (token + 1) % 4], [(token + 2) % 4, (token + 3) % 4]], np.int8)


class RoutedEngine(ScriptedEngine):
    """A ScriptedEngine that records routes as a MoE engine does: a row per token it generates, appended
    to the prefix's (a copy of the request's, from `copy_prefix`)."""

    def _accept(self, request, sample):
        before = len(sample.tokens)
        routes = np.zeros((0, 2, 2), np.int8) if sample.routes is None else sample.routes
        super()._accept(request, sample)  # under the engine's lock: poll sees the sample once done here
        new = [expert_row(t) for t in sample.tokens[before:]]
        sample.routes = np.concatenate([routes, np.array(new, np.int8).reshape(-1, 2, 2)])


def test_an_episode_keeps_each_turns_routes_and_marks_the_environments_tokens_unrecorded():
    """A multi-turn episode on an engine recording routes: every model turn continues from a copy of the
    prefix's routes and appends its own; the environment's observations get rows of -1 (not recorded)."""
    turn = [ord(c) for c in "hi#"]

    class Answers:
        async def reset(self, meta):
            self.k = 0

        async def step(self, action):
            self.k += 1
            return Step(observation=[{"role": "tool", "content": f"ok {self.k}"}], reward=1.0, done=self.k >= 2)

        async def close(self):
            pass

    engine = EpisodeEngine(RoutedEngine(lambda request: turn), lambda meta: Answers(), CharTokenizer(),
                           turn_stop_ids=[ord("#")], step_timeout_s=30)
    try:
        engine.submit(Request("e0", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0.0)))
        got = []
        wait_until(lambda: bool(got.extend(engine.poll(timeout=0.05)) or got), 60, "the episode to finish")
    finally:
        engine.close()
    (c,) = got
    s = c.sample
    assert s.finish_reason == "stop" and len(s.env_spans) == 1  # two model turns, one observation between
    assert s.routes.dtype == np.int8 and s.routes.shape == (len(s.tokens), 2, 2)
    mask = s.model_mask()
    np.testing.assert_array_equal(s.routes[mask], [expert_row(t) for t in np.asarray(s.tokens)[mask]])
    assert (s.routes[~mask] == -1).all()
    checks.check_routes("episode", s.routes, len(s.tokens), SPEC)  # what the service takes


# ---- refusals ---------------------------------------------------------------------------------------------

BAD_ROUTES = [
    ("list", lambda n: routes(n, 0).tolist(), "routes must be an integer numpy array, got a list"),
    ("float array", lambda n: routes(n, 0).astype(np.float32), "routes must be an integer numpy array, got a float32"),
    ("bool array", lambda n: routes(n, 0) > 0, "routes must be an integer numpy array, got a bool"),
    ("short", lambda n: routes(n - 1, 0), r"routes have shape \[2, 2, 2\], expected \[3, 2, 2\]"),
    ("wrong layers", lambda n: np.zeros((n, 3, 2), np.int8), r"routes have shape \[3, 3, 2\], expected \[3, 2, 2\]"),
    ("wrong top-k", lambda n: np.zeros((n, 2, 1), np.int8), r"routes have shape \[3, 2, 1\], expected \[3, 2, 2\]"),
    ("flat", lambda n: np.zeros(n * 4, np.int8), r"routes have shape \[12\], expected \[3, 2, 2\]"),
    ("expert id 4", lambda n: np.where(np.arange(n * 4).reshape(n, 2, 2) == 5, 4, 0).astype(np.int8),
     r"routes\[1, 0, 1\] = 4; expert ids must be in \[-1, 3\]"),
    ("expert id -2", lambda n: np.full((n, 2, 2), -2, np.int16), r"routes\[0, 0, 0\] = -2; expert ids must be in"),
    ("huge id", lambda n: np.full((n, 2, 2), 2**40, np.int64), r"routes\[0, 0, 0\] = 1099511627776"),
]


@pytest.mark.parametrize("name,make_bad,match", BAD_ROUTES, ids=[b[0] for b in BAD_ROUTES])
def test_bad_routes_are_refused_before_anything_changes(place, name, make_bad, match):
    svc = place(make())
    (t,) = svc.dispatch("w0", 0, 1)
    kept = [sample(2, 11, finish="abort"), Sample()]
    svc.abort(t.group_id, "w0", kept)  # what the service holds for the group: must survive the refusals
    (t,) = svc.dispatch("w0", 0, 1)
    before, snap = svc.stats(), svc.snapshot()
    bad = sample(3, 12, routes=make_bad(3))
    with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 1: {match}") as e:
        svc.finish(t.group_id, "w0", [sample(3, 13), bad], [1.0, 0.0])
    assert e.value.reason == "malformed"
    for call in (lambda: svc.abort(t.group_id, "w0", [bad, Sample()]),
                 lambda: svc.renew("w0", [t.group_id], {t.group_id: [bad, Sample()]})):
        with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 0: {match}"):
            call()
    expected = copy.deepcopy(before)
    expected["counts"]["refused"] += 1  # the finish's; an abort or renewal is not counted
    expected["counts"]["refused_malformed"] += 1
    assert svc.stats() == expected
    assert {**svc.snapshot(), "counts": None} == {**snap, "counts": None}  # the groups and samples held
    assert svc.stats()["groups"]["running"] == 1
    svc.release_worker("w0")  # the group goes back with what was stored before the refusals
    (again,) = svc.dispatch("w1", 0, 1)
    assert_same_routes(again.partial[0].routes, kept[0].routes)
    assert svc.finish(t.group_id, "w1", [sample(3, 14), sample(1, 15)], [1.0, 0.0]) == 0


def test_a_dense_models_service_refuses_routes(place):
    svc = place(make(route_spec=None))
    (t,) = svc.dispatch("w0", 0, 1)
    before = svc.stats()
    with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 0: routes given, but the model has no "
                                            f"experts"):
        svc.finish(t.group_id, "w0", [sample(2, 16), sample(2, 17, routes=None)], [1.0, 0.0])
    assert svc.stats()["counts"]["refused_malformed"] == before["counts"]["refused_malformed"] + 1
    assert svc.finish(t.group_id, "w0", [sample(2, 16, routes=None), sample(2, 17, routes=None)], [1.0, 0.0]) == 0


# ---- snapshots ---------------------------------------------------------------------------------------------

def filled(place):
    """A service holding routes in every state a snapshot keeps: requeued (partial), finished (no rewards
    yet), occupied; and the samples it was given, by group id."""
    svc = place(make(batch_groups=3))
    t1, t2, t3 = svc.dispatch("w0", 0, 3)
    given = {t1.group_id: [sample(3, 20, finish="abort"), sample(0, 21, finish="abort")],
             t2.group_id: [sample(4, 22), sample(2, 23, routes=None)],
             t3.group_id: [sample(1, 24), sample(6, 25)]}
    svc.abort(t1.group_id, "w0", given[t1.group_id])
    svc.finish(t2.group_id, "w0", given[t2.group_id])
    svc.finish(t3.group_id, "w0", given[t3.group_id], [0.0, 1.0])
    return svc, given


def test_snapshot_restore_keeps_routes_bit_exact_and_compact(place):
    svc, given = filled(place)
    snap = json.loads(json.dumps(svc.snapshot()))  # as a checkpoint stores it
    for g in snap["groups"]:
        for s, want in zip(g["samples"], given[g["group_id"]]):
            if want.routes is None:
                assert "routes" not in s  # a sample without routes is saved as before routes existed
                continue
            assert s["routes"]["dtype"] == "int8" and s["routes"]["shape"] == list(want.routes.shape)
            assert base64.b64decode(s["routes"]["data"]) == want.routes.tobytes()  # one byte per id, base64
    ExtraCheck(group_size=2, batch_groups=3, reserve_groups=3, eta=1, route_spec=SPEC)(0, {
        "trajectories": snap, "base_accuracy": None})
    other = place(make(batch_groups=3))
    other.restore(snap)
    (finished,) = other.unrewarded()
    for got, want in zip(finished.samples, given[finished.group_id], strict=True):
        assert_same_routes(got.routes, want.routes)
    (requeued,) = other.dispatch("w1", 0, 1)
    for got, want in zip(requeued.partial, given[requeued.group_id], strict=True):
        assert_same_routes(got.routes, want.routes)
    other.reward(finished.group_id, [1.0, 0.0])
    other.finish(requeued.group_id, "w1", [sample(3, 26), sample(1, 27)], [0.0, 1.0])
    batch = other.consume(0, timeout=5)
    kept = [g for g in batch.groups if g.group_id != requeued.group_id]  # the finished and occupied groups
    assert sorted(g.group_id for g in kept) == sorted(set(given) - {requeued.group_id})
    for g in kept:
        for got, want in zip(g.samples, given[g.group_id], strict=True):
            assert_same_routes(got.routes, want.routes)


def test_a_snapshot_from_before_routes_still_loads(place):
    svc, given = filled(place)
    snap = json.loads(json.dumps(svc.snapshot()))
    old = copy.deepcopy(snap)
    for g in old["groups"]:
        for s in g["samples"] or []:
            s.pop("routes", None)
    with_none = copy.deepcopy(old)
    with_none["groups"][0]["samples"][0]["routes"] = None  # as a plain dataclass dump writes it
    for snapshot in (old, with_none):
        other = place(make(batch_groups=3, route_spec=None))  # a dense model's service, as before
        other.restore(snapshot)
        (finished,) = other.unrewarded()
        assert [s.routes for s in finished.samples] == [None, None]
        assert [s.tokens for s in finished.samples] == [s.tokens for s in given[finished.group_id]]


@pytest.mark.parametrize("corrupt,match", [
    (lambda r: {**r, "dtype": "float32"}, "routes dtype 'float32' is not one of"),
    (lambda r: {**r, "shape": [r["shape"][0], 2]}, "routes shape .* must be 3 ints"),
    (lambda r: {**r, "shape": [r["shape"][0] + 1, 2, 2]}, "routes data holds 12 bytes, but shape"),
    (lambda r: {**r, "data": "not base64!"}, "routes data must be a base64 str"),
    (lambda r: {**r, "data": [1, 2]}, "routes data must be a base64 str"),
    (lambda r: [1, 2], "routes must be None or a dict of dtype, shape and data"),
    (lambda r: encode_routes(np.full((3, 2, 2), 4, np.int8)), r"routes\[0, 0, 0\] = 4"),
    (lambda r: encode_routes(np.zeros((3, 1, 2), np.int8)), r"routes have shape \[3, 1, 2\]"),
])
def test_restore_refuses_bad_routes_and_changes_nothing(place, corrupt, match):
    svc, given = filled(place)
    snap = json.loads(json.dumps(svc.snapshot()))
    (i, g), = [(i, g) for i, g in enumerate(snap["groups"]) if g["state"] == "requeued"]
    bad = copy.deepcopy(snap)
    bad["groups"][i]["samples"][0]["routes"] = corrupt(g["samples"][0]["routes"])
    other = place(make(batch_groups=3))
    before_stats, before_snap = other.stats(), other.snapshot()
    where = f"snapshot group {g['group_id']} sample 0: "
    with pytest.raises(ValueError, match=where + match):
        other.restore(bad)
    with pytest.raises(ValueError, match="trajectory snapshot.* is invalid: " + where + match):
        ExtraCheck(group_size=2, batch_groups=3, reserve_groups=3, eta=1, route_spec=SPEC)(0, {
            "trajectories": bad, "base_accuracy": None})
    assert other.stats() == before_stats and other.snapshot() == before_snap
    with pytest.raises(ValueError, match="routes given, but the model has no experts"):
        place(make(batch_groups=3, route_spec=None)).restore(snap)  # a MoE run's snapshot into a dense run
    other.restore(snap)


# ---- the wire ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,dtype", [(3, np.int8), (0, np.int8), (600, np.int8), (2000, np.int8),
                                     (5, np.int16), (2000, np.int32)])
def test_a_sample_with_routes_crosses_the_wire_bit_exact(n, dtype):
    """Small routes travel inline, large ones (>= INLINE_ARRAY_BYTES) in the tensor region: both come back
    with their dtype, shape and values, as do the groups and batches that hold them."""
    spec = RouteSpec(layers=2, top_k=2, num_experts=300 if dtype != np.int8 else 4)
    s = Sample(list(range(n)), [-0.5] * n, [0] * n, "stop", routes=routes(n, 30, dtype, spec))
    message = wire.encode({"samples": [s, Sample([1], [-1.0], [0], "stop")]})
    without = wire.encode({"samples": [dataclasses.replace(s, routes=None), Sample([1], [-1.0], [0], "stop")]})
    assert len(message) - len(without) <= s.routes.nbytes + 128  # raw bytes (and alignment), not ints in msgpack
    got, plain = wire.decode(message)["samples"]
    assert got.tokens == s.tokens and plain.routes is None
    assert_same_routes(got.routes, s.routes)


def test_batches_and_the_spec_cross_the_wire():
    s = sample(4, 31)
    batch = ConsumedBatch(0, [FinishedGroup(5, [1, 2], 0, [s, Sample()], [1.0, 0.0], step=0)], "ready")
    got = wire.decode(wire.encode([batch, SPEC]))
    assert got[1] == SPEC
    (g,) = got[0].groups
    assert_same_routes(g.samples[0].routes, s.routes)
    assert g.samples[1].routes is None
