"""The trainer's input: finished trajectories laid out as token rows, padded or packed.

Every per-token array is aligned with `tokens`: entry t describes token t, whose log-probability the
model computes from positions < t. A row holds one sequence (padded) or several (packed: segment ids
1, 2, ... with positions restarting at 0, short sequences kept inside equal parts of the row so that
attention runs per part); segment id 0 is padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import struct

from jaxflow.models.transformer import row_splits
from jaxflow.trainer.advantages import compute_advantages


@dataclasses.dataclass
class Trajectory:
    """One finished sample: a prompt and the completion an engine generated for it.

    behav_logp and versions have one entry per completion token: the engine's log-probability of the
    token and the policy version that produced it. group_id identifies the prompt's group (GRPO/RLOO).
    advantage, when set, is used as is instead of being computed from rewards. env_spans: [start, end)
    ranges of completion tokens the environment wrote (a multi-turn episode's observations): context
    for the tokens after them, never trained (loss mask 0, no behaviour log-prob, version -1).
    """

    prompt: Sequence[int]
    completion: Sequence[int]
    behav_logp: Sequence[float]
    versions: Sequence[int]
    reward: float = 0.0
    group_id: int = 0
    advantage: float | None = None
    env_spans: Sequence[Sequence[int]] = ()


@struct.dataclass
class TrajectoryBatch:
    """Arrays [M, b, T]: M micro-batches of b rows of T tokens (M = 1 without accumulation).

    tokens int32; positions int32 rotary positions; segment_ids int32 (0 = padding); loss_mask float32
    (1 = generated token that is trained); behav_logp float32 log μ of the token (0 where not trained);
    versions int32 policy version that generated the token (-1 on prompt and padding); advantages
    float32 advantage of the token's sequence (0 where not trained); rewards float32 raw reward of the
    token's sequence (0 where not trained), for losses that look at the reward itself (TOPR's split).
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    behav_logp: jax.Array
    versions: jax.Array
    advantages: jax.Array
    rewards: jax.Array

    @property
    def num_tokens(self) -> int:
        return int(np.asarray(self.loss_mask).sum())


# The batch's fields and their dtypes.
FIELD_DTYPES = {"tokens": np.int32, "positions": np.int32, "segment_ids": np.int32, "loss_mask": np.float32,
                "behav_logp": np.float32, "versions": np.int32, "advantages": np.float32,
                "rewards": np.float32}


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
    starts = np.asarray(batch.positions) == 0
    if (mask & starts).any():
        raise ValueError("batch.loss_mask marks a sequence's first token, which has no prediction")
    versions = np.asarray(batch.versions)[mask]
    if versions.max() > train_version:
        raise ValueError(f"batch holds tokens of policy version {versions.max()}, newer than the "
                         f"version being trained ({train_version})")
    if versions.min() < 0:
        raise ValueError("batch.versions is negative on a trained token")
    if not np.isfinite(np.asarray(batch.behav_logp)[mask]).all():
        raise ValueError("batch.behav_logp is not finite on a trained token")


def _advantages(trajectories: Sequence[Trajectory], estimator: str, scale_by_std: bool, std_ddof: int):
    given = [t.advantage is not None for t in trajectories]
    if all(given):
        return np.asarray([t.advantage for t in trajectories], np.float32), {}
    if any(given):
        raise ValueError("either every trajectory carries an advantage or none does")
    ids = np.asarray([t.group_id for t in trajectories])
    _, dense = np.unique(ids, return_inverse=True)
    adv, stats = compute_advantages(np.asarray([t.reward for t in trajectories], np.float32),
                                    dense.astype(np.int32), estimator, scale_by_std=scale_by_std,
                                    std_ddof=std_ddof)
    return np.asarray(adv), {k: float(v) for k, v in stats.items()}


def _place(rows: list[list[int]], num_rows: int, seq_len: int, pack: bool) -> list[tuple[int, int]]:
    """(row, offset) for each sequence.

    Packing is first-fit over sequences sorted by length, into parts of rows: a row opened for a
    sequence is cut into the most equal parts (`row_splits`) that still hold it, and no sequence
    straddles a part, so the step attends within parts (`split_attention`: n parts, n times less
    attention work). If that leaves too few rows, plain first-fit over whole rows."""
    lengths = [len(r) for r in rows]
    if not pack:
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} trajectories do not fit in {num_rows} padded rows")
        return [(i, 0) for i in range(len(rows))]
    order = sorted(range(len(rows)), key=lambda i: -lengths[i])
    for splits in (row_splits(seq_len), (1,)):
        parts: list[list[int]] = []  # per open row: the free tokens of each of its parts
        placement: list[tuple[int, int] | None] = [None] * len(rows)
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
    raise ValueError(f"{len(rows)} trajectories ({sum(lengths)} tokens) do not fit in "
                     f"{num_rows} packed rows of {seq_len} tokens")


