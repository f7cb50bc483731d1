"""Validation of everything that enters the trajectory service, done before any state changes.

A service call either changes nothing (it raised) or completes its transition: so every argument, sample,
reward and snapshot field is checked here first, in full, and the error names the bad thing (the group,
the sample index, the field and element) and what was expected. Booleans are not accepted as numbers.

What is wrong with a sample or a reward (rather than with the call) raises `SampleRefused`, a ValueError
whose `reason` says which kind of fault it is (`jaxflow.data.service_errors`), so that the service can
count refusals by kind. The same checks screen a consumed batch in the trainer
(`jaxflow.trainer.rl_trainer.screen_groups`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxflow.data.records import FINISH_REASONS, RouteSpec, Sample
from jaxflow.data.service_errors import SampleRefused
from jaxflow.data.timeouts import check_timeout  # noqa: F401  (the services call it as checks.check_timeout)

# Token ids at or above this do not fit the trainer's int32 batch, whatever the model: refused even when the
# vocab size is not known.
TOKEN_ID_LIMIT = 2**31
# float32's largest finite value: the trainer computes each group's reward mean and std in float32.
FLOAT32_MAX = 3.4028234663852886e38


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


def check_sample(what: str, s: Any, v_start: int, v_max: int, finished: bool, *, vocab_size: int | None = None,
                 max_tokens: int | None = None, route_spec: RouteSpec | None = None, prompt_tokens: int = 0) -> None:
    """Raises SampleRefused naming `what` (e.g. "group 3 sample 1") and the field of the first problem:
    token ids ints in [0, vocab_size) (below TOKEN_ID_LIMIT when vocab_size is None), at most `max_tokens`
    of them (None: no cap; a sample split into training sequences: `check_sequence_lengths`), log-probs
    finite numbers <= 0, versions ints in [v_start, v_max], the three lists of one length, finish_reason
    None or one of FINISH_REASONS (done if `finished`), env_spans as `check_env_spans` and routes as
    `check_routes` want them for `route_spec` (the model's; None: a dense model), sequence_starts as
    `check_sequence_starts` wants them, reward None or finite, teacher_logprobs None or a list of one
    finite number <= 0 per token (`check_teacher_logprobs`)."""
    if not isinstance(s, Sample):
        raise SampleRefused(f"{what}: is a {type(s).__name__}, not a Sample")
    for field in ("tokens", "logprobs", "versions"):
        if not isinstance(getattr(s, field), list):
            raise SampleRefused(f"{what}: {field} must be a list, got {type(getattr(s, field)).__name__}")
    n = len(s.tokens)
    split = isinstance(s.sequence_starts, list) and bool(s.sequence_starts)  # capped per sequence, below
    if max_tokens is not None and n > max_tokens and not split:  # before the per-token loops: costs nothing
        raise SampleRefused(f"{what}: {n} tokens, more than the {max_tokens} a trainer row leaves it", "length")
    if len(s.logprobs) != n or len(s.versions) != n:
        raise SampleRefused(f"{what}: {n} tokens but {len(s.logprobs)} log-probs and {len(s.versions)} versions")
    check_token_ids(what, "tokens", s.tokens, vocab_size)
    for i, lp in enumerate(s.logprobs):
        if not is_number(lp) or not math.isfinite(lp) or lp > 0:
            raise SampleRefused(f"{what}: logprobs[{i}] = {lp!r}; log-probs must be finite numbers <= 0")
    for i, v in enumerate(s.versions):
        if not is_int(v):
            raise SampleRefused(f"{what}: versions[{i}] = {v!r}; versions must be ints")
    if n and (min(s.versions) < v_start or max(s.versions) > v_max):
        raise SampleRefused(f"{what}: token versions span [{min(s.versions)}, {max(s.versions)}], "
                            f"outside [v_start={v_start}, latest published={v_max}]")
    if s.finish_reason is not None and (not isinstance(s.finish_reason, str)
                                        or s.finish_reason not in FINISH_REASONS):
        raise SampleRefused(f"{what}: finish_reason {s.finish_reason!r} is not None or one of {FINISH_REASONS}")
    if finished and not s.done:
        raise SampleRefused(f"{what} is not finished (finish_reason={s.finish_reason!r})")
    check_teacher_logprobs(what, s.teacher_logprobs, n)
    check_env_spans(what, s.env_spans, n)
    check_routes(what, s.routes, n, route_spec)
    check_sequence_starts(what, s)
    if split and max_tokens is not None:
        check_sequence_lengths(what, s, max_tokens, prompt_tokens)
    if s.reward is not None and (not is_number(s.reward) or not math.isfinite(s.reward)):
        raise SampleRefused(f"{what}: reward {s.reward!r:.80} must be None or a finite number", "reward")


def check_teacher_logprobs(what: str, teacher_logprobs: Any, n: int) -> None:
    """A sample's teacher_logprobs (`Sample.teacher_logprobs`) for a sample of `n` tokens: None, or a list of
    `n` finite numbers <= 0 (log-probabilities); else SampleRefused naming `what`, the field and the element."""
    if teacher_logprobs is None:
        return
    if not isinstance(teacher_logprobs, list):
        raise SampleRefused(f"{what}: teacher_logprobs must be None or a list, got {type(teacher_logprobs).__name__}")
    if len(teacher_logprobs) != n:
        raise SampleRefused(f"{what}: {n} tokens but {len(teacher_logprobs)} teacher_logprobs; the teacher's "
                            f"log-probs must be one per token")
    for i, lp in enumerate(teacher_logprobs):
        if not is_number(lp) or not math.isfinite(lp) or lp > 0:
            raise SampleRefused(f"{what}: teacher_logprobs[{i}] = {lp!r:.80}; log-probs must be finite numbers <= 0")


def check_token_ids(what: str, field: str, tokens: list, vocab_size: int | None) -> None:
    """Every element of `tokens` an int in [0, vocab_size) (vocab_size None: [0, TOKEN_ID_LIMIT)), else
    SampleRefused naming `what`, `field` and the element: "malformed" for a non-int or a negative one,
    "token_id" for an id the model cannot embed."""
    limit = TOKEN_ID_LIMIT if vocab_size is None else min(vocab_size, TOKEN_ID_LIMIT)
    for i, t in enumerate(tokens):
        if not is_int(t) or t < 0:
            raise SampleRefused(f"{what}: {field}[{i}] = {t!r:.80}; token ids must be non-negative ints")
        if t >= limit:
            model = "the model's vocab" if vocab_size is not None else "int32"
            raise SampleRefused(f"{what}: {field}[{i}] = {t}; token ids must be below {limit} ({model})",
                                "token_id")


def check_env_spans(what: str, spans: Any, n: int) -> None:
    """A sample's env_spans: a list of [start, end) int pairs, sorted, disjoint, non-empty, within its `n`
    tokens; else SampleRefused naming `what`."""
    if not isinstance(spans, list):
        raise SampleRefused(f"{what}: env_spans must be a list of [start, end) pairs, got {type(spans).__name__}")
    previous_end = 0
    for i, span in enumerate(spans):
        if (not isinstance(span, (list, tuple)) or len(span) != 2 or not all(is_int(x) for x in span)
                or not previous_end <= span[0] < span[1] <= n):
            raise SampleRefused(f"{what}: env_spans[{i}] = {span!r:.80}; spans must be sorted, disjoint, non-empty "
                                f"[start, end) int pairs within the sample's {n} tokens")
        previous_end = span[1]


def check_sequence_starts(what: str, s: Sample) -> None:
    """A sample's sequence_starts (`Sample.sequence_starts`), for a sample whose env_spans and routes passed
    their checks: a list of ints, sorted, unique, in [0, len(tokens)), each the start of an env span (a
    sequence opens with the context the agent sent); every training sequence holds at least one model
    token, but the last one of a sample not done (still generating, aborted) may hold only its context so
    far; at each start s, routes[s] (the experts of the input before token s, which its sequence does not
    have) are all -1 (not recorded). Else SampleRefused naming `what`, the field and the element."""
    starts, n = s.sequence_starts, len(s.tokens)
    if not isinstance(starts, list):
        raise SampleRefused(f"{what}: sequence_starts must be a list of ints, got {type(starts).__name__}")
    if not starts:
        return
    span_starts = {span[0] for span in s.env_spans}
    previous = -1
    for i, start in enumerate(starts):
        if not is_int(start) or not previous < start < n:
            raise SampleRefused(f"{what}: sequence_starts[{i}] = {start!r:.80}; starts must be sorted, unique ints "
                                f"in [0, {n}) (the sample's tokens)")
        if start not in span_starts:
            raise SampleRefused(f"{what}: sequence_starts[{i}] = {start} is not the start of an env span; a "
                                f"training sequence opens with its context (the environment's tokens)")
        previous = start
    trained = np.concatenate([[0], np.cumsum(s.model_mask())])  # model tokens before each index
    sequences = s.sequences()
    for k, (a, b) in enumerate(sequences):
        if trained[b] == trained[a] and (k < len(sequences) - 1 or s.done):
            raise SampleRefused(f"{what}: sequence_starts {starts!r:.200} leave training sequence {k} (tokens "
                                f"[{a}, {b})) without a model token")
    if s.routes is not None:
        for i, start in enumerate(starts):
            if (s.routes[start] != -1).any():
                raise SampleRefused(f"{what}: routes[{start}] = {s.routes[start].tolist()!r:.80} at "
                                    f"sequence_starts[{i}]; a sequence's first token has no input before it "
                                    f"in its sequence, so its routes must be -1 (not recorded)")


def check_sequence_lengths(what: str, s: Sample, max_tokens: int, prompt_tokens: int) -> None:
    """Each training sequence of a sample whose sequence_starts passed `check_sequence_starts` fits a trainer
    row: at most `max_tokens` tokens for the one that follows the prompt, max_tokens + prompt_tokens for a
    started one (its own context, without the prompt's `prompt_tokens`); else SampleRefused ("length")."""
    starts = set(s.sequence_starts)
    for k, (a, b) in enumerate(s.sequences()):
        cap = max_tokens + (prompt_tokens if a in starts else 0)
        if b - a > cap:
            raise SampleRefused(f"{what}: training sequence {k} (tokens [{a}, {b})) has {b - a} tokens, more "
                                f"than the {cap} a trainer row leaves it", "length")


def check_samples(group_id: int, n: int, samples: Any, what: str, v_start: int, v_max: int,
                  finished: bool, *, vocab_size: int | None = None, max_tokens: int | None = None,
                  route_spec: RouteSpec | None = None, prompt_tokens: int = 0) -> None:
    """`n` samples, each passing `check_sample` (with `vocab_size`, `max_tokens`, `route_spec` and
    `prompt_tokens`);
    TypeError for a non-list, SampleRefused naming the group and sample otherwise."""
    if not isinstance(samples, list):
        raise TypeError(f"group {group_id}: {what} samples must be a list of {n} Samples, "
                        f"got {type(samples).__name__}")
    if len(samples) != n:
        raise SampleRefused(f"group {group_id}: {what} has {len(samples)} samples, expected {n}")
    for i, s in enumerate(samples):
        check_sample(f"group {group_id} sample {i}", s, v_start, v_max, finished, vocab_size=vocab_size,
                     max_tokens=max_tokens, route_spec=route_spec, prompt_tokens=prompt_tokens)


def check_routes(what: str, routes: Any, n: int, spec: RouteSpec | None) -> None:
    """A sample's routes (`Sample.routes`) for a sample of `n` tokens of a model whose routing is `spec`:
    None always passes; otherwise the model must have experts (`spec` not None) and routes must be an
    integer numpy array of shape [n, spec.layers, spec.top_k] holding expert ids in
    [-1, spec.num_experts - 1] (-1: not recorded). Else SampleRefused naming `what` and the fault (the
    first bad element for a value out of range)."""
    if routes is None:
        return
    if spec is None:
        raise SampleRefused(f"{what}: routes given, but the model has no experts (a dense model records no "
                            f"routing: routes must be None)")
    if not isinstance(routes, np.ndarray) or routes.dtype.kind not in "iu":
        got = f"a {routes.dtype} array" if isinstance(routes, np.ndarray) else f"a {type(routes).__name__}"
        raise SampleRefused(f"{what}: routes must be an integer numpy array, got {got}")
    if routes.shape != spec.shape(n):
        raise SampleRefused(f"{what}: routes have shape {list(routes.shape)}, expected {list(spec.shape(n))} "
                            f"([{n} tokens, {spec.layers} sparse layers, top-{spec.top_k} experts])")
    bad = (routes < -1) | (routes >= spec.num_experts)
    if bad.any():
        i, layer, j = (int(x) for x in np.argwhere(bad)[0])
        raise SampleRefused(f"{what}: routes[{i}, {layer}, {j}] = {routes[i, layer, j]}; expert ids must be in "
                            f"[-1, {spec.num_experts - 1}] (-1: not recorded)")


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
    """One finite number per sample, whose group statistics (sum, mean and squared deviations, as the
    trainer computes them in float32) are finite too: else SampleRefused naming the group and the bad
    element (reason "reward"; "malformed" for a list of the wrong length or not a list)."""
    if not isinstance(rewards, list):
        raise SampleRefused(f"group {group_id}: rewards must be a list of {n} finite numbers, got {rewards!r:.80}")
    if len(rewards) != n:
        raise SampleRefused(f"group {group_id}: {len(rewards)} rewards for {n} samples; rewards must be "
                            f"{n} finite numbers")
    for i, r in enumerate(rewards):
        if not is_number(r) or not math.isfinite(r):
            raise SampleRefused(f"group {group_id}: rewards[{i}] = {r!r:.80}; rewards must be {n} finite numbers",
                                "reward")
    # Each reward finite is not enough: 2e38 + 2e38 overflows float32, and the advantages become NaN.
    largest = max(abs(r) for r in rewards) if rewards else 0.0
    total = sum(rewards) if largest <= FLOAT32_MAX else math.inf
    spread = sum((r - total / n) ** 2 for r in rewards) if abs(total) <= FLOAT32_MAX else math.inf
    if spread > FLOAT32_MAX:
        raise SampleRefused(f"group {group_id}: rewards {rewards!r:.200} overflow float32 in their sum or spread "
                            f"(the trainer's advantages would be NaN)", "reward")
