"""Killing a reward worker with everything its reward functions started.

What a reward function starts dies with its worker (on a timeout, a crash, or the pool's `close()`): each
worker leads its own process group, which is killed; its descendants (found with psutil while it lives, a
`setsid` child included) are killed; and every process whose environment carries the worker's marker
(`MARKER_ENV`, set in the worker before any call, inherited by whatever it executes) is killed, which also
finds a `setsid` daemon whose parent has exited. Without cgroups one escape remains: a process that leaves
the worker's tree (its parent exits) after a fork with no exec, or execs with the marker removed from its
environment, is not found.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal

import psutil

__all__ = ["MARKER_ENV", "kill"]

# The environment variable marking every process a reward worker starts (value: that worker's marker).
MARKER_ENV = "JAXFLOW_REWARD_WORKER"


def kill(process: multiprocessing.process.BaseProcess, marker: str = "") -> None:
    """SIGKILLs a worker with its process group, its descendants and every process carrying its marker (what
    its reward functions started, in sessions of their own or not), then reaps it."""
    descendants = []
    if process.is_alive():
        with contextlib.suppress(psutil.Error):  # listed before the worker dies, while they are its tree
            descendants = psutil.Process(process.pid).children(recursive=True)
    if process.is_alive():
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:  # not yet its own group leader (killed during start-up), or already gone
            process.kill()
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    if marker:
        _kill_marked(marker)
    process.join()


def _kill_marked(marker: str) -> None:
    """SIGKILLs every other process whose environment holds MARKER_ENV=marker, until a scan finds none (a marked
    process may fork while scanned). Not process_iter: its cache may hold an earlier process at a reused pid."""
    for _ in range(5):
        found = False
        for pid in psutil.pids():
            if pid == os.getpid():
                continue
            with contextlib.suppress(psutil.Error, OSError):
                proc = psutil.Process(pid)
                if proc.environ().get(MARKER_ENV) == marker:
                    found = True  # scan again even if this kill fails: nothing marked may outlive the scans
                    proc.kill()
        if not found:
            return
