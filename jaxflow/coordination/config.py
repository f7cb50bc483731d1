"""The rollout driver's settings: one `rollout.coordination` config section, checked as a whole. It holds
every placement and weight-sync option of the coordinator, whether it drives one engine or many.

Each strategy is switchable on its own; `areal_like()` and `default()` are the two ends the simulator
compares (no coordination vs everything on). Unknown keys and bad values raise a ConfigError naming them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import ml_collections

from jaxflow.config import Section, check_bool, check_choice, check_float, check_int

ROUTERS = ("round_robin", "least_loaded", "throughput")
QUEUES = ("fifo", "oldest_first")
SYNC_POLICIES = ("all", "selective")
SYNC_MODES = ("keep", "keep_kv", "abort")
STUCK_ACTIONS = ("wait", "retry", "release")


@dataclasses.dataclass(frozen=True)
class CostModel(Section):
    """An instance's decode step time, a + b * running + c * kv_used (kv_used in [0, 1]), in seconds;
    the coordinator scales it per instance by the speed it observes. Only ratios matter for routing.

    step_s: a, seconds per decode step of an idle instance.
    per_seq_s: b, seconds each running request adds.
    per_kv_s: c, seconds a full KV cache adds.
    """

    SECTION: ClassVar[str] = "rollout.coordination.cost"

    step_s: float = 0.015
    per_seq_s: float = 0.0002
    per_kv_s: float = 0.02

    def step_time(self, running: float, kv_used: float) -> float:
        return self.step_s + self.per_seq_s * running + self.per_kv_s * kv_used

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("step_s", "per_seq_s", "per_kv_s"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        return problems


@dataclasses.dataclass(frozen=True)
class Coordination(Section):
    """The `rollout.coordination` section (`Coordination.section(**overrides)` generates it for config files).

    routing: how a request picks its instance ("throughput": the cost model scaled by each
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
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    SECTION: ClassVar[str] = "rollout.coordination"

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name, valid in (("routing", ROUTERS), ("queue", QUEUES), ("sync", SYNC_POLICIES),
                            ("sync_mode", SYNC_MODES), ("stuck", STUCK_ACTIONS)):
            check_choice(problems, self.key(name), getattr(self, name), valid)
        for name, low in (("max_running", 1), ("extra_samples", 0), ("sync_idle_below", -1), ("sync_max_lag", 1),
                          ("stuck_threshold", 1), ("migrate_min_requests", 1), ("migrate_max_moves", 1)):
            check_int(problems, self.key(name), getattr(self, name), low)
        for name in ("extra_groups", "stuck_patience"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        check_bool(problems, self.key("migrate"), self.migrate)
        before = len(problems)
        for name in ("migrate_trigger", "migrate_stop"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        if len(problems) == before and not self.migrate_trigger > self.migrate_stop >= 1.0:
            problems.append(f"{self.SECTION}: need migrate_trigger > migrate_stop >= 1, got {self.migrate_trigger} "
                            f"and {self.migrate_stop}")
        return problems

    def reserve_groups(self, batch_groups: int) -> int:
        """Reservations per buffer for the trajectory service (B')."""
        return math.ceil(batch_groups * (1.0 + self.extra_groups))

    @classmethod
    def areal_like(cls, **overrides: Any) -> Coordination:
        """No coordination: least-loaded placement in arrival order, every instance syncs each version,
        no redundancy, migration or stuck handling (what the simulator calls AReaL-style)."""
        return cls(**{"routing": "least_loaded", "queue": "fifo", "migrate": False, "sync": "all", "stuck": "wait",
                             "extra_groups": 0.0, "extra_samples": 0, **overrides})


def config_section(**overrides: Any) -> ml_collections.ConfigDict:
    """The `rollout.coordination` section with the defaults of `Coordination` (`Coordination.section`)."""
    return Coordination.section(**overrides)
