"""An environment whose tool kills its own process on a chosen question (for the isolation tests)."""

import asyncio
import os

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
