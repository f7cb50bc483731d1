"""Migration: when one instance carries far more load than the fleet's mean, move requests from it to
the least loaded instances (abort there, resubmit with the tokens so far), until it is back within
`stop` x the mean. Load is requests x the instance's observed slowness.

`plan` is a pure function of the loads, so its effect can be tested on its own.
"""

from __future__ import annotations


def plan(loads: list[float], unit: list[float], *, trigger: float, stop: float, min_requests: int,
         room: list[int], versions: list[int], max_moves: int) -> list[tuple[int, int]]:
    """Moves as (from, to) instance indices, one request each, at most `max_moves`.

    loads: per-instance load; unit: the load one request adds on that instance (its slowness);
    room: requests each instance may still take; versions: each instance's weights version (a request
    only moves to an instance at least as new as the one it is on). Starts only when the most loaded
    instance is at >= trigger x the mean and holds >= min_requests requests; stops once it is <= stop x
    the mean, or when a move would no longer lower the maximum.
    """
    loads, room = list(loads), list(room)
    n = len(loads)
    mean = sum(loads) / n if n else 0.0
    src = max(range(n), key=lambda i: loads[i], default=None)
    if src is None or mean <= 0 or loads[src] < trigger * mean or loads[src] / unit[src] < min_requests:
        return []
    moves = []
    while len(moves) < max_moves:
        src = max(range(n), key=lambda i: loads[i])
        if loads[src] <= stop * mean or loads[src] / unit[src] < 1:
            break
        targets = [i for i in range(n) if i != src and room[i] > 0 and versions[i] >= versions[src]]
        if not targets:
            break
        dst = min(targets, key=lambda i: loads[i] + unit[i])
        if loads[dst] + unit[dst] >= loads[src]:  # would not lower the maximum
            break
        moves.append((src, dst))
        loads[src] -= unit[src]
        loads[dst] += unit[dst]
        room[dst] -= 1
    return moves
