"""Train-rollout mismatch corrections (`LossConfig.mismatch`) against a float64 NumPy reference written from the
formulas in `losses.mismatch_mask`'s docstring, composed with decoupled_ppo (a loss with a behaviour weight, a
staleness cap active) and ppo (a loss without one); the sequence mask on packed rows; the config checks; and the
key reaching the jitted step from a run config.
"""
import dataclasses
import functools
import pathlib

import jax
import numpy as np
import pytest
from tolerances import sum_atol

from jaxflow.config import ConfigError, load_config
from jaxflow.trainer import losses as L
from jaxflow.trainer.rl_trainer import check_trainer_config, step_config
from jaxflow.trainer.step import StepConfig

CLAMP = 20.0  # MAX_LOG_RATIO, part of the documented formula
LO, HI = 0.5, 2.0
B, T = 4, 8
CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_mask")
# Staleness bounds active in both modes: "clamp" caps w at 1.5 (below HI, so tis truncates only from below);
# "mask" drops tokens with w > 3 (above HI), which tis must leave dropped.
STALENESS = {"clamp": dict(behav_weight_cap=1.5, behav_weight_mode="clamp"),
             "mask": dict(behav_weight_cap=3.0, behav_weight_mode="mask")}
CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "arithmetic_tiny.py"


# ------------------------------------------------------------------------------------------- NumPy reference

def np_exp(x):
    return np.exp(np.clip(x, -CLAMP, CLAMP))


def np_surr(r, a, eps=0.2):
    """PPO's clipped surrogate as a loss and its derivative in r."""
    s1, s2 = r * a, np.clip(r, 1 - eps, 1 + eps) * a
    inside = (r > 1 - eps) & (r < 1 + eps)
    return -np.minimum(s1, s2), np.where(s1 <= s2, -a, -a * inside)


def np_seq_mean(x, m, ids):
    out = np.zeros_like(x)
    for i in np.unique(ids):
        sel = (ids == i) & m
        if sel.any():
            out[ids == i] = x[sel].mean()
    return out


def np_reference(name, cfg, c, ids=None):
    """(loss_bt, dloss/dlogp, keep, truncated, rho) of the policy term, float64, masked tokens 0."""
    m = c["mask"] > 0
    z = lambda x: np.where(m, np.asarray(x, np.float64), 0.0)  # noqa: E731
    lp, be, px, a = z(c["logp"]), z(c["behav"]), z(c["prox"]), z(c["adv"])
    ids = np.repeat(np.arange(lp.shape[0])[:, None], lp.shape[1], 1) if ids is None else ids
    log_rho = np.clip(px - be, -CLAMP, CLAMP)
    rho = np.exp(log_rho)
    truncated = np.zeros(lp.shape, bool)
    if name == "decoupled_ppo":
        u = np_exp(lp - px)
        w = rho.copy()
        cap = np.inf if cfg.behav_weight_cap is None else cfg.behav_weight_cap
        dropped = np.zeros(lp.shape, bool)
        if cfg.behav_weight_mode == "clamp":
            w = np.minimum(w, cap)
        else:
            dropped = w > cap
            w = np.where(dropped, 0.0, w)
        if cfg.mismatch == "tis":  # truncates the weight after the staleness bounds; dropped tokens stay 0
            truncated = ~dropped & ((w < LO) | (w > HI))
            w = np.where(dropped, 0.0, np.clip(w, LO, HI))
        s, ds = np_surr(u, a)
        loss, grad = w * s, w * ds * np.where(np.abs(lp - px) < CLAMP, u, 0.0)
    else:  # ppo: r = π_θ/μ carries ρ already
        r = np_exp(lp - be)
        loss, ds = np_surr(r, a)
        grad = ds * np.where(np.abs(lp - be) < CLAMP, r, 0.0)
    keep = m.copy()
    if cfg.mismatch in ("mis", "icepop"):
        keep &= (rho >= LO) & (rho <= HI)
    elif cfg.mismatch == "seq_mask":
        g = np.exp(np_seq_mean(log_rho, m, ids))
        keep &= (g >= LO) & (g <= HI)
    return z(loss * keep), z(grad * keep), keep, truncated & m, z(rho)


