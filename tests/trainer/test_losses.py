"""Policy losses against an independent float64 NumPy reference written from the formulas in the docstrings.

Every registered loss is run once (jit + vmap over random cases) and compared on: the scalar loss under all three
aggregations, the gradient w.r.t. logp_bt (analytic NumPy gradient; for the losses without stop-gradients it is
itself checked by central differences), and the scalar metrics. The cases hold empty rows, garbage (nan/±inf) on
masked tokens, log-ratios of ±30 (beyond the ±20 clamp), zero advantages and zero-variance rows; they are
resampled whenever a token lies within 1e-4 (in log space) of a clip/cap boundary, where fp32 and fp64 could pick
different branches.
"""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxflow.trainer import losses as L

CLAMP = 20.0  # MAX_LOG_RATIO, part of the documented formula
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
MEANS = ("token_mean", "seq_mean_token_mean")  # the aggregations whose weights sum to 1
CFGS = {
    "clamp": L.LossConfig(eps_low=0.2, eps_high=0.28, behav_weight_cap=5.0, behav_weight_mode="clamp",
                          kl_coef=0.1, kl_estimator="k3", tis_cap=2.0, constant_normalizer=16.0,
                          behav_weight_floor=0.3, tis_floor=0.2),
    "mask_dual": L.LossConfig(eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, behav_weight_cap=2.0,
                              behav_weight_mode="mask", kl_coef=0.05, kl_estimator="k1", tis_cap=1.5,
                              cispo_eps_low=0.5, cispo_eps_high=0.2, behav_weight_floor=0.5, tis_floor=0.5,
                              cispo_unified_mask=True, topr_pos_weight=1.5, topr_neg_weight=0.5),
    "none_small_eps": L.LossConfig(eps_low=3e-4, eps_high=4e-4, behav_weight_cap=2.0, behav_weight_mode="none",
                                   kl_coef=0.0, kl_estimator="k2"),
}
B, T, N_CASES = 6, 10, 8


# ------------------------------------------------------------------------------------------- NumPy reference

def np_exp(x):
    return np.exp(np.clip(x, -CLAMP, CLAMP))


def np_dexp(x):
    """d exp(clip(x)) / dx."""
    return np.where(np.abs(x) < CLAMP, np.exp(np.clip(x, -CLAMP, CLAMP)), 0.0)


def np_kl(lp, ref, est):
    """(k, dk/dlp) with d = ref - lp."""
    d = ref - lp
    if est == "k1":
        return lp - ref, np.ones_like(lp)
    if est == "k2":
        return 0.5 * d ** 2, -d
    dc = np.clip(d, -CLAMP, CLAMP)
    inside = np.abs(d) < CLAMP
    return np.exp(dc) - dc - 1.0, np.where(inside, 1.0 - np.exp(dc), 0.0)


def np_surr(r, a, el, eh, c):
    """-min(rA, clip(r)A), dual-clipped; returns (loss, dloss/dr, clip_low, clip_high, dual)."""
    s1, s2 = r * a, np.clip(r, 1 - el, 1 + eh) * a
    loss = -np.minimum(s1, s2)
    inside = (r > 1 - el) & (r < 1 + eh)
    dldr = np.where(s1 <= s2, -a, -a * inside)
    dual = np.zeros(r.shape, bool)
    if c is not None:
        dual = (a < 0) & (loss > -c * a)
        loss = np.where(dual, -c * a, loss)
        dldr = np.where(dual, 0.0, dldr)
    return loss, dldr, (a < 0) & (r < 1 - el), (a > 0) & (r > 1 + eh), dual


def np_behav(logw, cfg):
    raw = np_exp(logw)
    cap, floor = cfg.behav_weight_cap, cfg.behav_weight_floor
    if (cap is None and floor is None) or cfg.behav_weight_mode == "none":
        return raw, raw, np.zeros(raw.shape, bool)
    cap, floor = np.inf if cap is None else cap, 0.0 if floor is None else floor
    out = (raw > cap) | (raw < floor)
    if cfg.behav_weight_mode == "clamp":
        return np.clip(raw, floor, cap), raw, out
    return np.where(out, 0.0, raw), raw, out


