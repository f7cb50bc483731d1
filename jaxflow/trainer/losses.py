"""Staleness-aware policy losses for asynchronous RL post-training; `trainer.step` runs them.

Three policies meet in every loss, all as per-token log-probabilities of the sampled tokens, [B, T] float32:

  - `logp_bt`        log π_θ, the parameters being trained (the only differentiable input);
  - `behav_logp_bt`  log μ, the behaviour policy: the engine that sampled the token, possibly several versions old;
  - `prox_logp_bt`   log π_prox, the trainer's weights at the start of this step (AReaL's proximal policy).

Decoupled PPO (AReaL) splits the off-policy correction in two: a trust region u = π_θ/π_prox that is clipped, and
a constant behaviour weight w = π_prox/μ that corrects for staleness and is capped. The other losses are variants
behind one registry. Every loss returns a per-token loss already zeroed on masked tokens, plus per-token metrics;
`token_weights` turns the mask into aggregation weights computed on the full batch so that micro-batches can be
accumulated exactly, and `loss_and_metrics` applies them.

The same w also carries the train-rollout mismatch: the engine computes μ with its own kernels, batch shapes and
precision, so even a token sampled at the trainer's current version has π_prox/μ ≠ 1. `LossConfig.mismatch`
chooses a correction for it (truncated IS, token masks, a sequence mask; `mismatch_mask`), which acts on the
behaviour weight of the losses that have one and masks the others.

Numerics: every exp() of a log-ratio first clamps the log-ratio to ±MAX_LOG_RATIO (as verl's rollout IS does).
exp(20) ≈ 4.9e8 is far beyond any clip or cap, so the clamp only changes values that are already pathological, and
it keeps a 1e6-token sum of them finite in float32. Beyond the clamp the gradient through that exp() is 0. Masked
tokens are replaced by zeros before any arithmetic, so garbage there (±inf, NaN) never reaches values or gradients.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.config import Section, check_bool, check_choice, check_float

# Log-ratios are clamped to ±MAX_LOG_RATIO before exp() (see the module docstring).
MAX_LOG_RATIO = 20.0

BEHAV_WEIGHT_MODES = ("clamp", "mask", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")
TOPR_SPLITS = ("advantage", "reward")
MISMATCH_CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_mask")


@dataclasses.dataclass(frozen=True)
class LossConfig(Section):
    """The policy loss: the run config's `trainer.loss` section (`LossConfig.section(**overrides)` generates
    it). u = π_θ/π_prox, w = π_prox/μ, A = advantage. An ml_collections ConfigDict with some of these fields
    works too wherever a LossConfig is taken (the others default).

    name: decoupled_ppo, ppo, dual_clip, tis, cispo, topr or gspo (a key of POLICY_LOSSES).
    eps_low, eps_high: trust region, u is clipped to [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: 0.28).
    dual_clip_c: dual clip for A < 0: the loss is at most -c·A (c >= 1, typically 3). None = off.
    behav_weight_cap, behav_weight_floor: bounds on w (AReaL caps it at 5); None = no bound.
    behav_weight_mode: past a bound, "clamp" w to it, "mask" the token (dropped), or "none" (bounds ignored).
    tis_cap, tis_floor: "tis": IS weight sg(clip(π_θ/μ, tis_floor, tis_cap)) (floor 0: none).
    cispo_eps_low, cispo_eps_high: "cispo": IS weight sg(clip(u, 1 - eps_low, 1 + eps_high)); 1.0: no lower clip.
    cispo_unified_mask: "cispo" also drops tokens with A > 0, u > 1 + eps_high or A < 0, u < 1 - eps_low.
    topr_pos_weight, topr_neg_weight: "topr": -c·A·log π_θ with c = the weight on positive sequences, and
      the weight times sg(clip(π_θ/μ, 0, 1)) on the others.
    topr_split: "topr": a sequence is positive when its "advantage" > 0 or its raw "reward" > 0.
    kl_coef: + kl_coef·k(π_θ, π_ref) per token, KL to the initial policy (kept frozen when > 0); kl_ref metric.
    kl_estimator: Schulman's k1, k2 or k3.
    aggregation: token losses to the batch loss: token_mean, seq_mean_token_mean, seq_mean_token_sum or
      constant (Dr.GRPO: sum / (sequences · constant_normalizer)).
    constant_normalizer: C of "constant" aggregation; None = the row length T.
    mismatch: the train-rollout mismatch correction, on ρ = π_prox/μ per token (`mismatch_mask`): "none",
      "tis" (truncate the IS weight to [mismatch_low, mismatch_high]), "mis" (drop tokens whose ρ leaves it),
      "icepop" (the same two-sided mask, the IS weight kept) or "seq_mask" (drop every token of a sequence whose
      geometric-mean ρ leaves it). Needs π_prox (trainer.prox = "recompute"); "tis" and "icepop" need a loss
      with a behaviour weight.
    mismatch_low, mismatch_high: the bounds [lo, hi] of the correction, 0 <= lo < hi.

    CISPO's defaults follow MiniMax-M1, which clips the IS weight from above only; cispo_eps_high = 0.28 is
    DAPO's clip-higher value.
    """

    SECTION: ClassVar[str] = "trainer.loss"

    name: str = "decoupled_ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip_c: float | None = None
    behav_weight_cap: float | None = None
    behav_weight_floor: float | None = None
    behav_weight_mode: str = "clamp"
    tis_cap: float = 2.0
    tis_floor: float = 0.0
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 0.28
    cispo_unified_mask: bool = False
    topr_pos_weight: float = 1.0
    topr_neg_weight: float = 1.0
    topr_split: str = "advantage"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    aggregation: str = "token_mean"
    constant_normalizer: float | None = None
    mismatch: str = "none"
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name, valid in (("name", sorted(POLICY_LOSSES)), ("behav_weight_mode", BEHAV_WEIGHT_MODES),
                            ("kl_estimator", KL_ESTIMATORS), ("aggregation", AGGREGATIONS),
                            ("topr_split", TOPR_SPLITS), ("mismatch", MISMATCH_CORRECTIONS)):
            check_choice(problems, self.key(name), getattr(self, name), valid)
        for name in ("eps_low", "cispo_eps_low"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, 1.0)
        for name in ("eps_high", "cispo_eps_high", "topr_pos_weight", "topr_neg_weight", "kl_coef"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        check_bool(problems, self.key("cispo_unified_mask"), self.cispo_unified_mask)
        before = len(problems)
        check_float(problems, self.key("tis_cap"), self.tis_cap, 0.0, open_low=True)
        if len(problems) == before:
            check_float(problems, self.key("tis_floor"), self.tis_floor, 0.0, self.tis_cap, open_high=True)
        check_float(problems, self.key("dual_clip_c"), self.dual_clip_c, 1.0, optional=True)
        before = len(problems)
        check_float(problems, self.key("behav_weight_cap"), self.behav_weight_cap, 0.0, open_low=True, optional=True)
        if len(problems) == before:
            cap = math.inf if self.behav_weight_cap is None else self.behav_weight_cap
            check_float(problems, self.key("behav_weight_floor"), self.behav_weight_floor, 0.0, cap,
                        open_high=True, optional=True)
        check_float(problems, self.key("constant_normalizer"), self.constant_normalizer, 0.0, open_low=True,
                    optional=True)
        before = len(problems)
        check_float(problems, self.key("mismatch_low"), self.mismatch_low, 0.0)
        check_float(problems, self.key("mismatch_high"), self.mismatch_high, 0.0, open_low=True)
        if len(problems) == before and self.mismatch_low >= self.mismatch_high:
            problems.append(f"{self.key('mismatch_low')} must be < {self.key('mismatch_high')}, got "
                            f"{self.mismatch_low} >= {self.mismatch_high}")
        if self.mismatch in ("tis", "icepop") and POLICY_LOSS_USES_PROX.get(self.name) is False:
            # Their per-token weight holds π_θ/μ = (π_θ/π_prox)·ρ: ρ is in it already (see `mismatch_mask`).
            with_w = ", ".join(n for n in sorted(POLICY_LOSSES) if POLICY_LOSS_USES_PROX[n])
            problems.append(f"{self.key('mismatch')} {self.mismatch!r} is an importance weight, and "
                            f"{self.key('name')} {self.name!r} already weighs each token by π_θ/μ, which holds "
                            f"the mismatch ratio π_prox/μ: a second weight would count it twice; use a loss with "
                            f"a behaviour weight ({with_w}) or the masks 'mis' / 'seq_mask'")
        return problems


def _cfg(cfg: Any, field: str):
    # Fields a ConfigDict leaves out take LossConfig's defaults.
    return getattr(cfg, field) if hasattr(cfg, field) else _DEFAULTS[field]


def validate_loss_config(cfg: Any) -> None:
    """Raises ConfigError (a ValueError) naming every invalid field of a loss config: a LossConfig (checked when
    it was made) or an object such as a ConfigDict with some of its fields (the others default)."""
    if not isinstance(cfg, LossConfig):
        LossConfig.from_config({f: getattr(cfg, f) for f in _DEFAULTS if hasattr(cfg, f)})


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossConfig)}


# ----------------------------------------------------------------------------------------------- shared pieces

def _exp_ratio(log_ratio):
    return jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def kl_estimate(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(π_θ || π_ref) from tokens sampled by π_θ (Schulman, "Approximating KL").

    With d = ref - logp: k1 = -d = logp - ref; k2 = d²/2; k3 = exp(d) - d - 1 (non-negative, low variance; d is
    clamped to ±MAX_LOG_RATIO). Inputs [B, T] log-probs; returns [B, T] nats.
    """
    d = ref_logp_bt - logp_bt
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = jnp.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid names: {list(KL_ESTIMATORS)}")