def make_case(rng):
    """Random tokens with ρ = π_prox/μ spread over ~[0.2, 5]: no log-ratio (token or sequence) within 1e-3 of a
    bound or clip, where float32 and float64 could take different branches."""
    while True:
        mask = rng.random((B, T)) < 0.8
        mask[0] = True
        logp = -rng.gamma(2.0, 1.0, (B, T))
        prox = logp + 0.1 * rng.normal(size=(B, T))
        behav = prox - 0.8 * rng.normal(size=(B, T))
        adv = rng.normal(size=(B, 1)) + 0.3 * rng.normal(size=(B, T))
        c = {k: v.astype(np.float32) for k, v in dict(logp=logp, behav=behav, prox=prox, adv=adv, mask=mask).items()}
        lp, be, px = (c[k].astype(np.float64) for k in ("logp", "behav", "prox"))
        logs = np.concatenate([(px - be)[mask], (lp - px)[mask], (lp - be)[mask],
                               np_seq_mean(px - be, mask, packed_ids())[mask]])
        bounds = np.log([LO, HI, 1.5, 3.0, 1.2, 0.8])
        if np.abs(logs[:, None] - bounds).min() > 1e-3:
            return c


@functools.cache
def case():
    return make_case(np.random.default_rng(48))


def packed_ids():
    """Row 0 holds two sequences, rows 1-3 hold one and two; ids unique across rows."""
    ids = np.zeros((B, T), np.int32)
    ids[0, 4:] = 1
    ids[2, 3:] = 1
    return ids + 10 * np.arange(B)[:, None]


@functools.cache
def _jitted(name, cfg):
    def f(lp, be, px, a, m, w, ids):
        return L.loss_and_metrics(name, cfg, lp, be, px, a, m, w, sequence_ids_bt=ids)
    return jax.jit(jax.value_and_grad(f, has_aux=True))


def run(name, cfg, c, ids=None):
    w = (c["mask"] / c["mask"].sum()).astype(np.float32)
    (loss, metrics), grad = _jitted(name, cfg)(c["logp"], c["behav"], c["prox"], c["adv"], c["mask"], w, ids)
    tok_loss, tok = L.policy_loss(name, c["logp"], c["behav"], c["prox"], c["adv"], c["mask"], cfg,
                                  sequence_ids_bt=ids)
    return (float(loss), jax.tree.map(np.asarray, metrics), np.asarray(grad), np.asarray(tok_loss),
            jax.tree.map(np.asarray, tok), w.astype(np.float64))


# ---------------------------------------------------------------------------------------- against reference

# ppo has no behaviour weight (the staleness bounds do not apply), and tis and icepop are refused for it
# (test_config_checks).
PARAMS = ([("decoupled_ppo", c, s) for c in CORRECTIONS for s in STALENESS]
          + [("ppo", c, "clamp") for c in ("none", "mis", "seq_mask")])


