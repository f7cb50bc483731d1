"""The simulation loop: the real trajectory service and the real coordinator, in virtual time, against a
simulated fleet (`jaxflow.sim.fleet`) and a simulated trainer (step time a function of its tokens).

Each tick: the coordinator runs one `step()` (collect, surplus, sync, stuck, migrate, fill); the trainer,
if idle, consumes the next buffer once the service releases it and is busy for `TrainerModel.step_time`;
then the fleet advances to the next tick (or to the end of the train step, whichever is first). When
a train step ends the trainer publishes the next version (service first, then the parameters), as the
real trainer does.

Figures: trained tokens/s in steady state (after max(`warmup_steps`, eta + 1) steps: the first eta + 1
buffers are filled by the opening burst of admissions, which is not the steady state), the trainer's
idle fraction, the fleet's decode/stall/idle fractions, and the staleness of every consumed group
(v - v_start) and token block (v - the version that generated it).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from jaxflow.coordination import Coordination, Coordinator
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.trajectory_service import BufferState, TrajectoryService
from jaxflow.sim.fleet import InstanceSpec, SimFleet
from jaxflow.sim.workload import LengthModel, Workload
from rollout_bridge.engine import SamplingParams


@dataclasses.dataclass(frozen=True)
class TrainerModel:
    """A train step of `tokens` response tokens takes step_s + tokens / tokens_per_s seconds (forward,
    backward, optimizer and publishing the weights)."""

    step_s: float
    tokens_per_s: float

    def step_time(self, tokens: float) -> float:
        return self.step_s + tokens / self.tokens_per_s


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One simulated deployment and workload: what stays fixed while systems are compared."""

    name: str
    instances: tuple[InstanceSpec, ...]
    lengths: LengthModel
    trainer: TrainerModel
    batch_groups: int
    group_size: int
    max_tokens: int
    steps: int
    prompt_tokens: int = 256
    tick_s: float = 1.0
    warmup_steps: int = 2


class _Params:
    """The parameter service as the coordinator sees it: versions only (the fleet ignores tensors)."""

    def __init__(self):
        self.version = 0

    def latest(self) -> int:
        return self.version

    def pull(self, version: int | None = None) -> tuple[int, None]:
        return (self.version if version is None else version), None


def simulate(scenario: Scenario, strategy: Coordination, *, eta: int, seed: int = 0,
             max_wall_s: float = 600.0) -> dict[str, Any]:
    """Runs `scenario.steps` train steps under `strategy` at staleness bound `eta`; returns the figures."""
    sc = scenario
    workload = Workload(sc.lengths, prompt_tokens=sc.prompt_tokens)
    fleet = SimFleet(list(sc.instances), workload)
    clock = lambda: fleet.now
    source = PromptSource(workload.records(max(4096, 8 * sc.batch_groups)), seed=seed, num_epochs=None)
    service = TrajectoryService(source, batch_groups=sc.batch_groups, group_size=sc.group_size, eta=eta,
                                reserve_groups=strategy.reserve_groups(sc.batch_groups), clock=clock)
    params = _Params()
    coordinator = Coordinator("sim", fleet.engines, service, params, strategy=strategy, eta=eta,
                              sampling=SamplingParams(max_tokens=sc.max_tokens),
                              reward_fn=lambda task, samples: [float(i % 2) for i in range(len(samples))],
                              clock=clock, report_progress=False)  # simulated workers never die
    block = workload.block_tokens
    version, busy_until, busy_s = 0, None, 0.0
    step_ends: list[float] = []
    step_tokens: list[float] = []
    group_staleness: collections.Counter[int] = collections.Counter()
    token_staleness: collections.Counter[int] = collections.Counter()
    wall0 = time.perf_counter()
    while len(step_ends) < sc.steps:
        coordinator.step()
        if busy_until is None and service.buffer_state() != BufferState.PENDING.value:
            batch = service.consume(version, timeout=0)
            if not batch.groups:
                raise RuntimeError(f"buffer {version} came out empty: {service.stats()['next_buffer']}")
            tokens = 0.0
            for g in batch.groups:
                group_staleness[version - g.v_start] += 1
                for s in g.samples:
                    tokens += len(s.tokens) * block
                    for v, blocks in collections.Counter(s.versions).items():
                        token_staleness[version - v] += blocks * block
            step_tokens.append(tokens)
            duration = sc.trainer.step_time(tokens)
            busy_until, busy_s = fleet.now + duration, busy_s + duration
        target = fleet.now + sc.tick_s
        if busy_until is not None:
            target = min(target, busy_until)
        fleet.advance(target)
        if busy_until is not None and fleet.now >= busy_until - 1e-9:
            version += 1
            service.mark_published(version)
            params.version = version
            busy_until = None
            step_ends.append(fleet.now)
        if time.perf_counter() - wall0 > max_wall_s:
            raise TimeoutError(f"{sc.name}: simulation ran past {max_wall_s}s of wall time at step "
                               f"{len(step_ends)} of {sc.steps}")
    w = min(max(sc.warmup_steps, eta + 1), sc.steps - 1)
    span = step_ends[-1] - (step_ends[w - 1] if w > 0 else 0.0)
    steady_tokens = sum(step_tokens[w:])
    total = fleet.now
    stats = fleet.stats()
    n = len(fleet.engines)
    counts = service.stats()["counts"]
    return {
        "scenario": sc.name, "instances": n, "eta": eta, "steps": sc.steps,
        "tokens_per_s": steady_tokens / span,
        "step_s_mean": span / (sc.steps - w),
        "step_ends_s": [round(x, 2) for x in step_ends], "step_tokens": step_tokens,
        "virtual_s": total,
        "trainer_idle_frac": 1.0 - busy_s / total,
        "rollout_idle_frac": stats["total"]["idle_s"] / (n * total),
        "rollout_stall_frac": stats["total"]["stall_s"] / (n * total),
        "group_staleness": dict(sorted(group_staleness.items())),
        "token_staleness": dict(sorted(token_staleness.items())),
        "max_staleness": max(group_staleness),
        "groups_surplus": counts["surplus"], "groups_consumed": counts["consumed"],
        "coordinator": {k: v for k, v in coordinator.stats().items() if k != "instances"},
        "wall_s": time.perf_counter() - wall0,
    }
