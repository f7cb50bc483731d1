"""Scenarios for the simulator.

`reasoning(instances)`: reasoning-style RL of an ~8B model, one H100-class instance per engine (the
fleet's `InstanceSpec` defaults), response lengths with median ~1.5k tokens and a tail clipped at 32k,
groups of 16, 4 groups per instance per step, and a trainer with about as many GPUs as the fleet
(~7k trained tokens/s per GPU, 10 s per step of optimizer and weight publishing).

`from_trace(...)`: a small scenario whose engines, trainer and lengths are fitted from a real run's
trace (see benchmarks/simulate.py), to check the simulator against the real thing.
"""

from __future__ import annotations

from jaxflow.sim.fleet import InstanceSpec
from jaxflow.sim.loop import Scenario, TrainerModel
from jaxflow.sim.workload import reasoning_lengths

GROUP_SIZE = 16
GROUPS_PER_INSTANCE = 4


def reasoning(instances: int, *, steps: int = 12, seed: int = 0, tick_s: float = 1.0) -> Scenario:
    spec = InstanceSpec()
    return Scenario(name=f"reasoning-{instances}", instances=tuple(spec for _ in range(instances)),
                    lengths=reasoning_lengths(block_tokens=256, seed=seed),
                    trainer=TrainerModel(step_s=10.0, tokens_per_s=7000.0 * instances),
                    batch_groups=GROUPS_PER_INSTANCE * instances, group_size=GROUP_SIZE, max_tokens=32768,
                    steps=steps, tick_s=tick_s)
