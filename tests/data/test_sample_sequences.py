"""Training sequences inside a sample (`Sample.sequence_starts`: an agent that rewrote its history) through the
data path: the sample's own view of its sequences, the checks (each bad value refused by name, before
anything stored changes, in `finish`, `abort`, `renew` and `restore`), and the field kept as it was through
the service, its JSON snapshot (an old snapshot without the field reads as one sequence), the wire and the
engines' copies of a prefix."""

import copy
import dataclasses
import json

import numpy as np
import pytest
from service_placements import PLACEMENTS, placed

from jaxflow.data import checks
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import ConsumedBatch, FinishedGroup, RouteSpec, Sample
from jaxflow.data.trajectory_service import SampleRefused, TrajectoryService
from jaxflow.jobs.resume import ExtraCheck
from jaxflow.transport import wire
from rollout_bridge.engine import Request, copy_prefix, in_flight_copy

SPEC = RouteSpec(layers=2, top_k=2, num_experts=4)

# An agent's episode of 12 tokens: it sent [0, 3), the model answered [3, 6), a tool result [6, 8), the model
# [8, 9); then the agent rewrote its history and sent [9, 11) as a new context, the model answered [11, 12).
SPANS = [[0, 3], [6, 8], [9, 11]]


def records(n):
    return [{"prompt": [1 + i % 50, 2 + i % 7], "meta": {"index": i}} for i in range(n)]


def make(route_spec=None, **kw):
    kw.setdefault("batch_groups", 2)
    kw.setdefault("group_size", 2)
    kw.setdefault("eta", 1)
    return TrajectoryService(PromptSource(records(50), shuffle=False, num_epochs=1), route_spec=route_spec, **kw)


