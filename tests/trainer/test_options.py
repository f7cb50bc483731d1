"""Every update option is a config key that reaches the code and does what it says.

Three levels: the loss options on hand-computed numbers (policy_loss, token_weights, compute_advantages); the
optimizer keys against a NumPy AdamW written from optax's documented formulas; and the step options (clip range,
prox, KL reference, remat, micro-batch rows) through `RLTrainer`, built from configs/arithmetic_tiny.py's trainer
section with `--config.trainer.*` overrides, so each test also shows the key is read.
"""
import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxflow import sharding
from jaxflow.config import load_config
from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer
from jaxflow.trainer import losses as L
from jaxflow.trainer import step as step_module
from jaxflow.trainer.advantages import compute_advantages
from jaxflow.trainer.rl_trainer import RLTrainer, check_trainer_config, optimizer_config, step_config
from jaxflow.trainer.step import StepConfig, make_optimizer

pytestmark = pytest.mark.slow  # compiles and trains the model

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "arithmetic_tiny.py"
MODEL = ModelConfig("Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def trainer_section(**overrides) -> ml_collections.ConfigDict:
    """The config file's trainer section with `--config.trainer.<key>=<value>` overrides (dots as __)."""
    return load_config(str(CONFIG), {f"trainer.{k.replace('__', '.')}": str(v)
                                     for k, v in overrides.items()}).trainer


# ------------------------------------------------------------------------------------------- config plumbing

def test_defaults_keep_the_previous_update():
    # What RLTrainer hard-coded before these keys existed.
    t = trainer_section()
    assert step_config(t) == StepConfig(loss=L.LossConfig(name="decoupled_ppo", behav_weight_cap=5.0),
                                        minibatches=1, prox="recompute", remat=False)
    assert optimizer_config(t).to_dict() == dict(lr=1e-4, warmup_steps=5, schedule="constant", total_steps=1000,
                                                 b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)
    # Micro-batches change memory and the compiled shape, not the update (see the accumulation test below).
    assert (t.micro_batch_rows, t.adv_std_ddof, t.adv_scale_by_std) == (4, 0, True)


def test_every_loss_field_is_a_key_and_reaches_the_loss_config():
    fields = [f.name for f in dataclasses.fields(L.LossConfig)]
    assert sorted(trainer_section().loss.keys()) == sorted(fields)
    changed = dict(name="cispo", eps_low=0.1, eps_high=0.3, dual_clip_c=2.0, behav_weight_cap=4.0,
                   behav_weight_floor=0.25, behav_weight_mode="mask", tis_cap=3.0, tis_floor=0.5,
                   cispo_eps_low=0.5, cispo_eps_high=0.4, cispo_unified_mask=True, topr_pos_weight=2.0,
                   topr_neg_weight=0.5, topr_split="reward", kl_coef=0.01, kl_estimator="k2",
                   aggregation="seq_mean_token_sum", constant_normalizer=8.0, mismatch="icepop", mismatch_low=0.25,
                   mismatch_high=4.0)
    assert sorted(changed) == sorted(fields)
    loss = step_config(trainer_section(**{f"loss__{k}": v for k, v in changed.items()})).loss
    assert dataclasses.asdict(loss) == changed


@pytest.mark.parametrize("key,value", [
    ("loss.aggregation", "median"), ("loss.kl_estimator", "k4"), ("loss.topr_split", "score"),
    ("loss.behav_weight_mode", "drop"), ("loss.behav_weight_floor", 6.0), ("loss.tis_floor", 3.0),
    ("loss.kl_coef", -0.1), ("loss.name", "reinforce"), ("prox", "exact"), ("schedule", "linear"),
    ("b1", 1.0), ("b2", -0.1), ("adam_eps", 0.0), ("weight_decay", -1.0), ("lr", 0.0), ("max_grad_norm", 0.0),
    ("warmup_steps", -1), ("advantage", "ppo"), ("adv_std_ddof", 2), ("micro_batch_rows", -1)])
def test_a_bad_value_names_its_key(key, value):
    with pytest.raises(ValueError, match=rf"trainer\.{key.replace('.', '[.]')}\b"):
        check_trainer_config(trainer_section(**{key.replace(".", "__"): value}))


def test_an_unknown_loss_key_is_named():
    t = trainer_section()
    with t.loss.unlocked():
        t.loss.eps_hihg = 0.3
    with pytest.raises(ValueError, match=r"trainer\.loss\.eps_hihg is not a key of trainer\.loss \(nearest: eps_high"):
        step_config(t)
    old_style = ml_collections.ConfigDict({**t.to_dict(), "loss": "decoupled_ppo"})
    with pytest.raises(ValueError, match=r"trainer\.loss must be a section of loss options"):
        step_config(old_style)


def test_micro_batch_rows_must_split_over_the_batch_shards():
    mesh = sharding.make_mesh(2, 4, 1)
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_rows=4 .*multiple of the 8 data x fsdp shards"):
        RLTrainer(None, trainer_section(micro_batch_rows=4), mesh, seq_len=64, max_sequences=16)


# ----------------------------------------------------------------------------------- loss options, by hand

def _loss(name, cfg, logp, behav, prox, adv, rewards=None):
    row = lambda x: None if x is None else jnp.asarray([x], jnp.float32)  # noqa: E731
    loss, metrics = L.policy_loss(name, row(logp), row(behav), row(prox), row(adv),
                                  jnp.ones((1, len(logp))), cfg, rewards_bt=row(rewards))
    return np.asarray(loss[0]), {k: np.asarray(v[0]) for k, v in metrics.items()}


def test_behav_weight_floor_clamps_or_masks_from_below():
    # u = 1 (logp = prox), so the loss is -w·A; w = π_prox/μ = 0.1, 1 and 8.
    logp = np.log([0.2, 0.3, 0.4])
    behav = logp - np.log([0.1, 1.0, 8.0])
    adv = [1.0, -2.0, 0.5]
    args = (logp, behav, logp, adv)
    base, _ = _loss("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0), *args)
    clamp, m = _loss("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0, behav_weight_floor=0.5), *args)
    mask, _ = _loss("decoupled_ppo", L.LossConfig(behav_weight_cap=5.0, behav_weight_floor=0.5,
                                                  behav_weight_mode="mask"), *args)
    tol = 1e-6 * 8.0
    np.testing.assert_allclose(base, [-0.1, 2.0, -2.5], atol=tol)  # the default: no floor
    np.testing.assert_allclose(clamp, [-0.5, 2.0, -2.5], atol=tol)  # w: max(0.1, 0.5), 1, min(8, 5)
    np.testing.assert_allclose(mask, [0.0, 2.0, 0.0], atol=tol)  # below the floor or above the cap: dropped
    np.testing.assert_array_equal(m["behav_capped"], [1.0, 0.0, 1.0])


def test_tis_floor_truncates_the_ratio_from_below():
    # r = π_θ/μ = 0.2, 1, 4; loss = -sg(clip(r, floor, cap))·A·logp.
    logp = np.log([0.3, 0.5, 0.6])
    behav = logp - np.log([0.2, 1.0, 4.0])
    adv = [1.0, 1.0, -1.0]
    base, _ = _loss("tis", L.LossConfig(tis_cap=2.0), logp, behav, None, adv)
    floored, m = _loss("tis", L.LossConfig(tis_cap=2.0, tis_floor=0.5), logp, behav, None, adv)
    want = lambda c: -np.asarray(c) * np.asarray(adv) * logp  # noqa: E731
    tol = 1e-6 * np.abs(want([2.0, 2.0, 2.0])).sum()
    np.testing.assert_allclose(base, want([0.2, 1.0, 2.0]), atol=tol)
    np.testing.assert_allclose(floored, want([0.5, 1.0, 2.0]), atol=tol)
    np.testing.assert_array_equal(m["behav_capped"], [1.0, 0.0, 1.0])


def test_cispo_unified_mask_drops_tokens_pushed_further_out():
    # u = π_θ/π_prox per token, μ = π_prox (w = 1); eps_low = eps_high = 0.2 is the mask's trust region.
    u = np.array([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0])
    logp = np.log([0.3, 0.2, 0.4, 0.1, 0.5])
    prox = logp - np.log(u)
    cfg = dict(name="cispo", cispo_eps_low=1.0, cispo_eps_high=0.28, eps_low=0.2, eps_high=0.2)
    plain, _ = _loss("cispo", L.LossConfig(**cfg), logp, prox, prox, adv)
    unified, m = _loss("cispo", L.LossConfig(**cfg, cispo_unified_mask=True), logp, prox, prox, adv)
    want = -np.clip(u, 0.0, 1.28) * adv * logp
    tol = 1e-6 * np.abs(want).sum()
    np.testing.assert_allclose(plain, want, atol=tol)
    # A > 0 with u > 1.2 and A < 0 with u < 0.8 are masked; the others keep CISPO's clipped-weight loss.
    np.testing.assert_allclose(unified, want * np.array([0, 0, 1, 1, 1]), atol=tol)
    # Flags: masked (tokens 0, 1) or a clipped IS weight (token 3: u = 1.5 > 1.28).
    np.testing.assert_array_equal(m["clip_high"] + m["clip_low"], [1.0, 1.0, 0.0, 1.0, 0.0])


def test_topr_splits_by_raw_reward_and_weights_each_side():
    # r = π_θ/μ = 0.5 everywhere; token 0's sequence scored 0.6 but below its group's mean (A < 0).
    logp = np.log([0.2, 0.4, 0.3])
    behav = logp - np.log(0.5)
    adv = np.array([-0.3, 0.8, -1.0])
    rewards = np.array([0.6, 1.0, 0.0])
    cfg = dict(topr_pos_weight=2.0, topr_neg_weight=0.25)
    by_adv, _ = _loss("topr", L.LossConfig(**cfg), logp, behav, None, adv, rewards)
    by_reward, _ = _loss("topr", L.LossConfig(**cfg, topr_split="reward"), logp, behav, None, adv, rewards)
    default, _ = _loss("topr", L.LossConfig(), logp, behav, None, adv)
    c_neg = 0.25 * 0.5  # topr_neg_weight·clip(r, 0, 1)
    tol = 1e-6 * np.abs(2.0 * adv * logp).sum()
    np.testing.assert_allclose(by_adv, -np.array([c_neg, 2.0, c_neg]) * adv * logp, atol=tol)
    np.testing.assert_allclose(by_reward, -np.array([2.0, 2.0, c_neg]) * adv * logp, atol=tol)
    np.testing.assert_allclose(default, -np.array([0.5, 1.0, 0.5]) * adv * logp, atol=tol)
    with pytest.raises(ValueError, match="needs rewards_bt"):
        _loss("topr", L.LossConfig(topr_split="reward"), logp, behav, None, adv)


def test_seq_mean_token_sum_sums_a_sequence_and_averages_sequences():
    mask = np.array([[1, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    loss = np.array([[1.0, 2.0, 3.0, 9.0], [0.0, 4.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    w = np.asarray(L.token_weights(mask, "seq_mean_token_sum"))
    assert float(np.sum(w * loss)) == pytest.approx((1 + 2 + 3 + 4) / 2, abs=1e-6 * 10)
    # Packed: two sequences in row 0 (ids 1, 2) and one in row 1 count as three.
    ids = np.array([[1, 1, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]])
    w = np.asarray(L.token_weights(mask, "seq_mean_token_sum", sequence_ids_bt=ids))
    assert float(np.sum(w * loss)) == pytest.approx((1 + 2 + 3 + 4) / 3, abs=1e-6 * 10)


def test_grpo_std_ddof_one_divides_by_the_unbiased_std():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 1.0], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1], np.int32)
    pop, _ = compute_advantages(rewards, groups, "grpo", eps=0.0)
    unbiased, _ = compute_advantages(rewards, groups, "grpo", eps=0.0, std_ddof=1)
    centred = np.array([0.5, -0.5, -0.5, 0.5, -0.5, 0.0, 0.5])
    std0 = np.array([0.5] * 4 + [math.sqrt(1 / 6)] * 3)
    std1 = np.array([math.sqrt(1 / 3)] * 4 + [0.5] * 3)
    np.testing.assert_allclose(pop, centred / std0, atol=1e-6 * 2)
    np.testing.assert_allclose(unbiased, centred / std1, atol=1e-6 * 2)
    with pytest.raises(ValueError, match="std_ddof must be 0 or 1"):
        compute_advantages(rewards, groups, "grpo", std_ddof=2)


# ------------------------------------------------------------------------------------------- the optimizer

def _adamw_reference(cfg, grads, params):
    """optax's chain(clip_by_global_norm, adamw(schedule, mask)) written out in float64; returns the updates."""
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    p = {k: x.astype(np.float64) for k, x in params.items()}
    out = []
    for t, g in enumerate(grads):
        norm = math.sqrt(sum(float(np.sum(x ** 2)) for x in g.values()))
        scale = min(1.0, cfg.max_grad_norm / norm)
        if t < cfg.warmup_steps:
            lr = cfg.lr * (t + 1) / cfg.warmup_steps
        elif cfg.schedule == "constant":
            lr = cfg.lr
        else:
            decay = max(cfg.total_steps - cfg.warmup_steps, 1)
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * min(t - cfg.warmup_steps, decay) / decay))
        step = {}
        for k in p:
            gk = g[k] * scale
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * gk
            v[k] = cfg.b2 * v[k] + (1 - cfg.b2) * gk ** 2
            mh, vh = m[k] / (1 - cfg.b1 ** (t + 1)), v[k] / (1 - cfg.b2 ** (t + 1))
            decay_wd = 0.0 if k.endswith("norm") else cfg.weight_decay
            step[k] = -lr * (mh / (np.sqrt(vh) + cfg.eps) + decay_wd * p[k])
            p[k] = p[k] + step[k]
        out.append(step)
    return out


@pytest.mark.parametrize("overrides", [
    {}, {"b1": 0.5}, {"b2": 0.9}, {"adam_eps": 0.05}, {"weight_decay": 0.3}, {"lr": 0.02},
    {"schedule": "cosine", "steps": 4, "warmup_steps": 1}, {"warmup_steps": 0}, {"max_grad_norm": 10.0}],
    ids=lambda o: ",".join(o) or "defaults")
def test_optimizer_keys_shape_the_update(overrides):
    cfg = optimizer_config(trainer_section(**overrides))
    tx = make_optimizer(cfg)
    rng = np.random.default_rng(0)
    params = {"kernel": rng.normal(size=(3, 4)).astype(np.float32), "final_norm": np.ones(4, np.float32)}
    grads = [{k: rng.normal(size=x.shape).astype(np.float32) for k, x in params.items()} for _ in range(4)]
    state, p, got = tx.init(params), params, []
    for g in grads:
        u, state = tx.update(g, state, p)
        p = jax.tree.map(lambda a, b: a + b, p, u)
        got.append(u)
    want = _adamw_reference(cfg, grads, params)
    default = _adamw_reference(optimizer_config(trainer_section()), grads, params)
    for g_t, w_t, _d_t in zip(got, want, default):
        for k in params:
            # Each update element is at most ~lr·(1 + weight_decay·|p|) in size.
            tol = 1e-5 * cfg.lr * (1 + cfg.weight_decay * np.abs(params[k]).max())
            np.testing.assert_allclose(np.asarray(g_t[k]), w_t[k], atol=tol, rtol=0)
    if overrides:  # the key changed the updates (the reference above shows how)
        diff = max(np.abs(w_t[k] - d_t[k]).max() for w_t, d_t in zip(want, default) for k in params)
        assert diff > 1e-3 * optimizer_config(trainer_section()).lr


# --------------------------------------------------------------------------- step options through RLTrainer

def consumed(step=0, seed=0, groups=4, size=4):
    """A buffer of random groups (behaviour log-probs near the tiny model's ~ -log 256), continuous rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        samples = []
        for n in rng.integers(4, 20, size):
            samples.append(Sample(tokens=rng.integers(3, 250, n).tolist(),
                                  logprobs=(-5.5 + 0.3 * rng.normal(size=n)).tolist(), versions=[step] * n,
                                  finish_reason="stop"))
        out.append(FinishedGroup(100 * step + g, rng.integers(3, 250, 6).tolist(), step, samples,
                                 rng.random(size).round(2).tolist()))
    return ConsumedBatch(step, out, "full")


def make_trainer(**overrides):
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
    return RLTrainer(model, trainer_section(**overrides), mesh, seq_len=64, max_sequences=16)


def train(steps=1, **overrides):
    trainer = make_trainer(**overrides)
    metrics = [trainer.train(consumed(step=i, seed=i))[0] for i in range(steps)]
    return trainer, metrics


def test_eps_high_moves_the_clip_fraction():
    # PPO's ratio is π_θ/μ: μ is ±0.3 nats around the model's log-probs, so many ratios exceed 1.05.
    _, (narrow,) = train(**{"loss__name": "ppo", "loss__eps_high": 0.05})
    _, (wide,) = train(**{"loss__name": "ppo", "loss__eps_high": 2.0})
    assert narrow["clip_high_frac"] > wide["clip_high_frac"]
    assert narrow["clip_high_frac"] > 0.05
    assert narrow["clip_low_frac"] == wide["clip_low_frac"]  # eps_low is the same


def test_loglinear_prox_and_kl_reference_change_the_forward_passes(monkeypatch):
    calls = []
    original = step_module.token_logprobs

    def counting(model, mb, remat=False, *more, **options):
        calls.append(remat)
        return original(model, mb, remat, *more, **options)

    monkeypatch.setattr(step_module, "token_logprobs", counting)
    # The passes are counted as the step is traced, when the trainer lowers it at construction; compiling
    # and running the lowered step traces nothing more, so the four trainers skip both.
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *args, **kwargs: None)
    counts = {}
    for name, overrides in {"recompute": {}, "loglinear": {"prox": "loglinear"},
                            "kl": {"loss__kl_coef": 0.1}, "remat": {"remat": True}}.items():
        calls.clear()
        make_trainer(minibatches=2, **overrides)
        counts[name] = list(calls)  # forward passes traced into the jitted step
    # minibatches=2 with recompute: π_prox is a forward-only pass over the batch before the updates, beside
    # the differentiated pass (traced more than once: the step also traces it for its output structure);
    # loglinear interpolates instead; the KL reference adds its own forward pass.
    assert len(counts["loglinear"]) == len(counts["recompute"]) - 1
    assert len(counts["kl"]) == len(counts["recompute"]) + 1
    assert len(counts["remat"]) == len(counts["recompute"]) and all(counts["remat"])
    assert not any(counts["recompute"])


def test_kl_coef_keeps_a_frozen_reference_and_reports_kl_ref():
    trainer, metrics = train(steps=2, lr=1e-2, warmup_steps=0, **{"loss__kl_coef": 0.1})
    assert trainer.ref_params is not None
    # Step 0 trains the reference itself (KL 0 up to rounding); step 1's policy has moved away from it.
    assert metrics[0]["kl_ref"] < 1e-7 and metrics[1]["kl_ref"] > 1e-4
    # The reference stayed the initial weights while the state moved.
    initial = make_trainer().state.params
    for a, b in zip(jax.tree.leaves(trainer.ref_params), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    off, metrics = train(steps=2)
    assert off.ref_params is None and [m["kl_ref"] for m in metrics] == [0.0, 0.0]


def test_remat_gives_the_same_loss_and_gradient():
    _, (plain,) = train()
    _, (remat,) = train(remat=True)
    # Per-token losses are bounded by w·u·|A| <= 5·|A|: that scale sets the tolerance.
    scale = 5.0 * plain["adv_adv_abs_max"]
    assert remat["loss"] == pytest.approx(plain["loss"], abs=1e-5 * scale)
    assert remat["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)


def test_micro_batch_rows_accumulate_the_same_gradient():
    trainer = make_trainer(micro_batch_rows=2, adam_eps=1e-3)
    shapes = []
    run_step = trainer._step

    def spy(state, batch, ref=None):
        shapes.append(batch.tokens.shape)
        return run_step(state, batch, ref)

    spy.compiles, spy.compile_s = run_step.compiles, run_step.compile_s
    trainer._step = spy
    (metrics, _), whole = trainer.train(consumed()), make_trainer(micro_batch_rows=0, adam_eps=1e-3)
    whole_metrics, _ = whole.train(consumed())
    (m, b, _), = shapes
    assert b == 2 and m > 1  # the batch really was split into 2-row micro-batches
    scale = 5.0 * metrics["adv_adv_abs_max"]
    assert metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-5 * scale)
    assert metrics["grad_norm"] == pytest.approx(whole_metrics["grad_norm"], rel=1e-4)
    for a, c in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(whole.state.params)):
        # adam_eps=1e-3 keeps the first update continuous in the gradient: |Δ| <= lr and moves ~lr·δg/eps.
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-3 * trainer.cfg.lr, rtol=0)


def test_adv_std_ddof_reaches_the_batch_advantages():
    _, (pop,) = train()
    _, (unbiased,) = train(adv_std_ddof=1)
    # Groups of 4: the unbiased std is sqrt(4/3) times the population one, so |A| shrinks by sqrt(3/4).
    assert unbiased["adv_adv_abs_max"] == pytest.approx(pop["adv_adv_abs_max"] * math.sqrt(3 / 4), rel=1e-4)
