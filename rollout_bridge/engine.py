"""The one interface every rollout engine implements (jaxflow's JAX engine, vLLM).

An engine owns a background loop. Requests go in with `submit`; finished completions come out of
`poll`. Weights change with `update_weights(version, tensors)` while requests are in flight: in-flight
sequences are kept, and every token records the version that produced it.

`pause(mode)` / `resume()` stop and restart generation around work the caller does in between (the
two ways rollout systems take new weights):

- "keep" (PipelineRL-style): requests stay in flight, frozen; after `resume` they continue where they
  were, their KV recomputed if weights changed meanwhile.
- "abort" (AReaL-style): requests in flight are stopped and handed back as partial samples, to be
  resubmitted later with `Request(prefix=...)`, possibly under new weights.

While paused, `submit` queues, `abort` and `update_weights` work, and nothing is generated.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Iterable, Mapping

import numpy as np

from jaxflow.data.records import Sample


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
    """Generate one sample for `prompt`. prefix: tokens already generated for it (with their log-probs
    and versions), e.g. after an abort; generation continues from prompt + prefix.tokens.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
    prefix: Sample | None = None


@dataclasses.dataclass
class Completion:
    """The result of a request: the full sample (prefix included). finish_reason "error" comes with
    `error` saying why (e.g. a prompt longer than the context); the engine keeps serving.
    """

    request_id: str
    sample: Sample
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """What a router needs: requests running and waiting, KV-cache use in [0, 1], recent decode rate,
    and the weights version being served."""

    running: int
    waiting: int
    kv_used: float
    tokens_per_s: float
    version: int


def request_error(request: Request, *, vocab_size: int, context: int, context_name: str) -> str | None:
    """Why `request` cannot run on an engine with `context` positions (a per-request error: the engine
    keeps serving), or None. `context_name` names the engine's setting in the message."""
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
    if p.temperature < 0 or p.top_k < 0 or not 0 < p.top_p <= 1 or p.max_tokens < 1:
        return (f"invalid sampling params {p}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, "
                f"max_tokens >= 1")
    return None


PAUSE_MODES = ("keep", "abort")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")


class Engine(abc.ABC):
    """A rollout engine; see the module docstring."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the weights now generating."""

    @abc.abstractmethod
    def submit(self, request: Request) -> None:
        """Queues a request; returns at once."""

    @abc.abstractmethod
    def poll(self, timeout: float | None = None) -> list[Completion]:
        """Completions finished since the last poll; waits up to `timeout` s for at least one."""

    @abc.abstractmethod
    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Stops the given requests; returns their partial samples (finish_reason "abort")."""

    @abc.abstractmethod
    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Swaps in HF-named weights of `version` with requests kept in flight (their KV is recomputed
        under the new weights). Raises WeightsRejected, changing nothing, on a wrong name/shape/dtype.
        The JAX engine also takes `jaxflow.data.device_params.DeviceWeights` (no host round trip).
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

    def close(self) -> None:
        """Stops the engine's loop and frees its resources."""

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
