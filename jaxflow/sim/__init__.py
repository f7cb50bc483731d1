"""A simulated rollout fleet for studying coordinators at scale, in virtual time.

- `workload`: prompts and response lengths (log-normal with a per-prompt part, or resampled from
  observed groups), deterministic per (seed, prompt, sample).
- `fleet`: `SimFleet`, many simulated inference instances; each `SimEngine` implements the real
  `rollout_bridge.engine.Engine` interface, with a fitted cost model for decode, prefill and weight sync.
- `loop` (separate module): drives a coordinator over a fleet, advancing the virtual clock.
- `bounds` (separate module): the tail floor, the shortest mean step any strategy that trains every
  sample can reach under a staleness bound.
"""

from jaxflow.sim.fleet import InstanceSpec, SimEngine, SimFleet
from jaxflow.sim.workload import LengthModel, Workload, describe, reasoning_lengths

__all__ = ["InstanceSpec", "LengthModel", "SimEngine", "SimFleet", "Workload", "describe", "reasoning_lengths"]
