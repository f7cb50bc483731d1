"""The coordinator: jaxflow's one rollout driver, a control loop that drives one engine or a fleet of
them for the trajectory service (a coordinator over one engine is a rollout worker).

It sees every instance and places each *request* (one sample of a group) itself. Every `step()`:

1. collects completions from every engine; a group whose first N samples are done is rewarded and
   handed to the service (`finish`); its extra samples, if any, are stopped. With `scoring_threads` the
   rewards are computed on threads of their own while the loop goes on, and the group is handed in by
   the first step after they are ready (a group being scored is still held: renewed, handed back on stop);
2. stops the groups the service dropped as surplus (redundant rollout);
3. syncs weights where the sync policy says so (`jaxflow.coordination.sync`);
4. acts on a stuck buffer (`jaxflow.coordination.stuck`);
5. migrates requests off overloaded instances (`jaxflow.coordination.migration`);
6. fills every instance up to `max_running` from the request queue, admitting new groups from the
   service (Reserve, at the instance's version) when the queue has nothing the instance may run,
   placing each request where the router says (`jaxflow.coordination.routing`).

A request may run on any instance whose weights are at least its group's v_start, so migration, retry
and abort-mode syncs move it with its tokens so far (abort + resubmit with the prefix); the service
sees one worker, this coordinator, and every group keeps its v_start and reservation throughout.
The same code runs in real time over real engines (`jaxflow.jobs.rl`, `jaxflow.jobs.rollout_worker`)
and in virtual time over simulated ones (`jaxflow.sim`): pass the clock.

Weights come from a weight source `params` with `latest()` (the newest version, or None) and
`pull(version)` -> (version, weights), where weights are whatever the engines' `update_weights` takes;
`_load_weights` is the one place that pulls, so another kind of source plugs in there. Contract with
the trainer: it marks version v published in the trajectory service before it publishes v's weights,
so an engine never holds weights the service has not admitted.

`stop(abort_in_flight=True)` hands every group in flight back to the service with its samples so far
(it resumes them elsewhere from those prefixes); `stop(abort_in_flight=False)` admits nothing new and
lets the groups in flight finish first (up to `drain_timeout_s`, then aborts what is left). A hand-back
the service refuses (e.g. the group's lease ran out and another worker holds it) is logged and the others
still go back; `release_worker` then returns anything left.

Faults: the coordinator renews the service's leases on the groups it holds every `renew_every_s`
seconds and drops the ones the service says it no longer holds (`groups_lost`). With each renewal it
reports the tokens so far of every group that grew since its last report (`progress_reports`; the
engines' `progress` reads them without stopping anything), so that a coordinator that dies without
handing its groups back loses at most `renew_every_s` of generation: the service resumes them elsewhere
from the reported tokens. A reward function that
raises, or a group the service refuses at `finish` (e.g. NaN rewards), fails that group in the service
(counted as `groups_failed`, the reason in its meta) instead of stopping the loop.

On-policy distillation with the teacher beside the rollout (`trainer.distill.where = "rollout"`): `teacher_fn`
scores each finished group's samples before the group is rewarded and finished, and each sample records the
result as its `teacher_logprobs`; a teacher that raises fails the group as a reward that raises does.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable

from jaxflow.coordination import migration
from jaxflow.coordination.config import Coordination
from jaxflow.coordination.queue import PendingRequest, RequestQueue
from jaxflow.coordination.routing import Instance, Router
from jaxflow.coordination.stuck import stragglers
from jaxflow.coordination.sync import should_sync
from jaxflow.data.records import GroupTask, Sample
from rollout_bridge.engine import Completion, Engine, EngineError, Request, SamplingParams

log = logging.getLogger(__name__)


class RolloutFailed(RuntimeError):
    """A coordinator stopped for good because one of its engines failed (the engine's error is the cause)."""

# (task, its N finished samples) -> one reward per sample; None leaves rewarding to a reward pool.
RewardFn = Callable[[GroupTask, list[Sample]], list[float]]
# (task, its N finished samples) -> the teacher's log-prob of every token of each (`Sample.teacher_logprobs`).
TeacherFn = Callable[[GroupTask, list[Sample]], list[list[float]]]


@dataclasses.dataclass
class _Group:
    task: GroupTask
    started: float
    finished: list[Sample] = dataclasses.field(default_factory=list)
    live: dict[int, str] = dataclasses.field(default_factory=dict)  # sample -> request id on an instance
    retried: bool = False


class Coordinator:
    """Drives `engines` for `trajectories` (a TrajectoryService or an RPC client of one).

    Call `step()` repeatedly, or `start()` a background thread.

    Args:
      name: this coordinator's name: the worker name it leases groups under, and the prefix of its
        instances' names and request ids.
      engines: the inference engines it drives (at least one), one routing instance each.
      trajectories: a TrajectoryService or an RPC client of one: where groups come from and go back to.
      params: a ParameterService or client (`latest()`, `pull(version)`): the weights engines sync to.
      strategy: the coordination section (routing, queueing, redundancy, migration, syncs, stragglers).
      eta: the service's staleness bound, in policy versions.
      sampling: the sampling parameters of every request.
      reward_fn: (task, its finished samples) -> one reward per sample (not called for episodes, whose samples
        carry their environments' rewards); None leaves rewarding to the trajectory service.
      teacher_fn: (task, its finished samples) -> the teacher's per-token log-probs of each sample, recorded as
        its `teacher_logprobs` before the group is finished (e.g. `rollout_bridge.teacher.TeacherScorer.
        score_group`); None: samples carry none.
      clock: seconds, monotonic (tests and the simulator pass a virtual one).
      trace_every_s: if set, `trace` records each engine's load every that many seconds, every finished
        group's response lengths and every weight sync's duration (what `jaxflow.sim` fits its models to).
      renew_every_s: seconds between renewals of the service's leases on the groups held.
      report_progress: whether a renewal reports the tokens generated so far (what a dead worker's groups
        resume from); off where no worker can die unnoticed, since it copies every running request's tokens.
      scoring_threads: 0: a finished group is rewarded inside `step` (the loop waits for its rewards); N > 0:
        on N threads, while the loop goes on placing and collecting requests, each group handed in by the
        first `step` after its rewards are ready. For rewards that take a while (a reward model, a judge,
        a teacher): the groups finished meanwhile are scored concurrently, so their samples share batches.
    """

    def __init__(self, name: str, engines: list[Engine], trajectories, params, *, strategy: Coordination,
                 eta: int, sampling: SamplingParams, reward_fn: RewardFn | None = None,
                 teacher_fn: TeacherFn | None = None, clock: Callable[[], float] = time.monotonic,
                 trace_every_s: float | None = None, renew_every_s: float = 1.0, report_progress: bool = True,
                 scoring_threads: int = 0):
        if not engines:
            raise ValueError("a coordinator needs at least one engine")
        if not isinstance(scoring_threads, int) or scoring_threads < 0:
            raise ValueError(f"scoring_threads must be an int >= 0, got {scoring_threads!r}")
        self.name, self.trajectories, self.params, self.strategy = name, trajectories, params, strategy
        self.eta, self.sampling, self.reward_fn, self.clock = eta, sampling, reward_fn, clock
        self.teacher_fn = teacher_fn
        self.instances = [Instance(i, f"{name}/{i}", e) for i, e in enumerate(engines)]
        self.router = Router(strategy.routing, strategy.cost)
        self.queue = RequestQueue(strategy.queue)
        self._groups: dict[int, _Group] = {}
        # Finished groups whose rewards are being computed off the loop (scoring_threads > 0): group id ->
        # (its samples, the rewards' future). They are still this coordinator's: renewed, and handed back on stop.
        self._scoring: dict[int, tuple[list[Sample], concurrent.futures.Future]] = {}
        self._started: dict[int, float] = {}  # a scoring group's start, for its latency
        self._scorer = (concurrent.futures.ThreadPoolExecutor(scoring_threads, thread_name_prefix=f"score-{name}")
                        if scoring_threads else None)
        self._where: dict[str, tuple[int, int, int]] = {}  # request id -> (instance, group, sample)
        self._seq = 0
        self._group_size = getattr(trajectories, "group_size", 1)
        self._batch_groups = getattr(trajectories, "batch_groups", None)
        self._latencies: collections.deque[float] = collections.deque(maxlen=256)
        self._last_tick = clock()
        self._stop = threading.Event()
        self._draining = False  # stop(abort_in_flight=False) in progress: admit no new groups
        self._thread: threading.Thread | None = None
        self.trace_every_s = trace_every_s
        # Set (a RolloutFailed) when an engine failed and the coordinator stopped for good; the train loop
        # and the rollout worker read it instead of waiting on.
        self.error: RolloutFailed | None = None
        self.renew_every_s, self._renewed_at = renew_every_s, -math.inf
        # Progress in each renewal: what a dead worker's groups resume from. Off where no worker can die
        # unnoticed (the simulator), since reading every running request's tokens costs a copy of them.
        self.report_progress = report_progress
        self._reported: dict[int, int] = {}  # group -> tokens in its last progress report
        # Bounded: the newest samples of a long run.
        self.trace = {k: collections.deque(maxlen=200_000) for k in ("loads", "group_lengths", "sync_s")}
        self._traced_at = -math.inf
        self.counts = collections.Counter({k: 0 for k in (
            "groups_finished", "groups_failed", "groups_surplus", "requests_submitted", "requests_migrated",
            "requests_retried", "requests_resumed", "samples_redundant", "syncs", "buffers_released",
            "groups_aborted", "groups_lost", "progress_reports")})

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _request_id(self, gid: int, sample: int) -> str:
        self._seq += 1  # unique per engine across moves and retries; the sample index comes last
        return f"{self.name}:{gid}:{self._seq}:{sample}"

    def _register(self, task: GroupTask) -> None:
        n = task.n
        launched = n + self.strategy.extra_samples  # N' >= N
        g = _Group(task, self.clock())
        self._groups[task.group_id] = g
        partial = task.partial or [None] * n
        for i in range(launched):
            prev = partial[i] if i < n else None
            if prev is not None and prev.done:
                g.finished.append(prev)
                continue
            self.queue.push(PendingRequest(task.group_id, i, task.v_start,
                                           prev if prev is not None and prev.tokens else None))

    def _place(self, req: PendingRequest, inst: Instance) -> None:
        g = self._groups[req.group_id]
        rid = self._request_id(req.group_id, req.sample)
        inst.engine.submit(Request(rid, list(g.task.prompt), self.sampling, prefix=req.prefix, meta=g.task.meta))
        inst.requests.add(rid)
        g.live[req.sample] = rid
        self._where[rid] = (inst.index, req.group_id, req.sample)
        self.counts["requests_submitted"] += 1

    def _stop_request(self, rid: str) -> Sample | None:
        """Aborts a placed request; its partial sample, or None if it already finished (its completion
        then arrives through poll and is handled there)."""
        idx, gid, sample = self._where[rid]
        inst = self.instances[idx]
        out = [c for c in inst.engine.abort([rid]) if c.request_id == rid]
        if not out:
            return None
        del self._where[rid]
        inst.requests.discard(rid)
        self._groups[gid].live.pop(sample, None)
        return out[0].sample

    def _move(self, rid: str, dst: Instance | None) -> bool:
        """Stops `rid` and resubmits it with its tokens so far, on `dst` or through the queue."""
        _, gid, sample = self._where[rid]
        partial = self._stop_request(rid)
        if partial is None:
            return False
        req = PendingRequest(gid, sample, self._groups[gid].task.v_start, partial if partial.tokens else None)
        if dst is not None and dst.version >= req.v_start:
            self._place(req, dst)
        else:
            self.queue.push(req, front=True)
        return True

    def _drop_group(self, gid: int) -> int:
        """Forgets a group, stopping its requests; returns how many requests were stopped or unqueued."""
        g = self._groups.pop(gid, None)
        if g is None:
            return 0
        stopped = 0
        for rid in list(g.live.values()):
            if rid in self._where:
                idx = self._where.pop(rid)[0]
                self.instances[idx].requests.discard(rid)
                self.instances[idx].engine.abort([rid])
                stopped += 1
        return stopped + len(self.queue.take_group(gid))

    # ---- 1. completions ------------------------------------------------------------------------
    def _collect(self) -> None:
        now = self.clock()
        dt, self._last_tick = now - self._last_tick, now
        cost = self.strategy.cost
        record = self.trace_every_s is not None and now - self._traced_at >= self.trace_every_s
        if record:
            self._traced_at = now
        for inst in self.instances:
            if not inst.requests:
                inst.idle_s += dt
            for c in inst.engine.poll(timeout=0):
                self._completed(c)
            load = inst.engine.load()
            inst.kv_used = load.kv_used
            inst.observe(load.tokens_per_s, load.running, cost)
            if record:
                self.trace["loads"].append((round(now, 3), inst.index, load.running, load.waiting,
                                            round(load.kv_used, 5), round(load.tokens_per_s, 1)))

    def _completed(self, c: Completion) -> None:
        where = self._where.pop(c.request_id, None)
        if where is None:
            return  # a request stopped meanwhile
        idx, gid, sample = where
        self.instances[idx].requests.discard(c.request_id)
        g = self._groups.get(gid)
        if g is None:
            return
        g.live.pop(sample, None)
        if c.sample.finish_reason == "error":
            self._drop_group(gid)
            self.trajectories.fail(gid, f"engine error: {c.error}")
            self.counts["groups_failed"] += 1
            return
        if c.sample.finish_reason == "abort":  # an engine handed it back (closing): run it again
            self.queue.push(PendingRequest(gid, sample, g.task.v_start, c.sample if c.sample.tokens else None),
                            front=True)
            return
        g.finished.append(c.sample)
        if len(g.finished) == g.task.n:
            self._finish(gid)

    def _finish(self, gid: int) -> None:
        g = self._groups[gid]
        self.counts["samples_redundant"] += self._drop_group(gid)
        samples = g.finished[:g.task.n]
        if self._scorer is not None and (self.teacher_fn is not None or not all(s.reward is not None
                                                                                for s in samples)):
            self._scoring[gid] = (samples, self._scorer.submit(self._rewards, g.task, samples))
            self._started[gid] = g.started
            return
        try:
            rewards = self._rewards(g.task, samples)
        except Exception as e:  # noqa: BLE001 - handed in below as a failed group
            rewards = e
        self._hand_in(gid, samples, rewards, g.started)

    def _rewards(self, task: GroupTask, samples: list[Sample]) -> list[float] | None:
        """The group's teacher log-probs, recorded on its samples (with `teacher_fn`), then its rewards: its
        environments' (episodes), else the reward function's (None: the service's)."""
        if self.teacher_fn is not None:
            scored = self.teacher_fn(task, samples)
            if len(scored) != len(samples):
                raise ValueError(f"the teacher scored {len(scored)} samples of {len(samples)}")
            for s, logp in zip(samples, scored):
                s.teacher_logprobs = list(logp)
        if all(s.reward is not None for s in samples):
            return [float(s.reward) for s in samples]
        return self.reward_fn(task, samples) if self.reward_fn is not None else None

    def _scored(self) -> None:
        """Hands in the groups whose rewards the scoring threads have computed."""
        for gid, (samples, future) in list(self._scoring.items()):
            if future.done():
                del self._scoring[gid]
                error = future.exception()
                self._hand_in(gid, samples, error if error is not None else future.result(),
                              self._started.pop(gid))

    def _hand_in(self, gid: int, samples: list[Sample], rewards, started: float) -> None:
        """`finish`es a rewarded group in the service; rewards that are an exception (the reward function or
        the teacher raised) or a finish the service refuses fail the group there instead."""
        try:
            if isinstance(rewards, BaseException):
                raise rewards
            self.trajectories.finish(gid, self.name, samples, rewards)
        except (ConnectionError, TimeoutError):
            raise  # the service is unreachable: the loop hands everything back
        except Exception as e:  # a reward or teacher that raised, or a finish the service refused (NaN rewards...)
            log.warning("%s: group %d failed at finish: %s", self.name, gid, e)
            try:
                self.trajectories.fail(gid, f"finish refused: {type(e).__name__}: {e}"[:500])
            except (KeyError, ValueError) as refused:  # no longer ours (lease lapsed): nothing to fail
                log.warning("%s: group %d could not be failed: %s", self.name, gid, refused)
            self.counts["groups_failed"] += 1
            return
        self._latencies.append(self.clock() - started)
        if self.trace_every_s is not None:
            self.trace["group_lengths"].append([len(x.tokens) for x in samples])
        self.counts["groups_finished"] += 1

    # ---- 2-5. surplus, sync, stuck, migration ---------------------------------------------------
    def _renew(self) -> None:
        """Renews the leases on the groups held, every `renew_every_s`, reporting the tokens so far of
        those that grew since their last report; drops the groups the service took back."""
        now = self.clock()
        renew = getattr(self.trajectories, "renew", None)
        if renew is None or not (self._groups or self._scoring) or now - self._renewed_at < self.renew_every_s:
            return
        self._renewed_at = now
        report = self._progress() if self.report_progress else {}
        for gid in renew(self.name, [*self._groups, *self._scoring], report or None):
            if gid in self._groups or gid in self._scoring:
                self._forget(gid)
                self.counts["groups_lost"] += 1
                log.warning("%s: group %d was handed back by the service (lease expired)", self.name, gid)
        self._reported = {gid: k for gid, k in self._reported.items() if gid in self._groups}
        for gid, samples in report.items():
            self._reported[gid] = sum(len(x.tokens) for x in samples)
        self.counts["progress_reports"] += len(report)

    def _progress(self) -> dict[int, list[Sample]]:
        """The n samples so far of each group held whose tokens changed since its last report, ordered
        as `stop` hands them back: finished ones, then the longest partial ones (running requests' read
        from their engines, queued ones' prefixes). A group with a request its engine did not report
        (it just finished: its completion comes with the next poll) waits for the next report."""
        rids = collections.defaultdict(list)
        for g in self._groups.values():
            for rid in g.live.values():
                if rid in self._where:
                    rids[self._where[rid][0]].append(rid)
        got = {c.request_id: c.sample for idx, ids in rids.items()
               for c in self.instances[idx].engine.progress(ids)}
        report = {}
        for gid, g in self._groups.items():
            if not all(rid in got for rid in g.live.values()):
                continue
            partial = [got[rid] for rid in g.live.values()]
            partial += [r.prefix for r in self.queue.group(gid) if r.prefix is not None]
            partial.sort(key=lambda x: -len(x.tokens))
            n = g.task.n
            samples = (g.finished[:n] + partial + [Sample() for _ in range(n)])[:n]
            if sum(len(x.tokens) for x in samples) != self._reported.get(gid, 0):
                report[gid] = samples
        return report

    def _surplus(self) -> None:
        for gid in self.trajectories.take_surplus(self.name):
            if gid in self._groups or gid in self._scoring:
                self._forget(gid)
                self.counts["groups_surplus"] += 1

    def _forget(self, gid: int) -> None:
        """Drops a group held, running or being scored (its rewards, when they come, are not used)."""
        self._drop_group(gid)
        self._scoring.pop(gid, None)
        self._started.pop(gid, None)

    def _sync(self) -> None:
        s = self.strategy
        latest = self.params.latest()
        if latest is None:
            return
        for inst in self.instances:
            if not should_sync(s.sync, version=inst.version, latest=latest, running=inst.running,
                               must=self.trajectories.needs_sync(inst.version), idle_below=s.sync_idle_below,
                               max_lag=s.sync_max_lag):
                continue
            if s.sync_mode == "abort":  # in placement order: set order varies with the hash seed
                for rid in sorted(inst.requests, key=lambda r: int(r.rsplit(":", 2)[1])):
                    if self._move(rid, None):
                        self.counts["requests_resumed"] += 1
            self._load_weights(inst, latest)

    def _load_weights(self, inst: Instance, version: int | None) -> int:
        """Pulls `version` (None: the newest) from the weight source into one instance; returns it."""
        t0 = time.perf_counter()
        version, weights = self.params.pull(version)
        inst.engine.update_weights(version, weights, keep_kv=self.strategy.sync_mode == "keep_kv")
        if self.trace_every_s is not None:
            self.trace["sync_s"].append(time.perf_counter() - t0)
        inst.syncs += 1
        self.counts["syncs"] += 1
        log.debug("%s: weights now version %d", inst.name, version)
        return version

    def load_weights(self, version: int | None = None) -> int | None:
        """Loads `version` (default: the newest published, if any) into every instance now, whatever
        the sync policy; e.g. before the first step of an engine started from other weights. Returns the
        version, or None when nothing is published."""
        if version is None:
            version = self.params.latest()
            if version is None:
                return None
        for inst in self.instances:
            self._load_weights(inst, version)
        return version

    def _least_loaded(self, v_start: int, exclude: int) -> Instance | None:
        ok = [i for i in self.instances if i.index != exclude and i.version >= v_start
              and i.running < self.strategy.max_running]
        return min(ok, key=lambda i: (i.predicted_step_s(self.strategy.cost, 1), i.index), default=None)

    def _stuck(self) -> None:
        s = self.strategy
        if s.stuck == "wait" or not self._latencies:
            return
        v_train, occupied = self.trajectories.progress()
        batch = self._batch_groups
        missing = (batch - occupied) if batch is not None else s.stuck_threshold
        now = self.clock()
        ages = {gid: now - g.started for gid, g in self._groups.items()
                if g.task.v_start + self.eta <= v_train and not (s.stuck == "retry" and g.retried)}
        patience = s.stuck_patience * statistics.median(self._latencies)
        ids = stragglers(missing=missing, ages=ages, threshold=s.stuck_threshold, patience_s=patience)
        if not ids:
            return
        if s.stuck == "release":
            self.trajectories.release(v_train)
            self.counts["buffers_released"] += 1
            self._surplus()
            return
        for gid in ids:
            g = self._groups[gid]
            g.retried = True
            for rid in list(g.live.values()):
                src = self.instances[self._where[rid][0]]
                dst = self._least_loaded(g.task.v_start, exclude=src.index)
                if dst is not None and dst.predicted_step_s(s.cost, 1) < src.predicted_step_s(s.cost) \
                        and self._move(rid, dst):
                    self.counts["requests_retried"] += 1

    def _migrate(self) -> None:
        s = self.strategy
        if not s.migrate or len(self.instances) < 2:
            return
        moves = migration.plan([i.load for i in self.instances], [i.slowness for i in self.instances],
                               trigger=s.migrate_trigger, stop=s.migrate_stop, min_requests=s.migrate_min_requests,
                               room=[s.max_running - i.running for i in self.instances],
                               versions=[i.version for i in self.instances], max_moves=s.migrate_max_moves)
        for src, dst in moves:
            # The newest request on the source has the fewest tokens to recompute.
            rid = max(self.instances[src].requests, key=lambda r: int(r.rsplit(":", 2)[1]))
            if self._move(rid, self.instances[dst]):
                self.counts["requests_migrated"] += 1

    # ---- 6. admission and placement -------------------------------------------------------------
    def _admit(self, version: int, room: int) -> bool:
        if self._draining:
            return False
        per_group = self._group_size + self.strategy.extra_samples
        tasks = self.trajectories.dispatch(self.name, version, max(1, math.ceil(room / per_group)))
        for task in tasks:
            self._group_size = task.n
            self._register(task)
            if len(self._groups[task.group_id].finished) >= task.n:  # restored complete
                self._finish(task.group_id)
        return bool(tasks)

    def _fill(self) -> None:
        cap = self.strategy.max_running
        open_ = [i for i in self.instances if i.running < cap and not i.engine.paused]
        heap = [(self.router.key(i), i.index) for i in open_]
        heapq.heapify(heap)
        refused: set[int] = set()  # versions the service admitted nothing for, this round
        while heap:
            _, idx = heapq.heappop(heap)
            inst = self.instances[idx]
            req = self.queue.pop(inst.version)
            if req is None:
                if inst.version in refused:
                    continue
                room = sum(cap - i.running for i in open_ if i.version >= inst.version)
                if not self._admit(inst.version, room):
                    refused.add(inst.version)
                    continue
                req = self.queue.pop(inst.version)
                if req is None:
                    continue
            self._place(req, inst)
            self.router.placed(inst)
            if inst.running < cap:
                heapq.heappush(heap, (self.router.key(inst), idx))

    # ---- loop ----------------------------------------------------------------------------------
    def step(self) -> None:
        """One round of the control loop (see the module docstring)."""
        self._collect()
        self._scored()
        self._renew()
        self._surplus()
        self._sync()
        self._stuck()
        self._migrate()
        self._fill()

    def in_flight(self) -> int:
        """Groups this coordinator holds (queued, on an instance, or being scored)."""
        return len(self._groups) + len(self._scoring)

    def stats(self) -> dict:
        return {**self.counts, "groups_in_flight": len(self._groups), "groups_scoring": len(self._scoring),
                "queued_requests": len(self.queue),
                "instances": [{"name": i.name, "running": i.running, "version": i.version, "syncs": i.syncs,
                               "idle_s": i.idle_s, "slowness": i.slowness} for i in self.instances]}

    def start(self, tick_s: float = 0.01) -> Coordinator:
        """Runs `step` in a background thread every `tick_s` seconds until `stop`."""
        def loop():
            while not self._stop.is_set():
                try:
                    self.step()
                except EngineError as e:
                    failed = [i.index for i in self.instances
                              if getattr(i.engine, "failure", lambda: None)() is not None]
                    if not failed:  # the engine still serves: as any other error below
                        log.exception("coordinator %s failed; releasing its groups", self.name)
                        self._release_all("coordinator error")
                        time.sleep(0.5)
                        continue
                    # A failed engine raises the same from every later call: retrying would spin while the
                    # trainer waits for groups that never come. Stop, hand the groups back, say why.
                    log.error("coordinator %s: engine %s failed; it stops generating: %s", self.name, failed, e)
                    self.error = RolloutFailed(f"coordinator {self.name}: rollout engine {failed[0]} failed: {e}")
                    self.error.__cause__ = e
                    self._release_all("engine failed")
                    return
                except Exception:
                    log.exception("coordinator %s failed; releasing its groups", self.name)
                    self._release_all("coordinator error")
                    time.sleep(0.5)
                self._stop.wait(tick_s)

        self._thread = threading.Thread(target=loop, name=f"coordinator-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _release_all(self, reason: str) -> None:
        """After a failure: stops and forgets every group (requests and queue entries), and hands them
        back to the service, which requeues them."""
        for gid in [*self._groups, *self._scoring]:
            self._forget(gid)
        self.trajectories.release_worker(self.name, reason)

    def stop(self, abort_in_flight: bool = True, drain_timeout_s: float = 600.0) -> None:
        """Stops the loop. abort_in_flight: groups in flight go back to the service with their samples so
        far (the finished ones, then the longest partial ones). Else no new group is admitted and the
        ones in flight run to the end (rewarded and handed in as usual) first; any still running after
        `drain_timeout_s` seconds are aborted as above."""
        if not abort_in_flight and (self._groups or self._scoring):
            self._draining = True
            deadline = time.monotonic() + drain_timeout_s
            while (self._groups or self._scoring) and time.monotonic() < deadline:
                if self._thread is not None and self._thread.is_alive():
                    time.sleep(0.01)  # the loop steps
                else:
                    self.step()
                    time.sleep(0.001)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._draining = False
        self._scored()  # groups whose rewards came meanwhile are handed in; the others go back whole, below
        for gid, (samples, _) in list(self._scoring.items()):
            self._forget(gid)
            try:
                self.trajectories.abort(gid, self.name, samples, "coordinator stopped")
                self.counts["groups_aborted"] += 1
            except Exception as e:  # refused (lease lapsed...): the others still go back
                log.warning("%s: could not hand back group %d: %s", self.name, gid, e)
        if self._scorer is not None:
            self._scorer.shutdown(wait=False, cancel_futures=True)
        for gid, g in list(self._groups.items()):
            partial = [r.prefix for r in self.queue.take_group(gid) if r.prefix is not None]
            for rid in list(g.live.values()):
                got = self._stop_request(rid) if rid in self._where else None
                if got is not None and got.tokens:
                    partial.append(got)
            partial.sort(key=lambda x: -len(x.tokens))
            n = g.task.n
            samples = (g.finished[:n] + partial + [Sample() for _ in range(n)])[:n]
            self._drop_group(gid)
            try:
                self.trajectories.abort(gid, self.name, samples, "coordinator stopped")
                self.counts["groups_aborted"] += 1
            except Exception as e:  # refused (lease lapsed, bad partial...): the others still go back
                log.warning("%s: could not hand back group %d: %s", self.name, gid, e)
        try:
            self.trajectories.release_worker(self.name, "coordinator stopped")  # whatever is left
        except Exception as e:
            log.warning("%s: release_worker failed: %s", self.name, e)
