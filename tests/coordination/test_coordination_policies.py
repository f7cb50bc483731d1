"""The coordination strategies' pure pieces: their config (bad values and unknown keys named), the request
queue's order, migration.plan, should_sync and stragglers. tests/test_coordination.py shows each strategy's
effect in a simulated loop."""

from __future__ import annotations

import pytest

from jaxflow.config import ConfigError
from jaxflow.coordination import Coordination, CostModel, config_section, migration
from jaxflow.coordination.queue import PendingRequest, RequestQueue
from jaxflow.coordination.stuck import stragglers
from jaxflow.coordination.sync import should_sync


def test_coordination_names_every_bad_value():
    with pytest.raises(ConfigError) as e:
        Coordination(routing="fastest", queue="lifo", sync="some", sync_mode="drop", stuck="panic", max_running=0,
                     extra_groups=-0.5, extra_samples=-1, sync_max_lag=0, stuck_threshold=0, migrate_max_moves=0,
                     sync_idle_below=-2)
    msg = str(e.value)
    for part in ("routing 'fastest'", "('round_robin', 'least_loaded', 'throughput')", "queue 'lifo'", "sync 'some'",
                 "sync_mode 'drop'", "stuck 'panic'", "max_running must be >= 1, got 0", "extra_groups",
                 "extra_samples", "sync_max_lag", "stuck_threshold", "migrate_max_moves",
                 "sync_idle_below must be >= -1, got -2"):
        assert part in msg, part
    with pytest.raises(ValueError, match="migrate_trigger > migrate_stop >= 1"):
        Coordination(migrate_trigger=1.5, migrate_stop=1.5)
    with pytest.raises(ValueError, match="migrate_trigger > migrate_stop >= 1"):
        Coordination(migrate_trigger=2.0, migrate_stop=0.9)
    assert Coordination(extra_groups=0.25).reserve_groups(8) == 10 and Coordination().reserve_groups(8) == 8
    off = Coordination.areal_like(max_running=4)
    assert (off.routing, off.queue, off.migrate, off.sync, off.stuck, off.extra_groups, off.extra_samples,
            off.max_running) == ("least_loaded", "fifo", False, "all", "wait", 0.0, 0, 4)


def test_from_config_names_unknown_keys_with_the_nearest():
    with pytest.raises(ConfigError) as e:
        Coordination.from_config({"routng": "throughput", "extra_group": 0.5, "max_running": 8})
    msg = str(e.value)
    assert "coordination.routng is not a key of rollout.coordination (nearest: routing" in msg
    assert "coordination.extra_group is not a key of rollout.coordination (nearest: extra_groups" in msg
    assert "max_running" not in msg  # a valid key is not reported
    with pytest.raises(ConfigError, match=r"coordination\.cost\.step is not a key of rollout\.coordination\.cost"):
        Coordination.from_config({"cost": {"step": 0.1}})
    with pytest.raises(ValueError, match="stuck 'never'"):
        Coordination.from_config({"stuck": "never"})
    section = config_section(routing="least_loaded", extra_samples=2)
    section.cost.per_seq_s = 0.001
    c = Coordination.from_config(section)
    assert c.routing == "least_loaded" and c.extra_samples == 2 and c.cost == CostModel(per_seq_s=0.001)
    assert Coordination.from_config(config_section()) == Coordination()


def test_request_queue_orders():
    def requests():
        return [PendingRequest(0, 0, 2), PendingRequest(1, 0, 0), PendingRequest(2, 0, 1), PendingRequest(1, 1, 0)]

    for order, expected in (("fifo", [(3, 0, 1), (0, 0, 2), (1, 0, 0), (2, 0, 1), (1, 1, 0)]),
                            ("oldest_first", [(1, 0, 0), (1, 1, 0), (3, 0, 1), (2, 0, 1), (0, 0, 2)])):
        q = RequestQueue(order)
        for r in requests():
            q.push(r)
        q.push(PendingRequest(3, 0, 1), front=True)  # work already started: ahead of its rank
        assert len(q) == 5
        popped = []
        while (r := q.pop(9)) is not None:
            popped.append((r.group_id, r.sample, r.v_start))
        assert popped == expected, order
        assert len(q) == 0
    for order in ("fifo", "oldest_first"):
        q = RequestQueue(order)
        for r in requests():
            q.push(r)
        assert [r.sample for r in q.take_group(1)] == [0, 1] and len(q) == 2
        assert q.pop(0) is None  # v_start 1 and 2 need newer weights
        assert q.pop(1).group_id == 2 and q.pop(1) is None and q.pop(2).group_id == 0 and len(q) == 0
    with pytest.raises(ValueError, match="lifo"):
        RequestQueue("lifo")