def np_reference(name, cfg, c):
    """Returns (loss_bt, dloss_bt/dlogp_bt, per-token metrics) for one case, float64, masked tokens 0."""
    m = c["mask"] > 0
    z = lambda x: np.where(m, x.astype(np.float64), 0.0)
    lp, be, px, a, ref = z(c["logp"]), z(c["behav"]), z(c["prox"]), z(c["adv"]), z(c["ref"])
    zeros = np.zeros(lp.shape)
    el, eh = cfg.eps_low, cfg.eps_high
    lo = hi = dual = capped = zeros.astype(bool)
    if name == "ppo":
        r = np_exp(lp - be)
        loss, dldr, lo, hi, dual = np_surr(r, a, el, eh, cfg.dual_clip_c)
        grad, bw, kl = dldr * np_dexp(lp - be), np.ones_like(r), np_kl(lp, be, "k3")[0]
    elif name in ("decoupled_ppo", "dual_clip"):
        dc = cfg.dual_clip_c if (name == "decoupled_ppo" or cfg.dual_clip_c is not None) else 3.0
        u = np_exp(lp - px)
        w, bw, capped = np_behav(px - be, cfg)
        s, dldr, lo, hi, dual = np_surr(u, a, el, eh, dc)
        loss, grad, kl = w * s, w * dldr * np_dexp(lp - px), np_kl(lp, px, "k3")[0]
    elif name == "tis":
        r = np_exp(lp - be)
        coef = np.clip(r, cfg.tis_floor, cfg.tis_cap)
        capped = (r > cfg.tis_cap) | (r < cfg.tis_floor)
        loss, grad, bw, kl = -coef * a * lp, -coef * a, r, np_kl(lp, be, "k3")[0]
    elif name == "cispo":
        u = np_exp(lp - px)
        lo_b, hi_b = 1 - cfg.cispo_eps_low, 1 + cfg.cispo_eps_high
        coef = np.clip(u, lo_b, hi_b)
        w, bw, capped = np_behav(px - be, cfg)
        loss, grad, kl = -w * coef * a * lp, -w * coef * a, np_kl(lp, px, "k3")[0]
        lo, hi = (u < lo_b) & (a != 0), (u > hi_b) & (a != 0)
        if cfg.cispo_unified_mask:  # PPO's trust region as a token mask
            out_lo, out_hi = (a < 0) & (u < 1 - el), (a > 0) & (u > 1 + eh)
            loss, grad = np.where(out_lo | out_hi, 0.0, loss), np.where(out_lo | out_hi, 0.0, grad)
            lo, hi = lo | out_lo, hi | out_hi
    elif name == "topr":
        r = np_exp(lp - be)
        coef = np.where(a > 0, cfg.topr_pos_weight, cfg.topr_neg_weight * np.clip(r, 0, 1))
        loss, grad, bw, capped, kl = -coef * a * lp, -coef * a, r, (a <= 0) & (r > 1), np_kl(lp, be, "k3")[0]
    elif name == "gspo":
        n = np.maximum(m.sum(1, keepdims=True), 1)
        s_b = np_exp(((lp - px) * m).sum(1, keepdims=True) / n)
        w_b, bw_b, cap_b = np_behav(((px - be) * m).sum(1, keepdims=True) / n, cfg)
        s, dldr, lo, hi, dual = np_surr(np.broadcast_to(s_b, lp.shape), a, el, eh, cfg.dual_clip_c)
        # Token form: d s_bt / d logp_bt = s_b (the sequence ratio itself is stop-gradient).
        loss, grad, kl = w_b * s, w_b * dldr * s_b, np_kl(lp, px, "k3")[0]
        bw, capped = np.broadcast_to(bw_b, lp.shape), np.broadcast_to(cap_b, lp.shape)
    else:
        raise AssertionError(name)
    k, dk = np_kl(lp, ref, cfg.kl_estimator)
    loss, grad = loss + cfg.kl_coef * k, grad + cfg.kl_coef * dk
    metrics = dict(clip_low=lo, clip_high=hi, dual_clipped=dual, behav_weight=bw, behav_capped=capped,
                   approx_kl=kl, kl_ref=k)
    return z(loss), z(grad), {key: z(np.asarray(v, np.float64)) for key, v in metrics.items()}


def np_token_weights(mask, agg, const=None):
    m = (mask > 0).astype(np.float64)
    if agg == "token_mean":
        return m / m.sum()
    if agg == "seq_mean_token_mean":
        lens = m.sum(1)
        n_seq = (lens > 0).sum()
        return np.stack([m[b] / (lens[b] * n_seq) if lens[b] else m[b] for b in range(m.shape[0])])
    if agg == "seq_mean_token_sum":
        return m / (m.sum(1) > 0).sum()
    return m / (m.shape[0] * (m.shape[1] if const is None else const))