def make_batch(trajectories: Sequence[Trajectory], *, num_rows: int, seq_len: int,
               micro_batches: int = 1, pack: bool = False, advantage_estimator: str = "grpo",
               scale_by_std: bool = True, std_ddof: int = 0,
               minibatches: int = 1) -> tuple[TrajectoryBatch, dict[str, float]]:
    """Lays trajectories out as a [micro_batches, num_rows // micro_batches, seq_len] batch.

    Advantages come from the trajectories' rewards and group ids (or their own `advantage`), by
    `compute_advantages(estimator, scale_by_std=, std_ddof=)`. Filled rows are dealt to the
    `minibatches` (row r to minibatch r % K, the step's K consecutive groups of micro-batches), and
    inside a minibatch they fill its micro-batches in order: rows beyond the trajectories leave whole
    micro-batches empty at the end of each minibatch, which the step skips. A batch padded to a fixed
    shape therefore costs compute for its trajectories only.
    Returns the batch (numpy arrays) and advantage statistics.
    """
    if num_rows % micro_batches:
        raise ValueError(f"num_rows={num_rows} is not a multiple of micro_batches={micro_batches}")
    if minibatches < 1 or micro_batches % minibatches:
        raise ValueError(f"micro_batches={micro_batches} is not a multiple of minibatches={minibatches}")
    seqs = []
    for i, t in enumerate(trajectories):
        n = len(t.completion)
        if len(t.behav_logp) != n or len(t.versions) != n:
            raise ValueError(f"trajectory {i}: {n} completion tokens but {len(t.behav_logp)} behaviour "
                             f"log-probs and {len(t.versions)} versions")
        if not len(t.prompt):
            raise ValueError(f"trajectory {i} has an empty prompt")
        if any(not 0 <= a < b <= n for a, b in t.env_spans):
            raise ValueError(f"trajectory {i}: env_spans {list(t.env_spans)} are not [start, end) ranges within "
                             f"its {n} completion tokens")
        if len(t.prompt) + n > seq_len:
            raise ValueError(f"trajectory {i} has {len(t.prompt) + n} tokens, more than seq_len={seq_len}")
        seqs.append(list(t.prompt) + list(t.completion))
    advantages, stats = _advantages(trajectories, advantage_estimator, scale_by_std, std_ddof)
    out = {name: np.zeros((num_rows, seq_len), dtype) for name, dtype in FIELD_DTYPES.items()}
    out["versions"][:] = -1
    next_segment = np.ones(num_rows, np.int32)
    for i, (row, start) in enumerate(_place(seqs, num_rows, seq_len, pack)):
        t, n_prompt, end = trajectories[i], len(trajectories[i].prompt), start + len(seqs[i])
        gen = slice(start + n_prompt, end)
        out["tokens"][row, start:end] = seqs[i]
        out["positions"][row, start:end] = np.arange(len(seqs[i]))
        out["segment_ids"][row, start:end] = next_segment[row]
        next_segment[row] += 1
        out["loss_mask"][row, gen] = 1.0
        out["behav_logp"][row, gen] = t.behav_logp
        out["versions"][row, gen] = t.versions
        out["advantages"][row, gen] = advantages[i]
        out["rewards"][row, gen] = t.reward
        for span_start, span_end in t.env_spans:  # the environment's tokens: context only
            env = slice(start + n_prompt + span_start, start + n_prompt + span_end)
            for name in ("loss_mask", "behav_logp", "advantages", "rewards"):
                out[name][row, env] = 0
            out["versions"][row, env] = -1
    # Row r goes to minibatch r % K, position r // K of that minibatch's rows, in micro-batch order.
    k, rows = minibatches, num_rows // micro_batches
    split = {name: v.reshape(num_rows // k, k, seq_len).swapaxes(0, 1).reshape(micro_batches, rows, seq_len)
             for name, v in out.items()}
    return TrajectoryBatch(**{name: np.ascontiguousarray(v) for name, v in split.items()}), stats
