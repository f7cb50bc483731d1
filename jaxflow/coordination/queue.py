"""The queue of requests waiting for an instance, in arrival order ("fifo") or oldest v_start first.

A request may only run on an instance whose weights are at least its group's v_start, so `pop` takes
the first request in order that the instance can run.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from jaxflow.data.records import Sample


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
        self._heap: list[list] = []  # [key, seq, request, live]
        self._by_group: dict[int, list[list]] = {}
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, request: PendingRequest, front: bool = False) -> None:
        """Queues `request`; `front` puts it ahead of everything of its rank (work already started)."""
        seq = next(self._seq)
        rank = -seq if front else seq
        key = (request.v_start, rank) if self.order == "oldest_first" else (rank,)
        entry = [key, seq, request, True]
        heapq.heappush(self._heap, entry)
        self._by_group.setdefault(request.group_id, []).append(entry)
        self._live += 1

    def _forget(self, entry: list) -> None:
        entry[3] = False
        self._live -= 1
        group = self._by_group[entry[2].group_id]
        group.remove(entry)
        if not group:
            del self._by_group[entry[2].group_id]

    def pop(self, max_version: int) -> PendingRequest | None:
        """The first request in order with v_start <= max_version, or None."""
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not entry[3]:
                continue  # taken with its group
            if entry[2].v_start <= max_version:
                found = entry
                break
            skipped.append(entry)
            if self.order == "oldest_first":  # every later one is newer still
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if found is None:
            return None
        self._forget(found)
        return found[2]

    def group(self, group_id: int) -> list[PendingRequest]:
        """Every queued request of a group, left in the queue."""
        return [e[2] for e in self._by_group.get(group_id, ())]

    def take_group(self, group_id: int) -> list[PendingRequest]:
        """Removes and returns every queued request of a group."""
        entries = list(self._by_group.get(group_id, ()))
        for entry in entries:
            self._forget(entry)
        return [e[2] for e in entries]