# -------------------------------------------------------------------------------------------------- cases

def _near_boundary(c, cfg, margin=1e-4):
    m = c["mask"] > 0
    f = lambda x: np.where(m, x.astype(np.float64), 0.0)
    lp, be, px, ref = f(c["logp"]), f(c["behav"]), f(c["prox"]), f(c["ref"])
    n = np.maximum(m.sum(1), 1)
    logs = [(lp - px)[m], (lp - be)[m], (px - be)[m], (ref - lp)[m],
            np.where(m, lp - px, 0).sum(1) / n, np.where(m, px - be, 0).sum(1) / n]
    bounds = [np.log1p(cfg.eps_high), np.log(cfg.dual_clip_c or 3.0), CLAMP, -CLAMP, np.log(cfg.tis_cap),
              np.log1p(cfg.cispo_eps_high), np.log(cfg.behav_weight_cap or 5.0)]
    bounds += [np.log(f) for f in (cfg.behav_weight_floor, cfg.tis_floor) if f]
    for e in (cfg.eps_low, cfg.cispo_eps_low):
        if e < 1:
            bounds.append(np.log1p(-e))
    x = np.concatenate(logs)
    return bool(np.any(np.abs(x[:, None] - np.array(bounds)[None]) < margin))


def make_case(rng, cfg, extreme=True):
    while True:
        mask = rng.random((B, T)) < 0.7
        mask[0], mask[1] = False, True  # an empty and a full row
        lens = rng.integers(1, T + 1)
        mask[2, lens:] = False  # right-padded row
        logp = -rng.gamma(2.0, 1.0, (B, T))
        prox = logp + rng.normal(size=(B, T)) * rng.choice([1e-5, 0.05, 0.3, 1.0], (B, 1))
        behav = prox + rng.normal(size=(B, T)) * rng.choice([0.0, 1e-5, 0.1, 1.0], (B, 1))
        adv = rng.normal(size=(B, 1)) + rng.normal(size=(B, T)) * rng.choice([0.0, 0.5], (B, 1))
        adv[3] = 0.0  # a zero-variance group: A = 0 everywhere
        adv[rng.random((B, T)) < 0.1] = 0.0
        ref = logp + rng.normal(size=(B, T)) * 0.3
        if extreme:
            for arr, sign in ((logp, 1), (logp, -1), (behav, 1), (behav, -1), (ref, 1), (ref, -1)):
                b, t = rng.integers(1, B), rng.integers(T)
                arr[b, t] += sign * 30.0
        case = dict(logp=logp, behav=behav, prox=prox, adv=adv, ref=ref, mask=mask.astype(np.float32))
        case = {k: v.astype(np.float32) for k, v in case.items()}
        # Garbage where the mask is 0: it must never reach the loss, the metrics or the gradient.
        junk = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30], np.float32), (B, T))
        for k in ("logp", "behav", "prox", "adv", "ref"):
            case[k] = np.where(mask, case[k], junk).astype(np.float32)
        if not _near_boundary(case, cfg):
            return case


@functools.cache
def cases(cfg_id):
    rng = np.random.default_rng(list(CFGS).index(cfg_id))
    cs = [make_case(rng, CFGS[cfg_id], extreme=i % 2 == 0) for i in range(N_CASES)]
    return cs, {k: np.stack([c[k] for c in cs]) for k in cs[0]}


@functools.cache
def run_jax(name, cfg_id):
    """jit(vmap over cases (vmap over the 3 aggregations' weights)) of loss_and_metrics and its gradient."""
    cfg = CFGS[cfg_id]
    cs, st_ = cases(cfg_id)
    weights = np.stack([np.stack([np_token_weights(c["mask"], a, cfg.constant_normalizer) for a in AGGS])
                        for c in cs]).astype(np.float32)

    def per_weights(lp, be, px, a, m, ref, w):
        f = lambda x: L.loss_and_metrics(name, cfg, x, be, px, a, m, w, ref)
        return jax.value_and_grad(f, has_aux=True)(lp)

    def per_case(lp, be, px, a, m, ref, w3):
        return jax.vmap(per_weights, in_axes=(None,) * 6 + (0,))(lp, be, px, a, m, ref, w3)

    out = jax.jit(jax.vmap(per_case))(st_["logp"], st_["behav"], st_["prox"], st_["adv"], st_["mask"],
                                      st_["ref"], weights)
    return jax.tree.map(np.asarray, out), weights.astype(np.float64)


