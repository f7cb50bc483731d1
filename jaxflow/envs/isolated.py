"""Environments in a process of their own: a tool that crashes its process (a segfault, `os._exit`, the
out-of-memory killer) fails the episodes it was answering, not the run.

    make_env = isolated("jaxflow.envs.calculator:CalculatorEnv", {"latency_s": 0.2})
    env = make_env(meta)          # jaxflow's protocol; its calls run in the shared environment process

One child process (spawned, so it shares nothing with the engine's threads) hosts the environments of
every episode. It runs an asyncio loop, so tool waits overlap there as they do in-process: each call is
a message (call id, episode, method, arguments) whose answer comes back by call id. When the process
dies, every call waiting on it raises `EnvironmentProcessDied` (the episode engine counts it as an
environment error and fails those episodes only) and the next episode starts a new process. The
environment's options and answers cross the process boundary by pickle, over a pipe this process created
for its own child (nothing from the network).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from typing import Any

from jaxflow import refs

__all__ = ["EnvironmentProcessDied", "isolated"]


class EnvironmentProcessDied(RuntimeError):
    """The environment process exited while a call was waiting on it."""


def _serve(conn, ref: str, options: dict) -> None:
    """The child: environments by episode, each call run as a task on one event loop."""
    factory = refs.resolve(ref, what="environment reference")
    envs: dict[int, Any] = {}
    loop = asyncio.new_event_loop()
    send_lock = threading.Lock()

    async def run(call_id: int, episode: int, method: str, args: tuple) -> None:
        try:
            if method == "reset":
                envs[episode] = factory(**options)
            env = envs[episode]
            answer = await getattr(env, method)(*args)
            if method == "close":
                envs.pop(episode, None)
            reply = (call_id, True, answer)
        except BaseException as e:  # noqa: BLE001 - reported to the caller, whose episode then fails
            reply = (call_id, False, f"{type(e).__name__}: {e}")
        with send_lock:
            try:
                conn.send(reply)
            except Exception as e:  # noqa: BLE001 - e.g. an answer that does not pickle
                conn.send((call_id, False, f"{method}'s answer could not be sent back: {type(e).__name__}: {e}"))

    def reader() -> None:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                loop.call_soon_threadsafe(loop.stop)
                return
            loop.call_soon_threadsafe(lambda m=message: loop.create_task(run(*m)))

    threading.Thread(target=reader, daemon=True).start()
    loop.run_forever()


class _Process:
    """The parent's side of one environment process: calls by id, answers delivered to their futures."""

    def __init__(self, ref: str, options: dict):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, ref, options), name="jaxflow-envs", daemon=True)
        self.process.start()
        child.close()
        self.ids = itertools.count()
        self.pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.lock = threading.Lock()
        self.dead = False
        threading.Thread(target=self._read, name="jaxflow-envs-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                waiting = self.pending.pop(call_id, None)
            if waiting is not None:
                loop, future = waiting
                loop.call_soon_threadsafe(_resolve, future, ok, value)
        with self.lock:
            self.dead = True
            waiting, self.pending = list(self.pending.values()), {}
        self.process.join(timeout=1)
        why = EnvironmentProcessDied(f"the environment process exited (code {self.process.exitcode})")
        for loop, future in waiting:
            loop.call_soon_threadsafe(_fail, future, why)

    async def call(self, episode: int, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if self.dead:
                raise EnvironmentProcessDied(f"the environment process exited (code {self.process.exitcode})")
            call_id = next(self.ids)
            self.pending[call_id] = (loop, future)
            self.conn.send((call_id, episode, method, args))
        return await future


def _resolve(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(RuntimeError(value))


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class _IsolatedEnv:
    """One episode's environment in the shared process (jaxflow's protocol)."""

    def __init__(self, owner: _Isolated, episode: int):
        self.owner, self.episode, self.process = owner, episode, None

    async def reset(self, meta: dict) -> Any:
        self.process = self.owner.process()
        return await self.process.call(self.episode, "reset", meta)

    async def step(self, action: str) -> Any:
        return await self.process.call(self.episode, "step", action)

    async def close(self) -> None:
        if self.process is not None and not self.process.dead:
            await self.process.call(self.episode, "close")


class _Isolated:
    def __init__(self, ref: str, options: dict):
        refs.resolve(ref, what="environment reference")  # a bad reference fails here, not in the child
        self.ref, self.options = ref, dict(options)
        self.episodes = itertools.count()
        self.restarts = 0
        self._process: _Process | None = None
        self._lock = threading.Lock()

    def process(self) -> _Process:
        """The live environment process, started (again) when there is none."""
        with self._lock:
            if self._process is None or self._process.dead:
                if self._process is not None:
                    self.restarts += 1
                self._process = _Process(self.ref, self.options)
            return self._process

    def __call__(self, meta: dict) -> _IsolatedEnv:
        return _IsolatedEnv(self, next(self.episodes))


def isolated(ref: str, options: dict | None = None) -> _Isolated:
    """make_env(meta) -> environments made by "module:factory" `ref` with `options`, in a shared child
    process (see the module docstring); `restarts` counts the processes replaced after dying."""
    return _Isolated(ref, options or {})
