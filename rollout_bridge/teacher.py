"""`TeacherScorer`: a distillation teacher beside the rollout engines, scoring each finished group's samples.

On-policy distillation (jaxflow/trainer/distill.py) with `trainer.distill.where = "rollout"` computes the
teacher's per-token log-probs here instead of in the trainer's step: the teacher's weights live beside the
rollout engines (the trainer loads none; `mesh` says where they go, by default the first device) and groups
are scored as they finish, while the trainer trains. The coordinator calls `score_group(task, samples)` on
each finished group (on its scoring threads, while it goes on generating) before it hands the group to the
trajectory service (`Coordinator(teacher_fn=...)`), which records the result on each sample as
`Sample.teacher_logprobs`, as its behaviour log-probs are recorded; the trainer's batch carries them to the
step (`TrajectoryBatch.teacher_logp`).

A sample is scored as the step would score it: a prefill-only, teacher-forced forward of each of its training
sequences (`Sample.sequences`) in the context the trainer gives it (the group's prompt, or for a started
sequence its own tokens alone), through `jaxflow.trainer.step.token_logprobs`, the function the step's teacher
pass runs, in the same compute dtype and LM-head chunking. The two placements are then two programs computing
the same forward: they agree within its rounding (tests/trainer/test_teacher_scorer.py). Tokens the
environment wrote (env spans) and a started sequence's first token (no context predicts it) get 0.0: they are
never trained.

Batching: callers queue their sequences (one row each) and one dispatcher thread takes up to `batch_size`
queued rows at a time, whatever groups and callers they came from, and pads them to a bucket (rows to a power
of two up to `batch_size`, length to a power of two from 32 up to `max_len`: `jaxflow.rewards.model.buckets`),
so the teacher compiles one program per bucket seen, a few in all.

Failures fail the group, never the run: a sequence longer than `max_len`, a forward pass that raised, or a
group whose rows are not scored within `timeout_s` (a JAX computation cannot be interrupted: a hung batch is
left running, and later groups time out behind it) raises `TeacherFailed` from `score_group`, naming the group
and what went wrong; the coordinator then fails that group in the trajectory service (its prompt is retried)
and goes on. Thread-safe: several coordinators may share one scorer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.data.records import GroupTask, Sample
from jaxflow.models import hf_io, precision
from jaxflow.rewards.model import MIN_BUCKET_LEN, bucket_of, buckets
from jaxflow.trainer.step import LOGPROB_CHUNK, token_logprobs

log = logging.getLogger(__name__)


class TeacherFailed(RuntimeError):
    """A group's samples could not be scored by the teacher (the message says which group and why)."""


class _Rows:
    """The fields of right-padded rows that `token_logprobs` reads: each row one sequence from position 0."""

    def __init__(self, tokens_bt: jax.Array, lengths_b: jax.Array):
        t = tokens_bt.shape[1]
        self.tokens = tokens_bt
        self.positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)
        self.segment_ids = (jnp.arange(t)[None] < lengths_b[:, None]).astype(jnp.int32)
        self.context_ids = jnp.zeros_like(self.segment_ids)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"))
def rows_logprobs(graphdef, params: nnx.State, tokens_bt: jax.Array, lengths_b: jax.Array, *,
                  chunk: int) -> jax.Array:
    """log π(token_t | tokens_<t) of B right-padded sequences, [B, T] float32 (0 at t = 0 and past a length), by
    the model (graphdef, params) with params already in the compute dtype: the step's `token_logprobs`."""
    logp = token_logprobs(nnx.merge(graphdef, params), _Rows(tokens_bt, lengths_b), False, chunk)[0]
    return jnp.where(jnp.arange(tokens_bt.shape[1])[None] < lengths_b[:, None], logp, 0.0)


@dataclasses.dataclass
class _Row:
    ids: list[int]
    future: Future


def sample_rows(prompt: Sequence[int], sample: Sample) -> list[tuple[list[int], int, int, int]]:
    """The rows that score `sample` as the trainer lays it out: one per training sequence (`Sample.sequences`),
    as (row token ids, first sample token of the sequence, end, index in the row of that first token). A
    sequence that follows the prompt is prompt + its tokens; a started one its tokens alone."""
    starts = set(sample.sequence_starts)
    out = []
    for a, b in sample.sequences():
        context = [] if a in starts else list(prompt)
        out.append((context + list(sample.tokens[a:b]), a, b, len(context)))
    return out


