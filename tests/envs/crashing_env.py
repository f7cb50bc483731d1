"""An environment whose tool kills its own process on a chosen question (for the isolation tests)."""

import asyncio
import os

from jaxflow.envs.base import Step


class CrashOn:
    def __init__(self, crash_q=-1, latency_s=0.0):
        self.crash_q, self.latency_s = crash_q, latency_s

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        if self.meta["q"] == self.crash_q:
            os._exit(3)  # the whole process, as a segfault or the OOM killer would
        await asyncio.sleep(self.latency_s)
        return Step(reward=1.0, done=True, info={"pid": os.getpid()})

    async def close(self):
        pass
