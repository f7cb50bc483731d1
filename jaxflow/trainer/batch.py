"""The trainer's input: finished trajectories laid out as token rows, padded or packed.

Every per-token array is aligned with `tokens`: entry t describes token t, whose log-probability the
model computes from position t - 1 of the same segment. A row holds one sequence (padded) or several
(packed: segment ids 1, 2, ... with positions restarting at 0, short sequences kept inside equal parts
of the row so that attention runs per part); segment id 0 is padding.

A sample split into training sequences (`jaxflow.data.records.Sample.sequence_starts`) comes as one
trajectory per sequence, a started one with its leading environment tokens as its prompt: laid out like any
other, it attends to nothing before it, with positions from 0.

Shared prompts (`make_batch(share_prompts=True)`): the samples of one GRPO group have the same prompt,
so a packed row may hold it once for several of them (only trajectories of one group whose prompts are
equal token for token share one). The prompt but its last token is a segment of its own (h); each sample
follows as a segment that starts with the prompt's last token, then its completion, positions continuing
from the prompt's, and `context_ids` h on each of its tokens: its tokens attend to h and to their own
segment, so every log-probability is the one of the sample laid out alone, while the prompt's tokens go
through the model once instead of once per sample.

Routing replay (a mixture-of-experts policy, `make_batch(route_spec=...)`): `routes` [M, b, T, L_sparse,
k] holds, at position t, the experts the rollout engine chose for the input token t, which the trainer's
forward then uses (`jaxflow.models.moe`). A sample's `routes[i]` (its completion token i's) goes to the
position before token i; every other position holds -1 and routes itself (the prompt, padding).

Recorded teacher log-probs (on-policy distillation with the teacher beside the rollout, `make_batch(teacher=True)`):
`teacher_logp` [M, b, T] holds each trained token's teacher log-prob, aligned like `behav_logp` (0 where not
trained); the step then reads them instead of scoring the batch with a teacher of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from jaxflow.data.records import RouteSpec
from jaxflow.models.transformer import row_splits
from jaxflow.trainer.advantages import compute_advantages


class BatchOverflow(ValueError):
    """The trajectories do not fit the rows of the batch shape asked for (too many, or too many tokens to
    pack); a shape with more rows (more micro-batches) may hold them."""


@dataclasses.dataclass
class Trajectory:
    """One training sequence of a finished sample: a prompt (its context) and the completion an engine
    generated for it.

    behav_logp and versions have one entry per completion token: the engine's log-probability of the
    token and the policy version that produced it. group_id identifies the prompt's group (GRPO/RLOO).
    member: the group member (sample) it comes from. A sample split into several training sequences
    (`jaxflow.data.records.Sample.sequence_starts`) gives one trajectory per sequence, all with its member
    index and reward: group-relative advantages count each member once and give all its trajectories its
    advantage. None: a member of its own. advantage, when set, is used as is instead of being computed
    from rewards. env_spans: [start, end) ranges of completion tokens the environment wrote (a multi-turn
    episode's observations): context for the tokens after them, never trained (loss mask 0, no behaviour
    log-prob, version -1).
    """

    prompt: Sequence[int]
    completion: Sequence[int]
    behav_logp: Sequence[float]
    versions: Sequence[int]
    reward: float = 0.0
    group_id: int = 0
    advantage: float | None = None
    env_spans: Sequence[Sequence[int]] = ()
    routes: np.ndarray | None = None  # [len(completion), L_sparse, k]: see `jaxflow.data.records.Sample.routes`
    member: int | None = None
    teacher_logp: Sequence[float] | None = None  # per completion token: `jaxflow.data.records.Sample.teacher_logprobs`


@struct.dataclass
class TrajectoryBatch:
    """Arrays [M, b, T]: M micro-batches of b rows of T tokens (M = 1 without accumulation).

    tokens int32; positions int32 rotary positions; segment_ids int32 (0 = padding); loss_mask float32
    (1 = generated token that is trained); behav_logp float32 log μ of the token (0 where not trained);
    versions int32 policy version that generated the token (-1 on prompt and padding); advantages
    float32 advantage of the token's sequence (0 where not trained); rewards float32 raw reward of the
    token's sequence (0 where not trained), for losses that look at the reward itself (TOPR's split);
    context_ids int32 the segment id of a shared prompt the token also attends to (0: none).
    routes: with routing replay, [M, b, T, L_sparse, k] small ints, the recorded experts of each input
    position (-1: none; module docstring); None otherwise.
    teacher_logp: with recorded teacher log-probs (`make_batch(teacher=True)`), float32 [M, b, T] log π_T of the
    token (0 where not trained); None otherwise.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    behav_logp: jax.Array
    versions: jax.Array
    advantages: jax.Array
    rewards: jax.Array
    context_ids: jax.Array
    routes: jax.Array | None = None
    teacher_logp: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.loss_mask).sum())


