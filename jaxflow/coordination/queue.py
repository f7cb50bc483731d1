"""The queue of requests waiting for an instance, in arrival order ("fifo") or oldest v_start first.

A request may only run on an instance whose weights are at least its group's v_start, so `pop` takes
the first request in order that the instance can run.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from jaxflow.rollout_types import Sample


@dataclasses.dataclass
class PendingRequest:
    """One sample of a group, not on any instance: new, or stopped (migration, sync, retry) with its
    tokens so far in `prefix`."""

    group_id: int
    sample: int
    v_start: int
    prefix: Sample | None = None


class RequestQueue:
    def __init__(self, order: str = "fifo"):
        if order not in ("fifo", "oldest_first"):
            raise ValueError(f"unknown queue order {order!r}; valid: fifo, oldest_first")
        self.order = order
        self._heap: list[tuple[tuple[int, ...], PendingRequest]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, request: PendingRequest, front: bool = False) -> None:
        """Queues `request`; `front` puts it ahead of everything of its rank (work already started)."""
        seq = -next(self._seq) if front else next(self._seq)
        key = (request.v_start, seq) if self.order == "oldest_first" else (seq,)
        heapq.heappush(self._heap, (key, request))

    def pop(self, max_version: int) -> PendingRequest | None:
        """The first request in order with v_start <= max_version, or None."""
        skipped, found = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            if item[1].v_start <= max_version:
                found = item[1]
                break
            skipped.append(item)
            if self.order == "oldest_first":  # every later one is newer still
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def take_group(self, group_id: int) -> list[PendingRequest]:
        """Removes and returns every queued request of a group."""
        taken = [item[1] for item in self._heap if item[1].group_id == group_id]
        if taken:
            self._heap = [item for item in self._heap if item[1].group_id != group_id]
            heapq.heapify(self._heap)
        return taken