def episode(starts=(0, 9), finish="stop", spans=SPANS, n=12, routes=False, seed=0):
    """The episode above (tokens 20.., model tokens' log-probs their own values), split at `starts` (a
    tuple as a list; anything else as it is)."""
    mask = np.ones(n, bool)
    for a, b in spans:
        mask[a:b] = False
    logprobs = [-0.01 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    recorded = None
    if routes:
        rng = np.random.default_rng(seed)
        recorded = rng.integers(0, SPEC.num_experts, size=SPEC.shape(n)).astype(np.int8)
        recorded[~mask] = -1  # the environment's tokens: not recorded
    return Sample([20 + i for i in range(n)], logprobs, [0] * n, finish, [list(s) for s in spans],
                  routes=recorded, sequence_starts=list(starts) if isinstance(starts, tuple) else starts)


@pytest.fixture(params=PLACEMENTS)
def place(request):
    with placed(request.param) as p:
        yield p


# ---- the sample's view ----------------------------------------------------------------------------------

def test_sequences_of_a_sample():
    assert Sample([1, 2, 3], [-1.0] * 3, [0] * 3).sequences() == [(0, 3)]  # no starts: one, after the prompt
    assert Sample().sequences() == [(0, 0)]
    assert episode(starts=[0, 9]).sequences() == [(0, 9), (9, 12)]  # every sequence its own context
    assert episode(starts=[6]).sequences() == [(0, 6), (6, 12)]  # the first after the prompt, then a started one
    assert episode(starts=[0, 6, 9]).sequences() == [(0, 6), (6, 9), (9, 12)]
    for starts in ([0, 9], [6], [0], [0, 6, 9], [6, 9]):
        checks.check_sample("s", episode(starts=starts), 0, 0, True, route_spec=None)  # all valid


# ---- refusals --------------------------------------------------------------------------------------------

BAD_STARTS = [
    ("an int", dict(starts=9), "sequence_starts must be a list of ints, got int"),
    ("unsorted", dict(starts=[9, 0]), r"sequence_starts\[1\] = 0; starts must be sorted, unique ints in \[0, 12\)"),
    ("repeated", dict(starts=[0, 0]), r"sequence_starts\[1\] = 0; starts must be sorted, unique"),
    ("negative", dict(starts=[-1]), r"sequence_starts\[0\] = -1; starts must be sorted"),
    ("past the end", dict(starts=[0, 12]),
     r"sequence_starts\[1\] = 12; starts must be sorted, unique ints in \[0, 12\)"),
    ("bool", dict(starts=[True]), r"sequence_starts\[0\] = True; starts must be sorted"),
    ("float", dict(starts=[0.0]), r"sequence_starts\[0\] = 0.0; starts must be sorted"),
    ("a model token", dict(starts=[0, 3]), r"sequence_starts\[1\] = 3 is not the start of an env span"),
    ("inside a span", dict(starts=[1]), r"sequence_starts\[0\] = 1 is not the start of an env span"),
    ("no env spans", dict(starts=[0], spans=[]), r"sequence_starts\[0\] = 0 is not the start of an env span"),
    # Adjacent spans [6, 8) and [8, 9): the sequence [6, 8) is context alone.
    ("a sequence without model tokens", dict(starts=[0, 6, 8], spans=[[0, 3], [6, 8], [8, 9], [9, 11]]),
     r"sequence_starts \[0, 6, 8\] leave training sequence 1 \(tokens \[6, 8\)\) without a model token"),
    ("a first sequence without model tokens", dict(starts=[3], spans=[[0, 3], [3, 5]]),
     r"sequence_starts \[3\] leave training sequence 0 \(tokens \[0, 3\)\) without a model token"),
]


@pytest.mark.parametrize("name,kw,match", BAD_STARTS, ids=[b[0] for b in BAD_STARTS])
def test_bad_sequence_starts_are_refused_before_anything_changes(place, name, kw, match):
    svc = place(make())
    (t,) = svc.dispatch("w0", 0, 1)
    kept = [episode(starts=[0, 9], finish="abort"), Sample()]
    svc.abort(t.group_id, "w0", kept)  # what the service holds for the group: must survive the refusals
    (t,) = svc.dispatch("w0", 0, 1)
    before, snap = svc.stats(), svc.snapshot()
    bad = episode(**kw)
    with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 1: {match}") as e:
        svc.finish(t.group_id, "w0", [episode(), bad], [1.0, 0.0])
    assert e.value.reason == "malformed"
    unfinished = dataclasses.replace(bad, finish_reason="abort")
    for call in (lambda: svc.abort(t.group_id, "w0", [unfinished, Sample()]),
                 lambda: svc.renew("w0", [t.group_id], {t.group_id: [unfinished, Sample()]})):
        with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 0: {match}"):
            call()
    expected = copy.deepcopy(before)
    expected["counts"]["refused"] += 1  # the finish's; an abort or renewal is not counted
    expected["counts"]["refused_malformed"] += 1
    assert svc.stats() == expected
    assert {**svc.snapshot(), "counts": None} == {**snap, "counts": None}  # the groups and samples held
    svc.release_worker("w0")  # the group goes back with what was stored before the refusals
    (again,) = svc.dispatch("w1", 0, 1)
    assert again.partial[0].sequence_starts == [0, 9] and again.partial[0].tokens == kept[0].tokens
    assert svc.finish(t.group_id, "w1", [episode(), episode(starts=[6])], [1.0, 0.0]) == 0


def test_a_sample_still_generating_may_end_with_a_context_alone():
    """The agent has sent its new context, the model has not answered yet: an abort or a progress report
    keeps that; a finished sample whose last sequence holds no model token is refused."""
    svc = make()
    (t,) = svc.dispatch("w0", 0, 1)
    waiting = episode(starts=[0, 9], spans=[[0, 3], [6, 8], [9, 12]], finish=None)
    assert svc.renew("w0", [t.group_id], {t.group_id: [waiting, Sample()]}) == []
    svc.abort(t.group_id, "w0", [dataclasses.replace(waiting, finish_reason="abort"), Sample()])
    (t,) = svc.dispatch("w0", 0, 1)
    assert t.partial[0].sequence_starts == [0, 9]
    with pytest.raises(SampleRefused, match=rf"group {t.group_id} sample 0: sequence_starts \[0, 9\] leave "
                                            r"training sequence 1 \(tokens \[9, 12\)\) without a model token"):
        svc.finish(t.group_id, "w0", [dataclasses.replace(waiting, finish_reason="stop"), episode()], [1.0, 0.0])


def test_routes_at_a_sequence_start_must_be_unrecorded(place):
    """routes[i] are the experts of the input before token i; a sequence's first token has none in its
    sequence, so its routes must be -1."""
    svc = place(make(route_spec=SPEC, batch_groups=1))
    (t,) = svc.dispatch("w0", 0, 1)
    good = episode(routes=True)
    bad = episode(routes=True)
    bad.routes[9] = [[0, 1], [2, 3]]
    with pytest.raises(SampleRefused, match=rf"group {t.group_id} sample 1: routes\[9\] = \[\[0, 1\], \[2, 3\]\] at "
                                            r"sequence_starts\[1\]; .* must be -1"):
        svc.finish(t.group_id, "w0", [good, bad], [1.0, 0.0])
    bad.routes[9] = -1  # -1 there; recorded routes elsewhere, the environment's tokens' included, are kept
    bad.routes[10] = [[3, 2], [1, 0]]
    assert svc.finish(t.group_id, "w0", [good, bad], [1.0, 0.0]) == 0
    (g,) = svc.consume(0, timeout=5).groups
    np.testing.assert_array_equal(g.samples[1].routes, bad.routes)
    assert [s.sequence_starts for s in g.samples] == [[0, 9], [0, 9]]


def test_the_length_cap_holds_per_training_sequence():
    """With max_sequence_tokens (a trainer row) a split sample may be longer than a row: each of its
    sequences must fit with its context (the prompt for the first, unless started; nothing else)."""
    svc = make(max_sequence_tokens=8)  # prompts of 2 tokens
    (t,) = svc.dispatch("w0", 0, 1)
    long_unsplit = episode(starts=[])  # 12 tokens > 8 - 2
    with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 0: 12 tokens, more than the 6") as e:
        svc.finish(t.group_id, "w0", [long_unsplit, episode()], [1.0, 0.0])
    assert e.value.reason == "length"
    # [6]: the first sequence [0, 6) follows the prompt (2 + 6 = 8 fits); [6, 12) is its own context (6).
    head = episode(starts=[6])
    # [0, 9]: the started sequence [0, 9) is 9 tokens alone, more than a row's 8.
    too_long = episode(starts=[0, 9])
    with pytest.raises(SampleRefused, match=r"sample 1: training sequence 0 \(tokens \[0, 9\)\) has 9 tokens, "
                                            r"more than the 8 a trainer row leaves it") as e:
        svc.finish(t.group_id, "w0", [head, too_long], [1.0, 0.0])
    assert e.value.reason == "length"
    assert svc.finish(t.group_id, "w0", [head, episode(starts=[0, 6, 9])], [1.0, 0.0]) == 0


# ---- the field carried --------------------------------------------------------------------------------------

def filled(place, route_spec=SPEC):
    """A service holding split samples in every state a snapshot keeps: requeued (partial), finished (no
    rewards yet), occupied; and the samples it was given, by group id."""
    svc = place(make(route_spec=route_spec, batch_groups=3))
    t1, t2, t3 = svc.dispatch("w0", 0, 3)
    routes = route_spec is not None
    given = {t1.group_id: [episode(starts=[0, 9], finish="abort", routes=routes, seed=1), Sample()],
             t2.group_id: [episode(starts=[6], routes=routes, seed=2), episode(starts=[], seed=3)],
             t3.group_id: [episode(starts=[0, 6, 9], routes=routes, seed=4), episode(starts=[0])]}
    svc.abort(t1.group_id, "w0", given[t1.group_id])
    svc.finish(t2.group_id, "w0", given[t2.group_id])
    svc.finish(t3.group_id, "w0", given[t3.group_id], [0.0, 1.0])
    return svc, given


def test_snapshot_restore_keeps_sequence_starts(place):
    svc, given = filled(place)
    snap = json.loads(json.dumps(svc.snapshot()))  # as a checkpoint stores it
    for g in snap["groups"]:
        for s, want in zip(g["samples"], given[g["group_id"]]):
            if want.sequence_starts:
                assert s["sequence_starts"] == want.sequence_starts
            else:  # one sequence: saved as before the field existed
                assert "sequence_starts" not in s
    ExtraCheck(group_size=2, batch_groups=3, reserve_groups=3, eta=1, route_spec=SPEC)(0, {
        "trajectories": snap, "base_accuracy": None})
    other = place(make(route_spec=SPEC, batch_groups=3))
    other.restore(snap)
    (finished,) = other.unrewarded()
    assert [s.sequence_starts for s in finished.samples] == [s.sequence_starts for s in given[finished.group_id]]
    (requeued,) = other.dispatch("w1", 0, 1)
    assert [s.sequence_starts for s in requeued.partial] == [[0, 9], []]
    other.reward(finished.group_id, [1.0, 0.0])
    other.finish(requeued.group_id, "w1", [episode(), episode(starts=[6])], [0.0, 1.0])
    for g in other.consume(0, timeout=5).groups:
        want = given[g.group_id] if g.group_id != requeued.group_id else [episode(), episode(starts=[6])]
        for got, expected in zip(g.samples, want, strict=True):
            assert got.sequence_starts == expected.sequence_starts and got.tokens == expected.tokens
            assert got.env_spans == expected.env_spans


def test_a_snapshot_from_before_sequence_starts_reads_as_one_sequence(place):
    svc, given = filled(place, route_spec=None)
    old = json.loads(json.dumps(svc.snapshot()))
    for g in old["groups"]:
        for s in g["samples"] or []:
            s.pop("sequence_starts", None)  # what a snapshot from before the field holds
    other = place(make(batch_groups=3))
    other.restore(old)
    (finished,) = other.unrewarded()
    assert [s.sequence_starts for s in finished.samples] == [[], []]
    assert [s.tokens for s in finished.samples] == [s.tokens for s in given[finished.group_id]]
    (requeued,) = other.dispatch("w1", 0, 1)
    assert [s.sequence_starts for s in requeued.partial] == [[], []]


@pytest.mark.parametrize("bad,match", [
    ([0, 3], r"sequence_starts\[1\] = 3 is not the start of an env span"),
    ([9, 0], r"sequence_starts\[1\] = 0; starts must be sorted"),
    ("0", "sequence_starts must be a list of ints, got str"),
    ([0, 12], r"sequence_starts\[1\] = 12; starts must be sorted"),
], ids=["not a span start", "unsorted", "a str", "past the end"])
def test_restore_refuses_bad_sequence_starts_and_changes_nothing(place, bad, match):
    svc, _ = filled(place)
    snap = json.loads(json.dumps(svc.snapshot()))
    (i, g), = [(i, g) for i, g in enumerate(snap["groups"]) if g["state"] == "occupied"]
    corrupt = copy.deepcopy(snap)
    corrupt["groups"][i]["samples"][0]["sequence_starts"] = bad
    other = place(make(route_spec=SPEC, batch_groups=3))
    before_stats, before_snap = other.stats(), other.snapshot()
    where = f"snapshot group {g['group_id']} sample 0: "
    with pytest.raises(ValueError, match=where + match):
        other.restore(corrupt)
    with pytest.raises(ValueError, match="trajectory snapshot.* is invalid: " + where + match):
        ExtraCheck(group_size=2, batch_groups=3, reserve_groups=3, eta=1, route_spec=SPEC)(0, {
            "trajectories": corrupt, "base_accuracy": None})
    assert other.stats() == before_stats and other.snapshot() == before_snap
    other.restore(snap)


def test_sequence_starts_cross_the_wire():
    s = episode(starts=[0, 6, 9], routes=True)
    got, plain = wire.decode(wire.encode({"samples": [s, Sample([1], [-1.0], [0], "stop")]}))["samples"]
    assert got.sequence_starts == [0, 6, 9] and got.env_spans == s.env_spans and got.tokens == s.tokens
    np.testing.assert_array_equal(got.routes, s.routes)
    assert plain.sequence_starts == []
    batch = ConsumedBatch(0, [FinishedGroup(5, [1, 2], 0, [s, Sample()], [1.0, 0.0], step=0)], "ready")
    (g,) = wire.decode(wire.encode(batch)).groups
    assert [x.sequence_starts for x in g.samples] == [[0, 6, 9], []]


def test_engine_copies_keep_sequence_starts():
    """A resumed prefix and an in-flight copy keep the starts, as copies: the engine extends its own."""
    s = episode(starts=[0, 9], finish="abort")
    resumed = copy_prefix(Request("r", [1, 2], prefix=s))
    assert resumed.sequence_starts == [0, 9] and resumed.sequence_starts is not s.sequence_starts
    resumed.sequence_starts.append(11)
    assert s.sequence_starts == [0, 9]
    copied = in_flight_copy(s)
    assert copied.sequence_starts == [0, 9] and copied.sequence_starts is not s.sequence_starts
    assert copy_prefix(Request("r", [1, 2])).sequence_starts == []
