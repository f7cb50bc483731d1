"""An episode's environment on a thread of its own, so that an environment that blocks its thread (a
`time.sleep`, a blocking socket or a long computation inside `async def step`) holds up its own episode
only, and its call's time limit still fires.

    env = ThreadedEnv(lambda: factory(**options), name="e17")   # jaxflow's protocol; built at reset
    await asyncio.wait_for(env.step("..."), 30)                  # the caller's loop never waits on the thread

Each `ThreadedEnv` runs an event loop on a daemon thread; the environment is built there (its factory
too may block) and every call of the episode (reset, step, close) runs there as a task, so an environment
that keeps loop-bound state between calls (a client session, a lock) keeps working. The caller awaits a
future that the thread completes: a time limit on the caller's side fires whatever the thread does, and
cancelling the wait cancels the call on the thread as soon as the thread runs again.

Python cannot stop a thread: a call that never returns keeps its thread until it does. The episode has
failed long before (its time limit), `close` stops the loop once the thread is free, and `running`
counts the threads not yet finished. Run environments that may hang for good with `rollout.env.isolate`,
whose process is killed instead.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ThreadedEnv"]

_names = itertools.count()


class ThreadedEnv:
    """jaxflow's environment protocol (`jaxflow.envs.base`) over the environment `make()` builds, which
    lives and is called on a thread and event loop of its own (see the module docstring). name: the
    thread's name suffix (the episode's id)."""

    _lock = threading.Lock()
    _running = 0

    def __init__(self, make: Callable[[], Any], name: str | None = None):
        self._make = make
        self.env: Any = None
        self._loop = asyncio.new_event_loop()
        self._closed = False
        thread = threading.Thread(target=self._serve, name=f"env-{name if name is not None else next(_names)}",
                                  daemon=True)
        with ThreadedEnv._lock:
            ThreadedEnv._running += 1
        thread.start()

    @classmethod
    def running(cls) -> int:
        """Environment threads started and not yet finished, in this process (a blocked one stays counted
        until its call returns)."""
        with cls._lock:
            return cls._running

    def _serve(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            # What is left once stopped (a call cancelled while its environment blocked): cancelled, then let
            # it unwind; the executor of any `asyncio.to_thread` in the environment is not waited for.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=1.0))
        finally:
            loop.close()
            with ThreadedEnv._lock:
                ThreadedEnv._running -= 1

    async def _on_thread(self, method: str, *args: Any) -> Any:
        if self.env is None:
            if method == "close":  # never built (or its reset still blocked in the factory): nothing to close
                return None
            if method != "reset":
                raise RuntimeError(f"{method} before reset")
            self.env = self._make()
        return await getattr(self.env, method)(*args)

    async def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError(f"{method} after close")
        future = asyncio.run_coroutine_threadsafe(self._on_thread(method, *args), self._loop)
        # The caller's cancellation (its time limit, an abort) cancels the call on the thread.
        return await asyncio.wrap_future(future)

    async def reset(self, meta: dict) -> Any:
        return await self._call("reset", meta)

    async def step(self, action: str) -> Any:
        return await self._call("step", action)

    async def close(self) -> None:
        """Closes the environment (if it was built) on its thread, then stops the thread's loop: at once if
        the thread is free, else when the call holding it returns."""
        if self._closed:
            return
        try:
            await self._call("close")
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
