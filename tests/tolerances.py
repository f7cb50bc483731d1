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


def forward_terms(cfg) -> int:
    """The terms a transformer's logit accumulates rounding over: its widest dot product (the hidden or the
    MLP's width) once per layer and once in the head; `sum_atol(forward_terms(cfg), max|logit|)` bounds
    the difference between two programs computing the same forward pass."""
    return max(cfg.hidden_size, cfg.intermediate_size) * (cfg.num_layers + 1)


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


def assert_engines_served_the_trainers_weights(trained: list[dict]):
    """A run's per-step `behav_weight_*` metrics (w = pi_prox / mu token by token: the trainer's recomputed
    probability of each sampled token over the engine's) say the engines sampled with the weights the
    trainer published, version by version.

    Step 0 trains version-0 tokens only, sampled with the weights the trainer starts from, so every w is 1
    up to float32 summation order (1e-6 in log-prob); a tensor mangled or half-loaded on its way would move
    some token's w far more than 1e-3. Later steps train tokens up to eta versions old. There w estimates
    E_mu[pi/mu] = 1 without bias but with a heavy right tail: a token mu sampled at probability 0.01 that
    pi_prox gives 0.5 weighs 50, and moves the mean of a step of a few hundred tokens by 0.1 or more (CI saw
    1.14 on one step of a 24-step run at lr 3e-4). So the mean over all steps' tokens must be within 10% of 1,
    and each step's mean without its largest weight within (0.75, 1.33): engines on the wrong version or on
    garbage weights sample tokens pi_prox finds unlikely, which pulls the typical w, not only the tail, down.
    """
    assert trained, "no trained steps"
    first = trained[0]
    assert first["staleness"].keys() == {"0"}, first["staleness"]
    assert abs(first["behav_weight_mean"] - 1) < 1e-3 and first["behav_weight_max"] < 1 + 1e-3, first
    tokens = sum(r["num_tokens"] for r in trained)
    pooled = sum(r["behav_weight_mean"] * r["num_tokens"] for r in trained) / tokens
    assert 0.9 < pooled < 1.1, (pooled, [round(r["behav_weight_mean"], 3) for r in trained])
    for r in trained:
        n = r["num_tokens"]
        rest = (r["behav_weight_mean"] * n - r["behav_weight_max"]) / max(n - 1, 1)
        assert 0.75 < rest < 1.33, (r["step"], rest, r["behav_weight_mean"], r["behav_weight_max"], n)
