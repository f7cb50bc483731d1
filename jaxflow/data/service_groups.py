"""What the trajectory service keeps per group: its state, its record, the task a worker gets for it, and
the census of groups by state that `stats` and timeout messages report.

`jaxflow.data.trajectory_service` owns the transitions; this module only holds the records, so the
service reads as its protocol (Reserve -> Occupy -> Consume) and `service_snapshot` can name the fields.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from jaxflow.data.records import GroupTask, RouteSpec, Sample


class GroupState(str, enum.Enum):  # noqa: UP042 - not StrEnum: str() of a state keeps its class name
    REQUEUED = "requeued"  # holds a reservation, waiting for a worker (after an abort or a restore)
    RUNNING = "running"  # dispatched to a worker
    FINISHED = "finished"  # all samples done, waiting for rewards
    OCCUPIED = "occupied"  # rewarded, sitting in a buffer
    CONSUMED = "consumed"
    FAILED = "failed"
    SURPLUS = "surplus"  # redundant: every buffer it could occupy filled first (or was released)


class BufferState(str, enum.Enum):  # noqa: UP042 - as GroupState
    PENDING = "pending"  # may still receive groups
    READY = "ready"  # full
    READY_WITH_CAPACITY = "ready_with_capacity"  # not full, but the batch rule lets it be consumed
    STUCK = "stuck"  # can never fill: nothing left that could arrive


@dataclasses.dataclass
class GroupRecord:
    """One group in the service. samples: its n samples once finished; before, the tokens so far that
    it would resume from (an abort's partial samples, or its worker's latest `renew` progress), or None.
    """

    group_id: int
    prompt: list[int]
    meta: dict[str, Any]
    n: int
    v_start: int
    reserved: int  # buffer step whose slot this group holds (the latest step allowed to consume it)
    state: GroupState
    worker: str | None = None
    attempt: int = 0
    samples: list[Sample] | None = None
    rewards: list[float] | None = None
    step: int | None = None  # buffer occupied
    since: float = 0.0  # monotonic time of the last transition


FIELDS = tuple(f.name for f in dataclasses.fields(GroupRecord))


def copy_samples(samples: list[Sample]) -> list[Sample]:
    """Copies down to the lists and arrays: a worker extends what it is given while the service keeps its
    own."""
    return [Sample(list(s.tokens), list(s.logprobs), list(s.versions), s.finish_reason,
                   [list(span) for span in s.env_spans], s.reward,
                   None if s.routes is None else np.array(s.routes, copy=True), list(s.sequence_starts),
                   None if s.teacher_logprobs is None else list(s.teacher_logprobs))
            for s in samples]


def own_samples(samples: list[Sample], route_spec: RouteSpec | None) -> list[Sample]:
    """Checked samples as the service keeps them: the same Sample objects, but for those with routes, which
    are kept as a copy in the spec's dtype (never a view of a worker's array or of a received message)."""
    return [s if s.routes is None else dataclasses.replace(s, routes=np.array(s.routes, dtype=route_spec.dtype))
            for s in samples]


def group_task(g: GroupRecord) -> GroupTask:
    """The task a worker gets for `g`: its samples so far (copied) as `partial`, to resume from."""
    partial = None if g.samples is None else copy_samples(g.samples)
    return GroupTask(group_id=g.group_id, prompt=list(g.prompt), n=g.n, v_start=g.v_start,
                     meta=dict(g.meta), partial=partial, attempt=g.attempt)


def census(groups) -> dict[str, int]:
    """How many of `groups` (GroupRecords) are in each state that has any."""
    by_state: dict[str, int] = {}
    for g in groups:
        by_state[g.state.value] = by_state.get(g.state.value, 0) + 1
    return by_state
