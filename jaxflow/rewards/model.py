"""`RewardModel`: scoring responses with a scalar-head reward model, behind the reward pool's interface.

A reward model is an HF `...ForSequenceClassification` directory with one label (`jaxflow.models.classifier`)
and its tokenizer. A response is scored as transformers' reward-model recipe does: the conversation [the
prompt's messages + the response as the assistant turn] is rendered with the reward model's own chat template
(no generation prompt) and tokenized, and the score is the head on the last non-pad token's hidden state.

`RewardModel` has the calls the job makes of a `RewardPool` (`score_group(fn_ref, responses, meta)`,
`submit`, `stats()` with the pool's `STAT_KEYS`, `close()`), so `group_reward_fn(reward_model,
reward_model.name, decode)` is a rollout worker's reward function as with a pool, and the job's accounting
and first-batch check read its counts unchanged. Failures are scored and counted as the pool's are, and
never stall a caller:

- a score that is not a finite number scores `failed_value` and counts as `invalid` (per sample: one bad row
  does not fail its batch);
- a batch still running after `timeout_s` scores `failed_value` for its samples and counts them `timed_out`;
  the next batch runs at once (see "Timeouts" below);
- a sample that cannot be rendered (no prompt in its meta, a template error) or is longer than `max_len`
  tokens, and every sample of a batch whose forward pass raised, scores `failed_value` and counts as
  `raised`; each distinct message is logged once (or handed once to `on_failure`).

Batching: callers tokenize their samples in their own threads and queue them; one dispatcher thread takes up
to `batch_size` queued samples at a time, whatever groups and callers they came from (`score_groups` hands
several groups at once, so one caller's groups share batches too), and pads them to a bucket: rows to a power
of two (or `batch_size`), length to a power of two from 32 (or `max_len`), so the model compiles one program
per bucket seen, a few in all.

Timeouts: a JAX computation cannot be interrupted, so each batch runs in a thread of its own and the
dispatcher waits for it at most `timeout_s` (`compile_timeout_s` for the first batch of a bucket, which
compiles its program). A batch past its limit is answered `failed_value` and its thread is left to finish in
the background, its result dropped. While `max_stuck` such threads are still running, further batches are
answered `failed_value` (counted `timed_out`) without running, rather than piling more work onto a device
that does not answer.

Placement: it is thread-safe and its constructor takes plain arguments, so it can be built in a Ray host actor
(`jaxflow.cluster.ray_actors.build(RewardModel, ("score_group", "stats"), kwargs=...)`) and called through the
proxy, as the cluster job does with its reward pool; the host's threads serve several callers at once, whose
groups then share batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import pathlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.models.classifier import SequenceClassifier, load_sequence_classifier
from jaxflow.rewards.judging import prompt_messages
from jaxflow.rewards.pool import STAT_KEYS
from jaxflow.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Padded sequence lengths are powers of two from this, up to max_len.
MIN_BUCKET_LEN = 32
# Distinct failure messages remembered for log-once.
_MAX_REMEMBERED_ERRORS = 1000


def buckets(limit: int, low: int = 1) -> tuple[int, ...]:
    """The powers of two from `low` below `limit`, then `limit`: the padded sizes of a dimension."""
    out, n = [], low
    while n < limit:
        out.append(n)
        n *= 2
    return (*out, limit)


def bucket_of(n: int, sizes: Sequence[int]) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return next(s for s in sizes if s >= n)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _scores(graphdef, state, tokens_bt: jax.Array, lengths_b: jax.Array) -> jax.Array:
    """[B] float32 scores of the classifier (graphdef, state) on right-padded rows."""
    return nnx.merge(graphdef, state)(tokens_bt, lengths_b)


@dataclasses.dataclass
class _Sample:
    ids: list[int]
    future: Future


class RewardModel:
    """Scores responses with a one-label HF sequence classifier, batched across groups; a `RewardPool` stand-in.

    Args:
      directory: the reward model: config.json (a `...ForSequenceClassification` of a supported family with
        one label), safetensors weights, and a tokenizer with a chat template (tokenizer.json,
        tokenizer_config.json).
      batch_size: samples per forward pass at most.
      max_len: tokens of a rendered conversation at most; a longer one scores `failed_value` (raised).
      timeout_s: the longest one batch's forward pass may take (see the module docstring).
      compile_timeout_s: the same for the first batch of each padded shape, which compiles its program.
      failed_value: the score of a sample that failed (invalid, timed out, raised).
      max_stuck: timed-out batches still running at which further batches are failed without running.
      mesh: where the model lives (default: the first device); param_dtype: default the checkpoint's.
      on_failure: called as on_failure(message) with the first occurrence of each distinct failure message
        instead of logging it (on the dispatcher or a caller thread: it must be quick).
      name: the reference callers pass as `fn_ref` (default "reward_model:<directory>").

    Use as a context manager, or call `close()`.
    """

    def __init__(self, directory: str | os.PathLike, *, batch_size: int = 8, max_len: int = 2048,
                 timeout_s: float = 30.0, compile_timeout_s: float = 600.0, failed_value: float = 0.0,
                 max_stuck: int = 2, mesh: jax.sharding.Mesh | None = None, param_dtype=None,
                 on_failure: Callable[[str], None] | None = None, name: str | None = None):
        for key, value, low in (("batch_size", batch_size, 1), ("max_len", max_len, 2), ("max_stuck", max_stuck, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RewardModel: {key} must be an integer >= {low}, got {value!r}")
        for key, value in (("timeout_s", timeout_s), ("compile_timeout_s", compile_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"RewardModel: {key} must be a finite number > 0, got {value!r}")
        if isinstance(failed_value, bool) or not isinstance(failed_value, (int, float)) or not math.isfinite(
                failed_value):
            raise ValueError(f"RewardModel: failed_value must be a finite number, got {failed_value!r}")
        directory = pathlib.Path(directory)
        tokenizer = Tokenizer.from_dir(directory)
        if tokenizer.chat_template is None:
            raise ValueError(f"reward model {directory}: its tokenizer has no chat template to render "
                             "[prompt + response] with")
        self.model: SequenceClassifier = load_sequence_classifier(directory, mesh=mesh, param_dtype=param_dtype)
        if tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(f"reward model {directory}: its tokenizer has {tokenizer.vocab_size} tokens, more "
                             f"than its embedding's {self.model.config.vocab_size} rows")
        self.directory, self.tokenizer = directory, tokenizer
        self.name = name or f"reward_model:{directory}"
        self.batch_size, self.max_len, self.max_stuck = batch_size, max_len, max_stuck
        self.timeout_s, self.compile_timeout_s = float(timeout_s), float(compile_timeout_s)
        self.failed_value = float(failed_value)
        self.row_buckets = buckets(batch_size)
        self.len_buckets = buckets(max_len, min(MIN_BUCKET_LEN, max_len))
        self._pad_id = self.model.pad_token_id if self.model.pad_token_id is not None else 0
        self._graphdef, self._state = nnx.split(self.model)
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Sample] = collections.deque()
        self._stats = dict.fromkeys((*STAT_KEYS, "batches"), 0)
        self._compiled: set[tuple[int, int]] = set()
        self._stuck: list[threading.Thread] = []
        self._logged: set[str] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="reward-model", daemon=True)
        self._thread.start()

    # ---- public API (the RewardPool calls the job makes) ----

    def submit(self, fn_ref: str, response: str, meta: dict) -> Future:
        """Queues one sample; the future's result is its score (`failed_value` if it failed)."""
        return self._submit(fn_ref, [response], meta)[0]

    def score_group(self, fn_ref: str, responses: Sequence[str], meta: dict) -> list[float]:
        """Scores the responses of one group (they share `meta`, whose prompt `prompt_messages` reads);
        blocks. Its samples share batches with whatever else is queued."""
        return [f.result() for f in self._submit(fn_ref, list(responses), meta)]

    def score_groups(self, fn_ref: str, groups: Sequence[tuple[Sequence[str], dict]]) -> list[list[float]]:
        """Scores several (responses, meta) groups, queued together so that they share batches; blocks."""
        futures = [self._submit(fn_ref, list(responses), meta) for responses, meta in groups]
        return [[f.result() for f in fs] for fs in futures]

    def stats(self) -> dict[str, int]:
        """Counts since start, as `RewardPool.stats` (submitted, scored, raised, timed_out, crashed (always 0:
        nothing here runs in a process of its own), invalid, workers_started (0), pending) plus batches (forward
        passes run) and stuck (timed-out batches still running)."""
        with self._lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            done = sum(self._stats[k] for k in ("scored", "raised", "timed_out", "crashed", "invalid"))
            return {**self._stats, "pending": self._stats["submitted"] - done, "stuck": len(self._stuck)}

    def close(self) -> None:
        """Stops the dispatcher; samples still queued fail with RuntimeError. Idempotent. Waits for the batch
        in progress (at most its time limit); a timed-out batch still running is not waited for (a daemon
        thread)."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        self._thread.join()

    def __enter__(self) -> RewardModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- callers' side ----

    def _check_ref(self, fn_ref: str) -> None:
        if fn_ref != self.name:
            raise ValueError(f"this reward model is {self.name!r}, asked to score for {fn_ref!r}: pass its name "
                             "as the reward reference")

    def _submit(self, fn_ref: str, responses: list[str], meta: dict) -> list[Future]:
        self._check_ref(fn_ref)
        futures: list[Future] = [Future() for _ in responses]
        for f in futures:
            f.set_running_or_notify_cancel()
        with self._lock:
            if self._closing:
                raise RuntimeError("RewardModel is closed")
            self._stats["submitted"] += len(futures)
        try:
            prompt = prompt_messages(meta)
        except ValueError as e:
            for f in futures:
                self._fail(f, "raised", f"cannot render the sample: {e}")
            return futures
        queued = []
        for response, future in zip(responses, futures):
            try:
                ids = self.tokenizer.encode_chat(prompt + [{"role": "assistant", "content": str(response)}],
                                                 add_generation_prompt=False)
            except Exception as e:  # noqa: BLE001 - whatever the template raises (raise_exception, bad roles)
                self._fail(future, "raised", f"cannot render the sample: {type(e).__name__}: {e}")
                continue
            if not ids or len(ids) > self.max_len:
                self._fail(future, "raised", f"a rendered sample of {len(ids)} tokens is not within 1 .. "
                                             f"max_len={self.max_len}")
                continue
            queued.append(_Sample(ids, future))
        with self._lock:
            if self._closing:
                for s in queued:
                    s.future.set_exception(RuntimeError("RewardModel closed before the sample was scored"))
                return futures
            self._queue.extend(queued)
            self._wake.notify()
        return futures

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
                self._run_batch(batch)
            except Exception as e:  # noqa: BLE001 - a bug here must fail this batch's samples, not hang callers
                log.exception("reward model dispatcher failed on a batch")
                for s in batch:
                    if not s.future.done():
                        self._fail(s.future, "raised", f"the dispatcher failed: {type(e).__name__}: {e}")
        for s in left:
            s.future.set_exception(RuntimeError("RewardModel closed before the sample was scored"))

    def _run_batch(self, batch: list[_Sample]) -> None:
        rows = bucket_of(len(batch), self.row_buckets)
        length = bucket_of(max(len(s.ids) for s in batch), self.len_buckets)
        with self._lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            stuck = len(self._stuck)
        if stuck >= self.max_stuck:
            for s in batch:
                self._fail(s.future, "timed_out", f"was not run: {stuck} earlier batches are still running past "
                                                  f"their time limit (max_stuck={self.max_stuck})")
            return
        tokens = np.full((rows, length), self._pad_id, np.int32)
        lengths = np.zeros((rows,), np.int32)
        for i, s in enumerate(batch):
            tokens[i, :len(s.ids)], lengths[i] = s.ids, len(s.ids)
        outcome: dict = {}
        done = threading.Event()

        def compute():
            try:
                outcome["scores"] = self._forward(tokens, lengths)
            except Exception as e:  # noqa: BLE001 - an XLA or device error: the batch fails, the run goes on
                outcome["error"] = f"{type(e).__name__}: {e}"
            done.set()

        shape = (rows, length)
        limit = self.timeout_s if shape in self._compiled else self.compile_timeout_s
        thread = threading.Thread(target=compute, name="reward-model-batch", daemon=True)
        thread.start()
        with self._lock:
            self._stats["batches"] += 1
        if not done.wait(limit):
            with self._lock:
                self._stuck.append(thread)
            what = "timeout_s" if shape in self._compiled else "compile_timeout_s"
            for s in batch:
                self._fail(s.future, "timed_out", f"ran past {what}={limit:g}s")
            return
        if "error" in outcome:
            for s in batch:
                self._fail(s.future, "raised", f"forward pass raised {outcome['error'][:500]}")
            return
        self._compiled.add(shape)
        scores = outcome["scores"]
        for i, s in enumerate(batch):
            value = float(scores[i])
            if math.isfinite(value):
                with self._lock:
                    self._stats["scored"] += 1
                s.future.set_result(value)
            else:
                self._fail(s.future, "invalid", f"gave {value}, not a finite number")

    def _forward(self, tokens_bt: np.ndarray, lengths_b: np.ndarray) -> np.ndarray:
        """The scores of one padded batch, [rows] float32 on the host (runs in the batch's own thread)."""
        return np.asarray(jax.device_get(_scores(self._graphdef, self._state, jnp.asarray(tokens_bt),
                                                 jnp.asarray(lengths_b))))

    def _fail(self, future: Future, outcome: str, what: str) -> None:
        message = f"reward model {self.directory} {what}"
        with self._lock:
            self._stats[outcome] += 1
            first = message not in self._logged
            if first and len(self._logged) < _MAX_REMEMBERED_ERRORS:
                self._logged.add(message)
        if first and self._on_failure is not None:
            try:
                self._on_failure(message)
            except Exception:  # noqa: BLE001 - a reporting bug must not break scoring
                log.exception("reward model on_failure callback failed on: %s", message)
        elif first:
            log.warning("%s; the sample scores %g (logged once per distinct message)", message, self.failed_value)
        future.set_result(self.failed_value)