def behaviour_weight(log_w, cfg: Any):
    """The behaviour weight w = π_prox/μ = exp(log_w), bounded per `cfg.behav_weight_mode`, then truncated to
    [mismatch_low, mismatch_high] when cfg.mismatch is "tis".

    w corrects for staleness (μ is the engine's policy, possibly versions old) and for the train-rollout mismatch
    (the engine's kernels and precision against the trainer's) at once: for a token sampled at the trainer's
    current version it is exactly the mismatch ratio ρ. Works on any shape ([B, T] per token, [B] per sequence).
    Returns (w_used, w_raw, capped, truncated): w_used enters the loss (clip(w, floor, cap) for "clamp"; 0 above
    the cap or below the floor for "mask", which drops the token like AReaL's rejection sampling; w for "none" or
    no bounds; then, with mismatch "tis", clip(·, mismatch_low, mismatch_high) on the tokens "mask" kept); w_raw
    is the unbounded weight, logged so its max shows the worst staleness; capped is a bool array of the tokens a
    staleness bound acted on, truncated of those the mismatch truncation changed.
    """
    w_raw = _exp_ratio(log_w)
    cap, floor = _cfg(cfg, "behav_weight_cap"), _cfg(cfg, "behav_weight_floor")
    mode = _cfg(cfg, "behav_weight_mode")
    none = jnp.zeros(w_raw.shape, bool)
    w_used, capped, dropped = w_raw, none, none
    if (cap is not None or floor is not None) and mode != "none":
        over = none if cap is None else w_raw > cap
        under = none if floor is None else w_raw < floor
        capped = over | under
        if mode == "clamp":
            w_used = w_raw if cap is None else jnp.minimum(w_raw, cap)
            w_used = w_used if floor is None else jnp.maximum(w_used, floor)
        else:
            w_used, dropped = jnp.where(capped, 0.0, w_raw), capped
    truncated = none
    if _cfg(cfg, "mismatch") == "tis":
        lo, hi = _cfg(cfg, "mismatch_low"), _cfg(cfg, "mismatch_high")
        # A token the staleness mask dropped stays dropped: its weight 0 is not raised to lo.
        truncated = ~dropped & ((w_used < lo) | (w_used > hi))
        w_used = jnp.where(dropped, w_used, jnp.clip(w_used, lo, hi))
    return w_used, w_raw, capped, truncated


