"""A rollout worker: pulls groups from the trajectory service, generates them on one engine, returns
finished groups, and keeps its engine's weights fresh by a sync policy.

Weight sync policies (`SyncPolicy.when`):
  "every"  sync as soon as a newer version is published;
  "idle"   sync only when nothing is in flight (or when the service refuses work to a stale worker);
  "lag"    sync when lagging the newest version by `lag` or more.
A worker whose weights are too old to be given work (version + eta below the version being trained)
always syncs. Contract with the trainer: it marks version v published in the trajectory service
(`mark_published`) before it publishes v's weights, so a worker never holds weights the service has
not admitted. How in-flight requests cross a sync (`SyncPolicy.mode`):
  "keep"   the engine swaps weights with requests in flight and recomputes their KV (PipelineRL);
  "abort"  in-flight groups are aborted back to the service with their partial samples and resumed
           from the prefix under the new weights (AReaL).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from jaxflow.data.records import GroupTask, Sample
from rollout_bridge.engine import Completion, Engine, Request, SamplingParams

log = logging.getLogger(__name__)

SYNC_WHEN = ("every", "idle", "lag")
SYNC_MODES = ("keep", "abort")

# (task, finished samples) -> one reward per sample; None leaves rewarding to a reward pool.
RewardFn = Callable[[GroupTask, list[Sample]], list[float]]


@dataclasses.dataclass(frozen=True)
class SyncPolicy:
    when: str = "every"
    lag: int = 1
    mode: str = "keep"

    def __post_init__(self):
        if self.when not in SYNC_WHEN:
            raise ValueError(f"unknown sync policy {self.when!r}; valid: {', '.join(SYNC_WHEN)}")
        if self.mode not in SYNC_MODES:
            raise ValueError(f"unknown sync mode {self.mode!r}; valid: {', '.join(SYNC_MODES)}")
        if self.lag < 1:
            raise ValueError(f"sync lag must be >= 1, got {self.lag}")


@dataclasses.dataclass
class _InFlight:
    task: GroupTask
    samples: list[Sample | None]


class RolloutWorker:
    """Drives one engine. `trajectories` is a TrajectoryService or an RPC client of one; `params` a
    ParameterService or ParameterClient. Call `step()` repeatedly, or `start()` a background thread.
    """

    def __init__(self, name: str, engine: Engine, trajectories, params, *,
                 sampling: SamplingParams = SamplingParams(), sync: SyncPolicy = SyncPolicy(),
                 max_groups: int = 8, reward_fn: RewardFn | None = None):
        self.name, self.engine, self.trajectories, self.params = name, engine, trajectories, params
        self.sampling, self.sync_policy, self.max_groups = sampling, sync, max_groups
        self.reward_fn = reward_fn
        self._groups: dict[int, _InFlight] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {"groups_finished": 0, "groups_failed": 0, "groups_aborted": 0, "syncs": 0,
                       "samples": 0, "idle_s": 0.0}

    # ---- weights ---------------------------------------------------------------------------
    def _want_sync(self, latest: int | None) -> bool:
        v = self.engine.version
        if latest is None or latest <= v:
            return False
        if self.trajectories.needs_sync(v):
            return True
        p = self.sync_policy
        if p.when == "every":
            return True
        if p.when == "lag":
            return latest - v >= p.lag
        return not self._groups  # idle

    def sync(self, version: int | None = None) -> int:
        """Pulls `version` (default newest) and loads it into the engine; returns the version."""
        if self.sync_policy.mode == "abort" and self._groups:
            self._abort_all("weight sync")
        version, tensors = self.params.pull(version)
        self.engine.update_weights(version, tensors)
        self.counts["syncs"] += 1
        log.info("worker %s: weights now version %d", self.name, version)
        return version

    # ---- groups ----------------------------------------------------------------------------
    def _submit(self, task: GroupTask) -> None:
        partial = task.partial or [None] * task.n
        self._groups[task.group_id] = _InFlight(task, [s if s is not None and s.done else None
                                                       for s in partial])
        for i, prev in enumerate(partial):
            if prev is not None and prev.done:
                continue
            self.engine.submit(Request(self._request_id(task, i), list(task.prompt), self.sampling,
                                       prefix=prev if prev is not None and prev.tokens else None))

    def _request_id(self, task: GroupTask, sample: int) -> str:
        # Unique per engine even across workers, retries and restarted services sharing it.
        return f"{self.name}:{task.group_id}:{task.attempt}:{sample}"

    def _abort_all(self, reason: str) -> None:
        ids = [self._request_id(f.task, i) for f in self._groups.values()
               for i, s in enumerate(f.samples) if s is None]
        for c in self.engine.abort(ids):
            self._record(c)
        for gid, f in list(self._groups.items()):
            partial = [s if s is not None else Sample() for s in f.samples]
            self.trajectories.abort(gid, self.name, partial, reason)
            self.counts["groups_aborted"] += 1
        self._groups.clear()

    def _record(self, c: Completion) -> None:
        name, gid, attempt, i = c.request_id.rsplit(":", 3)
        f = self._groups.get(int(gid))
        if name == self.name and f is not None and f.task.attempt == int(attempt):
            f.samples[int(i)] = c.sample

    def _complete(self, gid: int) -> None:
        f = self._groups.pop(gid)
        errors = [s.finish_reason for s in f.samples if s.finish_reason == "error"]
        if errors:
            self.trajectories.fail(gid, f"engine error on {len(errors)} of {f.task.n} samples")
            self.counts["groups_failed"] += 1
            return
        rewards = self.reward_fn(f.task, f.samples) if self.reward_fn is not None else None
        self.trajectories.finish(gid, self.name, f.samples, rewards)
        self.counts["groups_finished"] += 1
        self.counts["samples"] += f.task.n

    def step(self, poll_timeout: float = 0.05) -> int:
        """One round: maybe sync, dispatch up to `max_groups` in flight, collect completions.
        Returns the number of groups finished in this round."""
        if self._want_sync(self.params.latest()):
            self.sync()
        room = self.max_groups - len(self._groups)
        if room > 0:
            for task in self.trajectories.dispatch(self.name, self.engine.version, room):
                self._submit(task)
        t0 = time.perf_counter()
        completions = self.engine.poll(timeout=poll_timeout)
        if not self._groups:
            self.counts["idle_s"] += time.perf_counter() - t0
        for c in completions:
            self._record(c)
        done = [g for g, f in self._groups.items() if all(s is not None for s in f.samples)]
        for gid in done:
            self._complete(gid)
        return len(done)

    def start(self) -> RolloutWorker:
        """Runs `step` in a background thread until `stop`."""
        def loop():
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception:  # noqa: BLE001 - a worker must not die silently; its groups go back
                    log.exception("worker %s failed; releasing its groups", self.name)
                    self.trajectories.release_worker(self.name, "worker error")
                    self._groups.clear()
                    time.sleep(0.5)

        self._thread = threading.Thread(target=loop, name=f"rollout-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, abort_in_flight: bool = True) -> None:
        """Stops the loop; in-flight groups go back to the service (with their partial samples)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if abort_in_flight and self._groups:
            self._abort_all("worker stopped")