def plan(loads, unit=None, *, trigger=2.0, stop=1.2, min_requests=2, room=None, versions=None, max_moves=100):
    n = len(loads)
    return migration.plan(list(loads), unit or [1.0] * n, trigger=trigger, stop=stop, min_requests=min_requests,
                          room=room or [100] * n, versions=versions or [0] * n, max_moves=max_moves)


def test_migration_plan():
    assert plan([3, 2, 2, 1]) == []  # 3 < 2 x the mean
    assert plan([0, 0, 0, 0]) == [] and plan([]) == []
    moves = plan([8, 0, 0, 0])  # mean 2: move until the source is <= 1.2 x 2
    assert moves == [(0, 1), (0, 2), (0, 3), (0, 1), (0, 2), (0, 3)]
    assert len(plan([8, 0, 0, 0], stop=1.9)) == 5  # stops at <= 3.8 instead
    assert plan([8, 0, 0, 0], max_moves=2) == [(0, 1), (0, 2)]
    assert plan([8, 0, 0, 0], trigger=4.5) == []  # 8 < 4.5 x 2
    assert plan([1, 0, 0, 0]) == []  # one request: below min_requests
    assert plan([1, 0, 0, 0], min_requests=1, stop=1.1) == []  # would not lower the maximum (0 + 1 >= 1)
    # Only to instances at least as new as the source; only where there is room.
    assert plan([8, 0, 0, 0], versions=[1, 0, 0, 1]) == [(0, 3)] * 4  # [4, 0, 0, 4]: no further gain
    assert plan([8, 0, 0, 0], room=[0, 0, 0, 1]) == [(0, 3)]
    # Load is requests x slowness: a request on the slow instance 1 adds 4, so until the source is down to
    # 2 x the mean (6) the requests go to the cheaper 2 and 3.
    assert plan([12, 0, 0, 0], unit=[1, 4, 1, 1], stop=2.0) == [(0, 2), (0, 3)] * 3
    assert plan([8, 0], unit=[1, 9]) == []  # 0 + 9 >= 8: never lowers the maximum
    # A slow source (unit 2): 3 requests weigh 6 >= 2 x the mean 2; each move takes 2 off it.
    assert plan([6, 1, 1, 0], unit=[2, 1, 1, 1]) == [(0, 3), (0, 1)]  # [2, 2, 1, 1]


def test_should_sync():
    kw = {"version": 3, "latest": 4, "running": 5, "must": False, "idle_below": 0, "max_lag": 2}
    assert should_sync("all", **kw) and not should_sync("selective", **kw)
    assert should_sync("selective", **{**kw, "running": 0})  # idle
    assert should_sync("selective", **{**kw, "running": 2, "idle_below": 2})  # nearly idle
    assert not should_sync("selective", **{**kw, "running": 0, "idle_below": -1})  # idleness off
    assert should_sync("selective", **{**kw, "latest": 5})  # lags by max_lag
    assert should_sync("selective", **{**kw, "must": True})  # too old to be given work
    assert not should_sync("all", **{**kw, "latest": 3}) and not should_sync("selective", **{**kw, "latest": 3,
                                                                                              "must": True})


def test_stragglers():
    ages = {7: 30.0, 3: 25.0}
    assert stragglers(missing=2, ages=ages, threshold=4, patience_s=20.0) == [3, 7]
    assert stragglers(missing=0, ages=ages, threshold=4, patience_s=20.0) == []  # the buffer is full
    assert stragglers(missing=5, ages=ages, threshold=4, patience_s=20.0) == []  # more than a short tail
    assert stragglers(missing=2, ages=ages, threshold=4, patience_s=26.0) == []  # one is not late yet
    assert stragglers(missing=2, ages={}, threshold=4, patience_s=0.0) == []
