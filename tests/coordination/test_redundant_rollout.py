"""The trajectory service's redundant rollout (B' > B reservations, SURPLUS groups) and `release`
(a stuck buffer handed over with what it holds): the first B to finish are trained, the rest are
counted and never trained, and the staleness bound holds throughout."""

import random

import pytest

from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import BufferState, TrajectoryService


def make(**kw):
    records = [{"prompt": [1 + i % 50], "meta": {"index": i}} for i in range(400)]
    kw.setdefault("group_size", 2)
    return TrajectoryService(PromptSource(records, shuffle=False, num_epochs=1), **kw)


def done(task, version):
    return [Sample([5, 6], [-1.0, -1.0], [version, version], "stop") for _ in range(task.n)]


def test_redundant_groups_first_b_to_finish_are_trained_the_rest_are_surplus():
    svc = make(batch_groups=4, reserve_groups=6, eta=0)
    tasks = svc.dispatch("w", 0, max_groups=10)
    assert len(tasks) == 6  # B' reservations, not B
    assert svc.dispatch("w", 0, max_groups=10) == []
    order = [tasks[i] for i in (5, 2, 0, 3)]  # finish out of dispatch order
    for t in order:
        assert svc.finish(t.group_id, "w", done(t, 0), [1.0, 0.0]) == 0
    assert svc.buffer_state() == BufferState.READY.value
    dropped = svc.take_surplus("w")
    assert sorted(dropped) == sorted(tasks[i].group_id for i in (1, 4))
    assert svc.take_surplus("w") == []  # reported once
    # A worker that finishes a dropped group before hearing of it changes nothing.
    assert svc.finish(tasks[1].group_id, "w", done(tasks[1], 0), [1.0, 1.0]) is None
    svc.abort(tasks[4].group_id, "w", None)
    batch = svc.consume(0, timeout=1)
    assert [g.group_id for g in batch.groups] == sorted(t.group_id for t in order)
    counts = svc.stats()["counts"]
    assert counts["surplus"] == 2 and counts["consumed"] == 4 and counts["created"] == 6


def test_a_surplus_group_is_dropped_only_when_no_buffer_it_may_occupy_has_room():
    svc = make(batch_groups=2, reserve_groups=3, eta=1)
    first = svc.dispatch("w", 0, max_groups=3)  # reserve buffer 1
    assert len(first) == 3
    svc.mark_published(0)
    for t in first[:2]:
        assert svc.finish(t.group_id, "w", done(t, 0), [0.0, 1.0]) == 0  # earliest room: buffer 0
    # Buffer 0 is full, but the third group may still land in buffer 1: not surplus.
    assert svc.take_surplus("w") == []
    assert svc.finish(first[2].group_id, "w", done(first[2], 0), [0.0, 1.0]) == 1


def test_release_hands_over_a_partial_buffer_and_drops_only_what_can_land_nowhere_else():
    svc = make(batch_groups=3, eta=1)
    svc.mark_published(0)
    old = svc.dispatch("w", 0, max_groups=3)  # all reserve buffer 1
    for t in old[:2]:
        svc.finish(t.group_id, "w", done(t, 0), [1.0, 0.0])  # land in buffer 0
    assert svc.release(0) == 0  # the third may still land in buffer 1: nothing dropped
    assert svc.buffer_state(0) == BufferState.READY_WITH_CAPACITY.value
    assert len(svc.consume(0, timeout=1).groups) == 2
    assert svc.finish(old[2].group_id, "w", done(old[2], 0), [1.0, 0.0]) == 1
    svc.mark_published(1)
    new = svc.dispatch("w", 1, max_groups=5)  # reserve buffer 2; buffer 1 has 2 slots left
    assert len(new) == 3
    for t in new[:1]:
        svc.finish(t.group_id, "w", done(t, 1), [1.0, 0.0])  # lands in buffer 1
    # Buffer 1 now holds 2; release it: the two others reserved buffer 2 and stay.
    assert svc.release(1) == 0 and svc.take_surplus("w") == []
    assert len(svc.consume(1, timeout=1).groups) == 2
    svc.mark_published(2)
    assert svc.release(2) == 2  # nothing occupies buffer 2: both can only have landed there
    assert sorted(svc.take_surplus("w")) == sorted(t.group_id for t in new[1:])
    with pytest.raises(ValueError, match="already consumed"):
        svc.release(1)


def test_bad_reserve_groups_is_named():
    with pytest.raises(ValueError, match="reserve_groups"):
        make(batch_groups=4, reserve_groups=3, eta=1)


@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings_keep_the_bound_and_the_accounting(seed):
    rng = random.Random(seed)
    eta, batch = rng.choice([0, 1, 3]), rng.choice([2, 4])
    svc = make(batch_groups=batch, reserve_groups=batch + rng.choice([1, 3]), eta=eta)
    running: dict[int, tuple] = {}  # id -> (task, worker)
    versions = {"a": 0, "b": 0}
    trained: list[int] = []
    v = 0
    for _ in range(400):
        op = rng.random()
        w = rng.choice("ab")
        if op < 0.35:
            for t in svc.dispatch(w, versions[w], max_groups=rng.randint(1, 4)):
                running[t.group_id] = (t, w)
        elif op < 0.7 and running:
            gid = rng.choice(list(running))
            t, owner = running.pop(gid)
            if rng.random() < 0.2:
                svc.abort(gid, owner, None)
            else:
                svc.finish(gid, owner, done(t, t.v_start), [rng.random(), 1.0])
        elif op < 0.8:
            for gid in svc.take_surplus(w):
                running.pop(gid, None)
        elif op < 0.9 and svc.buffer_state() != BufferState.PENDING.value:
            got = svc.consume(v, timeout=1)
            assert all(v - g.v_start <= eta for g in got.groups)
            assert len(got.groups) <= batch
            trained += [g.group_id for g in got.groups]
            v += 1
            svc.mark_published(v)
        else:
            versions[w] = v if svc.needs_sync(versions[w]) or rng.random() < 0.5 else versions[w]
    stats = svc.stats()
    c, gauges = stats["counts"], stats["groups"]
    assert len(trained) == len(set(trained)) == c["consumed"]
    in_flight = sum(n for k, n in gauges.items() if k not in ("consumed", "failed", "surplus"))
    assert c["created"] == c["consumed"] + c["surplus"] + c["failed"] + in_flight
    assert all(b["occupied"] <= batch for b in stats["buffers"].values())
