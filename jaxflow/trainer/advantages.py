"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO) over per-sequence rewards.

Every function here is pure `jax.numpy` and jit-safe. A batch holds `B` sequences; sequence `b` has a scalar
reward `rewards_b[b]` and belongs to group `group_ids_b[b]` (the `n` samples of one prompt). Groups may have
different sizes; the caller remaps group ids to the dense range `[0, num_groups)`.

Groups whose rewards are all equal (including singleton groups) carry no learning signal under any of these
estimators: they get an advantage of exactly 0 and are counted in `stats["zero_variance_groups"]`, so the
trainer can log how much of the batch was wasted (DAPO's dynamic sampling filters on the same quantity).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class GroupStats(NamedTuple):
    """Per-group reward statistics, gathered back to the sequences.

    All `_b` fields are `[B]`, all `_g` fields are `[num_groups]`.
    """

    count_b: jax.Array  # float32, size of the sequence's group
    mean_b: jax.Array  # float32, mean reward of the sequence's group
    std_b: jax.Array  # float32, std of the group's rewards (population, or with the `ddof` of group_stats)
    zero_var_b: jax.Array  # bool, the group's rewards are all identical
    count_g: jax.Array  # float32, group sizes (0 for unused ids)
    zero_var_g: jax.Array  # bool, non-empty group with identical rewards


def group_stats(rewards_b: jax.Array, group_ids_b: jax.Array, num_groups: int, ddof: int = 0) -> GroupStats:
    """Computes group sizes, means, stds and zero-variance flags.

    Args:
      rewards_b: [B] float, one scalar reward per sequence.
      group_ids_b: [B] int, group of each sequence, in [0, num_groups).
      num_groups: static number of group ids (segments).
      ddof: the std divides the squared deviations by n - ddof: 0 = population std (default), 1 = unbiased
        sample std (torch.std's default, which some GRPO implementations use). A singleton group's std is 0.
    """
    seg = lambda x: jax.ops.segment_sum(x, group_ids_b, num_segments=num_groups)
    count_g = seg(jnp.ones_like(rewards_b))
    safe_count_g = jnp.maximum(count_g, 1.0)
    mean_g = seg(rewards_b) / safe_count_g
    mean_b = mean_g[group_ids_b]
    # Two-pass variance: numerically better than E[r^2] - E[r]^2 for rewards with a large common offset.
    var_g = seg((rewards_b - mean_b) ** 2) / jnp.maximum(count_g - ddof, 1.0)
    # Zero variance is decided exactly from max == min, not from var < tol: sum/n of identical values is not
    # always bit-equal to the value, so `r - mean` can be 1e-9 instead of 0, and we promise an exact 0.
    max_g = jax.ops.segment_max(rewards_b, group_ids_b, num_segments=num_groups)
    min_g = jax.ops.segment_min(rewards_b, group_ids_b, num_segments=num_groups)
    zero_var_g = (count_g > 0) & (max_g == min_g)
    return GroupStats(
        count_b=count_g[group_ids_b],
        mean_b=mean_b,
        std_b=jnp.sqrt(var_g)[group_ids_b],
        zero_var_b=zero_var_g[group_ids_b],
        count_g=count_g,
        zero_var_g=zero_var_g,
    )


def grpo_advantages(rewards_b: jax.Array, gs: GroupStats, *, scale_by_std: bool, eps: float) -> jax.Array:
    """GRPO (DeepSeekMath): A = (r - mean_g) / (std_g + eps), or r - mean_g without std scaling.

    std_g is the group's reward std: population (divide by n) or unbiased (n - 1), per compute_advantages'
    std_ddof. Returns [B] float32.
    """
    centred_b = rewards_b - gs.mean_b
    if not scale_by_std:
        return centred_b
    return centred_b / (gs.std_b + eps)


def dr_grpo_advantages(rewards_b: jax.Array, gs: GroupStats, *, scale_by_std: bool, eps: float) -> jax.Array:
    """Dr.GRPO (Liu et al., "Understanding R1-Zero-like training"): A = r - mean_g, never std-scaled.

    Dividing by the group std up-weights groups that are nearly all-right or all-wrong (a difficulty bias);
    Dr.GRPO drops it, so `scale_by_std` is ignored here. Returns [B] float32.
    """
    del scale_by_std, eps
    return rewards_b - gs.mean_b


def rloo_advantages(rewards_b: jax.Array, gs: GroupStats, *, scale_by_std: bool, eps: float) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): A = r - mean of the other n-1 members = n/(n-1) * (r - mean_g).

    A singleton group has no other member to form a baseline, so its advantage is 0. `scale_by_std` and
    `eps` are ignored (the leave-one-out baseline is already unbiased). Returns [B] float32.
    """
    del scale_by_std, eps
    n_b = gs.count_b
    factor_b = jnp.where(n_b > 1, n_b / jnp.maximum(n_b - 1.0, 1.0), 0.0)
    return factor_b * (rewards_b - gs.mean_b)


# name -> fn(rewards_b, group_stats, *, scale_by_std, eps) -> adv_b.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def compute_advantages(
    rewards_b: jax.Array,
    group_ids_b: jax.Array,
    estimator: str,
    *,
    num_groups: int | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    std_ddof: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-sequence advantages from per-sequence rewards and group ids.

    Args:
      rewards_b: [B] float, scalar reward of each sequence.
      group_ids_b: [B] int32, group of each sequence in [0, num_groups); groups may differ in size.
      estimator: a key of `ADVANTAGE_ESTIMATORS` ("grpo", "dr_grpo", "rloo").
      num_groups: static segment count; defaults to B, which is always enough for dense ids.
      scale_by_std: GRPO only: divide by (std_g + eps).
      eps: GRPO only: added to the std so low-variance groups don't blow up.
      std_ddof: GRPO only: 0 divides by the population std, 1 by the unbiased sample std (n - 1).

    Returns:
      adv_b: [B] float32; exactly 0 for every member of a zero-variance group (incl. singletons).
      stats: `zero_variance_groups` (int32, non-empty groups with identical rewards), `num_groups` (int32,
        non-empty groups), `adv_mean` and `adv_abs_max` (float32, over the B sequences).

    Raises:
      ValueError: unknown estimator, a shape mismatch, or (with concrete ids) an id out of range.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}")
    if std_ddof not in (0, 1):
        raise ValueError(f"std_ddof must be 0 or 1, got {std_ddof!r}")
    rewards_b = jnp.asarray(rewards_b, jnp.float32)
    group_ids_b = jnp.asarray(group_ids_b, jnp.int32)
    if rewards_b.ndim != 1 or group_ids_b.shape != rewards_b.shape:
        raise ValueError(
            f"rewards_b must be 1-D and group_ids_b must match it; got rewards_b {rewards_b.shape}, "
            f"group_ids_b {group_ids_b.shape}")
    if num_groups is None:
        num_groups = rewards_b.shape[0]
    # segment_sum silently drops out-of-range ids, which would corrupt the baseline without a trace, so check
    # whenever the ids are concrete (under jit they are the caller's responsibility).
    if _is_concrete(group_ids_b) and group_ids_b.size:
        ids = np.asarray(group_ids_b)
        if ids.min() < 0 or ids.max() >= num_groups:
            raise ValueError(
                f"group_ids_b must lie in [0, {num_groups}); got min {ids.min()}, max {ids.max()}")

    return _compute(rewards_b, group_ids_b, estimator, num_groups, scale_by_std, eps, int(std_ddof))


# One compiled program per (shape, settings) instead of a dozen eagerly dispatched ops; inlined under an outer jit.
@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _compute(rewards_b, group_ids_b, estimator, num_groups, scale_by_std, eps, std_ddof):
    gs = group_stats(rewards_b, group_ids_b, num_groups, std_ddof)
    adv_b = ADVANTAGE_ESTIMATORS[estimator](rewards_b, gs, scale_by_std=scale_by_std, eps=eps)
    adv_b = jnp.where(gs.zero_var_b, 0.0, adv_b).astype(jnp.float32)
    stats = {
        "zero_variance_groups": jnp.sum(gs.zero_var_g).astype(jnp.int32),
        "num_groups": jnp.sum(gs.count_g > 0).astype(jnp.int32),
        "adv_mean": jnp.mean(adv_b),
        "adv_abs_max": jnp.max(jnp.abs(adv_b), initial=0.0),
    }
    return adv_b, stats


def broadcast_to_tokens(adv_b: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Copies each sequence's advantage onto its tokens: adv_bt[b, t] = adv_b[b] * mask_bt[b, t].

    Args:
      adv_b: [B] float advantages.
      mask_bt: [B, T] loss mask (1 = trained token); masked tokens get exactly 0.

    Returns:
      [B, T] float32.
    """
    adv_b = jnp.asarray(adv_b, jnp.float32)
    if adv_b.ndim != 1 or mask_bt.ndim != 2 or mask_bt.shape[0] != adv_b.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens needs adv_b [B] and mask_bt [B, T]; got adv_b {adv_b.shape}, "
            f"mask_bt {mask_bt.shape}")
    return jnp.where(mask_bt > 0, adv_b[:, None], 0.0)
