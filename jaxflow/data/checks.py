"""Validation of everything that enters the trajectory service, done before any state changes.

A service call either changes nothing (it raised) or completes its transition: so every argument, sample,
reward and snapshot field is checked here first, in full, and the error names the bad thing (the group,
the sample index, the field and element) and what was expected. Booleans are not accepted as numbers.
"""

from __future__ import annotations

import math
from typing import Any

from jaxflow.data.records import FINISH_REASONS, Sample
from jaxflow.data.timeouts import check_timeout  # noqa: F401  (the services call it as checks.check_timeout)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]; TypeError for a non-int (bools included), ValueError out of range."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else (f"<= {hi}" if lo is None else f"in [{lo}, {hi}]")
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def check_str(name: str, value: Any, empty_ok: bool = True) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {value!r}")
    if not empty_ok and not value:
        raise ValueError(f"{name} must be a non-empty str")
    return value


def check_sample(what: str, s: Any, v_start: int, v_max: int, finished: bool) -> None:
    """Raises ValueError naming `what` (e.g. "group 3 sample 1") and the field of the first problem:
    token ids non-negative ints, log-probs finite numbers <= 0, versions ints in [v_start, v_max], the
    three lists of one length, finish_reason None or one of FINISH_REASONS (done if `finished`)."""
    if not isinstance(s, Sample):
        raise ValueError(f"{what}: is a {type(s).__name__}, not a Sample")
    for field in ("tokens", "logprobs", "versions"):
        if not isinstance(getattr(s, field), list):
            raise ValueError(f"{what}: {field} must be a list, got {type(getattr(s, field)).__name__}")
    n = len(s.tokens)
    if len(s.logprobs) != n or len(s.versions) != n:
        raise ValueError(f"{what}: {n} tokens but {len(s.logprobs)} log-probs and {len(s.versions)} versions")
    for i, t in enumerate(s.tokens):
        if not is_int(t) or t < 0:
            raise ValueError(f"{what}: tokens[{i}] = {t!r}; token ids must be non-negative ints")
    for i, lp in enumerate(s.logprobs):
        if not is_number(lp) or not math.isfinite(lp) or lp > 0:
            raise ValueError(f"{what}: logprobs[{i}] = {lp!r}; log-probs must be finite numbers <= 0")
    for i, v in enumerate(s.versions):
        if not is_int(v):
            raise ValueError(f"{what}: versions[{i}] = {v!r}; versions must be ints")
    if n and (min(s.versions) < v_start or max(s.versions) > v_max):
        raise ValueError(f"{what}: token versions span [{min(s.versions)}, {max(s.versions)}], "
                         f"outside [v_start={v_start}, latest published={v_max}]")
    if s.finish_reason is not None and (not isinstance(s.finish_reason, str)
                                        or s.finish_reason not in FINISH_REASONS):
        raise ValueError(f"{what}: finish_reason {s.finish_reason!r} is not None or one of {FINISH_REASONS}")
    if finished and not s.done:
        raise ValueError(f"{what} is not finished (finish_reason={s.finish_reason!r})")
    check_env_spans(what, s.env_spans, n)
    if s.reward is not None and (not is_number(s.reward) or not math.isfinite(s.reward)):
        raise ValueError(f"{what}: reward {s.reward!r:.80} must be None or a finite number")


def check_env_spans(what: str, spans: Any, n: int) -> None:
    """A sample's env_spans: a list of [start, end) int pairs, sorted, disjoint, non-empty, within its `n`
    tokens; else ValueError naming `what`."""
    if not isinstance(spans, list):
        raise ValueError(f"{what}: env_spans must be a list of [start, end) pairs, got {type(spans).__name__}")
    previous_end = 0
    for i, span in enumerate(spans):
        if (not isinstance(span, (list, tuple)) or len(span) != 2 or not all(is_int(x) for x in span)
                or not previous_end <= span[0] < span[1] <= n):
            raise ValueError(f"{what}: env_spans[{i}] = {span!r:.80}; spans must be sorted, disjoint, non-empty "
                             f"[start, end) int pairs within the sample's {n} tokens")
        previous_end = span[1]


def check_samples(group_id: int, n: int, samples: Any, what: str, v_start: int, v_max: int,
                  finished: bool) -> None:
    if not isinstance(samples, list):
        raise TypeError(f"group {group_id}: {what} samples must be a list of {n} Samples, "
                        f"got {type(samples).__name__}")
    if len(samples) != n:
        raise ValueError(f"group {group_id}: {what} has {len(samples)} samples, expected {n}")
    for i, s in enumerate(samples):
        check_sample(f"group {group_id} sample {i}", s, v_start, v_max, finished)


def check_renewal(worker: Any, group_ids: Any, progress: Any) -> dict:
    """A `renew`'s arguments (the progress samples are checked against each group by the service);
    returns `progress` as a dict ({} for None)."""
    check_str("worker", worker, empty_ok=False)
    if not isinstance(group_ids, list) or not all(is_int(i) for i in group_ids):
        raise TypeError(f"group_ids must be a list of ints, got {group_ids!r:.200}")
    progress = {} if progress is None else progress
    if not isinstance(progress, dict):
        raise TypeError(f"progress must be None or a dict of group id -> samples, got {type(progress).__name__}")
    extra = sorted(set(progress) - set(group_ids), key=repr)
    if extra:
        raise ValueError(f"renew by {worker!r}: progress for group(s) {extra!r:.200} not among group_ids")
    return progress


def check_rewards(group_id: int, n: int, rewards: Any) -> None:
    """One finite number per sample, else ValueError naming the group and the bad element."""
    if not isinstance(rewards, list):
        raise ValueError(f"group {group_id}: rewards must be a list of {n} finite numbers, got {rewards!r}")
    if len(rewards) != n:
        raise ValueError(f"group {group_id}: {len(rewards)} rewards for {n} samples; rewards must be "
                         f"{n} finite numbers")
    for i, r in enumerate(rewards):
        if not is_number(r) or not math.isfinite(r):
            raise ValueError(f"group {group_id}: rewards[{i}] = {r!r}; rewards must be {n} finite numbers")