class TeacherScorer:
    """Scores finished samples with a frozen teacher: the teacher's log-prob of each token, batched across groups.

    Args:
      directory: the teacher, an HF model directory of any supported family (`jaxflow.models.hf_io.load_model`);
        its vocabulary must be the student's (the job checks: `jaxflow.trainer.distill.teacher_problems`).
      max_len: tokens of a row (a training sequence with its context) at most: the rollout's max_len.
      batch_size: rows per forward pass at most.
      chunk: positions per chunk of the LM head (the trainer's `logprob_chunk`).
      compute_dtype: what the forward computes in (the trainer's `model.compute_dtype`, as the step's teacher).
      param_dtype: the dtype the weights are loaded in (default the checkpoint's); they are cast to compute_dtype
        once, as the step casts its teacher's.
      mesh: where the teacher lives (default the first device).
      timeout_s: the longest `score_group` waits for its rows (queueing, compiling and the forward passes).
    """

    def __init__(self, directory: str | os.PathLike, *, max_len: int, batch_size: int = 8,
                 chunk: int = LOGPROB_CHUNK, compute_dtype: str = "float32", param_dtype=None,
                 mesh: jax.sharding.Mesh | None = None, timeout_s: float = 600.0):
        for key, value, low in (("max_len", max_len, 2), ("batch_size", batch_size, 1), ("chunk", chunk, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"TeacherScorer: {key} must be an integer >= {low}, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"TeacherScorer: timeout_s must be a finite number > 0, got {timeout_s!r}")
        self.directory = str(directory)
        self.model = hf_io.load_model(directory, mesh=mesh, param_dtype=param_dtype)
        self.config = self.model.config
        graphdef, params = nnx.split(self.model)
        self._graphdef = graphdef
        self._params = precision.cast_floating(params, precision.dtype_of(compute_dtype))
        self.max_len, self.batch_size, self.chunk, self.timeout_s = max_len, batch_size, chunk, float(timeout_s)
        self.row_buckets = buckets(batch_size)
        self.len_buckets = buckets(max_len, min(MIN_BUCKET_LEN, max_len))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Row] = collections.deque()
        self._stats = dict.fromkeys(("groups", "groups_failed", "rows", "batches"), 0)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="teacher-scorer", daemon=True)
        self._thread.start()

    # ---- public API ----

    def score_group(self, task: GroupTask, samples: Sequence[Sample]) -> list[list[float]]:
        """The teacher's log-prob of every token of each of `samples` (the finished samples of `task`'s group),
        one list per sample as long as its tokens (0.0 in env spans and on a started sequence's first token).
        Blocks; its rows share batches with whatever else is queued. Raises TeacherFailed naming the group."""
        try:
            return self._score(task, samples)
        except TeacherFailed:
            with self._lock:
                self._stats["groups_failed"] += 1
            raise

    def stats(self) -> dict[str, int]:
        """Counts since start: groups scored, groups_failed, rows (sequences) and batches (forward passes) run."""
        with self._lock:
            return dict(self._stats)

    def summary(self) -> dict[str, Any]:
        """{"directory", "architecture", "parameters"}: what the job prints of the teacher it loaded."""
        return {"directory": self.directory, "architecture": self.config.architecture,
                "parameters": sum(x.size for x in jax.tree.leaves(self._params))}

    def close(self) -> None:
        """Stops the dispatcher; rows still queued fail (their groups raise TeacherFailed). Idempotent."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        self._thread.join()

    def __enter__(self) -> TeacherScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- callers' side ----

    def _score(self, task: GroupTask, samples: Sequence[Sample]) -> list[list[float]]:
        what = f"teacher {self.directory}: group {task.group_id}"
        plans = []
        for i, s in enumerate(samples):
            rows = sample_rows(task.prompt, s)
            for ids, *_ in rows:
                if not 2 <= len(ids) <= self.max_len:
                    raise TeacherFailed(f"{what} sample {i}: a training sequence with its context of {len(ids)} "
                                        f"tokens is not within 2 .. max_len={self.max_len}")
            plans.append(rows)
        futures = [[self._submit(ids) for ids, *_ in rows] for rows in plans]
        deadline = time.monotonic() + self.timeout_s  # for the group as a whole
        out = []
        for i, (s, rows, fs) in enumerate(zip(samples, plans, futures)):
            logp = [0.0] * len(s.tokens)
            for (_, a, b, first), future in zip(rows, fs):
                try:
                    row = future.result(timeout=max(deadline - time.monotonic(), 0.0))
                except FutureTimeout:
                    raise TeacherFailed(f"{what} sample {i}: not scored within timeout_s={self.timeout_s:g}") from None
                except Exception as e:  # noqa: BLE001 - the forward pass's error, whatever it is
                    raise TeacherFailed(f"{what} sample {i}: {type(e).__name__}: {e}"[:1000]) from e
                logp[a:b] = row[first:first + b - a]
            for start, end in s.env_spans:  # the environment's tokens are never trained
                logp[start:end] = [0.0] * (end - start)
            out.append(logp)
        with self._lock:
            self._stats["groups"] += 1
        return out

    def _submit(self, ids: list[int]) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if self._closing:
                future.set_exception(RuntimeError("TeacherScorer is closed"))
                return future
            self._queue.append(_Row(ids, future))
            self._wake.notify()
        return future

    # ---- dispatcher ----

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if self._closing:
                    left, self._queue = list(self._queue), collections.deque()
                    break
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            try:
                scored = self._forward(batch)
            except Exception as e:  # noqa: BLE001 - a device or compile error fails this batch's rows, not the run
                log.warning("teacher %s: a forward pass of %d rows raised %s: %s", self.directory, len(batch),
                            type(e).__name__, e)
                for r in batch:
                    r.future.set_exception(e)
                continue
            for r, logp in zip(batch, scored):
                r.future.set_result(logp)
        for r in left:
            r.future.set_exception(RuntimeError("TeacherScorer closed before the row was scored"))

    def _forward(self, batch: list[_Row]) -> list[list[float]]:
        """Each row's log-probs (a list as long as its ids) from one padded forward pass."""
        rows = bucket_of(len(batch), self.row_buckets)
        length = bucket_of(max(len(r.ids) for r in batch), self.len_buckets)
        tokens = np.zeros((rows, length), np.int32)
        lengths = np.zeros((rows,), np.int32)
        for i, r in enumerate(batch):
            tokens[i, :len(r.ids)], lengths[i] = r.ids, len(r.ids)
        logp = np.asarray(jax.device_get(rows_logprobs(self._graphdef, self._params, jnp.asarray(tokens),
                                                       jnp.asarray(lengths), chunk=self.chunk)))
        with self._lock:
            self._stats["batches"] += 1
            self._stats["rows"] += len(batch)
        return [logp[i, :len(r.ids)].tolist() for i, r in enumerate(batch)]
