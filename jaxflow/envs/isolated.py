"""Environments in a process of their own: a tool that crashes its process (a segfault, `os._exit`, the
out-of-memory killer) or hangs it fails the episodes it was answering, not the run.

    make_env = isolated("jaxflow.envs.calculator:CalculatorEnv", {"latency_s": 0.2})
    env = make_env(meta)          # jaxflow's protocol; its calls run in the shared environment process

One child process (spawned, so it shares nothing with the engine's threads) hosts the environments of
every episode. It runs an asyncio loop, so tool waits overlap there as they do in-process: each call is
a message (call id, episode, method, arguments) whose answer comes back by call id. When the process
dies, every call waiting on it raises `EnvironmentProcessDied` (the episode engine counts it as an
environment error and fails those episodes only) and the next episode starts a new process.

A process that hangs (a tool that blocks the child's event loop, a deadlock) is found after a call on it
is cancelled (its episode timed out or was aborted): the child is told to cancel the call and must answer
a ping from its event loop within `PING_TIMEOUT_S` seconds (counted from when its loop started, for a
process still importing its environment); if it does not, it is killed, so it dies as above and is
replaced. An episode that starts meanwhile waits for that verdict before it resets; a call that is merely
slow (its loop still answers) keeps the process. The child ends with its parent, however the parent ends
(`_exit_with_parent`). The environment's options and answers cross the process boundary by pickle, over a
pipe this process created for its own child (nothing from the network).

Agent functions run there too (`rollout.env.isolate` with kind "agent"): each episode is an `AgentEpisode`
whose `reset` runs the agent on the child's event loop and returns its reward. The agent's own work (its
HTTP client, its tools) then runs outside the interpreter of the engine and trainer, so it neither takes
their interpreter lock nor crashes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import os
import threading
import time
from typing import Any

from jaxflow import refs

__all__ = ["AgentEpisode", "EnvironmentProcessDied", "PING_TIMEOUT_S", "isolated"]

PING_TIMEOUT_S = 5.0
# How often the child checks that its parent is still alive (`_exit_with_parent`).
PARENT_CHECK_S = 1.0
"""Seconds the environment process's event loop has to answer a ping after a call was cancelled, before
the process counts as hung and is killed (a loop that is free answers in milliseconds)."""

START_TIMEOUT_S = 300.0
"""Seconds a new environment process may take to import the environment's module and start its loop
before a ping's time counts (a process that never gets there counts as hung)."""

# Messages to the child that are not environment calls: (call id, None, _PING, ()) is answered from the
# child's event loop; (call id, None, _CANCEL, (id of the call to cancel,)) is not answered. The child's
# first message, (_READY, True, None), says its loop runs.
_PING, _CANCEL, _READY = "__ping__", "__cancel__", -1


class EnvironmentProcessDied(RuntimeError):
    """The environment process exited while a call was waiting on it."""


def _serve(conn, ref: str, options: dict) -> None:
    """The child: environments by episode, each call run as a task on one event loop."""
    factory = refs.resolve(ref, what="environment reference")
    envs: dict[int, Any] = {}
    tasks: dict[int, asyncio.Task] = {}
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
        finally:
            tasks.pop(call_id, None)
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
            loop.call_soon_threadsafe(dispatch, message)

    def dispatch(message: tuple) -> None:  # on the loop
        call_id, _, method, args = message
        if method == _PING:
            with send_lock:
                conn.send((call_id, True, None))
        elif method == _CANCEL:
            task = tasks.get(args[0])
            if task is not None:
                task.cancel()
        else:
            tasks[call_id] = loop.create_task(run(*message))

    def ready() -> None:
        with send_lock:
            conn.send((_READY, True, None))

    threading.Thread(target=reader, daemon=True).start()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    loop.call_soon(ready)
    loop.run_forever()


