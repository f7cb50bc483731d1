"""The records that travel between the trajectory service, rollout workers and the trainer.

A group is the n samples of one prompt. Every generated token carries the policy version that produced
it, so a sample continued after a weight update (or on another engine) mixes versions while its group
keeps the `v_start` it was admitted with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclasses.dataclass
class Sample:
    """One member of a group: a completion, finished or in progress.

    tokens: generated token ids. logprobs: the engine's log-probability of each token (behaviour
    policy). versions: the policy version that produced each token. finish_reason: None while
    unfinished, else one of FINISH_REASONS ("abort" means interrupted, resumable from its tokens).
    env_spans: in a multi-turn episode, the [start, end) index ranges of `tokens` that the environment
    wrote (observations, tool results: rendered through the chat template, never trained: log-prob 0,
    the version of the model turn before them); sorted, disjoint, non-empty. [] for a single answer.
    reward: a finished episode's reward from its environment (the sum over its turns; 0.0 when the
    environment failed); None for a single answer, which the task's reward function scores.
    routes: a mixture-of-experts policy's routing, for replay in the update (`jaxflow.models.moe`):
    [len(tokens), L_sparse, k] small ints (`route_dtype`), routes[i] the experts each sparse layer chose
    at the input position that produced token i (the token before it: for i = 0 the prompt's last
    token), -1 where not recorded. None when the engine records none (a dense model, replay off).
    sequence_starts: where the sample splits into separate training sequences, for an agent that rewrote
    its history (truncated or edited an earlier turn): training on one sequence would train on context the
    model never saw. [] (the default): one sequence, whose context is the group's prompt. Each start s:
    tokens[s:] up to the next start form a sequence whose context is its own tokens alone (not the
    prompt, not the tokens before s). The tokens before the first start, if any, form a sequence with the
    prompt as context; an agent's episode, every call its own context, starts at 0 (the prompt then is
    part of no sequence). Sorted, unique, in [0, len(tokens)); each the start of an env span (a sequence
    opens with the context the agent sent); every sequence holds a model token (the last one of a sample
    still generating may hold only its context so far); routes[s] is -1 (its sequence has no token
    before s). `sequences()` lists the sequences.
    teacher_logprobs: on-policy distillation with the teacher beside the rollout (`trainer.distill.where =
    "rollout"`): the teacher's log-probability of each token, one per token like `logprobs`, each computed
    in the context its training sequence has (0.0 inside env spans and on a token no context predicts: a
    started sequence's first). None (the default) when no teacher scored the sample; an engine continuing a
    sample drops them (they are scored when its group finishes).
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    env_spans: list[list[int]] = dataclasses.field(default_factory=list)
    reward: float | None = None
    routes: np.ndarray | None = None
    sequence_starts: list[int] = dataclasses.field(default_factory=list)
    teacher_logprobs: list[float] | None = None

    def sequences(self) -> list[tuple[int, int]]:
        """The [start, end) token ranges of the sample's training sequences, in order (see
        `sequence_starts`): [(0, len(tokens))] for a sample without starts. A sequence whose start is in
        `sequence_starts` is its own context; one that starts at 0 otherwise follows the group's prompt."""
        bounds = [0] if not self.sequence_starts or self.sequence_starts[0] > 0 else []
        bounds += list(self.sequence_starts)
        return list(zip(bounds, bounds[1:] + [len(self.tokens)]))

    def model_mask(self) -> np.ndarray:
        """bool per token: True where the model wrote it (trained), False inside an env span."""
        mask = np.ones(len(self.tokens), bool)
        for start, end in self.env_spans:
            mask[start:end] = False
        return mask

    @property
    def done(self) -> bool:
        return self.finish_reason in ("stop", "length")

    def validate(self, what: str, v_start: int, v_max: int) -> None:
        """Raises ValueError naming `what` if the arrays disagree or a version is out of [v_start, v_max]."""
        n = len(self.tokens)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"{what}: {n} tokens but {len(self.logprobs)} log-probs and "
                             f"{len(self.versions)} versions")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(f"{what}: {n} tokens but {len(self.teacher_logprobs)} teacher_logprobs")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{what}: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if n and (min(self.versions) < v_start or max(self.versions) > v_max):
            raise ValueError(f"{what}: token versions span [{min(self.versions)}, {max(self.versions)}], "
                             f"outside [v_start={v_start}, latest published={v_max}]")
        ids = np.asarray(self.tokens)
        if n and (ids.dtype.kind not in "iu" or ids.min() < 0):
            raise ValueError(f"{what}: token ids must be non-negative integers")


