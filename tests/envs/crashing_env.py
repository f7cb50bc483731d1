"""Environments whose tool kills or hangs its own process on a chosen question (for the isolation tests)."""

import asyncio
import os
import time

from jaxflow.envs.base import Step


class CrashOn:
    """Kills its process on question crash_q; a step on a question in slow_qs (default: all) first waits
    latency_s."""

    def __init__(self, crash_q=-1, latency_s=0.0, slow_qs=None):
        self.crash_q, self.latency_s = crash_q, latency_s
        self.slow_qs = None if slow_qs is None else set(slow_qs)

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        if self.meta["q"] == self.crash_q:
            os._exit(3)  # the whole process, as a segfault or the OOM killer would
        if self.slow_qs is None or self.meta["q"] in self.slow_qs:
            await asyncio.sleep(self.latency_s)
        return Step(reward=1.0, done=True, info={"pid": os.getpid()})

    async def close(self):
        pass


class HangOn:
    """Blocks its process's event loop for good (a tool stuck in a blocking call) on question hang_q; a step
    on a question in slow_qs waits latency_s without blocking (slow, not hung)."""

    def __init__(self, hang_q=-1, latency_s=0.0, slow_qs=()):
        self.hang_q, self.latency_s, self.slow_qs = hang_q, latency_s, set(slow_qs)

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        if self.meta["q"] == self.hang_q:
            time.sleep(3600)
        if self.meta["q"] in self.slow_qs:
            await asyncio.sleep(self.latency_s)
        return Step(reward=1.0, done=True, info={"pid": os.getpid()})

    async def close(self):
        pass
