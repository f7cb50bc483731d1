"""Rollout coordination: jaxflow's one rollout driver, a control loop placing every request of one engine
or a fleet of them (a coordinator over one engine is a rollout worker).

Strategies, each switchable in `rollout.coordination` (`config.Coordination`):

- routing (`routing.py`): throughput-optimal placement by a per-instance cost model;
- queue order (`queue.py`): the oldest v_start first;
- redundant rollout (`config.Coordination.extra_groups` / `extra_samples`, with the trajectory
  service's SURPLUS state): admit more than needed, train the first to finish, count the rest;
- migration (`migration.py`): move requests off overloaded instances;
- selective weight sync (`sync.py`): an instance syncs when idle or lagging, not all at once;
- stuck buffers (`stuck.py`): retry or release a buffer held back by a few slow groups.

`coordinator.Coordinator` runs them over real engines (`jaxflow.jobs.rl`) or simulated ones
(`jaxflow.sim`).
"""

from jaxflow.coordination.config import Coordination, CostModel, config_section
from jaxflow.coordination.coordinator import Coordinator

__all__ = ["Coordination", "Coordinator", "CostModel", "config_section"]