PARAMS = [(n, c) for n in sorted(L.POLICY_LOSSES) for c in CFGS]


@pytest.mark.parametrize("name,cfg_id", PARAMS)
def test_loss_and_grad_match_numpy_reference(name, cfg_id):
    cfg = CFGS[cfg_id]
    cs, _ = cases(cfg_id)
    ((loss, metrics), grad), weights = run_jax(name, cfg_id)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    for i, c in enumerate(cs):
        loss_bt, grad_bt, tok = np_reference(name, cfg, c)
        for j, agg in enumerate(AGGS):
            w = weights[i, j]
            ref_loss = np.sum(w * loss_bt)
            scale = np.sum(np.abs(w * loss_bt))
            np.testing.assert_allclose(loss[i, j], ref_loss, rtol=1e-5, atol=1e-6 * scale + 1e-7,
                                       err_msg=f"case {i} {agg} loss")
            np.testing.assert_allclose(grad[i, j], w * grad_bt, rtol=1e-4, atol=1e-7,
                                       err_msg=f"case {i} {agg} grad")
            assert np.all(grad[i, j][c["mask"] == 0] == 0)
        m = c["mask"] > 0
        mean = lambda x, m=m: x[m].mean()
        expect = {
            "behav_weight_mean": mean(tok["behav_weight"]), "behav_weight_max": tok["behav_weight"][m].max(),
            "behav_capped_frac": mean(tok["behav_capped"]), "clip_low_frac": mean(tok["clip_low"]),
            "clip_high_frac": mean(tok["clip_high"]), "clip_frac": mean(tok["clip_low"] + tok["clip_high"]),
            "dual_clip_frac": mean(tok["dual_clipped"]), "approx_kl": mean(tok["approx_kl"]),
            "kl_ref": mean(tok["kl_ref"]), "num_tokens": m.sum(),
        }
        for k, v in expect.items():
            np.testing.assert_allclose(metrics[k][i, 0], v, rtol=1e-5, atol=1e-6, err_msg=f"case {i} {k}")


@pytest.mark.parametrize("cfg_id", list(CFGS))
def test_analytic_reference_matches_central_differences(cfg_id):
    """The NumPy analytic gradient of the true (stop-gradient-free) objectives equals float64 finite differences.

    ppo, decoupled_ppo, dual_clip and the KL term are token-separable functions of logp, so all tokens can be
    perturbed at once.
    """
    cfg = CFGS[cfg_id]
    h = 1e-6
    for c in cases(cfg_id)[0]:
        for name in ("ppo", "decoupled_ppo", "dual_clip"):
            lp = c["logp"].astype(np.float64)
            up, dn = dict(c, logp=lp + h), dict(c, logp=lp - h)
            loss_bt, grad_bt, _ = np_reference(name, cfg, c)
            numeric = (np_reference(name, cfg, up)[0] - np_reference(name, cfg, dn)[0]) / (2 * h)
            # Round-off of the difference quotient is ~1e-16·|loss|/h (the clamped k3 term reaches 5e7).
            atol = 1e-5 + 1e-14 * np.abs(loss_bt) / h
            assert np.all(np.abs(grad_bt - numeric) <= atol + 1e-5 * np.abs(numeric)), name


def test_every_loss_is_covered():
    assert set(L.POLICY_LOSSES) == {"ppo", "decoupled_ppo", "dual_clip", "tis", "cispo", "topr", "gspo"}


def test_cases_exercise_the_interesting_regions():
    """Guards the test itself: the random cases must hit clips, caps and the dual clip."""
    cs, _ = cases("mask_dual")
    hits = {k: 0.0 for k in ("clip_low", "clip_high", "dual_clipped", "behav_capped")}
    for c in cs:
        tok = np_reference("decoupled_ppo", CFGS["mask_dual"], c)[2]
        for k in hits:
            hits[k] += tok[k].sum()
    assert all(v > 0 for v in hits.values()), hits


# -------------------------------------------------------------------------------------------- hand cases