@pytest.mark.parametrize("name,mismatch,staleness", PARAMS)
def test_corrections_match_numpy_reference(name, mismatch, staleness):
    cfg = L.LossConfig(name=name, mismatch=mismatch, mismatch_low=LO, mismatch_high=HI, **STALENESS[staleness])
    c, ids = case(), packed_ids()
    loss, metrics, grad, tok_loss, tok, w = run(name, cfg, c, ids)
    loss_bt, grad_bt, keep, truncated, rho = np_reference(name, cfg, c, ids)
    m = c["mask"] > 0
    # Each token's loss is a product of a few float32 factors of size <= ~5·|A| (a weight ≤ 5 times a clipped
    # ratio ≤ 1.2 times A): relative rounding of a few eps on each, and sum_atol over the weighted sum.
    scale = 6.0 * np.abs(c["adv"][m]).max()
    np.testing.assert_allclose(tok_loss, loss_bt, rtol=1e-5, atol=8 * sum_atol(1, scale))
    np.testing.assert_allclose(loss, np.sum(w * loss_bt), rtol=0, atol=sum_atol(int(m.sum()), scale * w.max()))
    np.testing.assert_allclose(grad, w * grad_bt, rtol=1e-5, atol=8 * sum_atol(1, scale * w.max()))
    np.testing.assert_array_equal(tok["mismatch_masked"], (m & ~keep).astype(np.float32))
    np.testing.assert_array_equal(tok["mismatch_truncated"], truncated.astype(np.float32))
    n = m.sum()
    np.testing.assert_allclose(metrics["mismatch_masked_frac"], (m & ~keep).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(metrics["mismatch_truncated_frac"], truncated.sum() / n, rtol=1e-6)
    d = np.clip(c["prox"].astype(np.float64) - c["behav"], -CLAMP, CLAMP)[m]
    np.testing.assert_allclose(metrics["mismatch_kl"], np.mean(np.exp(d) - d - 1), rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch_ratio_max"], rho[m].max(), rtol=1e-6)
    # The case exercises what it claims to: something dropped or truncated whenever a correction is on.
    if mismatch in ("mis", "icepop", "seq_mask"):
        assert 0 < (m & ~keep).sum() < n
    if mismatch == "tis" and name == "decoupled_ppo":
        assert truncated.any()
    if mismatch == "none":
        assert metrics["mismatch_masked_frac"] == 0 and metrics["mismatch_truncated_frac"] == 0


def test_icepop_and_mis_keep_the_behaviour_weight_and_tis_truncates_it():
    """Hand case, decoupled_ppo with u = 1 and A = 1: the loss is -w. ρ = 0.25, 1, 1.8, 4."""
    rho = np.array([0.25, 1.0, 1.8, 4.0])
    c = dict(logp=np.zeros((1, 4), np.float32), prox=np.zeros((1, 4), np.float32),
             behav=-np.log(rho)[None].astype(np.float32), adv=np.ones((1, 4), np.float32),
             mask=np.ones((1, 4), np.float32))
    want = {"none": -rho, "tis": -np.clip(rho, LO, HI), "mis": -rho * [0, 1, 1, 0], "icepop": -rho * [0, 1, 1, 0]}
    for mismatch, expect in want.items():
        cfg = L.LossConfig(mismatch=mismatch, mismatch_low=LO, mismatch_high=HI)
        loss, _ = L.policy_loss("decoupled_ppo", c["logp"], c["behav"], c["prox"], c["adv"], c["mask"], cfg)
        np.testing.assert_allclose(np.asarray(loss)[0], expect, rtol=1e-6, err_msg=mismatch)


def test_seq_mask_drops_one_of_two_sequences_packed_in_a_row():
    # Row 0: sequence 10 with log ρ = log 3 on each token (g = 3, dropped), sequence 11 with log ρ = ±0.2 (g = 1,
    # kept). Taken as one sequence the row's g is exp(log(3)/2) = 1.73: kept whole.
    log_rho = np.array([[np.log(3.0)] * 4 + [0.2, -0.2, 0.2, -0.2]])
    ids = np.array([[10] * 4 + [11] * 4])
    logp = np.full((1, 8), -1.0, np.float32)
    c = dict(logp=logp, prox=logp, behav=(logp - log_rho).astype(np.float32), adv=np.ones((1, 8), np.float32),
             mask=np.ones((1, 8), np.float32))
    for name in ("decoupled_ppo", "ppo"):
        cfg = L.LossConfig(name=name, mismatch="seq_mask", mismatch_low=LO, mismatch_high=HI)
        _, metrics, _, tok_loss, tok, _ = run(name, cfg, c, ids)
        want_loss, _, keep, _, _ = np_reference(name, cfg, c, ids)
        np.testing.assert_array_equal(keep[0], [False] * 4 + [True] * 4)
        np.testing.assert_allclose(tok_loss, want_loss, rtol=1e-6)
        assert np.all(tok_loss[0, :4] == 0) and np.all(tok_loss[0, 4:] != 0)
        assert metrics["mismatch_masked_frac"] == 0.5
        _, row_metrics, _, row_loss, _, _ = run(name, cfg, c)  # no ids: the row is one sequence
        assert row_metrics["mismatch_masked_frac"] == 0.0 and np.all(row_loss != 0)


def test_correction_needs_prox_and_leaves_masked_garbage_out():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError):  # without π_prox, ρ would be 1 and the correction silently nothing
        L.policy_loss("ppo", x, x, None, x, x, L.LossConfig(name="ppo", mismatch="mis"))
    loss, tok = L.policy_loss("ppo", x, x, None, x, x, L.LossConfig(name="ppo"))
    assert not np.any(np.asarray(tok["mismatch_kl"])) and not np.any(np.asarray(tok["mismatch_ratio"]))
    # ±inf and NaN on masked tokens reach neither the masks, the loss nor the gradient.
    c = dict(case())
    junk = np.where(c["mask"] > 0, 0.0, np.nan).astype(np.float32)
    dirty = {k: (c[k] + junk if k != "mask" else c[k]) for k in c}
    dirty["behav"] = np.where(c["mask"] > 0, c["behav"], -np.inf).astype(np.float32)
    cfg = L.LossConfig(mismatch="seq_mask", mismatch_low=LO, mismatch_high=HI)
    clean_out, dirty_out = run("decoupled_ppo", cfg, c, packed_ids()), run("decoupled_ppo", cfg, dirty, packed_ids())
    assert clean_out[0] == dirty_out[0]
    np.testing.assert_array_equal(clean_out[2], dirty_out[2])


# --------------------------------------------------------------------------------------------- config checks

@pytest.mark.parametrize("fields,keys", [
    (dict(mismatch="tis_clip"), ["mismatch"]),
    (dict(mismatch_low="0.5"), ["mismatch_low"]),
    (dict(mismatch_high=None), ["mismatch_high"]),
    (dict(mismatch_low=True), ["mismatch_low"]),
    (dict(mismatch_low=float("nan")), ["mismatch_low"]),
    (dict(mismatch_high=float("inf")), ["mismatch_high"]),
    (dict(mismatch_high=float("nan")), ["mismatch_high"]),
    (dict(mismatch_low=-0.1), ["mismatch_low"]),
    (dict(mismatch_high=0.0), ["mismatch_high"]),
    (dict(mismatch_low=2.0, mismatch_high=0.5), ["mismatch_low", "mismatch_high"]),
    (dict(mismatch_low=1.0, mismatch_high=1.0), ["mismatch_low", "mismatch_high"]),
    (dict(name="ppo", mismatch="tis"), ["mismatch", "name"]),
    (dict(name="tis", mismatch="icepop"), ["mismatch", "name"]),
    (dict(name="topr", mismatch="tis"), ["mismatch", "name"]),
])
def test_config_checks(fields, keys):
    with pytest.raises(ConfigError) as e:
        L.LossConfig.from_config(fields)
    assert len(e.value.problems) == 1, e.value.problems
    for key in keys:
        assert f"trainer.loss.{key}" in e.value.problems[0], (key, e.value.problems)


def test_good_configs_pass():
    for name in ("ppo", "tis", "topr"):
        for mismatch in ("none", "mis", "seq_mask"):
            L.LossConfig(name=name, mismatch=mismatch)
    for mismatch in CORRECTIONS:
        L.LossConfig(name="gspo", mismatch=mismatch, mismatch_low=0.0, mismatch_high=5)


def test_loglinear_prox_with_a_correction_is_refused_naming_both_keys():
    for prox, mismatch, refused in (("loglinear", "icepop", True), ("loglinear", "none", False),
                                    ("recompute", "icepop", False)):
        trainer = load_config(str(CONFIG), {"trainer.prox": prox, "trainer.loss.mismatch": mismatch}).trainer
        checks = (functools.partial(check_trainer_config, trainer), functools.partial(step_config, trainer),
                  functools.partial(StepConfig, loss=L.LossConfig(mismatch=mismatch), prox=prox))
        for check in checks:
            if not refused:
                check()
                continue
            with pytest.raises(ConfigError) as e:
                check()
            assert any("trainer.prox" in p and "trainer.loss.mismatch" in p for p in e.value.problems)


# ------------------------------------------------------------------------------------------------ the step

@pytest.mark.slow  # compiles the tiny model's step
def test_icepop_from_the_config_reaches_the_step():
    from train_step_setup import SEQ_LEN, one_device, setup, trajectories
    from train_step_setup import run as run_step

    from jaxflow.trainer.batch import make_batch
    from jaxflow.trainer.step import token_logprobs

    trainer = load_config(str(CONFIG), {"trainer.loss.mismatch": "icepop", "trainer.loss.mismatch_low": "0.5",
                                        "trainer.loss.mismatch_high": "2.0"}).trainer
    cfg = step_config(trainer)
    assert cfg.loss.mismatch == "icepop" and cfg.loss.name == "decoupled_ppo"
    batch, _ = make_batch(trajectories(seed=5, n=8, version=0, max_lag=0), num_rows=4, seq_len=2 * SEQ_LEN,
                          pack=True)
    assert batch.segment_ids.max() > 1  # packed rows: the step's sequence ids are per micro-batch slice
    _, _, model = setup(one_device())
    logp = np.asarray(token_logprobs(model, jax.tree.map(lambda x: x[0], batch))[0])[None]
    mask = batch.loss_mask > 0
    exact = dataclasses.replace(batch, behav_logp=np.where(mask, logp, 0).astype(np.float32))
    # Every other trained token's μ moved by a factor e (ρ = 1/e, below 0.5): dropped by icepop.
    flip = np.zeros(mask.shape, bool)
    flip[mask] = np.arange(mask.sum()) % 2 == 0
    perturbed = dataclasses.replace(exact, behav_logp=np.where(flip, logp + 1.0, exact.behav_logp)
                                    .astype(np.float32))
    _, (m_exact,) = run_step(one_device(), exact, cfg)
    _, (m_pert,) = run_step(one_device(), perturbed, cfg)
    assert m_exact["mismatch_masked_frac"] == 0.0
    assert m_exact["mismatch_ratio_max"] < 1 + 1e-4 and m_exact["mismatch_kl"] < 1e-6
    np.testing.assert_allclose(m_pert["mismatch_masked_frac"], flip.sum() / mask.sum(), rtol=1e-5)
    assert m_pert["mismatch_kl"] > 0.1 and np.isfinite(m_pert["loss"])