def route_dtype(num_experts: int) -> np.dtype:
    """The smallest signed integer dtype that holds expert ids 0 .. num_experts - 1 and -1 (no record)."""
    return np.dtype(np.int8 if num_experts <= 128 else np.int16 if num_experts <= 32768 else np.int32)


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    """The routing a mixture-of-experts policy records per generated token (`Sample.routes`): `layers`
    sparse layers (L_sparse), each choosing `top_k` of `num_experts` experts. A sample's routes are
    [len(tokens), layers, top_k] of ids in [-1, num_experts - 1]. The trajectory service refuses samples
    whose routes disagree with its spec (`jaxflow.data.checks.check_routes`); a dense model has no spec
    (None), and then a sample may carry no routes."""

    layers: int
    top_k: int
    num_experts: int

    def __post_init__(self):
        for name in ("layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"RouteSpec.{name} must be an int, got {value!r}")
        if self.layers < 0 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"RouteSpec needs layers >= 0 and 1 <= top_k <= num_experts; got layers="
                             f"{self.layers}, top_k={self.top_k}, num_experts={self.num_experts}")

    @classmethod
    def of(cls, cfg: Any) -> RouteSpec | None:
        """The spec of a `jaxflow.models.config.ModelConfig`'s routing; None for a dense model
        (num_experts 0)."""
        if not cfg.num_experts:
            return None
        return cls(layers=len(cfg.sparse_layers), top_k=cfg.num_experts_per_tok, num_experts=cfg.num_experts)

    @property
    def dtype(self) -> np.dtype:
        """The dtype routes are kept in (`route_dtype`)."""
        return route_dtype(self.num_experts)

    def shape(self, n: int) -> tuple[int, int, int]:
        """The routes' shape for a sample of `n` tokens."""
        return (n, self.layers, self.top_k)


def fit_routes(routes: np.ndarray | None, n: int) -> np.ndarray | None:
    """A copy of `routes` with exactly `n` rows, one per token: its first n rows, then rows of -1 (not
    recorded) for tokens it has none for (an environment's observation, tokens an engine has not labelled
    yet). None stays None. Always a new array: a copy never aliases the sample it came from."""
    if routes is None:
        return None
    routes = np.asarray(routes)
    out = np.full((n, *routes.shape[1:]), -1, dtype=routes.dtype)
    kept = min(n, len(routes))
    out[:kept] = routes[:kept]
    return out


@dataclasses.dataclass
class GroupTask:
    """What a rollout worker receives at dispatch: generate `n` samples for `prompt`.

    partial: for a resumed group, the samples so far (continue each unfinished one from its tokens;
    finished ones are kept as they are). meta: task data the reward function needs (e.g. the answer).
    """

    group_id: int
    prompt: list[int]
    n: int
    v_start: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    partial: list[Sample] | None = None
    attempt: int = 0


@dataclasses.dataclass
class FinishedGroup:
    """A rewarded group as the trainer consumes it, with the buffer step it occupied."""

    group_id: int
    prompt: list[int]
    v_start: int
    samples: list[Sample]
    rewards: list[float]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    step: int = -1


@dataclasses.dataclass
class ConsumedBatch:
    """What the trainer gets: the groups of buffer `step` and the buffer state that released them."""

    step: int
    groups: list[FinishedGroup]
    state: str
