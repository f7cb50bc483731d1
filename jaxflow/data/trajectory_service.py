"""The trajectory service: admission-bounded staleness by Reserve -> Occupy -> Consume.

There is one buffer per future train step; buffer `s` (capacity `batch_groups` groups) feeds the update
that trains version s into s+1. A group goes through:

1. Reserve (`dispatch`): a worker whose weights have version v_w gets a new group only if buffer
   v_w + eta, the latest step allowed to consume it, has a free slot; the group holds that slot.
   No slot, no dispatch. A worker with v_w + eta below the version being trained must sync first.
2. Occupy (`finish` + `reward`): once all its samples are done and rewarded, the group releases its
   reservation and moves to the earliest buffer s >= v_train with room; its own freed slot guarantees
   one exists, so finished work is never thrown away.
3. Consume (`consume`): the trainer takes buffer v_train when it is full (or, by config, ready with
   capacity), and every group in it satisfies v_train - v_start <= eta.

Aborted groups (weight sync, migration, dead worker) keep their reservation, their v_start and their
partial samples, and are dispatched again before new prompts. Every group is in exactly one state and
the counters say how many passed through each transition.

Redundant rollout (`reserve_groups` B' > B): each buffer takes B' reservations but still trains B groups,
the first B to finish. A group that can no longer land (every buffer it may occupy is full) becomes
SURPLUS: dropped, counted, never trained; its worker learns of it from `take_surplus` and stops it. This
trades a bias toward fast-finishing groups for not waiting on the slowest ones. `release` does the same
on demand for one buffer: it is handed to the trainer with what it holds, and the groups that could only
land there become SURPLUS (the stuck-buffer strategy of `jaxflow.coordination`).

Faults. Every call validates all its arguments (samples, rewards, versions, timeouts: `jaxflow.data.checks`)
before it changes anything, so a bad call raises and leaves the service as it was; `restore` checks the
whole snapshot first (`jaxflow.data.service_snapshot`). A dispatched group carries a lease of `lease_s`
seconds that its worker extends with `renew` (a coordinator does so from its loop), reporting there each
group's tokens so far; a lease that runs out (a dead, hung or departed worker) hands the group back with
the samples last reported (counted as `expired`, their tokens as `recovered_tokens`), and the worker that
let it lapse is told so if it calls about it later. `release_worker` does the same at once.

Samples the model cannot train on. With `vocab_size` (the model's; every job that has a model passes it),
`finish` refuses token ids outside [0, vocab_size) (ids >= 2**31 are refused even without it: they do not
fit the trainer's int32 batch); with `max_sequence_tokens` (the trainer's row, rollout.max_len), a sample
whose prompt and tokens together are longer (split into training sequences, `Sample.sequence_starts`: one
with a sequence that with its context is longer); and rewards whose group statistics overflow float32 (a sum of
episode turns can). With `route_spec` (a mixture-of-experts model's, `RouteSpec.of(its config)`), a sample's
recorded routing (`Sample.routes`, replayed by the update) must have its shape and expert ids; without one
(a dense model) a sample may carry none. A refused `finish` or `reward` raises `SampleRefused` (a ValueError
naming the group, sample and element) and changes nothing but the counters `refused` and `refused_<reason>`
(one per refused call, by `REFUSAL_REASONS`): the group stays with its worker, which fails it (the
coordinator does, so it is counted as failed) or lets its lease run out (it is then dispatched again, up to
max_attempts). Routes are checked wherever samples come in (`finish`, `abort`, `renew`), kept as copies in
the spec's dtype (never a view of the caller's array or of a received message), and saved in snapshots.

`consume` is exactly once. It is idempotent for the step just consumed: a trainer whose reply was lost asks
again for the same step and gets the same batch, counted once; the batch is kept until the next step is
consumed (or `ack`). A retry that arrives while the first call still waits (its client gave up) supersedes
it: the older call raises `ConsumeSuperseded` and takes nothing, so the batch goes to the retry, and the
kept batch is never replaced (counted as `consume_superseded`; `stats()["consume_waiting"]` says how many
calls wait).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import Any

from jaxflow.data import checks
from jaxflow.data.leases import Leases
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import ConsumedBatch, FinishedGroup, GroupTask, RouteSpec, Sample
from jaxflow.data.service_errors import REFUSAL_REASONS, ConsumeSuperseded, SampleRefused
from jaxflow.data.service_groups import FIELDS, BufferState, GroupState, census, group_task, own_samples
from jaxflow.data.service_groups import GroupRecord as _Group
from jaxflow.data.service_snapshot import parse_snapshot, snapshot_samples

__all__ = ["BATCH_RULES", "ConsumeSuperseded", "SampleRefused", "TrajectoryService"]

BATCH_RULES = ("full", "ready_with_capacity")
_DROPPED_KEPT = 100_000  # SURPLUS ids remembered, so that late calls about them are ignored


class TrajectoryService:
    """Embedded (thread-safe) trajectory service; `jaxflow.transport.rpc` serves the same object to other processes.

    Args:
      source: where the prompts of new groups come from.
      batch_groups: groups per train step (B).
      group_size: samples per prompt (n).
      eta: the staleness bound, in policy versions.
      batch_rule: "full" waits for B groups; "ready_with_capacity" also releases a buffer holding at least
        ceil(min_fill * B) groups once no reservation points at it and either `patience_s` has passed since
        it reached that fill or nothing else can arrive.
      min_fill: the share of B a "ready_with_capacity" buffer needs before it may be released, in (0, 1].
      patience_s: seconds a "ready_with_capacity" buffer waits after reaching min_fill (None: until
        nothing else can arrive).
      max_attempts: dispatches of one group before it is failed.
      initial_version: the trainer's policy version at start.
      reserve_groups: reservations per buffer (B' >= B, default B); above B is redundant rollout.
      clock: the time source, seconds (a simulator passes its virtual clock; tests a fake one).
      lease_s: seconds a dispatched group stays with its worker without a `renew` (None: for ever).
      vocab_size: the model's vocabulary size: `finish` refuses token ids at or above it (None: no model is
        known; ids must still be below 2**31).
      max_sequence_tokens: the most tokens of a group's prompt plus one of its samples, the trainer's row
        (rollout.max_len): `finish` refuses longer samples (None: no cap); a sample split into training
        sequences (`Sample.sequence_starts`), one whose longest sequence with its context is longer.
      route_spec: the routing a mixture-of-experts model records per token (`RouteSpec.of(model config)`):
        samples' routes must have its shape and expert ids. None: a dense model; samples carrying routes
        are refused.
    """

    def __init__(self, source: PromptSource, *, batch_groups: int, group_size: int, eta: int,
                 batch_rule: str = "full", min_fill: float = 1.0, patience_s: float | None = None,
                 max_attempts: int = 3, initial_version: int = 0, reserve_groups: int | None = None,
                 clock=time.monotonic, lease_s: float | None = 60.0, vocab_size: int | None = None,
                 max_sequence_tokens: int | None = None, route_spec: RouteSpec | None = None):
        if route_spec is not None and not isinstance(route_spec, RouteSpec):
            raise TypeError(f"route_spec must be None or a RouteSpec, got {route_spec!r:.80}")
        self.route_spec = route_spec
        for name, value in (("vocab_size", vocab_size), ("max_sequence_tokens", max_sequence_tokens)):
            if value is not None:
                checks.check_int(name, value, 1)
        self.vocab_size, self.max_sequence_tokens = vocab_size, max_sequence_tokens
        if lease_s is not None and not (checks.is_number(lease_s) and 0 < lease_s < math.inf):
            raise ValueError(f"lease_s must be None or a finite number of seconds > 0, got {lease_s!r}")
        self.lease_s = None if lease_s is None else float(lease_s)
        if batch_rule not in BATCH_RULES:
            raise ValueError(f"unknown batch_rule {batch_rule!r}; valid: {', '.join(BATCH_RULES)}")
        if batch_groups < 1 or group_size < 1 or eta < 0:
            raise ValueError(f"need batch_groups >= 1, group_size >= 1, eta >= 0; got {batch_groups}, "
                             f"{group_size}, {eta}")
        if not 0 < min_fill <= 1:
            raise ValueError(f"min_fill must be in (0, 1], got {min_fill}")
        reserve_groups = batch_groups if reserve_groups is None else reserve_groups
        if reserve_groups < batch_groups:
            raise ValueError(f"reserve_groups ({reserve_groups}) must be >= batch_groups ({batch_groups})")
        self.reserve_groups, self._clock = reserve_groups, clock
        self.source = source
        self.batch_groups, self.group_size, self.eta = batch_groups, group_size, eta
        self.batch_rule, self.min_fill, self.patience_s = batch_rule, min_fill, patience_s
        self.max_attempts = max_attempts
        self._lock = threading.Condition()
        self._v_train = initial_version  # the buffer the trainer consumes next
        self._published = initial_version  # newest weights version rollout workers may hold
        self._next_id = 0
        self._groups: dict[int, _Group] = {}
        self._counts = {k: 0 for k in ("created", "dispatched", "aborted", "requeued", "finished",
                                       "rewarded", "consumed", "failed", "surplus", "stale_rejected",
                                       "expired", "recovered_tokens", "consume_superseded", "refused",
                                       *(f"refused_{r}" for r in REFUSAL_REASONS))}
        self._filled_at: dict[int, float] = {}  # step -> when it reached min fill
        # Slots per buffer step, kept in step with every transition (dispatch must stay O(1)).
        self._reserved: collections.Counter[int] = collections.Counter()
        self._occupied: collections.Counter[int] = collections.Counter()
        self._released: set[int] = set()  # buffers `release`d: consumable with what they hold
        self._surplus_news: dict[str, list[int]] = collections.defaultdict(list)  # worker -> ids
        self._dropped: set[int] = set()  # SURPLUS ids (they leave the service; late calls are ignored)
        self._leases = Leases(self.lease_s)
        self._last: ConsumedBatch | None = None  # the batch consumed last, until the next consume or ack
        self._consume_calls = 0  # consume calls for the next buffer so far; only the newest may take it
        self._consume_waiting = 0  # consume calls waiting now (a gauge in `stats`)

    # ---- helpers (hold the lock) -------------------------------------------------------------
    def _slots(self, step: int) -> int:
        """Reserved + occupied slots of buffer `step`."""
        return self._reserved[step] + self._occupied[step]

    def _recount(self) -> None:
        self._reserved.clear()
        self._occupied.clear()
        for g in self._groups.values():
            if g.state == GroupState.OCCUPIED:
                self._occupied[g.step] += 1
            elif g.reserved >= 0:
                self._reserved[g.reserved] += 1

    def _group(self, group_id: int, want: GroupState, worker: str | None = None) -> _Group:
        g = self._groups.get(group_id)
        if worker is not None and self._leases.lapsed(group_id, worker) and (
                g is None or g.state != want or g.worker != worker):
            raise ValueError(f"group {group_id}: the lease of worker {worker!r} expired and the group was handed "
                             f"back; it is not held by {worker!r} any more")
        if g is None:
            raise KeyError(f"unknown group {group_id}")
        if g.state != want:
            raise ValueError(f"group {group_id} is {g.state.value}, not {want.value}")
        if worker is not None and g.worker != worker:
            raise ValueError(f"group {group_id} is assigned to worker {g.worker!r}, not {worker!r}")
        return g

    def _move(self, g: _Group, state: GroupState) -> None:
        g.state, g.since = state, self._clock()

    def _expire(self) -> None:
        """Hands back (requeues, counted) every running group whose lease ran out."""
        def holder(gid):
            g = self._groups.get(gid)
            return g.worker if g is not None and g.state == GroupState.RUNNING else None
        for gid in list(self._leases.expired(self._clock(), holder)):
            g = self._groups[gid]
            self._counts["expired"] += 1
            self._requeue(g, f"lease of worker {g.worker!r} expired", recovered=True)
            self._lock.notify_all()

    def renew(self, worker: str, group_ids: list[int],
              progress: dict[int, list[Sample]] | None = None) -> list[int]:
        """Extends the leases of `worker`'s running groups `group_ids` by lease_s from now. Returns the ids
        it does not hold (any more): expired and handed back, dropped, finished or unknown; stop those.

        progress: for some of `group_ids`, the group's n samples so far (finished ones complete, the others
        partial), kept in place of what the service held: if the worker then dies (`release_worker`, or
        its lease runs out) the group is dispatched again with them as `partial`, and the tokens are
        not generated twice. Checked in full first (a key not in `group_ids`, or samples that `abort`
        would refuse, raises and changes nothing); the progress of a group the worker does not hold is
        ignored, that group being among those returned."""
        progress = checks.check_renewal(worker, group_ids, progress)
        with self._lock:
            self._expire()
            held, lost = [], []
            for gid in group_ids:
                g = self._groups.get(gid)
                if g is not None and g.state == GroupState.RUNNING and g.worker == worker:
                    if gid in progress:
                        self._check_samples(g, progress[gid], "progress", finished=False)
                    held.append(g)
                else:
                    lost.append(gid)
            for g in held:
                self._leases.grant(g.group_id, self._clock())
                if g.group_id in progress:
                    g.samples = own_samples(progress[g.group_id], self.route_spec)
            return lost

    def _check_samples(self, g: _Group, samples: list[Sample], what: str, finished: bool) -> None:
        checks.check_samples(g.group_id, g.n, samples, what, g.v_start, self._published, finished,
                             route_spec=self.route_spec)

    def _check_finished(self, g: _Group, samples: list[Sample], rewards: list[float] | None) -> None:
        """`finish`'s checks: the samples against the model too (vocab, row length), and the rewards.
        A refusal is counted by reason and re-raised; nothing else changes."""
        max_tokens = None if self.max_sequence_tokens is None else self.max_sequence_tokens - len(g.prompt)
        try:
            checks.check_samples(g.group_id, g.n, samples, "finish", g.v_start, self._published, True,
                                 vocab_size=self.vocab_size, max_tokens=max_tokens, route_spec=self.route_spec,
                                 prompt_tokens=len(g.prompt))
            if rewards is not None:
                checks.check_rewards(g.group_id, g.n, rewards)
        except SampleRefused as e:
            self._refused(e)
            raise

    def _refused(self, e: SampleRefused) -> None:
        self._counts["refused"] += 1
        self._counts[f"refused_{e.reason}"] += 1

    # ---- rollout side --------------------------------------------------------------------------
    def needs_sync(self, version: int) -> bool:
        """True when a worker holding `version` can no longer be given work (version + eta < v_train)."""
        checks.check_int("version", version)
        with self._lock:
            return version + self.eta < self._v_train

    def dispatch(self, worker: str, version: int, max_groups: int = 1) -> list[GroupTask]:
        """Up to `max_groups` tasks for a worker holding weights `version`: requeued groups first
        (oldest v_start first; only those with v_start <= version), then new prompts, each reserving a
        slot in buffer version + eta. Returns [] when no slot is free or the worker must sync.
        """
        checks.check_str("worker", worker, empty_ok=False)
        checks.check_int("version", version, 0)
        checks.check_int("max_groups", max_groups, 1)
        with self._lock:
            self._expire()
            if version > self._published:
                raise ValueError(f"worker {worker!r} claims version {version}, but the latest published "
                                 f"version is {self._published}")
            tasks = []
            waiting = sorted((g for g in self._groups.values()
                              if g.state == GroupState.REQUEUED and g.v_start <= version),
                             key=lambda g: (g.v_start, g.group_id))
            for g in waiting[:max_groups]:
                g.worker, g.attempt = worker, g.attempt + 1
                self._move(g, GroupState.RUNNING)
                self._leases.grant(g.group_id, self._clock())
                tasks.append(group_task(g))
            step = version + self.eta
            while (len(tasks) < max_groups and step >= self._v_train and self._room(step)
                   and self._slots(step) < self.reserve_groups):
                record = self.source.next()
                if record is None:
                    break
                g = _Group(group_id=self._next_id, prompt=record["prompt"], meta=record["meta"],
                           n=self.group_size, v_start=version, reserved=step, state=GroupState.RUNNING,
                           worker=worker, attempt=1, since=self._clock())
                self._next_id += 1
                self._groups[g.group_id] = g
                self._reserved[step] += 1
                self._counts["created"] += 1
                self._leases.grant(g.group_id, self._clock())
                tasks.append(group_task(g))
            if step < self._v_train:
                self._counts["stale_rejected"] += 1
            self._counts["dispatched"] += len(tasks)
            return tasks

    def finish(self, group_id: int, worker: str, samples: list[Sample],
               rewards: list[float] | None = None) -> int | None:
        """All n samples of a running group are done. With rewards the group occupies a buffer at once
        (returns its step); without, it waits for `reward`. Validated before anything changes: samples or
        rewards that cannot be trained on raise SampleRefused, counted (module docstring)."""
        checks.check_int("group_id", group_id)
        checks.check_str("worker", worker, empty_ok=False)
        with self._lock:
            self._expire()
            if group_id in self._dropped:
                return None
            g = self._group(group_id, GroupState.RUNNING, worker)
            self._check_finished(g, samples, rewards)
            g.samples = own_samples(samples, self.route_spec)  # the service now owns these Samples
            self._move(g, GroupState.FINISHED)
            self._counts["finished"] += 1
            return self._occupy(g, rewards) if rewards is not None else None

    def reward(self, group_id: int, rewards: list[float]) -> int:
        """Rewards for a finished group; it occupies the earliest feasible buffer. Returns the step."""
        checks.check_int("group_id", group_id)
        with self._lock:
            g = self._group(group_id, GroupState.FINISHED)
            try:
                checks.check_rewards(g.group_id, g.n, rewards)
            except SampleRefused as e:
                self._refused(e)
                raise
            return self._occupy(g, rewards)

    def _room(self, step: int) -> bool:
        """Whether a finishing group may occupy buffer `step`. Without redundancy a group never takes a
        slot another group reserved; with it, the first B to finish win."""
        if step in self._released:
            return False
        if self.reserve_groups == self.batch_groups:
            return self._slots(step) < self.batch_groups
        return self._occupied[step] < self.batch_groups

    def _occupy(self, g: _Group, rewards: list[float]) -> int | None:
        g.rewards = [float(r) for r in rewards]
        reserved, g.reserved = g.reserved, -1  # release our slot before looking for room
        self._reserved[reserved] -= 1
        step = next((s for s in range(self._v_train, reserved + 1) if self._room(s)), None)
        self._counts["rewarded"] += 1
        if step is None:  # only with redundancy (or a released buffer): the others were first
            self._drop(g, notify=False)
            self._lock.notify_all()
            return None
        self._occupied[step] += 1
        g.step, g.worker = step, None
        self._move(g, GroupState.OCCUPIED)
        if self._occupied[step] >= self.batch_groups and self.reserve_groups > self.batch_groups:
            self._drop_unlandable()
        self._lock.notify_all()
        return step

    def _drop(self, g: _Group, notify: bool = True) -> None:
        """A group that can no longer land anywhere becomes SURPLUS and leaves the service (counted);
        its worker hears of it through `take_surplus`."""
        if g.reserved >= 0:
            self._reserved[g.reserved] -= 1
        if notify and g.state == GroupState.RUNNING and g.worker is not None:
            self._surplus_news[g.worker].append(g.group_id)
        self._move(g, GroupState.SURPLUS)
        self._counts["surplus"] += 1
        self._dropped.add(g.group_id)
        if len(self._dropped) > _DROPPED_KEPT:  # forget the oldest half: nobody still calls about them
            cutoff = sorted(self._dropped)[_DROPPED_KEPT // 2]
            self._dropped = {i for i in self._dropped if i >= cutoff}
        del self._groups[g.group_id]

    def _can_land(self, g: _Group) -> bool:
        self._reserved[g.reserved] -= 1  # its own slot is its own to take
        ok = any(self._room(s) for s in range(self._v_train, g.reserved + 1))
        self._reserved[g.reserved] += 1
        return ok

    def _drop_unlandable(self) -> None:
        for g in list(self._groups.values()):
            if g.state in (GroupState.RUNNING, GroupState.REQUEUED) and g.reserved >= 0 \
                    and not self._can_land(g):
                self._drop(g)

    def take_surplus(self, worker: str) -> list[int]:
        """Ids of `worker`'s running groups dropped as SURPLUS since the last call: stop generating them.
        A `finish` or `abort` of one of them is accepted and ignored."""
        checks.check_str("worker", worker)
        with self._lock:
            return self._surplus_news.pop(worker, [])

    def progress(self) -> tuple[int, int]:
        """(the buffer the trainer consumes next, how many groups it holds), in O(1) for coordinators."""
        with self._lock:
            return self._v_train, self._occupied[self._v_train]

    def release(self, step: int | None = None) -> int:
        """Hands buffer `step` (default: the next one) to the trainer with what it holds, as
        READY_WITH_CAPACITY: no group may occupy it any more, and groups that could land nowhere else
        become SURPLUS. Returns how many were dropped."""
        if step is not None:
            checks.check_int("step", step, 0)
        with self._lock:
            step = self._v_train if step is None else step
            if step < self._v_train:
                raise ValueError(f"buffer {step} was already consumed (next is {self._v_train})")
            before = self._counts["surplus"]
            self._released.add(step)
            self._drop_unlandable()
            self._lock.notify_all()
            return self._counts["surplus"] - before

    def abort(self, group_id: int, worker: str, partial: list[Sample] | None = None,
              reason: str = "") -> None:
        """A running group stops (weight sync, migration, shutdown); it keeps its reservation, its
        v_start and the tokens so far in `partial`, and is dispatched again (or failed after
        max_attempts dispatches)."""
        checks.check_int("group_id", group_id)
        checks.check_str("worker", worker, empty_ok=False)
        checks.check_str("reason", reason)
        with self._lock:
            self._expire()
            if group_id in self._dropped:
                return
            g = self._group(group_id, GroupState.RUNNING, worker)
            if partial is not None:
                self._check_samples(g, partial, "abort", finished=False)
                g.samples = own_samples(partial, self.route_spec)
            self._counts["aborted"] += 1
            self._requeue(g, reason or "aborted")

    def _requeue(self, g: _Group, reason: str, count_attempt: bool = True, recovered: bool = False) -> None:
        """recovered: its worker did not hand it back (dead or gone); count the tokens it still has."""
        g.worker = None
        if recovered and g.samples is not None:
            self._counts["recovered_tokens"] += sum(len(s.tokens) for s in g.samples)
        if count_attempt and g.attempt >= self.max_attempts:
            self._fail(g, f"{reason}; gave up after {g.attempt} attempts")
            return
        self._move(g, GroupState.REQUEUED)
        self._counts["requeued"] += 1

    def _fail(self, g: _Group, reason: str) -> None:
        if g.reserved >= 0:
            self._reserved[g.reserved] -= 1
        g.reserved, g.worker = -1, None
        g.meta = {**g.meta, "failure": reason}
        self._move(g, GroupState.FAILED)
        self._counts["failed"] += 1
        self._lock.notify_all()

    def fail(self, group_id: int, reason: str) -> None:
        """Gives up on a running, requeued or finished group (its slot is freed); counted, never silent."""
        checks.check_int("group_id", group_id)
        checks.check_str("reason", reason)
        with self._lock:
            if group_id in self._dropped:
                return
            g = self._groups.get(group_id)
            if g is None:
                raise KeyError(f"unknown group {group_id}")
            if g.state not in (GroupState.RUNNING, GroupState.REQUEUED, GroupState.FINISHED):
                raise ValueError(f"group {group_id} is {g.state.value}; only running, requeued or "
                                 f"finished groups can fail")
            self._fail(g, reason)

    def release_worker(self, worker: str, reason: str = "worker gone") -> int:
        """Requeues every group running on `worker` (it crashed or left); returns how many."""
        checks.check_str("worker", worker)
        checks.check_str("reason", reason)
        with self._lock:
            mine = [g for g in self._groups.values() if g.state == GroupState.RUNNING and g.worker == worker]
            for g in mine:
                self._counts["aborted"] += 1
                self._requeue(g, reason, recovered=True)
            return len(mine)

    def unrewarded(self) -> list[FinishedGroup]:
        """Finished groups still waiting for rewards (e.g. after a restore)."""
        with self._lock:
            return [FinishedGroup(g.group_id, list(g.prompt), g.v_start, list(g.samples), [], dict(g.meta))
                    for g in self._groups.values() if g.state == GroupState.FINISHED]

    # ---- trainer side --------------------------------------------------------------------------
    def mark_published(self, version: int) -> None:
        """The trainer made weights `version` available; workers may now hold it."""
        checks.check_int("version", version, 0)
        with self._lock:
            if version < self._published or version > self._v_train:
                raise ValueError(f"cannot publish version {version}: latest published {self._published}, "
                                 f"trainer at {self._v_train}")
            self._published = version
            self._lock.notify_all()

    def buffer_state(self, step: int | None = None) -> str:
        """State of buffer `step` (default: the one the trainer consumes next), a BufferState value."""
        if step is not None:
            checks.check_int("step", step, 0)
        with self._lock:
            return self._buffer_state(self._v_train if step is None else step).value

    def _can_arrive(self, step: int) -> bool:
        """Whether any group may still land in buffer `step`."""
        in_flight = any(g.state in (GroupState.RUNNING, GroupState.REQUEUED, GroupState.FINISHED)
                        and g.v_start <= step for g in self._groups.values())
        return in_flight or not self.source.exhausted

    def _buffer_state(self, step: int) -> BufferState:
        occupied = self._occupied[step]
        if occupied >= self.batch_groups:
            return BufferState.READY
        if step in self._released:
            return BufferState.READY_WITH_CAPACITY
        arriving = self._can_arrive(step)
        if self.batch_rule == "ready_with_capacity":
            reserved = self._slots(step) - occupied
            if occupied >= math.ceil(self.min_fill * self.batch_groups) and reserved == 0:
                now = self._clock()
                since = self._filled_at.setdefault(step, now)
                if not arriving or (self.patience_s is not None and now - since >= self.patience_s):
                    return BufferState.READY_WITH_CAPACITY
        if not arriving:
            return BufferState.STUCK
        return BufferState.PENDING

    def consume(self, version: int, timeout: float | None = None) -> ConsumedBatch:
        """Blocks until buffer `version` is ready and hands its groups to the trainer.

        A STUCK buffer (nothing more can arrive) is handed over with what it holds, possibly nothing:
        the end of the data. Raises TimeoutError if not ready within `timeout` seconds.

        Asking again for the step consumed last (its reply was lost) returns the same batch, not counted
        again, until the next step is consumed or `ack(version)` releases it. A call still waiting when a
        newer one for the same buffer arrives raises ConsumeSuperseded and takes nothing.
        """
        checks.check_int("version", version, 0)
        timeout = checks.check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._last is not None and version == self._last.step:
                return self._last
            if version != self._v_train:
                raise ValueError(f"trainer asks for buffer {version}, but the next buffer is {self._v_train}")
            # A call still waiting here was given up on by its client (the trainer consumes one buffer at a
            # time): this newer one supersedes it, so the batch goes to a caller that is still there.
            self._consume_calls += 1
            call = self._consume_calls
            self._lock.notify_all()
            self._consume_waiting += 1
            try:
                state = self._wait_ready(version, call, deadline, timeout)
            finally:
                self._consume_waiting -= 1
            groups = sorted((g for g in self._groups.values()
                             if g.state == GroupState.OCCUPIED and g.step == version), key=lambda g: g.group_id)
            for g in groups:
                assert version - g.v_start <= self.eta, f"staleness bound broken by group {g.group_id}"
                self._move(g, GroupState.CONSUMED)
            self._counts["consumed"] += len(groups)
            for g in groups:  # consumed groups leave the service; the counters keep their history
                del self._groups[g.group_id]
            self._occupied.pop(version, None)
            self._reserved.pop(version, None)
            self._v_train = version + 1
            self._filled_at.pop(version, None)
            self._released.discard(version)
            self._lock.notify_all()
            self._last = ConsumedBatch(version, [FinishedGroup(g.group_id, g.prompt, g.v_start, g.samples,
                                                               g.rewards, g.meta, g.step) for g in groups],
                                       state.value)
            return self._last

    def _wait_ready(self, version: int, call: int, deadline: float | None, timeout: float | None) -> BufferState:
        """Waits (holding the lock between waits) until buffer `version` is not PENDING; its state. Raises
        ConsumeSuperseded once a newer consume call arrived, TimeoutError after `deadline`."""
        while True:
            if call != self._consume_calls:
                self._counts["consume_superseded"] += 1
                raise ConsumeSuperseded(f"consume({version}) gave way to a newer call for buffer {version} "
                                        f"(its client gave up and asked again); it took nothing")
            state = self._buffer_state(version)
            if state != BufferState.PENDING:
                return state
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"buffer {version} not ready after {timeout}s: {self._summary(version)}")
            # Re-check patience timers and leases now and then (waiters are notified of the rest).
            wait = 0.05 if self.patience_s is not None else 0.25 if self.lease_s is not None else None
            self._lock.wait(wait if left is None else min(left, wait or left))
            self._expire()

    def ack(self, version: int) -> None:
        """The trainer received batch `version`: the service need not keep it for a repeated `consume`."""
        checks.check_int("version", version, 0)
        with self._lock:
            if self._last is not None and self._last.step == version:
                self._last = None

    def _summary(self, step: int) -> str:
        return (f"{self._slots(step)} of {self.batch_groups} slots taken; groups by state "
                f"{census(self._groups.values())}")

    def stats(self) -> dict[str, Any]:
        """Counters of every transition and gauges of every state, for logs and accounting checks."""
        with self._lock:
            self._expire()  # leases run out lazily: any call applies what is due
            gauges = {**{s.value: 0 for s in GroupState}, **census(self._groups.values())}
            gauges["consumed"] = self._counts["consumed"]
            gauges["surplus"] = self._counts["surplus"]
            steps = sorted(k for k in set(self._reserved) | set(self._occupied) if self._slots(k))
            buffers = {s: {"reserved": self._reserved[s], "occupied": self._occupied[s]} for s in steps}
            return {"v_train": self._v_train, "published": self._published, "counts": dict(self._counts),
                    "groups": gauges, "buffers": buffers, "next_buffer": self._summary(self._v_train),
                    "consume_waiting": self._consume_waiting}

    # ---- snapshot ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A JSON-serialisable copy of the whole service state (taken with the trainer's checkpoint)."""
        with self._lock:
            groups = []
            for g in self._groups.values():
                groups.append({**dataclasses.asdict(dataclasses.replace(g, samples=None)), "state": g.state.value,
                               "samples": snapshot_samples(g.samples)})
            return {"v_train": self._v_train, "published": self._published, "next_id": self._next_id,
                    "counts": dict(self._counts), "groups": groups, "source": self.source.get_state()}

    def restore(self, snap: dict[str, Any]) -> None:
        """Replaces the state with a snapshot. Groups that were running are requeued (their workers are
        gone) with their reservations and partial samples, so nothing is lost or consumed twice."""
        parsed = parse_snapshot(snap, group_fields=FIELDS,
                                states={s.value: s for s in GroupState}, n=self.group_size,
                                batch_groups=self.batch_groups, reserve_groups=self.reserve_groups, eta=self.eta,
                                route_spec=self.route_spec)
        with self._lock:
            old_source = self.source.get_state()
            self.source.set_state(parsed["source"])
            if self.source.get_state() != parsed["source"]:
                self.source.set_state(old_source)
                raise ValueError(f"snapshot source {parsed['source']!r} cannot be restored")
            self._v_train, self._published, self._next_id = parsed["v_train"], parsed["published"], parsed["next_id"]
            self._counts = {**{k: 0 for k in self._counts}, **parsed["counts"]}
            self._groups, self._last = {}, None
            self._leases.clear()
            for d in parsed["groups"]:
                g = _Group(**d)
                g.since = self._clock()
                self._groups[g.group_id] = g
                if g.state == GroupState.RUNNING:
                    self._counts["aborted"] += 1
                    self._requeue(g, "trainer restart", count_attempt=False)
            self._recount()
            self.source.set_state(snap["source"])
            self._filled_at.clear()
            self._lock.notify_all()

    def __getstate__(self) -> dict[str, Any]:  # pickled into another process (a Ray actor): a new lock there
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Condition())
