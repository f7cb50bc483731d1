"""Float32 tolerances set from the scale of the terms being summed, not from the result.

A float32 sum of n terms carries a rounding error of at most about n * eps * sum(|term|) / n per term
(the standard worst-case bound, n * eps * max|term|), whatever the summation order a CPU, a thread
count or a sharding picks. When the terms have both signs the sum can be far smaller than their
magnitudes (a policy loss of -1e-3 made of advantage-weighted terms of size 1), so a relative
tolerance on the result would demand more precision than float32 holds: compare against the scale of
the terms instead.
"""

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)


def sum_atol(num_terms: int, term_scale: float) -> float:
    """Worst-case float32 rounding of a sum of `num_terms` terms of magnitude up to `term_scale`."""
    return max(num_terms, 1) * F32_EPS * float(term_scale)


def assert_sums_close(actual, desired, num_terms: int, term_scale: float):
    """Two float32 reductions of the same terms, summed in different orders (sharding, packing,
    micro-batching), agree to within the rounding of the terms."""
    np.testing.assert_allclose(actual, desired, rtol=0, atol=sum_atol(num_terms, term_scale))


def policy_loss_scale(batch) -> tuple[int, float]:
    """(trained tokens, largest term) of a policy loss on `batch`: each token contributes about its
    advantage times a ratio near 1 (2 bounds a clipped PPO ratio with eps <= 1), and aggregation
    divides by a count no smaller than 1/num_terms of the sum."""
    mask = np.asarray(batch.loss_mask) > 0
    adv = np.abs(np.asarray(batch.advantages))[mask]
    return int(mask.sum()), 2.0 * float(adv.max())