# Token ids beyond int32 would raise OverflowError (numpy) while the batch is written: checked first.
_INT32_LIMIT = 2**31

# The batch's fields and their dtypes.
FIELD_DTYPES = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "loss_mask": np.float32,
                "behav_logp": np.float32, "versions": np.int32, "advantages": np.float32,
                "rewards": np.float32, "context_ids": np.int32}


def validate_batch(batch: TrajectoryBatch, train_version: int) -> None:
    """Host-side checks before a batch enters the jitted step; raises ValueError naming the problem."""
    shape = np.shape(batch.tokens)
    if len(shape) != 3:
        raise ValueError(f"batch.tokens must be [micro_batches, rows, seq_len], got shape {shape}")
    for name, dtype in FIELD_DTYPES.items():
        value = getattr(batch, name)
        if np.shape(value) != shape:
            raise ValueError(f"batch.{name} has shape {np.shape(value)}, expected {shape} like tokens")
        if np.dtype(value.dtype) != dtype:
            raise ValueError(f"batch.{name} has dtype {value.dtype}, expected {np.dtype(dtype).name}")
    mask = np.asarray(batch.loss_mask) > 0
    if not mask.any():
        raise ValueError("batch.loss_mask is empty: the batch has no token to train on")
    segments = np.asarray(batch.segment_ids)
    if (mask & (segments == 0)).any():
        raise ValueError("batch.loss_mask marks padding tokens (segment id 0) for training")
    previous = np.pad(segments[..., :-1], ((0, 0), (0, 0), (1, 0)))
    if (mask & (segments != previous)).any():
        raise ValueError("batch.loss_mask marks a sequence's first token, which has no prediction")
    _validate_context(segments, np.asarray(batch.context_ids))
    if batch.routes is not None:
        routes = np.asarray(batch.routes)
        if routes.ndim != 5 or routes.shape[:3] != shape or routes.dtype.kind != "i":
            raise ValueError(f"batch.routes must be integers [micro_batches, rows, seq_len, layers, top_k] with "
                             f"[micro_batches, rows, seq_len] = {shape}, got {routes.dtype} {routes.shape}")
    versions = np.asarray(batch.versions)[mask]
    if versions.max() > train_version:
        raise ValueError(f"batch holds tokens of policy version {versions.max()}, newer than the "
                         f"version being trained ({train_version})")
    if versions.min() < 0:
        raise ValueError("batch.versions is negative on a trained token")
    if not np.isfinite(np.asarray(batch.behav_logp)[mask]).all():
        raise ValueError("batch.behav_logp is not finite on a trained token")
    if batch.teacher_logp is not None:
        teacher = np.asarray(batch.teacher_logp)
        if teacher.shape != shape or teacher.dtype != np.float32:
            raise ValueError(f"batch.teacher_logp must be float32 {shape} like tokens, got {teacher.dtype} "
                             f"{teacher.shape}")
        if not np.isfinite(teacher[mask]).all():
            raise ValueError("batch.teacher_logp is not finite on a trained token")