def _single(name, cfg, logp, behav, prox, adv, mask=None, ref=None):
    arr = lambda x: jnp.asarray(np.asarray(x, np.float32).reshape(1, -1))
    mask = np.ones(np.shape(logp)) if mask is None else mask
    loss, tok = L.policy_loss(name, arr(logp), arr(behav), arr(prox), arr(adv), arr(mask), cfg,
                              None if ref is None else arr(ref))
    return np.asarray(loss)[0], {k: np.asarray(v)[0] for k, v in tok.items()}


def test_dual_clip_bounds_negative_advantage_losses():
    lu = np.log([5.0, 2.0, 5.0, 0.5])
    adv = [-1.0, -1.0, 1.0, -1.0]
    loss, tok = _single("dual_clip", L.LossConfig(), lu, [0.0] * 4, [0.0] * 4, adv)
    # u=5,A=-1: -min(-5, -1.2) = 5 > c=3 -> 3. u=2: 2 < 3 kept. A=+1, u=5: clipped at 1.2. u=.5,A=-1: clip 0.8.
    np.testing.assert_allclose(loss, [3.0, 2.0, -1.2, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(tok["dual_clipped"], [1, 0, 0, 0])
    np.testing.assert_array_equal(tok["clip_high"], [0, 0, 1, 0])
    np.testing.assert_array_equal(tok["clip_low"], [0, 0, 0, 1])
    no_dual, _ = _single("decoupled_ppo", L.LossConfig(), lu, [0.0] * 4, [0.0] * 4, adv)
    np.testing.assert_allclose(no_dual, [5.0, 2.0, -1.2, 0.8], rtol=1e-6)
    c5, _ = _single("dual_clip", L.LossConfig(dual_clip_c=4.0), lu, [0.0] * 4, [0.0] * 4, adv)
    np.testing.assert_allclose(c5[0], 4.0, rtol=1e-6)


def test_behaviour_cap_clamp_vs_mask_vs_none():
    behav = -np.log([10.0, 2.0])  # w = π_prox/μ = 10 and 2, π_θ = π_prox so u = 1
    args = ([0.0, 0.0], behav, [0.0, 0.0], [1.0, 1.0])
    clamp, t_c = _single("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0, behav_weight_mode="clamp"), *args)
    mask, t_m = _single("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0, behav_weight_mode="mask"), *args)
    none, t_n = _single("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0, behav_weight_mode="none"), *args)
    np.testing.assert_allclose(clamp, [-5.0, -2.0], rtol=1e-6)
    np.testing.assert_allclose(mask, [0.0, -2.0], rtol=1e-6)
    np.testing.assert_allclose(none, [-10.0, -2.0], rtol=1e-5)
    np.testing.assert_array_equal(t_c["behav_capped"], [1, 0])
    np.testing.assert_array_equal(t_m["behav_capped"], [1, 0])
    np.testing.assert_array_equal(t_n["behav_capped"], [0, 0])
    np.testing.assert_allclose(t_m["behav_weight"], [10.0, 2.0], rtol=1e-5)  # logged uncapped


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators(est):
    lp = np.array([-1.0, -2.0, -0.5, -3.0])
    ref = np.array([-1.0, -1.5, -2.5, -0.1])
    d = ref - lp
    want = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - d - 1}[est]
    got = L.kl_estimate(jnp.asarray(lp, jnp.float32), jnp.asarray(ref, jnp.float32), est)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    g = jax.grad(lambda x: L.kl_estimate(x, jnp.asarray(ref, jnp.float32), est).sum())(jnp.asarray(lp, jnp.float32))
    h = 1e-6
    k = lambda x: {"k1": x - ref, "k2": 0.5 * (ref - x) ** 2, "k3": np.exp(ref - x) - (ref - x) - 1}[est]
    np.testing.assert_allclose(g, (k(lp + h) - k(lp - h)) / (2 * h), rtol=1e-5, atol=1e-6)
    # Added to the policy loss with kl_coef; kl_coef = 0 still reports it.
    cfg = L.LossConfig(kl_coef=0.5, kl_estimator=est)
    with_kl, tok = _single("ppo", cfg, lp, lp, lp, np.zeros(4), ref=ref)
    np.testing.assert_allclose(with_kl, 0.5 * want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tok["kl_ref"], want, rtol=1e-5, atol=1e-6)


def test_loglinear_prox_logp_matches_reference():
    rng = np.random.default_rng(0)
    behav = -rng.gamma(2.0, 1.0, (3, 8)).astype(np.float32)
    logp = (behav + rng.normal(size=(3, 8))).astype(np.float32)
    versions = rng.integers(0, 9, (3, 8)).astype(np.int32)  # includes v > v_prox = 6
    v_prox = 6
    alpha = np.clip((v_prox - versions) / np.maximum(v_prox + 1 - versions, 1), 0, 1).astype(np.float64)
    want = behav + alpha * (logp.astype(np.float64) - behav)
    got = L.loglinear_prox_logp(behav, logp, versions, v_prox)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    on_policy = versions == v_prox
    np.testing.assert_array_equal(np.asarray(got)[on_policy], behav[on_policy])  # α = 0: π_prox = μ
    np.testing.assert_array_equal(np.asarray(got)[versions > v_prox], behav[versions > v_prox])
    np.testing.assert_allclose(np.asarray(got)[versions == v_prox - 1],
                               (0.5 * (behav + logp))[versions == v_prox - 1], rtol=1e-6)
    g = jax.grad(lambda x: L.loglinear_prox_logp(behav, x, versions, v_prox).sum())(jnp.asarray(logp))
    assert not np.any(np.asarray(g))  # π_prox is a constant of the step
    jitted = jax.jit(L.loglinear_prox_logp)(behav, logp, versions, jnp.int32(v_prox))
    np.testing.assert_allclose(jitted, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------- token weights

@pytest.mark.parametrize("agg", AGGS)
def test_token_weights_match_reference(agg):
    mask = cases("clamp")[0][0]["mask"]
    np.testing.assert_allclose(L.token_weights(mask, agg, 12.0), np_token_weights(mask, agg, 12.0), rtol=1e-6)
    if agg == "constant":
        np.testing.assert_allclose(L.token_weights(mask, agg), np_token_weights(mask, agg), rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(AGGS), st.integers(1, 5))
def test_token_weights_make_micro_batches_exact(seed, agg, split):
    """Σ over micro-batches of Σ w·loss equals the full-batch loss; token/seq means weigh to 1."""
    rng = np.random.default_rng(seed)
    mask = (rng.random((6, 7)) < rng.random()).astype(np.float32)
    mask[rng.integers(6), rng.integers(7)] = 1.0
    loss_bt = rng.normal(size=(6, 7)) * mask
    w = np.asarray(L.token_weights(mask, agg), np.float64)
    parts = sum(np.sum(w[i:i + split] * loss_bt[i:i + split]) for i in range(0, 6, split))
    np.testing.assert_allclose(parts, np.sum(w * loss_bt), rtol=1e-12)
    np.testing.assert_allclose(w, np_token_weights(mask, agg), rtol=1e-6)
    if agg in MEANS:
        np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-5)


@pytest.mark.slow  # compiles per packed layout
@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(AGGS))
def test_token_weights_with_sequence_ids_for_packed_rows(seed, agg):
    """Packed rows: weights per sequence id equal the unpacked weights of the same sequences (reference: a dict)."""
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.integers(0, 4, (5, 9)), axis=1) + 10 * np.arange(5)[:, None]  # ≤4 segments per row
    mask = (rng.random((5, 9)) < 0.6).astype(np.float32)
    mask[0, 0] = 1.0
    lens = {}
    for i, mk in zip(ids.ravel(), mask.ravel()):
        lens[i] = lens.get(i, 0) + mk
    n_seq = sum(v > 0 for v in lens.values())
    if agg == "token_mean":
        want = mask / mask.sum()
    elif agg == "seq_mean_token_mean":
        want = mask / (np.vectorize(lambda i: max(lens[i], 1))(ids) * n_seq)
    elif agg == "seq_mean_token_sum":
        want = mask / n_seq
    else:
        want = mask / (n_seq * 7.0)
    got = jax.jit(functools.partial(L.token_weights, aggregation=agg, constant_normalizer=7.0))(
        mask, sequence_ids_bt=ids)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if agg in MEANS:
        np.testing.assert_allclose(np.sum(got), 1.0, rtol=1e-5)
    # One sequence per row: the same as the row-based weights (up to empty rows in "constant").
    rows = np.repeat(np.arange(5)[:, None], 9, axis=1)
    if mask.sum(1).all() or agg != "constant":
        np.testing.assert_allclose(L.token_weights(mask, agg, 7.0, sequence_ids_bt=rows),
                                   np_token_weights(mask, agg, 7.0), rtol=1e-6)


def test_empty_mask_raises_eagerly_and_gives_zero_weights_under_jit():
    empty = np.zeros((3, 4), np.float32)
    for agg in AGGS:
        with pytest.raises(ValueError, match="loss mask is empty"):
            L.token_weights(empty, agg)
        w = jax.jit(L.token_weights, static_argnums=1)(empty, agg)
        assert np.all(np.asarray(w) == 0)
    with pytest.raises(ValueError, match="aggregation"):
        L.token_weights(np.ones((2, 2)), "sum")


# -------------------------------------------------------------------------------------------- robustness

@pytest.mark.slow  # compiles per packed layout
def test_masked_extreme_values_give_no_nan_and_no_effect():
    c = cases("clamp")[0][0]
    m = c["mask"] > 0
    weights = np_token_weights(c["mask"], "token_mean").astype(np.float32)
    cfg = CFGS["clamp"]
    for name in L.POLICY_LOSSES:
        def f(lp, case, name=name):
            return L.loss_and_metrics(name, cfg, lp, case["behav"], case["prox"], case["adv"], case["mask"],
                                      weights, case["ref"])
        (loss, met), g = jax.value_and_grad(f, has_aux=True)(c["logp"], c)
        clean = {k: np.where(m, v, 0.0).astype(np.float32) for k, v in c.items()}
        (loss2, met2), g2 = jax.value_and_grad(f, has_aux=True)(clean["logp"], clean)
        assert np.isfinite(loss) and np.all(np.isfinite(g)), name
        assert all(np.isfinite(v) for v in met.values()), name
        np.testing.assert_array_equal(loss, loss2)
        np.testing.assert_array_equal(g, g2)
        loss_bt, tok = L.policy_loss(name, c["logp"], c["behav"], c["prox"], c["adv"], c["mask"], cfg, c["ref"])
        assert np.all(np.asarray(loss_bt)[~m] == 0)
        assert all(np.all(np.asarray(v)[~m] == 0) for v in tok.values())


def test_unknown_loss_names_valid_ones():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*decoupled_ppo.*gspo"):
        L.policy_loss("ppo2", *(np.zeros((2, 3), np.float32),) * 5, L.LossConfig())


def test_shape_mismatch_names_argument_and_shapes():
    x, bad = np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match=r"prox_logp_bt has shape \(2, 4\) but logp_bt has shape \(2, 3\)"):
        L.policy_loss("decoupled_ppo", x, x, bad, x, x, L.LossConfig())
    with pytest.raises(ValueError, match=r"ref_logp_bt has shape \(2, 4\)"):
        L.policy_loss("ppo", x, x, x, x, x, L.LossConfig(), bad)
    with pytest.raises(ValueError, match=r"weights_bt has shape \(2, 4\)"):
        L.loss_and_metrics("ppo", L.LossConfig(), x, x, x, x, x, bad)
    with pytest.raises(ValueError, match=r"logp_bt must be \[B, T\]"):
        L.policy_loss("ppo", np.zeros(3), np.zeros(3), None, np.zeros(3), np.zeros(3), L.LossConfig())


def test_missing_inputs_and_bad_config():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="needs prox_logp_bt"):
        L.policy_loss("decoupled_ppo", x, x, None, x, x, L.LossConfig())
    loss_none, _ = L.policy_loss("ppo", x, x, None, x, x, L.LossConfig())
    loss_prox, _ = L.policy_loss("ppo", x, x, x * 5, x, x, L.LossConfig())
    np.testing.assert_array_equal(loss_none, loss_prox)  # ppo ignores prox
    with pytest.raises(ValueError, match="needs ref_logp_bt"):
        L.policy_loss("ppo", x, x, None, x, x, L.LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="behav_weight_mode 'clip' is not one of"):
        L.LossConfig(behav_weight_mode="clip")
    with pytest.raises(ValueError, match="dual_clip_c"):
        L.LossConfig(dual_clip_c=0.5)


def test_config_dict_is_accepted_and_defaults_missing_fields():
    cd = ml_collections.ConfigDict({"name": "decoupled_ppo", "eps_high": 0.28, "behav_weight_cap": 5.0})
    c = cases("clamp")[0][1]
    args = (c["logp"], c["behav"], c["prox"], c["adv"], c["mask"])
    got, _ = L.policy_loss("decoupled_ppo", *args, cd)
    want, _ = L.policy_loss("decoupled_ppo", *args, L.LossConfig(eps_high=0.28, behav_weight_cap=5.0))
    np.testing.assert_array_equal(got, want)
