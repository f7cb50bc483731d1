"""Routing: which instance takes the next request.

- "round_robin": the next instance in turn that has room;
- "least_loaded": the fewest requests (placement by count only);
- "throughput": the lowest predicted decode step time once the request is added, from the cost model
  a + b * running + c * kv_used, scaled by the speed the coordinator observes on that instance. A slow
  or KV-heavy instance gets fewer requests, so the fleet's per-request decode speed stays even.
"""

from __future__ import annotations

import dataclasses

from jaxflow.coordination.config import CostModel
from rollout_bridge.engine import Engine


@dataclasses.dataclass
class Instance:
    """The coordinator's view of one engine."""

    index: int
    name: str
    engine: Engine
    requests: set[str] = dataclasses.field(default_factory=set)  # request ids placed here
    kv_used: float = 0.0
    slowness: float = 1.0  # observed step time / cost model (EMA); 2 means half as fast as modelled
    idle_s: float = 0.0
    syncs: int = 0

    @property
    def running(self) -> int:
        return len(self.requests)

    @property
    def version(self) -> int:
        return self.engine.version

    def predicted_step_s(self, cost: CostModel, extra: int = 0) -> float:
        return self.slowness * cost.step_time(self.running + extra, self.kv_used)

    @property
    def load(self) -> float:
        """Requests weighted by how slow this instance runs them (used by migration)."""
        return self.running * self.slowness

    def observe(self, tokens_per_s: float, running: int, cost: CostModel, weight: float = 0.3) -> None:
        """Folds the engine's reported decode rate into `slowness`."""
        if tokens_per_s > 0 and running > 0:
            observed = running / tokens_per_s  # seconds per decode step
            ratio = observed / cost.step_time(running, self.kv_used)
            self.slowness = (1 - weight) * self.slowness + weight * ratio


class Router:
    """Orders instances for the next request: the one with the smallest `key` takes it."""

    def __init__(self, policy: str, cost: CostModel):
        self.policy, self.cost = policy, cost
        self._placed: dict[int, int] = {}

    def key(self, inst: Instance) -> tuple:
        if self.policy == "round_robin":
            return (self._placed.get(inst.index, 0), inst.index)
        if self.policy == "least_loaded":
            return (inst.running, inst.index)
        return (inst.predicted_step_s(self.cost, extra=1), inst.index)

    def placed(self, inst: Instance) -> None:
        self._placed[inst.index] = self._placed.get(inst.index, 0) + 1
