"""Advantage estimators against a per-group NumPy reference written from the formulas (a Python loop over groups)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import sum_atol

from jaxflow.trainer import advantages as A


def np_advantages(rewards, ids, estimator, scale_by_std=True, eps=1e-6):
    """Float64 reference: loops over groups; identical rewards in a group (incl. a singleton) give 0."""
    rewards = np.asarray(rewards, np.float64)
    adv = np.zeros_like(rewards)
    zero_var = 0
    for g in np.unique(ids):
        idx = np.flatnonzero(ids == g)
        r = rewards[idx]
        if np.all(r == r[0]):
            zero_var += 1
            continue
        n, mean = len(r), r.mean()
        if estimator == "grpo":
            adv[idx] = (r - mean) / (r.std() + eps) if scale_by_std else r - mean
        elif estimator == "dr_grpo":
            adv[idx] = r - mean
        elif estimator == "rloo":
            adv[idx] = [r[i] - np.delete(r, i).mean() for i in range(n)]
    return adv, zero_var, len(np.unique(ids))


def random_batch(rng, num_groups=7, max_size=6):
    sizes = rng.integers(1, max_size + 1, num_groups)
    ids = np.repeat(np.arange(num_groups), sizes)
    rng.shuffle(ids)  # members of a group need not be contiguous
    rewards = rng.choice([0.0, 1.0], len(ids)) + rng.choice([0.0, 0.1, 0.5], len(ids))
    rewards[ids == 0] = 0.1  # a zero-variance group whose sum/n is not bit-equal to 0.1
    rewards[ids == 1] = rng.normal(size=(ids == 1).sum()) * 3 + 7
    return rewards.astype(np.float32), ids.astype(np.int32)


@pytest.mark.slow  # compiles per estimator and group layout
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_matches_numpy_reference_with_variable_group_sizes(estimator, scale_by_std):
    rng = np.random.default_rng(0)
    for _ in range(10):
        rewards, ids = random_batch(rng)
        adv, stats = A.compute_advantages(rewards, ids, estimator, scale_by_std=scale_by_std)
        want, zero_var, num_groups = np_advantages(rewards, ids, estimator, scale_by_std)
        # A group's baseline sums up to max_size rewards; the batch mean sums every advantage.
        adv_atol = 4 * sum_atol(6, np.abs(rewards).max())
        np.testing.assert_allclose(adv, want, rtol=1e-5, atol=adv_atol)
        assert int(stats["zero_variance_groups"]) == zero_var
        assert int(stats["num_groups"]) == num_groups
        np.testing.assert_allclose(stats["adv_mean"], want.mean(),
                                   atol=adv_atol + sum_atol(len(want), np.abs(want).max()))
        np.testing.assert_allclose(stats["adv_abs_max"], np.abs(want).max(), rtol=1e-5)


def test_zero_variance_groups_are_exactly_zero_and_counted():
    # In float32, sum(7 × 0.1) / 7 != 0.1, so only an exact max == min test gives exact zeros for group 0.
    rewards = np.array([0.1] * 7 + [1.0, 0.0, 5.0, 0.3, 0.3], np.float32)
    ids = np.array([0] * 7 + [1, 1, 2, 3, 3], np.int32)  # group 2 is a singleton
    zero = ids != 1
    for est in A.ADVANTAGE_ESTIMATORS:
        adv, stats = A.compute_advantages(rewards, ids, est)
        adv = np.asarray(adv)
        assert np.all(adv[zero] == 0.0), est
        assert np.all(adv[~zero] != 0.0), est
        assert int(stats["zero_variance_groups"]) == 3
        assert int(stats["num_groups"]) == 4


def test_known_values():
    rewards = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    ids = np.zeros(4, np.int32)
    grpo, _ = A.compute_advantages(rewards, ids, "grpo", eps=0.0)
    std = np.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    np.testing.assert_allclose(grpo, (rewards - 0.25) / std, rtol=1e-6)
    dr, _ = A.compute_advantages(rewards, ids, "dr_grpo")
    np.testing.assert_allclose(dr, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    rloo, _ = A.compute_advantages(rewards, ids, "rloo")
    np.testing.assert_allclose(rloo, [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_jit_and_num_groups():
    rng = np.random.default_rng(1)
    rewards, ids = random_batch(rng, num_groups=5)
    f = jax.jit(A.compute_advantages, static_argnames=("estimator", "num_groups", "scale_by_std"))
    for est in A.ADVANTAGE_ESTIMATORS:
        adv_jit, stats_jit = f(rewards, ids, estimator=est, num_groups=5)
        adv, stats = A.compute_advantages(rewards, ids, est)
        np.testing.assert_allclose(adv_jit, adv, rtol=1e-6, atol=1e-7)
        assert int(stats_jit["zero_variance_groups"]) == int(stats["zero_variance_groups"])
        assert int(stats_jit["num_groups"]) == int(stats["num_groups"]) == 5


@pytest.mark.slow  # compiles per estimator and group layout
@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, 2.0])), min_size=1, max_size=12),
       st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_property_against_reference(pairs, estimator):
    ids = np.array([g for g, _ in pairs], np.int32)
    rewards = np.array([r for _, r in pairs], np.float32)
    adv, stats = A.compute_advantages(rewards, ids, estimator, num_groups=5)
    want, zero_var, num_groups = np_advantages(rewards, ids, estimator)
    # Baselines sum up to 12 rewards <= 2; dividing by the smallest non-zero std these groups can have
    # (one 0.5 among eleven 0s: 0.138) scales that rounding up.
    np.testing.assert_allclose(adv, want, rtol=1e-5, atol=sum_atol(12, 2.0) / 0.138)
    assert int(stats["zero_variance_groups"]) == zero_var and int(stats["num_groups"]) == num_groups
    if estimator != "grpo":  # centred estimators sum to 0 within every group
        for g in np.unique(ids):
            assert abs(float(np.asarray(adv)[ids == g].sum())) < 1e-5


def test_errors():
    r, ids = np.zeros(4, np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*dr_grpo.*grpo.*rloo"):
        A.compute_advantages(r, ids, "ppo")
    with pytest.raises(ValueError, match="group_ids_b"):
        A.compute_advantages(r, ids[:3], "grpo")
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        A.compute_advantages(r, np.array([0, 1, 2, 0], np.int32), "grpo", num_groups=2)


def test_broadcast_to_tokens():
    adv = np.array([1.5, -2.0, 0.0], np.float32)
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], np.float32)
    out = A.broadcast_to_tokens(adv, mask)
    np.testing.assert_array_equal(out, adv[:, None] * mask)
    with pytest.raises(ValueError, match="adv_b"):
        A.broadcast_to_tokens(adv[:2], mask)
    assert jnp.asarray(out).dtype == jnp.float32


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_make_batch_compiles_once_per_shape_whatever_the_trajectory_count(estimator):
    """make_batch pads the advantage computation to its row count: batches of 1, 6 and 13 groups (1-3 samples
    each) share one compiled program, and their advantages and statistics are those of the unpadded
    computation."""
    from jaxflow.trainer.batch import Trajectory, make_batch
    rng = np.random.default_rng(3)
    compiled = None
    for num_groups in (1, 6, 13):
        rewards, ids = random_batch(rng, num_groups=num_groups, max_size=3)
        trajs = [Trajectory([1, 2], [3, 4, 5], [-1.0] * 3, [0] * 3, reward=float(r), group_id=int(g) * 7)
                 for r, g in zip(rewards, ids)]
        batch, stats = make_batch(trajs, num_rows=64, seq_len=16, pack=True, advantage_estimator=estimator)
        compiled = compiled or A._compute._cache_size()  # the first batch compiles; the others reuse it
        want, zero_var, groups = np_advantages(rewards, ids, estimator)
        # Each trajectory's advantage, found by its reward (equal rewards in a group get equal advantages).
        got = np.asarray(batch.advantages)[np.asarray(batch.loss_mask) > 0].reshape(len(trajs), 3)[:, 0]
        adv_atol = 4 * sum_atol(3, np.abs(rewards).max())
        np.testing.assert_allclose(np.sort(got), np.sort(want), rtol=1e-5, atol=adv_atol)
        assert stats["num_groups"] == groups and stats["zero_variance_groups"] == zero_var
        np.testing.assert_allclose(stats["adv_mean"], want.mean(),
                                   atol=adv_atol + sum_atol(len(want), np.abs(want).max()))
        np.testing.assert_allclose(stats["adv_abs_max"], np.abs(want).max(), rtol=1e-5, atol=adv_atol)
    assert A._compute._cache_size() == compiled
