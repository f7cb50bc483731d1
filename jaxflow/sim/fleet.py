"""A discrete-event simulated rollout fleet: many LLM inference instances in virtual time.

Each instance is a `SimEngine`, a real `rollout_bridge.engine.Engine` (submit / poll / abort /
update_weights / pause / resume / load), so a coordinator drives it exactly like a JAX or vLLM engine.
Nothing happens between calls: the simulation loop moves the clock with `SimFleet.advance(t)`, and every
instance generates what it would have generated from `now` to t. `poll` never blocks.

Requests. The prompt is `[prompt_index]` (see `Workload.records`); the sample index is the integer after
the last ":" of the request id. The target length L = workload.length(prompt_index, sample_index); with
cap = params.max_tokens the sample stops at L ("stop") or, when L >= cap, at cap ("length"). A request
with a `prefix` (a partial sample from an abort, maybe from another engine) resumes: the prefix counts as
generated and starting it costs the prefill of prompt + prefix.

Samples are in BLOCKS. `Sample.tokens`, `.logprobs` and `.versions` hold one entry per block of
`workload.block_tokens` tokens (tokens 0, log-probs -1.0, versions the engine version that generated the
block's last token), so a 3000-token sample with 256-token blocks has 12 entries (the last block may be
partial). A partial sample from an abort holds only the whole blocks generated so far: progress is
rounded down to a block and the rest is lost (as if recomputed). A prefix of k entries counts as k blocks.

Cost model, per instance with n running sequences holding kv KV tokens (prompt + generated each):

    decode step = (step_s + per_seq_s * n + per_kv_token_s * kv) / speed   seconds, one token per sequence

Decoding is fluid: over dt each running sequence gains dt / step tokens. Stalls (nothing generated)
come first in an advance: admitting a sequence costs (prompt + its tokens so far) / prefill_tokens_per_s,
a weight update sync_s plus the recompute of the running sequences' KV, all divided by speed.

Scheduling: waiting requests are admitted FIFO while running < max_running and the KV cache holds the
newcomer's prompt + tokens; when growing sequences overflow kv_capacity, the most recently admitted one
is preempted to the front of the queue, keeping its progress (re-admission recomputes it).

Time quantisation: an advance is cut into at most `max_substeps` sub-steps per instance; each but the
last ends where the instance's first sequence finishes, so the time after a finish goes to the others (at
the new, faster step) and to admissions. In the last sub-step, sequences reaching their target stop there
and time left over counts as idle. The step time is re-evaluated per sub-step (KV growth within one is
ignored). Finished samples appear in `poll` after the advance. A paused instance still serves its
pending stall (e.g. a weight load), then idles.

Per-sequence state lives in [instances, max_running] numpy arrays, so an advance is a few vectorized
passes over the fleet; Python runs per sequence only at submit, finish, abort, preemption and sync.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import sys
from collections.abc import Iterable, Mapping

import numpy as np

from jaxflow.data.records import Sample
from jaxflow.sim.workload import Workload
from rollout_bridge import engine as engine_api
from rollout_bridge.engine import (
    Completion,
    Engine,
    EngineLoad,
    Request,
    WeightsRejected,
)

_EPS = 1e-6  # tokens: a sequence this close to its target has finished


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    """One inference instance (defaults: roughly an 8B model on one H100 under vLLM).

    step_s, per_seq_s, per_kv_token_s: the decode step cost (see the module docstring). kv_capacity: KV
    cache size in tokens. max_running: sequences decoded at once (others wait). prefill_tokens_per_s:
    prefill / recompute speed. sync_s: time to load new weights. speed: a multiplier on everything
    (0.5 doubles every time).
    """

    step_s: float = 0.01
    per_seq_s: float = 1e-4
    per_kv_token_s: float = 4e-8
    kv_capacity: int = 400_000
    max_running: int = 128
    prefill_tokens_per_s: float = 30_000.0
    sync_s: float = 5.0
    speed: float = 1.0

    def __post_init__(self):
        def bad(name, what):
            return ValueError(f"InstanceSpec.{name} must be {what}, got {getattr(self, name)!r}")

        for name, low_ok, inf_ok in [("step_s", True, False), ("per_seq_s", True, False),
                                     ("per_kv_token_s", True, False), ("sync_s", True, False),
                                     ("prefill_tokens_per_s", False, True), ("speed", False, False)]:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v >= 0 if low_ok else v > 0):
                raise bad(name, "a number " + (">= 0" if low_ok else "> 0"))
            if math.isinf(v) and not inf_ok:
                raise bad(name, "finite")
        for name in ("kv_capacity", "max_running"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise bad(name, "an int >= 1")
        if self.step_s + self.per_seq_s + self.per_kv_token_s == 0:
            raise ValueError("InstanceSpec: step_s, per_seq_s and per_kv_token_s are all 0 (a free decode step)")


@dataclasses.dataclass(slots=True, eq=False)
class _Seq:
    """A request in flight: target and progress in tokens (prefix included; progress is up to date
    only while out of a slot), and (token position, version) segments of what this engine generated."""

    request_id: str
    prefix_versions: list[int]
    progress: float
    target: float
    reason: str
    segments: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    slot: int | None = None
    order: int = 0


class SimFleet:
    """All simulated instances; `engines[i]` is the Engine view of instance i. See the module docstring."""

    def __init__(self, specs: list[InstanceSpec], workload: Workload, *, start_version: int = 0,
                 max_substeps: int = 4):
        if not specs:
            raise ValueError("specs is empty: a fleet needs at least one instance")
        if max_substeps < 1:
            raise ValueError(f"max_substeps must be >= 1, got {max_substeps}")
        self.specs, self.workload, self.max_substeps = list(specs), workload, max_substeps
        self.now = 0.0
        e, rows = len(self.specs), max(s.max_running for s in self.specs)

        def field(name, dtype=np.float64):
            return np.array([getattr(s, name) for s in self.specs], dtype=dtype)

        self._a, self._b, self._c = field("step_s"), field("per_seq_s"), field("per_kv_token_s")
        self._speed, self._prefill, self._sync = field("speed"), field("prefill_tokens_per_s"), field("sync_s")
        self._kv_cap = field("kv_capacity")
        # Python ints, not an array: the coordinator reads an engine's version many times per tick.
        self._version = [int(start_version)] * e
        self._stall = np.zeros(e)
        self._paused = np.zeros(e, bool)
        self._n = np.zeros(e, np.int64)
        self._kv = np.zeros(e)  # KV tokens held (prompt + progress of running sequences), kept up to date
        # Per slot: active, tokens so far (0 when free), tokens left (inf when free).
        self._active = np.zeros((e, rows), bool)
        self._progress = np.zeros((e, rows))
        self._left = np.full((e, rows), np.inf)
        self._rate = np.zeros(e)  # tokens decoded per second over the last advance
        self._stat = {k: np.zeros(e) for k in ("tokens", "decode_s", "stall_s", "idle_s")}
        self._count = {k: np.zeros(e, np.int64) for k in ("syncs", "preemptions", "completions")}
        self.engines = [SimEngine(self, i) for i in range(e)]

    def advance(self, t: float) -> None:
        """Moves every instance from `now` to virtual time t (seconds)."""
        dt = float(t) - self.now
        if dt < 0:
            raise ValueError(f"advance({t}) goes back in time (now is {self.now})")
        if dt == 0:
            return
        rem = np.full(len(self.specs), dt)
        tokens = np.zeros(len(self.specs))
        prompt = self.workload.prompt_tokens
        for sub in range(self.max_substeps):
            last = sub == self.max_substeps - 1
            stalled = np.minimum(self._stall, rem)
            self._stall -= stalled
            self._stat["stall_s"] += stalled
            rem -= stalled
            decoding = (self._n > 0) & ~self._paused & (rem > 0)
            idle = ~decoding & (rem > 0)
            self._stat["idle_s"][idle] += rem[idle]
            rem[idle] = 0.0
            if not decoding.any():
                break
            kv = prompt * self._n + self._progress.sum(1)  # exact again (no drift from the updates)
            step = (self._a + self._b * self._n + self._c * kv) / self._speed
            rate = np.divide(1.0, step, out=np.zeros_like(step), where=decoding)
            if last:  # until the slowest finishes; the rest of the time is idle
                need = np.where(self._active, self._left, 0.0).max(1)
            else:  # until the first finishes
                need = self._left.min(1)
            h = np.where(decoding, np.minimum(rem, np.divide(need, rate, out=np.zeros_like(need),
                                                             where=decoding)), 0.0)
            inc = np.minimum(self._left, (rate * h)[:, None])
            inc *= self._active
            self._left -= inc
            self._progress += inc
            got = inc.sum(1)
            self._kv = kv + got
            tokens += got
            self._stat["tokens"] += got
            self._stat["decode_s"] += h
            rem -= h
            if last:
                self._stat["idle_s"] += rem
                rem[:] = 0.0
            done_i, done_r = np.nonzero(self._left <= _EPS)
            if len(done_i):
                self._free_slots(done_i, done_r)
                for i, r in zip(done_i.tolist(), done_r.tolist()):
                    self.engines[i]._finish(r)
            for i in np.nonzero(self._kv > self._kv_cap)[0].tolist():
                self.engines[i]._preempt_overflow()
            for i in dict.fromkeys(done_i.tolist()):  # np.nonzero lists rows in ascending order
                self.engines[i]._admit()
            if not (rem > 0).any():
                break
        self._rate = tokens / dt
        self.now = float(t)

    def _free_slots(self, rows: np.ndarray, cols: np.ndarray) -> None:
        """The array side of finishing the sequences in slots (rows, cols), at once."""
        e = len(self.specs)
        held = self.workload.prompt_tokens + self._progress[rows, cols]
        self._active[rows, cols], self._progress[rows, cols], self._left[rows, cols] = False, 0.0, np.inf
        self._n -= np.bincount(rows, minlength=e)
        self._kv = np.where(self._n > 0, self._kv - np.bincount(rows, held, minlength=e), 0.0)
        self._count["completions"] += np.bincount(rows, minlength=e)

    def stats(self) -> dict:
        """{"now", "engines": [per instance], "total"}, each with tokens (generated, aborted work
        included), decode_s, stall_s (sync + prefill / recompute), idle_s, syncs, preemptions, completions.
        decode_s + stall_s + idle_s is the time each instance has lived (`now`)."""
        keys = [*self._stat, *self._count]
        columns = {**self._stat, **self._count}
        per = [{k: columns[k][i].item() for k in keys} for i in range(len(self.specs))]
        total = {k: columns[k].sum().item() for k in keys}
        return {"now": self.now, "engines": per, "total": total}


class SimEngine(Engine):
    """Instance `index` of a SimFleet as an Engine; time moves only with `SimFleet.advance`."""

    def __init__(self, fleet: SimFleet, index: int):
        self._fleet, self.index = fleet, index
        self.spec = fleet.specs[index]
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._in_flight: dict[str, _Seq] = {}
        self._slots: list[_Seq | None] = [None] * self.spec.max_running
        self._free = list(range(self.spec.max_running - 1, -1, -1))
        self._done: list[Completion] = []
        self._order = 0

    # ----- the Engine interface -----

    @property
    def version(self) -> int:
        return self._fleet._version[self.index]

    def submit(self, request: Request) -> None:
        """Queues `request` (admitted at once if it fits). A malformed one (prompt not [prompt_index], id
        without ":<sample index>", bad params, or a sample longer than the KV cache) comes back from
        `poll` with finish_reason "error", as a real engine does."""
        rid = request.request_id
        if rid in self._in_flight:
            raise ValueError(f"request id {rid!r} is already in flight on sim engine {self.index}")
        f, block = self._fleet, self._fleet.workload.block_tokens
        prefix = request.prefix or Sample()
        error = engine_api.request_error(request, vocab_size=sys.maxsize, context=sys.maxsize,
                                         context_name="(unbounded)")
        try:
            sample_index = int(rid.rsplit(":", 1)[1])
        except (IndexError, ValueError):
            sample_index = -1
        if error is None and sample_index < 0:
            error = f"request id {rid!r} does not end in ':<sample index>'"
        if error is None:
            length = f.workload.length(int(request.prompt[0]), sample_index)
            cap = request.params.max_tokens
            target = float(min(length, cap))
            done_tokens = len(prefix.tokens) * block
            need = f.workload.prompt_tokens + max(target, done_tokens)
            if need > self.spec.kv_capacity:
                error = f"prompt + sample = {need:.0f} tokens exceeds kv_capacity {self.spec.kv_capacity}"
        if error is not None:
            sample = engine_api.copy_prefix(request)  # the prefix as it came (env spans, routes and all)
            sample.finish_reason = "error"
            self._done.append(Completion(rid, sample, error))
            return
        seq = _Seq(rid, [int(v) for v in prefix.versions], float(done_tokens), target,
                   "length" if length >= cap else "stop")
        self._in_flight[rid] = seq
        self._waiting.append(seq)
        self._admit()

    def poll(self, timeout: float | None = None) -> list[Completion]:
        """Completions finished so far (errors included); never waits, whatever `timeout`."""
        done, self._done = self._done, []
        return done

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Partial samples (finish_reason "abort", whole blocks only) of the given requests waiting or
        running; unknown or finished ids are skipped."""
        out = []
        for rid in dict.fromkeys(request_ids):
            seq = self._in_flight.pop(rid, None)
            if seq is None:
                continue
            if seq.slot is None:
                self._waiting.remove(seq)
            else:
                self._release(seq.slot)
            blocks = int(seq.progress // self._fleet.workload.block_tokens)
            out.append(Completion(rid, self._sample(seq, blocks, blocks * self._fleet.workload.block_tokens,
                                                    "abort")))
        self._admit()
        return out

    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Partial samples (finish_reason None, whole blocks only) of the given requests waiting or
        running, which go on; unknown or finished ids are skipped."""
        block = self._fleet.workload.block_tokens
        out = []
        for rid in dict.fromkeys(request_ids):
            seq = self._in_flight.get(rid)
            if seq is None:
                continue
            done = seq.progress if seq.slot is None else float(self._fleet._progress[self.index, seq.slot])
            blocks = int(done // block)
            out.append(Completion(rid, self._sample(seq, blocks, blocks * block, None)))
        return out

    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray] | None, *,
                       keep_kv: bool = False) -> None:
        """Switches to `version` now (tensors are ignored); the instance then stalls sync_s plus the
        recompute of its running sequences' KV (none with `keep_kv`). Raises WeightsRejected (a ValueError)
        for a version that is not an int or is lower than the current one."""
        f, i = self._fleet, self.index
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
            raise WeightsRejected(f"version must be an int, got {version!r}")
        if version < f._version[i]:
            raise WeightsRejected(f"version {version} is older than the served version {f._version[i]}")
        f._version[i] = int(version)
        f._stall[i] += (f._sync[i] + (0.0 if keep_kv else f._kv[i] / f._prefill[i])) / f._speed[i]
        for seq in self._slots:
            if seq is not None:
                seq.segments.append((float(f._progress[i, seq.slot]), int(version)))
        f._count["syncs"][i] += 1

    def pause(self, mode: str = "keep") -> list[Completion]:
        """Stops generating (pending stalls still elapse); "abort" also returns every request in flight
        as a partial sample."""
        engine_api.check_pause_mode(mode)
        self._fleet._paused[self.index] = True
        return self.abort(list(self._in_flight)) if mode == "abort" else []

    def resume(self) -> None:
        self._fleet._paused[self.index] = False
        self._admit()

    @property
    def paused(self) -> bool:
        return bool(self._fleet._paused[self.index])

    def load(self) -> EngineLoad:
        f, i = self._fleet, self.index
        return EngineLoad(running=f._n.item(i), waiting=len(self._waiting),
                          kv_used=f._kv.item(i) / self.spec.kv_capacity, tokens_per_s=f._rate.item(i),
                          version=f._version[i])

    def close(self) -> None:
        """Nothing to stop: a simulated engine has no loop."""

    # ----- scheduling (called by the fleet and the methods above) -----

    def _admit(self) -> None:
        """Starts waiting sequences FIFO while a slot is free and the KV cache holds them."""
        f, i = self._fleet, self.index
        if f._paused[i] or not self._waiting or not self._free:
            return
        kv, prompt = float(f._kv[i]), f.workload.prompt_tokens
        while self._waiting and self._free:
            seq = self._waiting[0]
            need = prompt + seq.progress
            if f._n[i] > 0 and kv + need > self.spec.kv_capacity:
                break
            self._waiting.popleft()
            r = self._free.pop()
            self._slots[r], seq.slot, seq.order = seq, r, self._order
            self._order += 1
            f._active[i, r], f._progress[i, r] = True, seq.progress
            f._left[i, r] = max(seq.target - seq.progress, 0.0)
            f._n[i] += 1
            kv += need
            f._kv[i] = kv
            f._stall[i] += need / (f._prefill[i] * f._speed[i])
            version = f._version[i]
            if not seq.segments or seq.segments[-1][1] != version:
                seq.segments.append((seq.progress, version))

    def _release(self, r: int) -> _Seq:
        """Frees slot r; the sequence keeps its progress."""
        f, i = self._fleet, self.index
        seq = self._slots[r]
        seq.progress, seq.slot = float(f._progress[i, r]), None
        self._slots[r] = None
        f._active[i, r], f._progress[i, r], f._left[i, r] = False, 0.0, np.inf
        f._n[i] -= 1
        f._kv[i] = f._kv[i] - (f.workload.prompt_tokens + seq.progress) if f._n[i] else 0.0
        self._free.append(r)
        return seq

    def _finish(self, r: int) -> None:
        """Hands the sample in slot r to poll (its arrays already cleared by SimFleet._free_slots)."""
        seq = self._slots[r]
        self._slots[r], seq.slot = None, None
        self._free.append(r)
        del self._in_flight[seq.request_id]
        blocks = max(len(seq.prefix_versions), math.ceil(seq.target / self._fleet.workload.block_tokens))
        self._done.append(Completion(seq.request_id, self._sample(seq, blocks, seq.target, seq.reason)))

    def _preempt_overflow(self) -> None:
        """Preempts the most recently admitted sequences until the KV cache holds the rest."""
        f, i = self._fleet, self.index
        while f._kv[i] > self.spec.kv_capacity and f._n[i] > 1:
            newest = max((s for s in self._slots if s is not None), key=lambda s: s.order)
            self._waiting.appendleft(self._release(newest.slot))
            f._count["preemptions"][i] += 1

    def _sample(self, seq: _Seq, blocks: int, tokens: float, reason: str | None) -> Sample:
        """`blocks` entries: the prefix's versions, then per block the version in force when its last
        token (position min(end, tokens) - 1) was generated."""
        block, kept = self._fleet.workload.block_tokens, len(seq.prefix_versions)
        versions = seq.prefix_versions[:blocks]
        if blocks > kept:
            if len(seq.segments) == 1:
                versions = versions + [seq.segments[0][1]] * (blocks - kept)
            else:
                # Per block, the last segment starting before its end (a handful of segments: bisect
                # on lists beats numpy's per-call cost).
                starts = [s for s, _ in seq.segments]
                seg_versions = [v for _, v in seq.segments]
                versions = versions + [seg_versions[max(bisect.bisect_left(starts, min(k * block, tokens)) - 1, 0)]
                                       for k in range(kept + 1, blocks + 1)]
        return Sample(tokens=[0] * blocks, logprobs=[-1.0] * blocks, versions=versions, finish_reason=reason)
