"""`RewardPool`: scoring with reward functions in worker processes that a bad reward function cannot take down.

A reward function is named by reference, "module:function" (e.g. "jaxflow.tasks:reward"), and called as
`fn(response: str, meta: dict) -> float`. `RewardPool` runs such calls in spawned worker processes, one call
per worker at a time, so that:

- a call that raises scores `failed_value`, is counted in `stats()["raised"]`, and each distinct error message
  is logged once (or handed once to `on_failure`);
- a call still running after `timeout_s` has its worker killed (SIGKILL, with any processes it started, see
  below) and replaced; the sample scores `failed_value` and is counted in `stats()["timed_out"]`;
- a worker that dies during a call (os._exit, a segfault, the OOM killer) is replaced; the sample scores
  `failed_value` and is counted in `stats()["crashed"]`;
- a result that is not a finite real number scores `failed_value` and is counted in `stats()["invalid"]`.
- a call that maps more memory than its worker's limit (`memory_limit_mb`; by default the workers share
  half of the machine's physical memory) raises MemoryError in the worker and counts as raised, rather than
  pushing the machine into swap or the OOM killer.

Design: every worker has its own duplex pipe; one dispatcher thread in the parent owns all workers, hands a
queued job to each idle worker (one call, or a group's calls: `score_group` makes one job per worker, which
answers each call as it ends, `timeout_s` running from the previous answer, so a group costs one hand-off
instead of one per sample), and waits on the pipes, the workers' process sentinels and a wake-up pipe at
once (`multiprocessing.connection.wait`), with a timeout at the nearest deadline. ProcessPoolExecutor
cannot kill one hung call (and a dead worker breaks it). Calls and results cross the pipes as msgpack, so
the parent never unpickles anything a reward function produced, and `meta` must be msgpack-serialisable.

A new worker is given calls only once it reports ready, so spawn start-up never eats into `timeout_s`. The
first call of a function in a worker imports its module first, under its own limit `import_timeout_s`; the
worker reports when the import is done, and `timeout_s` runs from then (or list the references in `preload`
to import them at start-up).

What a reward function starts dies with its worker (on a timeout, a crash, or `close()`), its own process
group and any `setsid` daemons included: see `jaxflow.rewards.reaper`.

Spawned workers re-import the main module of the parent, as with any `multiprocessing` spawn: a script that
creates a pool must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import msgpack

from jaxflow import machine, refs
from jaxflow.rewards import reaper
from jaxflow.rewards.worker import MAX_ERROR_CHARS, WHAT, check_result, error_text, worker_main

log = logging.getLogger(__name__)

# Results are a few hundred bytes; anything longer from a worker is refused rather than buffered.
_MAX_RESULT_BYTES = 1 << 16
# Distinct error messages remembered for log-once; beyond this, new messages are still counted, and logged.
_MAX_REMEMBERED_ERRORS = 1000
# Consecutive workers that die before reporting ready after which the pool stops restarting them.
_MAX_START_FAILURES = 3

# The least address space a default worker limit allows, however many workers share the machine: the
# interpreter with msgpack and psutil maps ~30 MiB, with numpy ~170 MiB, with torch ~660 MiB.
MIN_DEFAULT_MEMORY_MB = 2048

STAT_KEYS = ("submitted", "scored", "raised", "timed_out", "crashed", "invalid", "workers_started")


def default_memory_limit_mb(num_workers: int) -> int:
    """The default address-space limit of each of `num_workers` reward workers, in MiB: together they may map
    half of this machine's physical memory (`jaxflow.machine.physical_memory_bytes`), each at least
    `MIN_DEFAULT_MEMORY_MB`."""
    share = machine.physical_memory_bytes() // 2 // max(1, num_workers)
    return max(MIN_DEFAULT_MEMORY_MB, share >> 20)


@dataclasses.dataclass
class _Job:
    """Calls of one function on `responses` (sharing `meta`), one future each; `done` of them answered; `live`,
    per future, what its set_running_or_notify_cancel() said (it may be called once) when the job started."""
    job_id: int
    fn_ref: str
    responses: list[str]
    meta: dict
    futures: list[Future]
    live: list[bool] | None = None
    done: int = 0

    def payload(self) -> bytes:
        return msgpack.packb([self.job_id, self.fn_ref, self.responses[self.done:], self.meta, self.done])


@dataclasses.dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    ready: bool = False
    job: _Job | None = None
    deadline: float = math.inf
    # fn_refs this worker has imported: a call of another one gets import_timeout_s until the worker says
    # "loaded", then timeout_s.
    loaded: set[str] = dataclasses.field(default_factory=set)
    marker: str = ""


class RewardPool:
    """Scores responses with reward functions in worker processes, surviving raises, hangs and crashes.

    Args:
      num_workers: worker processes; each runs one call at a time.
      timeout_s: the longest one call may run before its worker is killed and replaced.
      failed_value: the score of a sample whose call raised, timed out, crashed or returned an invalid value.
      import_timeout_s: extra time allowed for a worker's first call of a function (its module import).
      preload: function references every worker imports at start-up, before it takes calls.
      memory_limit_mb: each worker's address-space limit (RLIMIT_AS) in MiB: a runaway allocation raises
        MemoryError in the worker (counted as raised) instead of pushing the machine into swap or the OOM
        killer. None (the default): `default_memory_limit_mb(num_workers)`, the workers' share of half this
        machine's physical memory; 0: no limit. Leave room for the interpreter and the reward's imports (a
        few hundred MiB).
      on_failure: if set, called as on_failure(message) with the first occurrence of each distinct failure
        message (e.g. "reward function m:f raised KeyError: 'x'") instead of logging it; it runs on the
        pool's dispatcher thread, so it must be quick (what it raises is logged and ignored).

    Use as a context manager, or call `close()`: workers are daemon processes, but close() is what ends them
    promptly and leaves no process behind.
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 2.0, *, failed_value: float = 0.0,
                 import_timeout_s: float = 30.0, preload: Sequence[str] = (), memory_limit_mb: int | None = None,
                 on_failure: Callable[[str], None] | None = None):
        if num_workers < 1:
            raise ValueError(f"RewardPool: num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
        if check_result(failed_value) is None:
            raise ValueError(f"RewardPool: failed_value must be a finite number, got {failed_value!r}")
        if memory_limit_mb is None:
            memory_limit_mb = default_memory_limit_mb(num_workers)
        if isinstance(memory_limit_mb, bool) or not isinstance(memory_limit_mb, int) or memory_limit_mb < 0:
            raise ValueError(f"RewardPool: memory_limit_mb must be an int >= 0 (0: no limit) or None (a share of "
                             f"this machine's memory), got {memory_limit_mb!r}")
        for fn_ref in preload:
            refs.parse(fn_ref, what=WHAT)
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.failed_value, self.import_timeout_s = float(failed_value), float(import_timeout_s)
        self._preload = tuple(preload)
        # Each worker's RLIMIT_AS in MiB; None: unlimited.
        self.memory_limit_mb: int | None = memory_limit_mb or None
        self._on_failure = on_failure
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: collections.deque[_Job] = collections.deque()
        self._stats = dict.fromkeys(STAT_KEYS, 0)
        self._marker_prefix = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._logged: set[str] = set()
        self._next_job_id = 0
        self._closing = False
        self._broken: str | None = None
        self._start_failures = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        try:
            for _ in range(num_workers):
                self._workers.append(self._start_worker())
        except BaseException:
            self._shutdown_workers()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self._thread.start()

    # ---- public API ----

    def submit(self, fn_ref: str, response: str, meta: dict) -> Future:
        """Queues one call; the future's result is the score (a float, `failed_value` if the call failed).

        Raises:
          jaxflow.refs.RefError (a ValueError): `fn_ref` is not "module:function".
          TypeError: `response` or `meta` cannot be sent to a worker (meta must be msgpack-serialisable).
          RuntimeError: the pool is closed or its workers cannot start.
        """
        return self._submit(fn_ref, [response], meta)[0]

    def score_group(self, fn_ref: str, responses: Sequence[str], meta: dict) -> list[float]:
        """Scores the responses of one group (they share `meta`) in as many jobs as there are workers (one
        with one worker), in parallel over the workers; blocks. Each call keeps `submit`'s guarantees."""
        responses, k = list(responses), max(1, min(self.num_workers, len(responses)))
        jobs = [self._submit(fn_ref, responses[i::k], meta) for i in range(k)]  # response j: jobs[j % k][j // k]
        return [jobs[j % k][j // k].result() for j in range(len(responses))]

    def _submit(self, fn_ref: str, responses: list[str], meta: dict) -> list[Future]:
        refs.parse(fn_ref, what=WHAT)
        futures: list[Future] = [Future() for _ in responses]
        if not futures:
            return futures
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardPool is closed")
            if self._broken:
                raise RuntimeError(self._broken)
            job = _Job(self._next_job_id, fn_ref, responses, meta, futures)
            self._next_job_id += 1
            try:
                job.payload()
            except (TypeError, ValueError, OverflowError) as e:
                raise TypeError(f"reward call for {fn_ref}: response and meta must be msgpack-serialisable "
                                f"({e})") from None
            self._pending.append(job)
            self._stats["submitted"] += len(responses)
        self._wake()
        return futures

    def stats(self) -> dict[str, int]:
        """Counts since start: submitted, scored (valid results), raised, timed_out, crashed, invalid,
        workers_started (initial workers plus replacements), and pending (queued or running now)."""
        with self._lock:
            return {**self._stats, "pending": self._stats["submitted"] - sum(
                self._stats[k] for k in ("scored", "raised", "timed_out", "crashed", "invalid"))}

    def worker_pids(self) -> list[int]:
        """The process ids of the current workers (replaced workers get new ones)."""
        with self._lock:
            return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stops the workers and the dispatcher; calls still queued or running fail with RuntimeError.

        Idempotent. Returns once every worker process has exited and been reaped.
        """
        with self._lock:
            if self._closing:
                already = True
            else:
                already, self._closing = False, True
        if already:
            self._thread.join()
            return
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- dispatcher (runs in self._thread; the only code that touches the workers after __init__) ----

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the dispatcher will wake anyway

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        marker = f"{self._marker_prefix}-{self._stats['workers_started']}"
        process = self._context.Process(target=worker_main,
                                        args=(child_conn, self._preload, self.memory_limit_mb, marker),
                                        name="jaxflow-reward-worker", daemon=True)
        process.start()
        # The child holds its own copy; closing ours lets a dead child show up as EOF on parent_conn.
        child_conn.close()
        with self._lock:
            self._stats["workers_started"] += 1
        return _Worker(process, parent_conn, loaded=set(self._preload), marker=marker)

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing or self._broken:
                        break
                self._assign()
                self._poll()
        except BaseException as e:  # noqa: BLE001 - a dispatcher bug must fail calls, not hang callers
            log.exception("reward pool dispatcher failed")
            with self._lock:
                self._broken = f"reward pool dispatcher failed: {error_text(e)}"
        finally:
            self._shutdown_workers()

    def _assign(self) -> None:
        """Hands queued calls to idle, ready workers."""
        for worker in self._workers:
            if worker.job is not None or not worker.ready:
                continue
            with self._lock:
                job = self._pending.popleft() if self._pending else None
            if job is None:
                return
            if job.live is None:
                job.live = [f.set_running_or_notify_cancel() for f in job.futures]
                if not any(job.live):
                    continue  # cancelled by the caller while queued
            try:
                worker.conn.send_bytes(job.payload())
            except (OSError, EOFError):
                # The worker died while idle; its sentinel will show it. The call goes back to the front.
                with self._lock:
                    self._pending.appendleft(job)
                worker.ready = False
                continue
            worker.job = job
            limit = self.timeout_s if job.fn_ref in worker.loaded else self.import_timeout_s
            worker.deadline = time.monotonic() + limit

    def _poll(self) -> None:
        """Waits for a result, a worker death, a wake-up or the nearest deadline, and handles what happened."""
        deadline = min(w.deadline for w in self._workers)
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        waitables = [self._wake_r] + [w.conn for w in self._workers] + [w.process.sentinel for w in self._workers]
        ready = set(multiprocessing.connection.wait(waitables, timeout))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            alive = True
            if worker.conn in ready:
                # Drain: a worker may have sent "loaded" and its result, then died, before this turn.
                while alive and worker.conn.poll(0):
                    alive = self._receive(worker)
            if alive and worker.process.sentinel in ready:
                # A result sent just before dying has been read above; whatever is left died with it.
                alive = False
            if not alive:
                self._replace(i, "crashed")
            elif worker.job is not None and now >= worker.deadline:
                self._replace(i, "timed_out")

    def _receive(self, worker: _Worker) -> bool:
        """Reads one message from `worker`; False if the worker is gone (or sent something malformed)."""
        try:
            message = msgpack.unpackb(worker.conn.recv_bytes(_MAX_RESULT_BYTES), raw=False)
        except (EOFError, OSError, ValueError, msgpack.UnpackException):
            return False
        if isinstance(message, list) and message[:1] == ["ready"]:
            worker.ready = True
            self._start_failures = 0
            return True
        if isinstance(message, list) and message[:1] == ["start_failed"] and len(message) == 2:
            # Every replacement would fail the same way: stop rather than restart workers in a loop.
            self._break(f"reward workers cannot start: {str(message[1])[:MAX_ERROR_CHARS]}")
            return True
        job = worker.job
        if message == [getattr(job, "job_id", None), "loaded", None]:
            worker.loaded.add(job.fn_ref)
            worker.deadline = time.monotonic() + self.timeout_s
            return True
        if not isinstance(message, list) or len(message) != 4 or message[:2] != [getattr(job, "job_id", None),
                                                                                  getattr(job, "done", None)]:
            log.error("reward worker %s sent an unexpected message; replacing it", worker.process.pid)
            return False
        _, _, status, payload = message
        if status == "ok":
            self._finish(job, "scored", float(payload))
        elif status == "invalid":
            self._fail(job, "invalid", f"returned {payload}, not a finite real number")
        else:
            self._fail(job, "raised", f"raised {payload}")
        if job.done == len(job.futures):  # a finished job frees the worker; else the next call's
            worker.job, worker.deadline = None, math.inf  # timeout_s runs from this answer
        else:
            worker.deadline = time.monotonic() + self.timeout_s
        return True

    def _replace(self, index: int, reason: str) -> None:
        """Ends worker `index` (killing it if need be), fails its call as `reason`, and starts a replacement."""
        worker = self._workers[index]
        if reason != "timed_out":
            # Its pipe closed as it died; give the exit a moment to complete so the exit code is its own.
            worker.process.join(timeout=1.0)
        reaper.kill(worker.process, worker.marker)
        worker.conn.close()
        if worker.job is not None:
            if reason == "crashed":
                what = f"crashed its worker (exit code {worker.process.exitcode})"
            elif worker.job.fn_ref in worker.loaded:
                what = f"ran past timeout_s={self.timeout_s:g}s; its worker was killed"
            else:
                what = f"did not import within import_timeout_s={self.import_timeout_s:g}s; its worker was killed"
            job, worker.job = worker.job, None
            self._fail(job, reason, what)
            if job.done < len(job.futures):  # the calls after the failed one go back to the front of the queue
                with self._lock:
                    self._pending.appendleft(job)
        elif not worker.ready:
            self._start_failures += 1
            log.error("reward worker %s exited with code %s before it was ready", worker.process.pid,
                      worker.process.exitcode)
            if self._start_failures >= _MAX_START_FAILURES:
                # The dead worker stays in the list, not ready; the dispatcher stops at its next turn.
                self._break(f"reward workers cannot start: {_MAX_START_FAILURES} exited in a row before ready "
                            f"(last exit code {worker.process.exitcode}); check the preload references and "
                            "that the main module is import-safe (if __name__ == '__main__')")
                return
        else:
            log.warning("reward worker %s exited while idle (exit code %s); replacing it", worker.process.pid,
                        worker.process.exitcode)
        self._workers[index] = self._start_worker()

    def _break(self, message: str) -> None:
        """Marks the pool unusable: submit() refuses calls and the dispatcher stops, failing queued calls."""
        log.error("%s", message)
        with self._lock:
            self._broken = message

    def _finish(self, job: _Job, outcome: str, value: float) -> None:
        """The result of `job`'s next call (its future dropped if the caller cancelled it)."""
        with self._lock:
            self._stats[outcome] += 1
        index, job.done = job.done, job.done + 1
        if job.live[index]:
            job.futures[index].set_result(value)

    def _fail(self, job: _Job, outcome: str, what: str) -> None:
        message = f"reward function {job.fn_ref} {what}"
        with self._lock:
            first = message not in self._logged
            if first and len(self._logged) < _MAX_REMEMBERED_ERRORS:
                self._logged.add(message)
        if first and self._on_failure is not None:
            try:
                self._on_failure(message)
            except Exception:  # noqa: BLE001 - a reporting bug must not break the pool
                log.exception("reward pool on_failure callback failed on: %s", message)
        elif first:
            log.warning("%s; the sample scores %g (logged once per distinct message)", message, self.failed_value)
        self._finish(job, outcome, self.failed_value)

    def _shutdown_workers(self) -> None:
        """Stops every worker and fails the calls still queued or running; leaves no process behind."""
        for worker in self._workers:
            try:
                if worker.ready and worker.job is None:
                    worker.conn.send_bytes(b"")
            except (OSError, EOFError):
                pass
        for worker in self._workers:
            worker.process.join(timeout=1.0 if worker.ready and worker.job is None else 0.0)
            reaper.kill(worker.process, worker.marker)
            worker.conn.close()
        message = self._broken or "RewardPool closed before the call finished"
        with self._lock:
            jobs = [w.job for w in self._workers if w.job is not None] + list(self._pending)
            self._pending.clear()
        for worker in self._workers:
            worker.job = None
        for job in jobs:
            for i in range(job.done, len(job.futures)):
                if job.live[i] if job.live is not None else job.futures[i].set_running_or_notify_cancel():
                    job.futures[i].set_exception(RuntimeError(message))


def group_reward_fn(pool: RewardPool, fn_ref: str, decode: Callable[[Sequence[int]], str]):
    """A rollout worker's `reward_fn(task, samples) -> rewards` that scores decoded samples with `pool`.

    Args:
      pool: where the reward function runs.
      fn_ref: the reward function ("module:function"), e.g. a task's `reward_ref`.
      decode: token ids -> text, e.g. `tokenizer.decode`.
    """
    def reward_fn(task, samples) -> list[float]:
        return pool.score_group(fn_ref, [decode(s.tokens) for s in samples], task.meta)
    return reward_fn
