"""What this machine can hold: its physical memory, from which the default memory limits are derived.

Limits sized for a big server (64 GiB of pending parameter bytes, say) do not protect a 24 GiB machine:
they allow more than it holds. So the limits that guard against a runaway or hostile allocation default to
a share of this machine's RAM (`ParameterService`'s `max_pending_bytes`, `RewardPool`'s worker memory), and
each stays overridable where it is set.
"""

from __future__ import annotations

import os

__all__ = ["FALLBACK_MEMORY_BYTES", "physical_memory_bytes"]

# What the limits assume when the machine will not say how much RAM it has.
FALLBACK_MEMORY_BYTES = 16 << 30


def physical_memory_bytes() -> int:
    """This machine's physical memory in bytes: sysconf's page size times pages (Linux, macOS), else psutil's
    total, else `FALLBACK_MEMORY_BYTES`. Not a container's cgroup limit: the RAM of the host."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            return int(total)
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or the name unknown here
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - any failure to ask means: assume the fallback
        return FALLBACK_MEMORY_BYTES
