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
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    env_spans: list[list[int]] = dataclasses.field(default_factory=list)
    reward: float | None = None
    routes: np.ndarray | None = None

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