def clipped_surrogate(ratio_bt, adv_bt, eps_low, eps_high, dual_clip_c=None):
    """PPO's clipped surrogate as a loss: -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), optionally dual-clipped.

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for A < 0 the loss is further bounded
    by -c·A, i.e. loss = min(-min(rA, clip(r)A), -c·A), so a token whose ratio exploded cannot dominate the batch.
    Returns (loss, clip_low, clip_high, dual_clipped); the flags mark tokens where the clip changed the loss
    (A<0 and r<1-eps_low; A>0 and r>1+eps_high; A<0 and the -c·A bound was active).
    """
    surr = -jnp.minimum(ratio_bt * adv_bt, jnp.clip(ratio_bt, 1.0 - eps_low, 1.0 + eps_high) * adv_bt)
    clip_low = (adv_bt < 0) & (ratio_bt < 1.0 - eps_low)
    clip_high = (adv_bt > 0) & (ratio_bt > 1.0 + eps_high)
    dual = jnp.zeros(surr.shape, bool)
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv_bt
        dual = (adv_bt < 0) & (surr > bound)
        surr = jnp.where(dual, bound, surr)
    return surr, clip_low, clip_high, dual


def _metrics(behav_weight, behav_capped, approx_kl, clip_low=None, clip_high=None, dual=None, truncated=None):
    zeros = jnp.zeros(approx_kl.shape, jnp.float32)
    as_f = lambda x: zeros if x is None else jnp.broadcast_to(x, zeros.shape).astype(jnp.float32)
    return {
        "clip_low": as_f(clip_low), "clip_high": as_f(clip_high), "behav_weight": as_f(behav_weight),
        "behav_capped": as_f(behav_capped), "approx_kl": approx_kl.astype(jnp.float32), "dual_clipped": as_f(dual),
        "mismatch_truncated": as_f(truncated),
    }


# ---------------------------------------------------------------------------------------------------- registry

# name -> fn(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg) -> (loss_bt, metrics). The inputs a loss
# function sees are already validated, zeroed on masked tokens and (except logp_bt) stop-gradient; `policy_loss`
# does that and is the entry point.
POLICY_LOSSES: dict[str, Callable] = {}
# name -> whether the loss reads prox_logp_bt (callers may skip computing π_prox when it does not).
POLICY_LOSS_USES_PROX: dict[str, bool] = {}
# name -> whether the loss takes a `rewards_bt` keyword (the raw reward of each token's sequence).
POLICY_LOSS_USES_REWARDS: dict[str, bool] = {}


