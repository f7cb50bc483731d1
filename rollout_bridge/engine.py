"""The one interface every rollout engine implements (jaxflow's JAX engine, vLLM).

An engine owns a background loop. Requests go in with `submit`; finished completions come out of
`poll`. Weights change with `update_weights(version, tensors)` while requests are in flight: in-flight
sequences are kept, and every token records the version that produced it.

`pause(mode)` / `resume()` stop and restart generation around work the caller does in between (the
two ways rollout systems take new weights):

- "keep" (PipelineRL-style): requests stay in flight, frozen; after `resume` they continue where they
  were, their KV recomputed if weights changed meanwhile (kept as it was with `keep_kv`).
- "abort" (AReaL-style): requests in flight are stopped and handed back as partial samples, to be
  resubmitted later with `Request(prefix=...)`, possibly under new weights.

While paused, `submit` queues, `abort` and `update_weights` work, and nothing is generated.

Request admission is written once, here: `Engine.submit` checks a request (`_invalid`), refuses an id
already in flight, completes at once a request that cannot run (finish_reason "error", with why) or
whose resumed prefix is already complete, and hands the rest with a copy of its prefix
(`copy_prefix`) to the engine's `_accept`, which queues it up to the engine's own slot or KV limits.
`poll` hands out what `_hand_out` collected. An engine built on these calls `_init_admission()` first.

`progress(ids)` reads requests' tokens so far without stopping them (`in_flight_copy` makes the copy).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping

import numpy as np

from jaxflow.data import checks
from jaxflow.data.records import RouteSpec, Sample, fit_routes
from jaxflow.data.service_errors import SampleRefused


class EngineError(RuntimeError):
    """An engine-level failure (not a per-request one)."""


class WeightsRejected(ValueError):
    """New weights were refused before anything changed; the engine keeps serving the old version."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_tokens counts all generated tokens of the sample, a resumed prefix included.
    top_k = 0 and top_p = 1 disable those filters; temperature 0 is greedy.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclasses.dataclass
class Request:
    """Generate one sample for `prompt`. prefix: tokens already generated for it (with their log-probs,
    versions and, from a mixture-of-experts engine, routes), e.g. after an abort; generation continues
    from prompt + prefix.tokens, the prefix's routes kept as they are. meta: the
    task's data, for an engine that runs episodes (`rollout_bridge.episodes`; others ignore it).
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    prefix: Sample | None = None
    meta: dict | None = None


@dataclasses.dataclass
class Completion:
    """The result of a request: the full sample (prefix included). finish_reason "error" comes with
    `error` saying why (e.g. a prompt longer than the context); the engine keeps serving. info: an
    episode's turns and environment failure, if any (`rollout_bridge.episodes`); {} otherwise.
    """

    request_id: str
    sample: Sample
    error: str | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What a router needs: requests running and waiting, KV-cache use in [0, 1], recent decode rate,
    and the weights version being served."""

    running: int
    waiting: int
    kv_used: float
    tokens_per_s: float
    version: int


