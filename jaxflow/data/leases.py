"""Leases on dispatched groups: a group stays with its worker only while the worker keeps renewing it.

The trajectory service grants a lease at dispatch and extends it on `renew`; `expired(now, running)`
yields the groups whose lease ran out. One heap entry per leased group, renewals only move the deadline
(the entry is pushed again when it surfaces early), so both are O(log n) whatever the renewal rate.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Iterator

_LAPSED_KEPT = 10_000  # groups whose lease expired, and the worker that let it lapse (to tell it so)


class Leases:
    def __init__(self, lease_s: float | None):
        self.lease_s = lease_s
        self._deadline: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []
        self._queued: set[int] = set()
        self._lapsed: collections.OrderedDict[int, set[str]] = collections.OrderedDict()

    def grant(self, group_id: int, now: float) -> None:
        """Starts or extends the lease of a group to `now + lease_s` (nothing when leases are off)."""
        if self.lease_s is None:
            return
        self._deadline[group_id] = deadline = now + self.lease_s
        if group_id not in self._queued:
            heapq.heappush(self._heap, (deadline, group_id))
            self._queued.add(group_id)

    def expired(self, now: float, holder: Callable[[int], str | None]) -> Iterator[int]:
        """Groups whose lease ran out by `now` and that `holder(group_id)` says a worker still holds
        (None: no longer running, the lease is forgotten). Each is remembered as lapsed by that worker."""
        while self._heap and self._heap[0][0] <= now:
            _, gid = heapq.heappop(self._heap)
            self._queued.discard(gid)
            worker = holder(gid)
            deadline = self._deadline.get(gid, -math.inf)
            if worker is not None and deadline > now:
                heapq.heappush(self._heap, (deadline, gid))
                self._queued.add(gid)
                continue
            self._deadline.pop(gid, None)
            if worker is not None:
                self._lapsed.setdefault(gid, set()).add(worker)
                self._lapsed.move_to_end(gid)
                if len(self._lapsed) > _LAPSED_KEPT:
                    self._lapsed.popitem(last=False)
                yield gid

    def lapsed(self, group_id: int, worker: str) -> bool:
        """Whether a lease of `worker` on `group_id` expired (remembered for the last groups that lapsed)."""
        return worker in self._lapsed.get(group_id, ())

    def clear(self) -> None:
        self._deadline.clear()
        self._heap.clear()
        self._queued.clear()
        self._lapsed.clear()