def _validate_context(segments: np.ndarray, context: np.ndarray) -> None:
    """A non-zero context id must name a segment of the same row that ends before the token."""
    shared = context != 0
    if not shared.any():
        return
    if (shared & (segments == 0)).any():
        raise ValueError("batch.context_ids is set on padding tokens (segment id 0)")
    if (shared & (context == segments)).any():
        raise ValueError("batch.context_ids names a token's own segment")
    if context.min() < 0 or context.max() > segments.max():
        raise ValueError("batch.context_ids names a segment id that no row holds")
    rows = segments.reshape(-1, segments.shape[-1])
    last = np.full((rows.shape[0], rows.shape[1] + 1), -1)
    where = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
    np.maximum.at(last, (np.arange(rows.shape[0])[:, None].repeat(rows.shape[1], 1), rows), where)
    ctx = context.reshape(rows.shape)
    end = np.take_along_axis(last, ctx, axis=1)
    if ((ctx != 0) & ((end < 0) | (end >= where))).any():
        raise ValueError("batch.context_ids names a segment that is not earlier in the token's row")


def _advantages(trajectories: Sequence[Trajectory], estimator: str, scale_by_std: bool, std_ddof: int,
                size: int):
    given = [t.advantage is not None for t in trajectories]
    if all(given):
        return np.asarray([t.advantage for t in trajectories], np.float32), {}
    if any(given):
        raise ValueError("either every trajectory carries an advantage or none does")
    # One entry per group member: the trajectories of a member split into several training sequences share
    # its reward and count once in its group's statistics.
    members: dict[tuple, int] = {}
    member_of = np.zeros(len(trajectories), np.int64)
    first: list[int] = []  # a trajectory of each member
    for i, t in enumerate(trajectories):
        key = (t.group_id, "member", t.member) if t.member is not None else (t.group_id, "trajectory", i)
        if key not in members:
            members[key] = len(first)
            first.append(i)
        member_of[i] = members[key]
        j = first[member_of[i]]
        if t.reward != trajectories[j].reward:
            raise ValueError(f"trajectories {j} and {i} (group {t.group_id} member {t.member}) carry rewards "
                             f"{trajectories[j].reward} and {t.reward}; the sequences of one member share its reward")
    n = len(first)
    _, dense = np.unique(np.asarray([trajectories[j].group_id for j in first]), return_inverse=True)
    # Padded to one length for every batch of a shape (`size`, at least one entry more than the
    # trajectories), so the computation compiles once per run rather than once per trajectory count (a
    # count seen first cost up to 0.9 s of compiling beside a busy rollout engine). The padding is one
    # extra group of zero rewards: it has zero variance, so its advantages are 0, and it is taken out of
    # the statistics.
    length = max(size, n) + 1
    rewards = np.zeros(length, np.float32)
    rewards[:n] = [trajectories[j].reward for j in first]
    ids = np.full(length, dense.max(initial=-1) + 1, np.int32)
    ids[:n] = dense
    adv, stats = compute_advantages(rewards, ids, estimator, num_groups=length, scale_by_std=scale_by_std,
                                    std_ddof=std_ddof)
    adv = np.asarray(adv)[:n]  # per member
    return adv[member_of], {"zero_variance_groups": float(stats["zero_variance_groups"]) - 1,
                            "num_groups": float(stats["num_groups"]) - 1,
                            "adv_mean": float(adv.mean()),
                            "adv_abs_max": float(np.abs(adv).max(initial=0.0))}


