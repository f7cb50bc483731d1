"""Weight sync policy: which instances take the newest published weights now.

"all" (AReaL-style): every instance behind the newest version syncs at once, paying the sync (and, in
"keep" mode, the KV recompute of everything in flight) on every version.
"selective": an instance syncs only when it must (its weights are too old to be given work), when it
is (nearly) idle (at most `idle_below` requests running; -1 never counts as idle), or when it lags the
newest version by `max_lag` or more, so syncs spread out and land where they cost least. Over one
engine, "all" syncs on every version, idle_below=-1 on a lag of max_lag only, and a large max_lag only
when idle.
"""

from __future__ import annotations


def should_sync(policy: str, *, version: int, latest: int, running: int, must: bool, idle_below: int,
                max_lag: int) -> bool:
    if latest <= version:
        return False
    if must or policy == "all":
        return True
    return running <= idle_below or latest - version >= max_lag