def _exit_with_parent(parent: int) -> None:
    """Ends the child once its parent is gone. The pipe's end of file says so when the parent exits, but a
    parent killed outright (SIGKILL, an unhandled SIGTERM) may have forked other processes that still hold its
    end of the pipe; the child is then reparented, which this thread sees within `PARENT_CHECK_S` even while a
    tool blocks the event loop."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(0)  # nobody is left to answer; pending calls and environments go with the process


class _Process:
    """The parent's side of one environment process: calls by id, answers delivered to their futures."""

    def __init__(self, ref: str, options: dict, ping_timeout_s: float):
        self.ping_timeout_s = ping_timeout_s
        self.hung = False
        self.ready = threading.Event()  # the child's loop runs
        self.verdict: concurrent.futures.Future | None = None  # of the liveness check in progress, if any
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, ref, options), name="jaxflow-envs", daemon=True)
        self.process.start()
        child.close()
        self.ids = itertools.count()
        # A call's (loop, future); a ping's (None, threading.Event).
        self.pending: dict[int, tuple[Any, Any]] = {}
        self.lock = threading.Lock()
        self.dead = False
        threading.Thread(target=self._read, name="jaxflow-envs-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            if call_id == _READY:
                self.ready.set()
                continue
            with self.lock:
                waiting = self.pending.pop(call_id, None)
            if waiting is not None:
                loop, future = waiting
                if loop is None:
                    future.set()  # a ping answered
                else:
                    loop.call_soon_threadsafe(_resolve, future, ok, value)
        with self.lock:
            self.dead = True
            waiting, self.pending = list(self.pending.values()), {}
        self.process.join(timeout=1)
        why = EnvironmentProcessDied(self._why())
        self.ready.set()  # a liveness check in progress ends now: the process is dead either way
        for loop, future in waiting:
            if loop is None:
                future.set()
            else:
                loop.call_soon_threadsafe(_fail, future, why)

    def _why(self) -> str:
        if self.hung:
            return (f"the environment process hung (its event loop did not answer within {self.ping_timeout_s} s "
                    f"after a call was cancelled) and was killed")
        return f"the environment process exited (code {self.process.exitcode})"

    def _send(self, message: tuple) -> None:
        """Sends to the child (caller holds the lock); a child already gone is the reader's to report."""
        try:
            self.conn.send(message)
        except (OSError, ValueError):
            pass

    def check(self) -> concurrent.futures.Future:
        """Starts a liveness check unless one is in progress; its future is done (True: the process was
        killed as hung) once the verdict is in."""
        with self.lock:
            if self.verdict is not None and not self.verdict.done():
                return self.verdict
            verdict = self.verdict = concurrent.futures.Future()
            if self.dead:
                verdict.set_result(False)
                return verdict
            ping_id, answered = next(self.ids), threading.Event()
            self.pending[ping_id] = (None, answered)
            self._send((ping_id, None, _PING, ()))

        def wait() -> None:
            killed = False
            # A process still starting (importing the environment's module) answers once its loop runs.
            if not (self.ready.wait(START_TIMEOUT_S) and answered.wait(self.ping_timeout_s)):
                with self.lock:
                    if not self.dead:
                        self.hung = self.dead = killed = True
                if killed:
                    self.process.kill()  # the reader sees the pipe close and fails the calls waiting
                    self.process.join(timeout=5)
            with self.lock:
                self.pending.pop(ping_id, None)
            verdict.set_result(killed)

        threading.Thread(target=wait, name="jaxflow-envs-ping", daemon=True).start()
        return verdict

    async def call(self, episode: int, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            if self.dead:
                raise EnvironmentProcessDied(self._why())
            call_id = next(self.ids)
            try:
                self.conn.send((call_id, episode, method, args))
            except (OSError, ValueError):  # the child is gone and the reader has not seen its pipe close yet
                raise EnvironmentProcessDied(self._why()) from None
            self.pending[call_id] = (loop, future)
        try:
            return await future
        except asyncio.CancelledError:  # timed out or aborted: stop it there, and see that the process lives
            with self.lock:
                self.pending.pop(call_id, None)
                if not self.dead:
                    self._send((next(self.ids), None, _CANCEL, (call_id,)))
            self.check()
            raise


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
        process = self.owner.process()
        if process.verdict is not None and not process.verdict.done():  # maybe hung: wait to know
            await asyncio.wrap_future(process.verdict)
            process = self.owner.process()
        self.process = process
        return await self.process.call(self.episode, "reset", meta)

    async def step(self, action: str) -> Any:
        return await self.process.call(self.episode, "step", action)

    async def close(self) -> None:
        if self.process is not None and not self.process.dead:
            try:
                await self.process.call(self.episode, "close")
            except EnvironmentProcessDied:  # its environment went with the process: nothing left to close
                pass


class _Isolated:
    # Its environments' calls only wait on the child process: the episode engine calls them from its loop.
    off_loop = True

    def __init__(self, ref: str, options: dict):
        refs.resolve(ref, what="environment reference")  # a bad reference fails here, not in the child
        self.ref, self.options = ref, dict(options)
        self.episodes = itertools.count()
        self.restarts = 0
        self.hung = 0
        self._process: _Process | None = None
        self._lock = threading.Lock()

    def process(self) -> _Process:
        """The live environment process, started (again) when there is none."""
        with self._lock:
            if self._process is None or self._process.dead:
                if self._process is not None:
                    self.restarts += 1
                    self.hung += self._process.hung
                self._process = _Process(self.ref, self.options, PING_TIMEOUT_S)
            return self._process

    def __call__(self, meta: dict) -> _IsolatedEnv:
        return _IsolatedEnv(self, next(self.episodes))


class AgentEpisode:
    """One agent episode in the environment process: `reset(call)` awaits the agent function `ref`
    (`async def agent(base_url, task, episode, *, api_key, **options)`) with `options` and the call's
    {"base_url", "task", "episode", "api_key"}, and returns what it returns (the parent checks the reward)."""

    def __init__(self, ref: str, options: dict):
        self.fn = refs.resolve(ref, what="agent reference", expect="function")
        self.options = options

    async def reset(self, call: dict) -> Any:
        return await self.fn(call["base_url"], call["task"], call["episode"], api_key=call["api_key"],
                             **self.options)

    async def close(self) -> None:
        return None


def isolated(ref: str, options: dict | None = None) -> _Isolated:
    """make_env(meta) -> environments made by "module:factory" `ref` with `options`, in a shared child
    process (see the module docstring); `restarts` counts the processes replaced after dying, `hung` those
    of them killed as hung."""
    return _Isolated(ref, options or {})
