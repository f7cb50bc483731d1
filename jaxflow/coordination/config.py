"""The rollout driver's settings: one `rollout.coordination` config section, checked as a whole. It holds
every placement and weight-sync option of the coordinator, whether it drives one engine or many.

Each strategy is switchable on its own; `areal_like()` and `default()` are the two ends the simulator
compares (no coordination vs everything on). Unknown keys and bad values raise a ValueError naming them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import ml_collections

from jaxflow.config import ConfigError

ROUTERS = ("round_robin", "least_loaded", "throughput")
QUEUES = ("fifo", "oldest_first")
SYNC_POLICIES = ("all", "selective")
SYNC_MODES = ("keep", "keep_kv", "abort")
STUCK_ACTIONS = ("wait", "retry", "release")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """An instance's decode step time, a + b * running + c * kv_used (kv_used in [0, 1]), in seconds;
    the coordinator scales it per instance by the speed it observes. Only ratios matter for routing."""

    step_s: float = 0.015
    per_seq_s: float = 0.0002
    per_kv_s: float = 0.02

    def step_time(self, running: float, kv_used: float) -> float:
        return self.step_s + self.per_seq_s * running + self.per_kv_s * kv_used


@dataclasses.dataclass(frozen=True)
class Coordination:
    """routing: how a request picks its instance ("throughput": the cost model scaled by each
    instance's observed speed; "least_loaded": fewest requests; "round_robin").
    queue: order of requests waiting for an instance ("oldest_first": oldest v_start first).
    max_running: requests the coordinator keeps on one instance.
    extra_groups: redundant rollout, B' = ceil(B * (1 + extra_groups)) groups admitted per buffer, the
    first B to finish are trained. extra_samples: N' = N + extra_samples samples launched per group,
    the first N to finish are kept. Both bias the batch toward short responses; off by default.
    migrate: move requests from an instance whose load is >= migrate_trigger x the mean to the least
    loaded ones, until <= migrate_stop x the mean (abort + resubmit with the prefix), at most
    migrate_max_moves requests per coordinator step.
    sync: "all" instances take each new version at once; "selective": an instance syncs when it runs
    at most sync_idle_below requests (-1: never for being idle), when it lags by sync_max_lag versions,
    or when it must (its weights are too old to be given work).
    sync_mode: "keep" requests across a sync (KV recomputed), "keep_kv" them with their KV as it was
    (PipelineRL's in-flight update: no recompute; later tokens attend to keys and values older weights
    computed, none older than the request's v_start), or "abort" them back to the queue, to be resumed
    from their tokens so far under the new weights.
    stuck: when the next buffer misses at most stuck_threshold groups and those have run for over
    stuck_patience x the median group time: "retry" their unfinished requests on the least loaded
    instances, "release" the buffer to the trainer with what it holds, or "wait".
    """

    routing: str = "throughput"
    queue: str = "oldest_first"
    max_running: int = 64
    extra_groups: float = 0.0
    extra_samples: int = 0
    migrate: bool = True
    migrate_trigger: float = 2.0
    migrate_stop: float = 1.2
    migrate_min_requests: int = 2
    migrate_max_moves: int = 16
    sync: str = "selective"
    sync_idle_below: int = 0
    sync_max_lag: int = 2
    sync_mode: str = "keep"
    stuck: str = "retry"
    stuck_threshold: int = 4
    stuck_patience: float = 2.0
    cost: CostModel = CostModel()

    def __post_init__(self):
        problems = []
        for name, value, valid in (("routing", self.routing, ROUTERS), ("queue", self.queue, QUEUES),
                                   ("sync", self.sync, SYNC_POLICIES), ("sync_mode", self.sync_mode, SYNC_MODES),
                                   ("stuck", self.stuck, STUCK_ACTIONS)):
            if value not in valid:
                problems.append(f"{name} {value!r} is not one of {', '.join(valid)}")
        for name, value, low in (("max_running", self.max_running, 1), ("extra_groups", self.extra_groups, 0),
                                 ("extra_samples", self.extra_samples, 0), ("sync_idle_below", self.sync_idle_below, -1),
                                 ("sync_max_lag", self.sync_max_lag, 1), ("stuck_threshold", self.stuck_threshold, 1),
                                 ("stuck_patience", self.stuck_patience, 0),
                                 ("migrate_min_requests", self.migrate_min_requests, 1),
                                 ("migrate_max_moves", self.migrate_max_moves, 1)):
            if value < low:
                problems.append(f"{name} must be >= {low}, got {value}")
        if not self.migrate_trigger > self.migrate_stop >= 1.0:
            problems.append(f"need migrate_trigger > migrate_stop >= 1, got {self.migrate_trigger} and "
                            f"{self.migrate_stop}")
        if problems:
            raise ConfigError("bad coordination config: " + "; ".join(problems))

    def reserve_groups(self, batch_groups: int) -> int:
        """Reservations per buffer for the trajectory service (B')."""
        return math.ceil(batch_groups * (1.0 + self.extra_groups))

    @classmethod
    def areal_like(cls, **overrides: Any) -> Coordination:
        """No coordination: least-loaded placement in arrival order, every instance syncs each version,
        no redundancy, migration or stuck handling (what the simulator calls AReaL-style)."""
        return cls(**{"routing": "least_loaded", "queue": "fifo", "migrate": False, "sync": "all", "stuck": "wait",
                             "extra_groups": 0.0, "extra_samples": 0, **overrides})

    @classmethod
    def from_config(cls, section: ml_collections.ConfigDict | dict) -> Coordination:
        """From a config section; unknown keys are named with the nearest valid ones."""
        items = dict(section.items()) if hasattr(section, "items") else dict(section)
        fields = {f.name for f in dataclasses.fields(cls)} - {"cost"}
        cost_fields = {f.name for f in dataclasses.fields(CostModel)}
        unknown = [k for k in items if k not in fields and k != "cost"]
        if unknown:
            hints = [f"{k!r} (nearest: {', '.join(difflib.get_close_matches(k, sorted(fields), n=2)) or '-'})"
                     for k in unknown]
            raise ConfigError(f"unknown coordination keys {', '.join(hints)}; valid: {', '.join(sorted(fields))}")
        cost = dict(items.pop("cost", {}) or {})
        if set(cost) - cost_fields:
            raise ConfigError(f"unknown coordination.cost keys {sorted(set(cost) - cost_fields)}; valid: "
                             f"{sorted(cost_fields)}")
        return cls(**items, cost=CostModel(**cost))


def config_section(**overrides: Any) -> ml_collections.ConfigDict:
    """The `rollout.coordination` section with the defaults of `Coordination`, for config files."""
    c = Coordination(**overrides)
    d = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "cost"}
    d["cost"] = dataclasses.asdict(c.cost)
    return ml_collections.ConfigDict(d)