def request_error(request: Request, *, vocab_size: int, context: int, context_name: str,
                  route_shape: tuple[int, int] | None = None, num_experts: int = 0) -> str | None:
    """Why `request` cannot run on an engine with `context` positions (a per-request error: the engine
    keeps serving), or None. `context_name` names the engine's setting in the message. route_shape:
    (L_sparse, k) of a mixture-of-experts model's routes (`Sample.routes`), which a prefix's routes must
    have, their entries expert ids below `num_experts` or -1 (not recorded); None for a dense model, whose
    prefixes carry no routes."""
    p = request.params
    prefix = request.prefix or Sample()
    n = len(request.prompt) + len(prefix.tokens)
    if not request.prompt:
        return "empty prompt"
    if n > context - 1:
        return (f"prompt ({len(request.prompt)} tokens) + prefix ({len(prefix.tokens)} tokens) = {n} "
                f"tokens is longer than the context of {context - 1} ({context_name} {context} minus one "
                f"generated token)")
    if any(not 0 <= t < vocab_size for t in [*request.prompt, *prefix.tokens, *p.stop_token_ids]):
        return f"token ids must lie in [0, {vocab_size}) (the model's vocab)"
    if not len(prefix.logprobs) == len(prefix.versions) == len(prefix.tokens):
        return (f"prefix has {len(prefix.tokens)} tokens but {len(prefix.logprobs)} log-probs and "
                f"{len(prefix.versions)} versions")
    spec = None if route_shape is None else RouteSpec(*route_shape, num_experts)
    try:  # the trajectory service's own check of a sample's routes
        checks.check_routes("prefix routes", prefix.routes, len(prefix.tokens), spec)
    except SampleRefused as e:
        return str(e)
    if p.temperature < 0 or p.top_k < 0 or not 0 < p.top_p <= 1 or p.max_tokens < 1:
        return (f"invalid sampling params {p}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                f"max_tokens >= 1")
    return None


def copy_prefix(request: Request) -> Sample:
    """A new sample holding the request's prefix (empty without one), to generate into; a multi-turn
    episode's prefix keeps the spans its environment wrote and its training sequences' starts, a
    mixture-of-experts one its routes (a copy: the continuation appends its own rows to it)."""
    prefix = request.prefix or Sample()
    # Malformed routes come only with a request `request_error` refuses, whose "error" completion needs none.
    routes = prefix.routes if isinstance(prefix.routes, np.ndarray) and prefix.routes.ndim == 3 else None
    return Sample(tokens=list(prefix.tokens), logprobs=list(prefix.logprobs), versions=list(prefix.versions),
                  env_spans=[list(span) for span in prefix.env_spans], routes=fit_routes(routes, len(prefix.tokens)),
                  sequence_starts=list(prefix.sequence_starts))


def in_flight_copy(sample: Sample, versions: list[int] | None = None) -> Sample:
    """A copy of a sample still generating, for `Engine.progress`: finish_reason None, and `versions`
    in place of its own where the engine labels versions only when a request ends. Its routes (if any)
    are copied with one row per token (-1 for tokens not labelled yet: `fit_routes`)."""
    return Sample(tokens=list(sample.tokens), logprobs=list(sample.logprobs),
                  versions=list(sample.versions if versions is None else versions),
                  env_spans=[list(span) for span in sample.env_spans],
                  routes=fit_routes(sample.routes, len(sample.tokens)), sequence_starts=list(sample.sequence_starts))


def resumed_finish(sample: Sample, params: SamplingParams) -> str | None:
    """"length" or "stop" when a resumed sample is already complete (nothing to generate), else None."""
    if len(sample.tokens) >= params.max_tokens:
        return "length"
    if sample.tokens and sample.tokens[-1] in params.stop_token_ids:
        return "stop"
    return None


PAUSE_MODES = ("keep", "abort")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")


class Engine(abc.ABC):
    """A rollout engine; see the module docstring. An engine using the shared admission (`submit`,
    `poll`) calls `_init_admission()` and implements `_invalid`, `_in_flight` and `_accept`."""

    # Names the failing part in EngineError messages ("the engine loop failed with ...").
    _failure_subject = "the engine"

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the weights now generating."""

    def submit(self, request: Request) -> None:
        """Queues a request; returns at once. A request that cannot run completes (through `poll`) with
        finish_reason "error"; one whose prefix is already complete, with "length" or "stop"."""
        error = self._invalid(request)
        with self._lock:
            self._raise_if_down()
            if self._in_flight(request.request_id):
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            sample = copy_prefix(request)
            sample.finish_reason = "error" if error is not None else resumed_finish(sample, request.params)
            if sample.finish_reason is not None:
                self._hand_out(Completion(request.request_id, sample, error))
                return
            launch = self._accept(request, sample)
        if launch is not None:
            launch()

    def poll(self, timeout: float | None = None) -> list[Completion]:
        """Completions finished since the last poll (errors included; aborted requests come back from
        `abort`, not here); waits up to `timeout` s for at least one. Raises EngineError once the engine
        has failed or is closed and nothing is left to hand out."""
        with self._lock:
            if not self._completions and self._error is None and not self._closing and timeout:
                self._finished.wait_for(
                    lambda: self._completions or self._error is not None or self._closing, timeout)
            if not self._completions and (self._error is not None or self._closing):
                raise self._engine_error() from self._error
            done, self._completions = self._completions, []
            return done

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Stops the given requests; returns their partial samples (finish_reason "abort")."""

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 - a no-op unless an engine keeps caches
        """Says that these finished requests will not continue (their episodes ended), so an engine that
        keeps a finished turn's cache for the same request's next turn (the JAX engine) frees it now
        instead of holding it until the room is needed. Unknown ids are ignored; by default a no-op."""

    @abc.abstractmethod
    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Copies of the samples so far (finish_reason None: in flight) of those `request_ids` still waiting
        or running, without stopping them: the coordinator reports them to the trajectory service, which
        resumes them elsewhere from these tokens should this engine's process die. Ids finished (their
        completion is in, or will be in, `poll`) or unknown are skipped."""

    @abc.abstractmethod
    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray], *, keep_kv: bool = False) -> None:
        """Swaps in HF-named weights of `version` with requests kept in flight (their KV is recomputed
        under the new weights). Raises WeightsRejected, changing nothing, on a wrong name/shape/dtype.
        The JAX engine also takes `jaxflow.data.device_params.DeviceWeights` (no host round trip).

        keep_kv: keep the in-flight KV instead of recomputing it (PipelineRL's in-flight update, the
        coordinator's sync_mode "keep_kv"): no recompute, and the tokens after the swap are sampled by the
        new weights attending to keys and values older weights computed. Each token still records the
        version that sampled it; its prefix's KV is at least as new as the request's first token (v_start),
        so the staleness bound, which holds on v_start, still bounds every weight a token depends on.
        """

    @abc.abstractmethod
    def pause(self, mode: str = "keep") -> list[Completion]:
        """Stops generating after the step in progress; returns once nothing runs. mode "keep" returns
        []; "abort" returns the partial samples (finish_reason "abort") of every request in flight,
        waiting ones included. Pausing a paused engine only applies `mode` again."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Generates again: kept requests continue, queued ones start. A no-op when not paused."""

    @property
    @abc.abstractmethod
    def paused(self) -> bool:
        """Whether the engine is paused."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Current load, for routing."""

    def close(self) -> None:  # noqa: B027 - a no-op for an engine that holds nothing
        """Stops the engine's loop and frees its resources."""

    # ----- shared admission (see the module docstring) -----

    def _init_admission(self) -> None:
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)  # poll waits for completions
        self._completions: list[Completion] = []
        self._error: BaseException | None = None  # the failure that stopped the engine
        self._closing = False

    def _invalid(self, request: Request) -> str | None:
        """Why `request` cannot run on this engine (a per-request error), or None."""
        raise NotImplementedError

    def _in_flight(self, request_id: str) -> bool:
        """Whether a request of this id is queued or running (caller holds the lock)."""
        raise NotImplementedError

    def _accept(self, request: Request, sample: Sample):
        """Queues a valid request that has `sample` (its prefix copied) to generate into; caller holds
        the lock. May return a callable that `submit` calls after releasing it (e.g. to start a stream)."""
        raise NotImplementedError

    def _hand_out(self, completion: Completion) -> None:
        """Makes a completion the next `poll`'s (caller holds the lock)."""
        self._completions.append(completion)
        self._finished.notify_all()

    def _engine_error(self) -> EngineError:
        if self._error is None:
            return EngineError("the engine is closed")
        return EngineError(f"{self._failure_subject} failed with {type(self._error).__name__}: {self._error}; "
                           f"abort() still returns the partial samples of requests in flight")

    def failure(self) -> BaseException | None:
        """What stopped this engine for good (its loop's error), or None while it serves. A failed engine
        raises EngineError from every later poll and submit: its caller stops instead of retrying."""
        return getattr(self, "_error", None)

    def _raise_if_down(self) -> None:
        if self._error is not None or self._closing:
            raise self._engine_error() from self._error

    def generate(self, requests: list[Request], timeout: float = 600.0) -> list[Completion]:
        """Submits `requests` and waits for all of them; results in request order."""
        for r in requests:
            self.submit(r)
        done: dict[str, Completion] = {}
        deadline = time.monotonic() + timeout
        while len(done) < len(requests):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(requests) - len(done)} of {len(requests)} requests unfinished "
                                   f"after {timeout}s")
            for c in self.poll(timeout=min(left, 1.0)):
                done[c.request_id] = c
        return [done[r.request_id] for r in requests]


