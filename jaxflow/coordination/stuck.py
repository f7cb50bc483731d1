"""Stuck buffers: the trainer waits on a buffer that misses only a few groups, the slow tail.

`stragglers` decides which groups hold the buffer back long enough to act on: the buffer misses at
most `threshold` groups, and the groups that can only land there (v_start + eta = the buffer) have all
run for more than `patience_s`. The coordinator then applies its action: "retry" (restart their
unfinished requests on the least loaded instances) or "release" (hand the buffer to the trainer with
what it holds; the stragglers become surplus).
"""

from __future__ import annotations


def stragglers(*, missing: int, ages: dict[int, float], threshold: int, patience_s: float) -> list[int]:
    """Group ids to act on ([] when the buffer is not stuck on a short, slow tail).

    missing: groups the buffer still needs; ages: {group id: seconds running} of the groups that can
    only land in it."""
    if missing <= 0 or missing > threshold or not ages or min(ages.values()) < patience_s:
        return []
    return sorted(ages)