def register_policy_loss(name: str, *, uses_prox: bool = True, uses_rewards: bool = False):
    """Decorator adding a loss to POLICY_LOSSES; `uses_prox=False` lets callers pass prox_logp_bt=None;
    `uses_rewards=True` makes `policy_loss` pass `rewards_bt=` (possibly None) to it.

    A loss registered with uses_prox=True weighs its tokens by the behaviour weight from `behaviour_weight`
    (which applies the "tis" mismatch truncation) and reports its `truncated` flags as the `mismatch_truncated`
    metric; one with uses_prox=False weighs them by π_θ/μ (see `mismatch_mask`)."""
    def deco(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        POLICY_LOSS_USES_PROX[name] = uses_prox
        POLICY_LOSS_USES_REWARDS[name] = uses_rewards
        return fn
    return deco


@register_policy_loss("ppo", uses_prox=False)
def ppo_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """PPO-clip with π_old = μ (the behaviour policy), as in synchronous PPO/GRPO.

    r = exp(logp - behav_logp); loss = -min(r·A, clip(r, 1-eps_low, 1+eps_high)·A), dual-clipped for A<0 when
    cfg.dual_clip_c is set. Under staleness the trust region is measured against a stale policy, which is what
    AReaL shows degrades at large η; use decoupled_ppo there.
    """
    del prox_logp_bt, mask_bt
    r = _exp_ratio(logp_bt - behav_logp_bt)
    loss, lo, hi, dual = clipped_surrogate(r, adv_bt, _cfg(cfg, "eps_low"), _cfg(cfg, "eps_high"),
                                           _cfg(cfg, "dual_clip_c"))
    ones = jnp.ones_like(r)
    return loss, _metrics(ones, None, kl_estimate(logp_bt, behav_logp_bt), lo, hi, dual)


def _decoupled(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, cfg, dual_clip_c):
    u = _exp_ratio(logp_bt - prox_logp_bt)
    w, w_raw, capped, truncated = behaviour_weight(prox_logp_bt - behav_logp_bt, cfg)
    surr, lo, hi, dual = clipped_surrogate(u, adv_bt, _cfg(cfg, "eps_low"), _cfg(cfg, "eps_high"), dual_clip_c)
    return w * surr, _metrics(w_raw, capped, kl_estimate(logp_bt, prox_logp_bt), lo, hi, dual, truncated)


@register_policy_loss("decoupled_ppo")
def decoupled_ppo_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """Decoupled PPO (AReaL, Fu et al. 2025): trust region against π_prox, staleness corrected by π_prox/μ.

    u = exp(logp - prox_logp); w = exp(prox_logp - behav_logp) (constant), capped per cfg.behav_weight_mode;
    loss = -w·min(u·A, clip(u, 1-eps_low, 1+eps_high)·A), dual-clipped for A<0 when cfg.dual_clip_c is set.
    """
    del mask_bt
    return _decoupled(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, cfg, _cfg(cfg, "dual_clip_c"))


@register_policy_loss("dual_clip")
def dual_clip_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """decoupled_ppo with the dual clip always on: c = cfg.dual_clip_c, or 3.0 when that is None.

    loss = w·min(-min(u·A, clip(u)·A), -c·A) for A<0, and w·(-min(u·A, clip(u)·A)) for A>=0.
    """
    del mask_bt
    c = _cfg(cfg, "dual_clip_c")
    return _decoupled(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, cfg, 3.0 if c is None else c)


@register_policy_loss("tis", uses_prox=False)
def tis_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """Truncated importance sampling REINFORCE (ROLL pg_variant "tis"; slime --use-tis caps at 2.0).

    loss = -sg(clip(exp(logp - behav_logp), tis_floor, tis_cap))·A·logp. No trust region: the gradient is the
    truncated-IS policy gradient. `behav_capped` marks tokens whose IS weight hit tis_cap or tis_floor.
    """
    del prox_logp_bt, mask_bt
    r = _exp_ratio(logp_bt - behav_logp_bt)
    tis_cap, tis_floor = _cfg(cfg, "tis_cap"), _cfg(cfg, "tis_floor")
    c = jax.lax.stop_gradient(jnp.clip(r, tis_floor, tis_cap))
    return -c * adv_bt * logp_bt, _metrics(r, (r > tis_cap) | (r < tis_floor), kl_estimate(logp_bt, behav_logp_bt))


@register_policy_loss("cispo")
def cispo_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """CISPO (MiniMax-M1): clip the IS weight, never the gradient, so every token keeps contributing.

    u = exp(logp - prox_logp); loss = -w·sg(clip(u, 1-cispo_eps_low, 1+cispo_eps_high))·A·logp, with w the capped
    behaviour weight of decoupled_ppo so stale samples are corrected too. With cfg.cispo_unified_mask (MiniMax-M1's
    unified formulation) the loss is also multiplied by M = 0 where A > 0 and u > 1 + eps_high or A < 0 and
    u < 1 - eps_low (PPO's trust region as a token mask; eps_low/eps_high, not the cispo_ bounds), else 1.
    clip_low/clip_high mark tokens whose weight was clipped and A≠0 (for CISPO a clipped weight changes the loss
    whatever the sign of A), or that the unified mask dropped.
    """
    del mask_bt
    u = _exp_ratio(logp_bt - prox_logp_bt)
    lo_b, hi_b = 1.0 - _cfg(cfg, "cispo_eps_low"), 1.0 + _cfg(cfg, "cispo_eps_high")
    c = jax.lax.stop_gradient(jnp.clip(u, lo_b, hi_b))
    w, w_raw, capped, truncated = behaviour_weight(prox_logp_bt - behav_logp_bt, cfg)
    nonzero = adv_bt != 0
    lo, hi = (u < lo_b) & nonzero, (u > hi_b) & nonzero
    loss = -w * c * adv_bt * logp_bt
    if _cfg(cfg, "cispo_unified_mask"):
        out_lo = (adv_bt < 0) & (u < 1.0 - _cfg(cfg, "eps_low"))
        out_hi = (adv_bt > 0) & (u > 1.0 + _cfg(cfg, "eps_high"))
        loss = jnp.where(out_lo | out_hi, 0.0, loss)
        lo, hi = lo | out_lo, hi | out_hi
    return loss, _metrics(w_raw, capped, kl_estimate(logp_bt, prox_logp_bt), lo, hi, truncated=truncated)


@register_policy_loss("topr", uses_prox=False, uses_rewards=True)
def topr_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg, rewards_bt=None):
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025; ROLL pg_variant "topr").

    Positive tokens: loss = -topr_pos_weight·A·logp (plain SFT-like push, never truncated); the others:
    loss = -topr_neg_weight·sg(clip(r, 0, 1))·A·logp with r = exp(logp - behav_logp), so negatives are tapered
    off once the policy already avoids them. A token is positive when A > 0 (cfg.topr_split="advantage") or
    when its sequence's raw reward is > 0 ("reward", the paper's split; needs rewards_bt).
    `behav_capped` marks negative tokens with r > 1.
    """
    del prox_logp_bt, mask_bt
    if _cfg(cfg, "topr_split") == "reward":
        if rewards_bt is None:
            raise ValueError("topr with topr_split='reward' needs rewards_bt (got None)")
        pos = rewards_bt > 0
    else:
        pos = adv_bt > 0
    r = _exp_ratio(logp_bt - behav_logp_bt)
    c = jnp.where(pos, _cfg(cfg, "topr_pos_weight"),
                  _cfg(cfg, "topr_neg_weight") * jax.lax.stop_gradient(jnp.clip(r, 0.0, 1.0)))
    return -c * adv_bt * logp_bt, _metrics(r, (~pos) & (r > 1.0), kl_estimate(logp_bt, behav_logp_bt))


@register_policy_loss("gspo")
def gspo_loss(logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg):
    """GSPO (Zheng et al. 2025), token form, with the behaviour weight of decoupled PPO at sequence level.

    s_b = exp(Σ_t m·(logp - prox_logp) / Σ_t m) (geometric-mean sequence ratio); s_bt = sg(s_b)·exp(logp - sg(logp))
    has value s_b and gradient s_b·∇logp_t; w_b = exp(Σ_t m·(prox_logp - behav_logp) / Σ_t m), capped per
    cfg.behav_weight_mode at sequence level; loss_bt = -w_b·min(s_bt·A, clip(s_bt, 1-eps_low, 1+eps_high)·A),
    dual-clipped for A<0 when cfg.dual_clip_c is set.
    The GSPO paper used eps_low=3e-4, eps_high=4e-4 since a sequence ratio moves far less than a token ratio;
    the cfg values are used as given. With seq_mean_token_mean aggregation and a per-sequence A this is GSPO.
    """
    m = mask_bt
    len_b = jnp.maximum(jnp.sum(m, axis=1), 1.0)
    log_s_b = jax.lax.stop_gradient(jnp.sum(m * (logp_bt - prox_logp_bt), axis=1) / len_b)
    s_bt = _exp_ratio(log_s_b)[:, None] * jnp.exp(logp_bt - jax.lax.stop_gradient(logp_bt))
    w_b, w_raw_b, capped_b, trunc_b = behaviour_weight(jnp.sum(m * (prox_logp_bt - behav_logp_bt), axis=1) / len_b,
                                                       cfg)
    surr, lo, hi, dual = clipped_surrogate(s_bt, adv_bt, _cfg(cfg, "eps_low"), _cfg(cfg, "eps_high"),
                                           _cfg(cfg, "dual_clip_c"))
    return w_b[:, None] * surr, _metrics(w_raw_b[:, None], capped_b[:, None], kl_estimate(logp_bt, prox_logp_bt),
                                         lo, hi, dual, trunc_b[:, None])


# ---------------------------------------------------------------------------------------------- entry points

def _check_shapes(**arrays) -> None:
    (ref_name, ref), *rest = arrays.items()
    ref_shape = tuple(jnp.shape(ref))
    if len(ref_shape) != 2:
        raise ValueError(f"{ref_name} must be [B, T]; got shape {ref_shape}")
    for name, x in rest:
        if x is not None and tuple(jnp.shape(x)) != ref_shape:
            raise ValueError(f"{name} has shape {tuple(jnp.shape(x))} but {ref_name} has shape {ref_shape}")


def _dense_ids(sequence_ids_bt) -> jax.Array:
    """Sequence ids [B, T] as dense indices in [0, B·T), flattened [B·T]; unique(size=...) keeps shapes static
    under jit."""
    flat = jnp.asarray(sequence_ids_bt).reshape(-1)
    _, dense = jnp.unique(flat, return_inverse=True, size=flat.size)
    return dense.reshape(-1)


def sequence_mean(x_bt: jax.Array, mask_bt: jax.Array, sequence_ids_bt: jax.Array | None = None) -> jax.Array:
    """Per token, the mean of x_bt over the trained tokens (mask_bt > 0) of the token's sequence ([B, T] in,
    [B, T] float32 out; 0 for a sequence without trained tokens). Without sequence_ids_bt a row is a sequence;
    with it ([B, T] ints unique across rows, as `token_weights` takes them) a sequence is the tokens sharing an
    id, so packed rows hold several."""
    m = (jnp.asarray(mask_bt) > 0).astype(jnp.float32)
    mx = jnp.where(m > 0, jnp.asarray(x_bt, jnp.float32), 0.0)
    if sequence_ids_bt is None:
        return jnp.broadcast_to((jnp.sum(mx, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0))[:, None], m.shape)
    dense = _dense_ids(sequence_ids_bt)
    sums = jax.ops.segment_sum(mx.reshape(-1), dense, num_segments=dense.size)
    counts = jax.ops.segment_sum(m.reshape(-1), dense, num_segments=dense.size)
    return (sums / jnp.maximum(counts, 1.0))[dense].reshape(m.shape)


def mismatch_mask(behav_logp_bt, prox_logp_bt, mask_bt, cfg, sequence_ids_bt=None) -> jax.Array:
    """The train-rollout mismatch correction's keep mask [B, T] float32 (1 = kept, 0 = dropped), applied by
    `policy_loss` to the policy term of every loss.

    The engine that sampled a token (μ) and the trainer (π_prox) compute its log-prob with different kernels,
    batch shapes and precision. With ρ_t = exp(clamp(log π_prox - log μ, ±MAX_LOG_RATIO)), the ratio that for a
    token sampled at the trainer's current version is exactly that mismatch (stale tokens add their staleness),
    [lo, hi] = [mismatch_low, mismatch_high], sg the stop-gradient and ρ' the importance weight the loss carries
    for the gap, cfg.mismatch is:

      "tis"      ρ' → sg(clip(ρ', lo, hi)): truncated IS, every token kept (Yao et al. 2025, "Your efficient RL
                 framework secretly brings you off-policy RL training"; verl rollout_is_threshold, slime
                 --use-tis --tis-clip; they cap at 2). Applied in `behaviour_weight`; this mask is all ones.
      "icepop"   ρ'·1[lo <= ρ_t <= hi]: a two-sided hard mask that keeps the IS weight (IcePop, inclusionAI's
                 Ring-1T, α = 0.5, β = 5; OpenRLHF is_correction_type=icepop).
      "mis"      1[lo <= ρ_t <= hi]: token rejection; kept tokens keep whatever weighting the loss has (Liu et al.
                 2025, "When speed kills stability"; verl's rollout rejection sampling).
      "seq_mask" 1[lo <= g_s <= hi] for every token of sequence s, g_s = exp(mean over its trained tokens of
                 log ρ_t), the geometric-mean ratio: drops whole sequences (verl's geometric rejection, OpenRLHF
                 seq-mask-tis, the seq-mask / OPSM family).

    How it composes: a loss with a behaviour weight (registered uses_prox=True: decoupled_ppo, dual_clip, cispo,
    gspo) weighs tokens by w = π_prox/μ, which is ρ: ρ' = w_used, the weight after the staleness bounds. "tis"
    truncates it (gspo: its sequence weight), "icepop" and "mis" multiply the loss by the token mask, which for
    these losses makes them the same; "seq_mask" by the sequence mask. A loss without one (ppo, tis, topr) weighs
    tokens by π_θ/μ = (π_θ/π_prox)·ρ (topr's positive tokens not at all), so it carries ρ already and a second
    IS weight would count it twice: "tis" and "icepop" are refused for them at config check, and "mis" and
    "seq_mask" are pure masks for every loss. So mis and seq_mask drop tokens; tis and icepop keep the IS weight,
    truncated or masked. Dropped tokens still count in the aggregation's denominators (as behav_weight_mode
    "mask" does), and the KL penalty to π_ref is not masked.

    Args: behav_logp_bt, prox_logp_bt, mask_bt [B, T] (masked tokens may hold anything); cfg: a LossConfig or an
      object with its fields; sequence_ids_bt: [B, T] ints unique across rows (packed rows), else a row is a
      sequence. Returns [B, T] float32 in {0, 1}, 0 on masked tokens too.
    """
    m = jnp.asarray(mask_bt) > 0
    corr = _cfg(cfg, "mismatch")
    if corr not in MISMATCH_CORRECTIONS:
        raise ValueError(f"unknown mismatch correction {corr!r}; valid names: {list(MISMATCH_CORRECTIONS)}")
    if corr in ("none", "tis"):
        return m.astype(jnp.float32)
    lo, hi = _cfg(cfg, "mismatch_low"), _cfg(cfg, "mismatch_high")
    d = jnp.asarray(prox_logp_bt, jnp.float32) - jnp.asarray(behav_logp_bt, jnp.float32)
    log_rho = jnp.clip(jnp.where(m, d, 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)
    if corr == "seq_mask":
        log_rho = sequence_mean(log_rho, m, sequence_ids_bt)
    rho = jnp.exp(log_rho)
    return (m & (rho >= lo) & (rho <= hi)).astype(jnp.float32)


def policy_loss(name, logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg, ref_logp_bt=None,
                rewards_bt=None, sequence_ids_bt=None):
    """Per-token policy loss `name` (a key of POLICY_LOSSES), times the mismatch correction's mask
    (`mismatch_mask`), plus the optional KL penalty.

    Args: all [B, T]: logp_bt (log π_θ, differentiable), behav_logp_bt (log μ), prox_logp_bt (log π_prox; may be
      None for ppo/tis/topr without a mismatch correction), adv_bt, mask_bt (1 = trained token), ref_logp_bt
      (log π_ref, optional), rewards_bt (raw reward of the token's sequence; only topr with topr_split="reward"
      reads it), sequence_ids_bt (ints unique across rows: the sequences of packed rows, for "seq_mask"; None: a
      row is a sequence). All but logp_bt are treated as constants. cfg: a LossConfig or any object with its
      fields.
    Returns: loss_bt [B, T] float32, zero on masked tokens, = mask·(loss of `name`) + kl_coef·k(π_θ, π_ref); and
      per-token metrics [B, T] float32 (zero on masked tokens): clip_low, clip_high, behav_weight (uncapped),
      behav_capped, approx_kl (k3 vs π_prox, or vs μ for losses without prox), dual_clipped, kl_ref (k(π_θ, π_ref);
      0 without ref_logp_bt), mismatch_masked (dropped by the correction), mismatch_truncated (weight truncated by
      "tis"), mismatch_kl (k3 estimate of KL(μ || π_prox): exp(d) - d - 1, d = log π_prox - log μ clamped to
      ±MAX_LOG_RATIO) and mismatch_ratio (ρ = π_prox/μ); the last two are 0 without prox_logp_bt.
    Raises: ValueError for an unknown loss, a bad config, mismatched shapes, a missing prox or ref input (prox is
      needed by every loss when cfg.mismatch is not "none": without it ρ would be 1).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {sorted(POLICY_LOSSES)}")
    validate_loss_config(cfg)
    _check_shapes(logp_bt=logp_bt, behav_logp_bt=behav_logp_bt, prox_logp_bt=prox_logp_bt, adv_bt=adv_bt,
                  mask_bt=mask_bt, ref_logp_bt=ref_logp_bt, rewards_bt=rewards_bt, sequence_ids_bt=sequence_ids_bt)
    have_prox = prox_logp_bt is not None
    if not have_prox:
        if POLICY_LOSS_USES_PROX[name]:
            raise ValueError(f"policy loss {name!r} needs prox_logp_bt (got None)")
        if _cfg(cfg, "mismatch") != "none":
            raise ValueError(f"mismatch correction {_cfg(cfg, 'mismatch')!r} needs prox_logp_bt (got None): the "
                             f"mismatch ratio is π_prox/μ")
        prox_logp_bt = behav_logp_bt
    kl_coef = _cfg(cfg, "kl_coef")
    if kl_coef > 0 and ref_logp_bt is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp_bt (got None)")

    m = jnp.asarray(mask_bt) > 0
    # Zero masked tokens *before* any exp(): jnp.where's unused branch still gets a gradient of 0·inf = NaN.
    clean = lambda x: jnp.where(m, jnp.asarray(x, jnp.float32), 0.0)
    const = lambda x: jax.lax.stop_gradient(clean(x))
    logp = clean(logp_bt)
    behav, prox, adv = const(behav_logp_bt), const(prox_logp_bt), const(adv_bt)
    extra = {}
    if POLICY_LOSS_USES_REWARDS[name]:
        extra["rewards_bt"] = None if rewards_bt is None else const(rewards_bt)
    loss_bt, metrics = POLICY_LOSSES[name](logp, behav, prox, adv, m.astype(jnp.float32), cfg, **extra)
    keep = mismatch_mask(behav, prox, m, cfg, sequence_ids_bt)
    loss_bt = jnp.where(keep > 0, loss_bt, 0.0)
    zeros = jnp.zeros_like(logp)
    metrics.setdefault("mismatch_truncated", zeros)
    metrics["mismatch_masked"] = m.astype(jnp.float32) - keep
    metrics["mismatch_kl"] = kl_estimate(behav, prox, "k3") if have_prox else zeros
    metrics["mismatch_ratio"] = _exp_ratio(prox - behav) if have_prox else zeros

    if ref_logp_bt is not None:
        kl_bt = kl_estimate(logp, const(ref_logp_bt), _cfg(cfg, "kl_estimator"))
        if kl_coef > 0:
            loss_bt = loss_bt + kl_coef * kl_bt
        metrics["kl_ref"] = kl_bt
    else:
        metrics["kl_ref"] = jnp.zeros_like(logp)
    loss_bt = jnp.where(m, loss_bt, 0.0)
    metrics = {k: jnp.where(m, v, 0.0).astype(jnp.float32) for k, v in metrics.items()}
    return loss_bt, metrics


def token_weights(mask_bt: jax.Array, aggregation: str, constant_normalizer: float | None = None, *,
                  sequence_ids_bt: jax.Array | None = None) -> jax.Array:
    """Aggregation weights w_bt such that the batch loss is Σ_bt w_bt·loss_bt. Compute them on the FULL batch.

    Because the weights are fixed before splitting, summing Σ w·loss over micro-batches gives exactly the full
    batch loss. With m = (mask_bt > 0), len_b = Σ_t m, N = number of sequences with len_b > 0:
      token_mean:          w = m / Σ_bt m
      seq_mean_token_mean: w = m / (len_b · N)        (empty sequences get weight 0)
      seq_mean_token_sum:  w = m / N                  (a sequence's token losses summed, then averaged)
      constant:            w = m / (B · C)            (Dr.GRPO; C = constant_normalizer, default T)
    Without sequence_ids_bt a row is a sequence. With it (packed rows: several sequences per row), a sequence is
    the set of masked tokens sharing an id, len is counted per id, and B in "constant" becomes N, the number of
    ids that own a masked token (a packed batch has no trace of fully masked sequences).
    Args: mask_bt [B, T]; sequence_ids_bt [B, T] int, unique across rows. Returns [B, T] float32.
    Raises: ValueError for an unknown aggregation, or an all-zero mask when mask_bt is concrete (eager). Under jit
      the mask is a tracer and cannot be inspected, so an empty mask gives all-zero weights (a loss of 0).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; valid names: {list(AGGREGATIONS)}")
    if jnp.ndim(mask_bt) != 2:
        raise ValueError(f"mask_bt must be [B, T]; got shape {jnp.shape(mask_bt)}")
    m = (jnp.asarray(mask_bt) > 0).astype(jnp.float32)
    if not isinstance(m, jax.core.Tracer) and not np.any(np.asarray(m)):
        raise ValueError(f"loss mask is empty (all {m.size} entries of mask_bt are 0): nothing to train on")
    if aggregation == "token_mean":
        return m / jnp.maximum(jnp.sum(m), 1.0)
    if sequence_ids_bt is not None:
        _check_shapes(mask_bt=mask_bt, sequence_ids_bt=sequence_ids_bt)
        # Unmasked tokens add 0 to any count.
        m_n = m.reshape(-1)
        dense_n = _dense_ids(sequence_ids_bt)
        len_s = jax.ops.segment_sum(m_n, dense_n, num_segments=m_n.size)
        num_seqs = jnp.maximum(jnp.sum(len_s > 0), 1).astype(jnp.float32)
        if aggregation == "seq_mean_token_mean":
            denom_n = jnp.maximum(len_s[dense_n], 1.0) * num_seqs
        elif aggregation == "seq_mean_token_sum":
            denom_n = num_seqs
        else:
            denom_n = num_seqs * (m.shape[1] if constant_normalizer is None else constant_normalizer)
        return (m_n / denom_n).reshape(m.shape)
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum"):
        len_b = jnp.sum(m, axis=1)
        num_seqs = jnp.maximum(jnp.sum(len_b > 0), 1).astype(jnp.float32)
        if aggregation == "seq_mean_token_sum":
            return m / num_seqs
        return m / (jnp.maximum(len_b, 1.0)[:, None] * num_seqs)
    c = m.shape[1] if constant_normalizer is None else constant_normalizer
    return m / (m.shape[0] * c)


def loss_and_metrics(name, cfg, logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, weights_bt,
                     ref_logp_bt=None, rewards_bt=None, sequence_ids_bt=None):
    """Scalar loss Σ_bt weights_bt·loss_bt (weights from `token_weights` on the full batch) and scalar metrics.

    Inputs as in `policy_loss`; weights_bt [B, T]. Metrics are plain masked means over this (micro-)batch's
    tokens: behav_weight_mean/max (uncapped), behav_capped_frac, clip_low_frac, clip_high_frac, clip_frac (their
    sum), dual_clip_frac, approx_kl, kl_ref, mismatch_masked_frac (tokens the mismatch correction dropped),
    mismatch_truncated_frac (tokens whose weight "tis" truncated), mismatch_kl (KL(μ || π_prox), k3) and
    mismatch_ratio_max (the largest π_prox/μ); plus loss and num_tokens (to re-weight means across
    micro-batches). All metrics are 0 when the mask is empty; the mismatch_kl and mismatch_ratio_max are 0
    without prox_logp_bt.
    """
    _check_shapes(logp_bt=logp_bt, weights_bt=weights_bt)
    loss_bt, tok = policy_loss(name, logp_bt, behav_logp_bt, prox_logp_bt, adv_bt, mask_bt, cfg, ref_logp_bt,
                               rewards_bt, sequence_ids_bt)
    m = jnp.asarray(mask_bt) > 0
    loss = jnp.sum(jnp.where(m, weights_bt, 0.0) * loss_bt)
    n = jnp.sum(m).astype(jnp.float32)
    mean = lambda x: jnp.sum(x) / jnp.maximum(n, 1.0)
    metrics = {
        "loss": loss,
        "behav_weight_mean": mean(tok["behav_weight"]),
        "behav_weight_max": jnp.max(jnp.where(m, tok["behav_weight"], 0.0)),
        "behav_capped_frac": mean(tok["behav_capped"]),
        "clip_low_frac": mean(tok["clip_low"]),
        "clip_high_frac": mean(tok["clip_high"]),
        "clip_frac": mean(tok["clip_low"] + tok["clip_high"]),
        "dual_clip_frac": mean(tok["dual_clipped"]),
        "approx_kl": mean(tok["approx_kl"]),
        "kl_ref": mean(tok["kl_ref"]),
        "mismatch_masked_frac": mean(tok["mismatch_masked"]),
        "mismatch_truncated_frac": mean(tok["mismatch_truncated"]),
        "mismatch_kl": mean(tok["mismatch_kl"]),
        "mismatch_ratio_max": jnp.max(jnp.where(m, tok["mismatch_ratio"], 0.0)),
        "num_tokens": n,
    }
    return loss, metrics


def loglinear_prox_logp(behav_logp_bt, logp_bt, versions_bt, v_prox):
    """AReaL's log-linear π_prox, which saves the extra forward pass of the pre-step weights.

    log π_prox ≈ log μ + α_t·(sg(log π_θ) - log μ), α_t = clip((v_prox - v_t) / (v_prox + 1 - v_t), 0, 1).
    Assumption: along the versions v_t (the version that sampled token t, whose log-prob is log μ) … v_prox (the
    weights at the start of this step) … v_prox+1 (π_θ, the version this step is making), a token's log-prob moves
    linearly in the version number, so π_prox sits a fraction α of the way from μ to π_θ. On-policy tokens
    (v_t = v_prox) get α = 0, i.e. π_prox = μ (exact up to engine/trainer numerics); very stale tokens get α → 1,
    i.e. π_prox → π_θ. Elsewhere it is an approximation; AReaL reports similar reward at 27% less train time.

    Args: behav_logp_bt, logp_bt [B, T] float; versions_bt [B, T] int (per-token behaviour version); v_prox int.
    Returns: [B, T] float32 log π_prox, stop-gradient (π_prox is a constant of the step). Tokens with v_t > v_prox
      (which admission control should never let through) get α = 0.
    """
    _check_shapes(logp_bt=logp_bt, behav_logp_bt=behav_logp_bt, versions_bt=versions_bt)
    lag = (jnp.asarray(v_prox) - jnp.asarray(versions_bt)).astype(jnp.float32)
    alpha = jnp.clip(lag / jnp.maximum(lag + 1.0, 1.0), 0.0, 1.0)
    behav = jnp.asarray(behav_logp_bt, jnp.float32)
    return jax.lax.stop_gradient(behav + alpha * (jnp.asarray(logp_bt, jnp.float32) - behav))