class WrappingEngine(Engine):
    """An engine whose requests run their model turns on an inner engine (jaxflow's episodes, agents): the
    weights, pausing and load are the inner engine's, and a pump thread hands each of the inner engine's
    completions to `_inner_done` while an event loop of the wrapper's own runs what its requests wait on
    (environments, agents). A subclass keeps its requests' states in `self._episodes` (id -> state), calls
    `_start_wrapping(inner, name)` after `_init_admission()`, implements `_inner_done`, and closes with
    `_take_all()` (then stopping what it took) and `_stop_wrapping()`."""

    def _start_wrapping(self, inner: Engine, name: str) -> None:
        import asyncio

        self.inner = inner
        self._loop = asyncio.new_event_loop()
        self._threads = [threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True),
                         threading.Thread(target=self._pump, name=f"{name}-pump", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def paused(self) -> bool:
        return self.inner.paused

    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray], *, keep_kv: bool = False) -> None:
        self.inner.update_weights(version, tensors, keep_kv=keep_kv)

    def load(self) -> EngineLoad:
        return self.inner.load()

    def _take_all(self) -> list:
        """Starts closing: marks the engine closed (pollers wake up) and takes every request's state
        (`self._episodes`, id -> state) for the caller to stop."""
        with self._lock:
            self._closing = True
            taken, self._episodes = list(self._episodes.values()), {}
            self._finished.notify_all()
        return taken

    def _stop_wrapping(self, drain_s: float = 0.0) -> None:
        """Ends closing: closes the inner engine, lets what is left on the loop finish (up to `drain_s`
        seconds), then stops the loop and joins the threads."""
        import asyncio

        self.inner.close()

        async def drain():
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if pending:
                await asyncio.wait(pending, timeout=drain_s)

        if drain_s:
            try:
                asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout=drain_s + 5)
            except Exception:  # noqa: BLE001 - a stuck close: stop anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        for t in self._threads:
            t.join(timeout=10)

    @abc.abstractmethod
    def _inner_done(self, completion: Completion) -> None:
        """A turn the inner engine finished (on the pump thread; never block here)."""

    def _pump(self) -> None:
        """Moves the inner engine's finished turns to `_inner_done`; an inner engine that fails takes this
        one down with it."""
        while True:
            with self._lock:
                if self._closing:
                    return
            try:
                done = self.inner.poll(timeout=0.05)
            except Exception as e:  # noqa: BLE001 - the inner engine is down: so is this one
                with self._lock:
                    if not self._closing:
                        self._error = e
                        self._finished.notify_all()
                return
            for c in done:
                self._inner_done(c)
