"""The check every blocking service call makes of its `timeout` before it waits.

A timeout reaches the services from other processes, so it can be anything msgpack carries. NaN makes
every deadline comparison false, so a wait loop never ends and a server thread spins for ever, even after
its client has gone; infinity overflows the lock's wait; a negative number, a bool or a string is a
caller's mistake that would otherwise surface as a misleading TimeoutError or a raw TypeError. None (wait
without limit) and finite numbers >= 0 pass.
"""

from __future__ import annotations

import math
from numbers import Real

__all__ = ["check_timeout"]


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    """Returns `timeout` as a float (or None); raises TypeError or ValueError naming `what` and the value
    unless it is None or a finite real number >= 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise TypeError(f"{what} must be a number of seconds or None, got {type(timeout).__name__} "
                        f"{timeout!r}")
    seconds = float(timeout)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0 or None (no limit), "
                         f"got {timeout!r}")
    return seconds