def _place(lengths: list[int], num_rows: int, seq_len: int, pack: bool,
           what: str) -> list[tuple[int, int]]:
    """(row, offset) for each item of `lengths` tokens (a sequence, or a shared prompt and its samples).

    Packing is first-fit over sequences sorted by length, into parts of rows: a row opened for a
    sequence is cut into the most equal parts (`row_splits`) that still hold it, and no sequence
    straddles a part, so the step attends within parts (`split_attention`: n parts, n times less
    attention work). If that leaves too few rows, plain first-fit over whole rows."""
    if not pack:
        if len(lengths) > num_rows:
            raise BatchOverflow(f"{what} do not fit in {num_rows} padded rows")
        return [(i, 0) for i in range(len(lengths))]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for splits in (row_splits(seq_len), (1,)):
        parts: list[list[int]] = []  # per open row: the free tokens of each of its parts
        placement: list[tuple[int, int] | None] = [None] * len(lengths)
        for i in order:
            spot = next(((r, j) for r, free in enumerate(parts) for j, f in enumerate(free) if f >= lengths[i]),
                        None)
            if spot is None:
                if len(parts) == num_rows:
                    break
                n = max(n for n in splits if seq_len // n >= lengths[i])
                parts.append([seq_len // n] * n)
                spot = (len(parts) - 1, 0)
            r, j = spot
            size = seq_len // len(parts[r])
            placement[i] = (r, (j + 1) * size - parts[r][j])
            parts[r][j] -= lengths[i]
        else:
            return placement
    raise BatchOverflow(f"{what} ({sum(lengths)} tokens) do not fit in "
                     f"{num_rows} packed rows of {seq_len} tokens")


# Cost of a token in a part of S tokens, relative to its cost in a part of 0: 1 + S / ATTENTION_TOKENS (the
# projections and MLP per token, plus attention over the part). Used to choose how many samples share one
# copy of their prompt: more per copy saves prompt tokens but needs larger parts. A rough weight: on the
# single-turn task's batches 64, 128, 512 and 4096 gave the same update time within noise.
ATTENTION_TOKENS = 128


def _item_cost(length: int, parts: list[int]) -> float:
    """What a packed item of `length` tokens costs: the tokens of the smallest part that holds it."""
    size = next((p for p in parts if p >= length), parts[-1])
    return size * (1 + size / ATTENTION_TOKENS)


def _share(trajectories: Sequence[Trajectory], seq_len: int) -> list[list[int]]:
    """The packed items: [i] for a trajectory laid out alone, [i, j, ...] for trajectories of one group with
    the same prompt laid out behind one copy of it (see the module docstring). For each group this picks
    the part size (a `row_splits` part of seq_len) to fill with copies of the prompt and as many samples as
    fit, largest first, by `_item_cost` (or none: every sample alone)."""
    parts = sorted({seq_len // n for n in row_splits(seq_len)})
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault((t.group_id, tuple(t.prompt)), []).append(i)
    items = []
    for (_, prompt), members in groups.items():
        head = len(prompt) - 1
        pieces = sorted(members, key=lambda i: -len(trajectories[i].completion))
        sizes = {i: 1 + len(trajectories[i].completion) for i in members}
        best = [[i] for i in members]
        best_cost = sum(_item_cost(head + sizes[i], parts) for i in members)
        for part in parts if head >= 1 and len(members) > 1 else ():
            if head + sizes[pieces[0]] + sizes[pieces[1]] > part:
                continue
            units: list[list[int]] = []
            free: list[int] = []
            for i in pieces:  # first fit, largest first
                k = next((k for k, f in enumerate(free) if f >= sizes[i]), None)
                if k is None:
                    units.append([])
                    free.append(part - head)
                    k = len(units) - 1
                units[k].append(i)
                free[k] -= sizes[i]
            cost = sum(_item_cost(part - f, parts) for f in free)
            if cost < best_cost:
                best, best_cost = units, cost
        items += best
    return items


def make_batch(trajectories: Sequence[Trajectory], *, num_rows: int, seq_len: int,
               micro_batches: int = 1, pack: bool = False, advantage_estimator: str = "grpo",
               scale_by_std: bool = True, std_ddof: int = 0, minibatches: int = 1,
               share_prompts: bool = False, route_spec: RouteSpec | None = None,
               teacher: bool = False) -> tuple[TrajectoryBatch, dict[str, float]]:
    """Lays trajectories out as a [micro_batches, num_rows // micro_batches, seq_len] batch.

    Advantages come from the trajectories' rewards and group ids (or their own `advantage`), by
    `compute_advantages(estimator, scale_by_std=, std_ddof=)`, one per group member (`Trajectory.member`).
    Filled rows are dealt to the
    `minibatches` (row r to minibatch r % K, the step's K consecutive groups of micro-batches), and
    inside a minibatch they fill its micro-batches in order: rows beyond the trajectories leave whole
    micro-batches empty at the end of each minibatch, which the step skips. A batch padded to a fixed
    shape therefore costs compute for its trajectories only. share_prompts (packed rows only): samples
    of one group with the same prompt may share one copy of it (module docstring). route_spec: the routing
    (`jaxflow.data.records.RouteSpec`) of a mixture-of-experts policy whose recorded routes the batch carries
    for replay (module docstring); a trajectory without routes routes itself. teacher: the batch carries the
    trajectories' recorded teacher log-probs (`teacher_logp`; every trajectory must have them).
    Returns the batch (numpy arrays) and advantage statistics. Raises BatchOverflow when the trajectories
    do not fit num_rows rows, ValueError for other bad arguments.
    """
    if num_rows % micro_batches:
        raise ValueError(f"num_rows={num_rows} is not a multiple of micro_batches={micro_batches}")
    if minibatches < 1 or micro_batches % minibatches:
        raise ValueError(f"micro_batches={micro_batches} is not a multiple of minibatches={minibatches}")
    if share_prompts and not pack:
        raise ValueError("share_prompts needs packed rows (pack=True)")
    for i, t in enumerate(trajectories):
        n = len(t.completion)
        if len(t.behav_logp) != n or len(t.versions) != n:
            raise ValueError(f"trajectory {i}: {n} completion tokens but {len(t.behav_logp)} behaviour "
                             f"log-probs and {len(t.versions)} versions")
        if not len(t.prompt):
            raise ValueError(f"trajectory {i} has an empty prompt")
        for field in ("prompt", "completion"):
            ids = getattr(t, field)
            if len(ids) and not -_INT32_LIMIT <= min(ids) <= max(ids) < _INT32_LIMIT:
                raise ValueError(f"trajectory {i}: {field} token ids span [{min(ids)}, {max(ids)}], outside the int32 "
                                 f"range the batch holds (screen them first: rl_trainer.screen_groups)")
        if any(not 0 <= a < b <= n for a, b in t.env_spans):
            raise ValueError(f"trajectory {i}: env_spans {list(t.env_spans)} are not [start, end) ranges within "
                             f"its {n} completion tokens")
        if teacher and (t.teacher_logp is None or len(t.teacher_logp) != n):
            got = "none" if t.teacher_logp is None else len(t.teacher_logp)
            raise ValueError(f"trajectory {i}: {n} completion tokens but {got} teacher log-probs (teacher_logp); a "
                             f"batch with recorded teacher log-probs needs one per completion token")
        if len(t.prompt) + n > seq_len:
            raise ValueError(f"trajectory {i} has {len(t.prompt) + n} tokens, more than seq_len={seq_len}")
        if t.routes is not None:
            if route_spec is None:
                raise ValueError(f"trajectory {i} has routes but the batch replays none (route_spec=None)")
            layers, top_k, experts = route_spec.layers, route_spec.top_k, route_spec.num_experts
            r = np.asarray(t.routes)
            if r.shape != (n, layers, top_k) or r.dtype.kind not in "iu":
                raise ValueError(f"trajectory {i}: routes are {r.dtype} {r.shape}, expected integers "
                                 f"{(n, layers, top_k)} ({n} completion tokens, {layers} sparse layers, top-{top_k})")
            if r.size and not -1 <= r.min() <= r.max() < experts:
                raise ValueError(f"trajectory {i}: routes span [{r.min()}, {r.max()}], outside [-1, {experts - 1}] "
                                 f"({experts} experts)")
    advantages, stats = _advantages(trajectories, advantage_estimator, scale_by_std, std_ddof, num_rows)
    items = _share(trajectories, seq_len) if share_prompts else [[i] for i in range(len(trajectories))]
    # An item's tokens: its prompt but the last, then each sample's last prompt token and completion (for an
    # item of one sample, that is just its prompt and completion).
    lengths = [len(trajectories[item[0]].prompt) - 1 + sum(1 + len(trajectories[i].completion) for i in item)
               for item in items]
    what = f"{len(trajectories)} trajectories"
    if len(items) < len(trajectories):
        what += f" ({len(items)} packed items)"
    out = {name: np.zeros((num_rows, seq_len), dtype) for name, dtype in FIELD_DTYPES.items()}
    out["versions"][:] = -1
    if teacher:
        out["teacher_logp"] = np.zeros((num_rows, seq_len), np.float32)
    if route_spec is not None:
        out["routes"] = np.full((num_rows, seq_len, route_spec.layers, route_spec.top_k), -1, route_spec.dtype)
    next_segment = np.ones(num_rows, np.int32)

    def write(row: int, start: int, tokens: Sequence[int], first_position: int, context: int) -> int:
        """Writes one segment's tokens; returns its segment id."""
        segment, end = next_segment[row], start + len(tokens)
        next_segment[row] += 1
        out["tokens"][row, start:end] = tokens
        out["positions"][row, start:end] = np.arange(first_position, first_position + len(tokens))
        out["segment_ids"][row, start:end] = segment
        out["context_ids"][row, start:end] = context
        return segment

    def train(row: int, start: int, i: int) -> None:
        """Marks trajectory i's completion, from `start`, for training (its environment spans not), and
        places its routes one position earlier (the inputs that produced its tokens)."""
        t = trajectories[i]
        gen = slice(start, start + len(t.completion))
        if t.routes is not None:
            out["routes"][row, start - 1:start - 1 + len(t.completion)] = t.routes
        out["loss_mask"][row, gen] = 1.0
        out["behav_logp"][row, gen] = t.behav_logp
        out["versions"][row, gen] = t.versions
        out["advantages"][row, gen] = advantages[i]
        out["rewards"][row, gen] = t.reward
        if teacher:
            out["teacher_logp"][row, gen] = t.teacher_logp
        for span_start, span_end in t.env_spans:  # the environment's tokens: context only
            env = slice(start + span_start, start + span_end)
            for name in ("loss_mask", "behav_logp", "advantages", "rewards") + (("teacher_logp",) if teacher else ()):
                out[name][row, env] = 0
            out["versions"][row, env] = -1

    for item, (row, start) in zip(items, _place(lengths, num_rows, seq_len, pack, what)):
        prompt = list(trajectories[item[0]].prompt)
        if len(item) == 1:
            write(row, start, prompt + list(trajectories[item[0]].completion), 0, 0)
            train(row, start + len(prompt), item[0])
            continue
        head = write(row, start, prompt[:-1], 0, 0)
        start += len(prompt) - 1
        for i in item:  # each sample: the prompt's last token, then its completion
            completion = list(trajectories[i].completion)
            write(row, start, prompt[-1:] + completion, len(prompt) - 1, head)
            train(row, start + 1, i)
            start += 1 + len(completion)
    # Row r goes to minibatch r % K, position r // K of that minibatch's rows, in micro-batch order.
    k, rows = minibatches, num_rows // micro_batches
    split = {name: v.reshape(num_rows // k, k, seq_len, *v.shape[2:]).swapaxes(0, 1).reshape(
        micro_batches, rows, seq_len, *v.shape[2:]) for name, v in out.items()}
    return TrajectoryBatch(**{name: np.ascontiguousarray(v) for name, v in split.items()}), stats
