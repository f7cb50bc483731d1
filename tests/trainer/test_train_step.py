"""The jitted PPO update: sharding invariance, accumulation, packing, learning, resume, bad input."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_sums_close, policy_loss_scale
from train_step_setup import (
    CFG,
    SEQ_LEN,
    assert_grad_norms_close,
    assert_trees_close,
    host,
    one_device,
    optimizer,
    run,
    setup,
    trajectories,
)

from jaxflow import sharding
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.batch import Trajectory, make_batch
from jaxflow.trainer.checkpoint import Checkpointer
from jaxflow.trainer.losses import LossConfig
from jaxflow.trainer.state import abstract_train_state, create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, token_logprobs

pytestmark = pytest.mark.slow  # compiles and trains the model


@functools.cache
def _unsharded_reference():
    """The batch the sharding tests train, and two steps of it on one device: (batch, params, metrics); run
    once for all the meshes compared with it (the arrays are host copies, which nothing modifies)."""
    batch, _ = make_batch(trajectories(), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
    return (batch, *run(one_device(), batch, steps=2))


@pytest.mark.parametrize("shape", [(2, 4, 1), (1, 4, 2), (2, 2, 2)], ids=["data2xfsdp4", "fsdp4xtensor2",
                                                                        "data2xfsdp2xtensor2"])
def test_sharded_equals_unsharded(shape):
    batch, ref_params, ref_m = _unsharded_reference()
    params, m = run(sharding.make_mesh(*shape), batch, steps=2)
    n, scale = policy_loss_scale(batch)
    for a, b in zip(m, ref_m):
        assert_sums_close(a["loss"], b["loss"], n, scale)
        assert_grad_norms_close(a["grad_norm"], b["grad_norm"], n)
    assert_trees_close(params, ref_params, atol=1e-5)


def test_micro_batches_equal_one_big_batch():
    trajs = trajectories(seed=1)
    big, _ = make_batch(trajs, num_rows=16, seq_len=SEQ_LEN, micro_batches=1)
    four, _ = make_batch(trajs, num_rows=16, seq_len=SEQ_LEN, micro_batches=4)
    assert four.tokens.shape == (4, 4, SEQ_LEN)
    params_1, m_1 = run(one_device(), big)
    params_4, m_4 = run(one_device(), four)
    assert_sums_close(m_4[0]["loss"], m_1[0]["loss"], *policy_loss_scale(big))
    assert_grad_norms_close(m_4[0]["grad_norm"], m_1[0]["grad_norm"], policy_loss_scale(big)[0])
    assert m_4[0]["num_tokens"] == m_1[0]["num_tokens"]
    assert_trees_close(params_4, params_1, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_packed_equals_padded(aggregation):
    trajs = trajectories(seed=2)
    loss = LossConfig(aggregation=aggregation, constant_normalizer=64.0)
    padded, _ = make_batch(trajs, num_rows=16, seq_len=SEQ_LEN)
    packed, _ = make_batch(trajs, num_rows=8, seq_len=64, pack=True)
    assert packed.segment_ids.max() > 1  # several sequences share a row
    params_pad, m_pad = run(one_device(), padded, StepConfig(loss=loss))
    params_pack, m_pack = run(one_device(), packed, StepConfig(loss=loss))
    assert_sums_close(m_pack[0]["loss"], m_pad[0]["loss"], *policy_loss_scale(padded))
    assert_grad_norms_close(m_pack[0]["grad_norm"], m_pad[0]["grad_norm"], policy_loss_scale(padded)[0])
    assert_trees_close(params_pack, params_pad, atol=1e-6)


def test_empty_micro_batches_change_nothing_and_the_shape_compiles_once():
    trajs = trajectories(seed=8)
    tight, _ = make_batch(trajs, num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
    padded, _ = make_batch(trajs, num_rows=32, seq_len=SEQ_LEN, micro_batches=4)
    assert padded.loss_mask[:2].any(axis=(1, 2)).all() and not padded.loss_mask[2:].any()
    params_t, m_t = run(one_device(), tight)
    state, step, _ = setup(one_device())
    assert step.compile(state, padded.tokens.shape) > 0 and step.compiles == 1
    state, m_p = step(state, padded)
    assert step.compiles == 1  # the call used the executable compiled ahead
    assert m_p["num_tokens"] == m_t[0]["num_tokens"]
    assert_sums_close(m_p["loss"], m_t[0]["loss"], *policy_loss_scale(tight))
    assert_grad_norms_close(m_p["grad_norm"], m_t[0]["grad_norm"], policy_loss_scale(tight)[0])
    assert_trees_close(host(state.params), params_t, atol=1e-6)
    # With K minibatches the filled rows are dealt over them, each minibatch's empty micro-batches last.
    two, _ = make_batch(trajs, num_rows=32, seq_len=SEQ_LEN, micro_batches=4, minibatches=2)
    assert [bool(two.loss_mask[i].any()) for i in range(4)] == [True, False, True, False]


def _completion_logp(model, batch):
    logp, _ = token_logprobs(model, jax.tree.map(lambda x: x[0], batch))
    return np.asarray(logp)


@pytest.mark.parametrize("loss_name", ["decoupled_ppo", "gspo", "cispo", "tis"])
def test_learning_is_real(loss_name):
    # On-policy batch with fixed advantages: +1 trajectories must gain log-prob, -1 ones must lose it.
    mesh = one_device()
    state, step, model = setup(mesh, StepConfig(loss=LossConfig(name=loss_name, eps_low=0.2, eps_high=0.2)),
                               tx=optimizer(lr=3e-3, eps=1e-8))
    rng = np.random.default_rng(3)
    trajs = [Trajectory(prompt=rng.integers(0, 256, 4).tolist(), completion=rng.integers(0, 256, 8).tolist(),
                        behav_logp=[0.0] * 8, versions=[0] * 8, advantage=1.0 if i % 2 else -1.0)
             for i in range(8)]
    batch, _ = make_batch(trajs, num_rows=8, seq_len=16)
    before = _completion_logp(model, batch)
    batch = dataclasses.replace(batch, behav_logp=np.where(batch.loss_mask > 0, before[None], 0).astype(np.float32))
    for v in range(5):
        versions = np.where(batch.loss_mask > 0, v, -1).astype(np.int32)
        state, metrics = step(state, dataclasses.replace(batch, versions=versions))
    nnx.update(model, state.params)
    after = _completion_logp(model, batch)
    mask = batch.loss_mask[0] > 0
    positive = np.array([t.advantage > 0 for t in trajs])[:, None] & mask
    negative = np.array([t.advantage < 0 for t in trajs])[:, None] & mask
    assert (after - before)[positive].mean() > 0.05
    assert (after - before)[negative].mean() < -0.05


def test_minibatches_use_start_of_step_proximal_policy():
    batch, _ = make_batch(trajectories(seed=4), num_rows=16, seq_len=SEQ_LEN, micro_batches=4)
    _, one = run(one_device(), batch, StepConfig(minibatches=1))
    _, two = run(one_device(), batch, StepConfig(minibatches=2))
    assert one[0]["approx_kl"] == 0.0  # K = 1: the gradient is taken at π_prox itself
    assert two[0]["approx_kl"] > 0.0  # second update moved away from π_prox
    assert np.isfinite(two[0]["loss"])


def test_loglinear_prox_equals_recompute_on_policy():
    # All tokens of the version being trained and μ = π_θ: the interpolation gives π_prox = μ = π_θ.
    state, step, model = setup(one_device())
    batch, _ = make_batch(trajectories(seed=5, max_lag=0), num_rows=16, seq_len=SEQ_LEN)
    logp = _completion_logp(model, batch)
    batch = dataclasses.replace(batch, behav_logp=np.where(batch.loss_mask > 0, logp[None], 0).astype(np.float32))
    _, m_re = run(one_device(), batch, StepConfig(prox="recompute"))
    _, m_ll = run(one_device(), batch, StepConfig(prox="loglinear"))
    assert_sums_close(m_ll[0]["loss"], m_re[0]["loss"], *policy_loss_scale(batch))
    assert_grad_norms_close(m_ll[0]["grad_norm"], m_re[0]["grad_norm"], policy_loss_scale(batch)[0])


def test_kl_to_reference():
    state, step, _ = setup(one_device(), StepConfig(loss=LossConfig(kl_coef=0.1)))
    batch, _ = make_batch(trajectories(seed=6), num_rows=16, seq_len=SEQ_LEN)
    ref = jax.tree.map(lambda x: x.copy(), state.params)
    with pytest.raises(ValueError, match="ref_params"):
        step(state, batch)
    state, m1 = step(state, batch, ref)
    state, m2 = step(state, batch, ref)
    assert float(m1["kl_ref"]) < 1e-6 < float(m2["kl_ref"])


def test_resume_from_checkpoint_is_identical(tmp_path):
    batches = [make_batch(trajectories(seed=10 + i, version=i), num_rows=16, seq_len=SEQ_LEN,
                          micro_batches=2)[0] for i in range(4)]
    mesh = sharding.make_mesh(1, 4, 2)
    state, step, model = setup(mesh)
    losses = []
    for i, batch in enumerate(batches):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        if i == 1:
            with Checkpointer(tmp_path / "ckpt") as ckpt:
                ckpt.save(2, state, {"consumed": [0, 1]})
    uninterrupted = host(state.params)

    tx = optimizer()
    for target_mesh, atol in [(mesh, 0.0), (sharding.make_mesh(2, 2, 2), 1e-5)]:
        _, step2, model2 = setup(target_mesh)
        with Checkpointer(tmp_path / "ckpt") as ckpt:
            restored, extra = ckpt.restore(abstract_train_state(model2, tx, target_mesh))
        assert extra == {"consumed": [0, 1]} and int(restored.version) == 2
        resumed = []
        for batch in batches[2:]:
            restored, m = step2(restored, batch)
            resumed.append(float(m["loss"]))
        if atol:  # another mesh sums in another order
            for b, got, want in zip(batches[2:], resumed, losses[2:]):
                assert_sums_close(got, want, *policy_loss_scale(b))
        else:
            assert resumed == losses[2:]
        assert_trees_close(host(restored.params), uninterrupted, atol=atol)
        assert int(restored.step) == 4 and int(restored.version) == 4


def test_bad_input_is_named():
    state, step, _ = setup(one_device())
    batch, _ = make_batch(trajectories(seed=7), num_rows=16, seq_len=SEQ_LEN)
    with pytest.raises(ValueError, match=r"batch.behav_logp has shape \(1, 16, 31\), expected \(1, 16, 32\)"):
        step(state, dataclasses.replace(batch, behav_logp=batch.behav_logp[..., :-1]))
    with pytest.raises(ValueError, match="loss_mask is empty"):
        step(state, dataclasses.replace(batch, loss_mask=np.zeros_like(batch.loss_mask)))
    with pytest.raises(ValueError, match="policy version 3, newer than the version being trained"):
        step(state, dataclasses.replace(batch, versions=np.where(batch.loss_mask > 0, 3, -1).astype(np.int32)))
    with pytest.raises(ValueError, match="trainer.loss.name 'bogus' is not one of"):
        StepConfig(loss=LossConfig(name="bogus"))
    with pytest.raises(ValueError, match="trajectory 0: 3 completion tokens but 2 behaviour log-probs"):
        make_batch([Trajectory([1], [1, 2, 3], [0.0, 0.0], [0, 0, 0])], num_rows=1, seq_len=8)
    assert int(state.version) == 0  # nothing above reached the state


def test_non_finite_update_is_skipped():
    state, step, _ = setup(one_device())
    batch, _ = make_batch(trajectories(seed=8), num_rows=16, seq_len=SEQ_LEN)
    before = host(state.params)
    poisoned = dataclasses.replace(batch, advantages=np.where(batch.loss_mask > 0, 3e38, 0).astype(np.float32))
    state, m = step(state, poisoned)
    assert float(m["updates_skipped"]) == 1 and int(state.skipped) == 1
    assert_trees_close(host(state.params), before, atol=0)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(host(state.opt_state)))
    state, m = step(state, dataclasses.replace(batch, versions=np.where(batch.loss_mask > 0, 1, -1).astype(np.int32)))
    assert float(m["updates_skipped"]) == 0 and np.isfinite(float(m["loss"]))
    assert int(state.version) == 2 and int(state.skipped) == 1


def test_environment_tokens_get_no_gradient():
    """A multi-turn episode's environment tokens are context, never trained: episodes that differ only in
    what the environment wrote at their end (context for nothing after it) give the same update, and
    the tokens the environment wrote are masked out of the batch. Ending in model tokens instead, the
    same change reaches the update (the environment's tokens are context for the model's)."""
    base = trajectories(seed=3)

    def episodes(env_tokens, env_at_end=True):
        out = []
        for t in base:
            k = len(t.completion)
            model_part = list(t.completion)
            if env_at_end:
                completion, spans = model_part + env_tokens, [[k, k + len(env_tokens)]]
                logp, versions = list(t.behav_logp) + [0.0] * len(env_tokens), list(t.versions) + [0] * len(env_tokens)
            else:
                completion = model_part[:1] + env_tokens + model_part[1:]
                spans = [[1, 1 + len(env_tokens)]]
                logp = list(t.behav_logp[:1]) + [0.0] * len(env_tokens) + list(t.behav_logp[1:])
                versions = list(t.versions[:1]) + [0] * len(env_tokens) + list(t.versions[1:])
            out.append(dataclasses.replace(t, completion=completion, behav_logp=logp, versions=versions,
                                           env_spans=spans))
        return out

    batch_a, _ = make_batch(episodes([7, 8, 9]), num_rows=16, seq_len=SEQ_LEN)
    batch_b, _ = make_batch(episodes([200, 100, 50]), num_rows=16, seq_len=SEQ_LEN)
    plain, _ = make_batch(base, num_rows=16, seq_len=SEQ_LEN)
    assert batch_a.num_tokens == batch_b.num_tokens == plain.num_tokens  # 3 env tokens each: all masked
    env = (np.asarray(batch_a.tokens) != np.asarray(plain.tokens)) & (np.asarray(plain.segment_ids) == 0)
    assert env.sum() == 3 * len(base)
    for name in ("loss_mask", "behav_logp", "advantages", "rewards"):
        assert not np.asarray(getattr(batch_a, name))[env].any(), name
    assert (np.asarray(batch_a.versions)[env] == -1).all()
    params_a, m_a = run(one_device(), batch_a)
    params_b, m_b = run(one_device(), batch_b)
    params_plain, m_plain = run(one_device(), plain)
    # Same tokens trained with the same context: the same update, to the last bit's worth of reordering.
    n, scale = policy_loss_scale(plain)
    assert_sums_close(m_a[0]["loss"], m_plain[0]["loss"], n, scale)
    assert_sums_close(m_b[0]["loss"], m_plain[0]["loss"], n, scale)
    assert_trees_close(params_a, params_b, atol=1e-6)
    # In the middle, the environment's tokens are context: changing them changes the update.
    mid_a, _ = make_batch(episodes([7, 8, 9], env_at_end=False), num_rows=16, seq_len=SEQ_LEN)
    mid_b, _ = make_batch(episodes([200, 100, 50], env_at_end=False), num_rows=16, seq_len=SEQ_LEN)
    assert mid_a.num_tokens == plain.num_tokens
    moved = [np.abs(x - y).max() for x, y in zip(jax.tree.leaves(run(one_device(), mid_a)[0]),
                                                 jax.tree.leaves(run(one_device(), mid_b)[0]))]
    assert max(moved) > 1e-4


def test_lora_steps_train_the_adapters_alone_on_a_sharded_mesh():
    """With LoRA the state holds the adapters (and their optimizer state) alone; the base goes to the
    step frozen, and stays bit-identical; the first update moves B (A's gradient is 0 while B is 0), the
    next A too; the same step on 8 devices (fsdp 4 x tensor 2) agrees with one device."""
    from jaxflow.models.lora import LoRASpec, attach
    from jaxflow.trainer.state import frozen_state

    def run(mesh):
        model = Transformer(CFG, rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
        attach(model.layers, LoRASpec(rank=4, alpha=8.0), jax.random.key(1), mesh)
        tx = optimizer()
        state = create_train_state(model, tx, mesh)
        frozen = frozen_state(model)
        base = jax.tree.map(np.asarray, frozen)
        step = TrainStep(nnx.graphdef(model), tx, StepConfig(), mesh, train_state_shardings(state.params, tx, mesh),
                         frozen=frozen)
        assert {type(v) for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))} \
            == {nnx.LoRAParam}
        a0 = np.asarray(state.params["layers"]["q_proj_lora_a"][...])
        history = []
        for v in range(2):
            batch, _ = make_batch(trajectories(seed=v, version=v), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
            state, metrics = step(state, batch)
            history.append((np.asarray(state.params["layers"]["q_proj_lora_a"][...]),
                            np.asarray(state.params["layers"]["q_proj_lora_b"][...]), float(metrics["loss"])))
        assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)))
        return a0, history

    a0, one = run(one_device())
    (a_1, b_1, _), (a_2, b_2, _) = one
    # Step 1: B moves; A has no gradient yet (B is 0), only the optimizer's weight decay (lr 1e-3 x 0.01).
    np.testing.assert_allclose(a_1, a0 * (1 - 1e-3 * 0.01), rtol=1e-6, atol=0)
    assert np.abs(b_1).max() > 1e-4
    # Step 2: A has a gradient through the moved B: it moves beyond the decay (and float32 rounding, ~1e-8).
    assert np.abs(a_2 - a_1 * (1 - 1e-3 * 0.01)).max() > 1e-5
    _, eight = run(sharding.make_mesh(fsdp=4, tensor=2))
    for (a, b, _), (a8, b8, _) in zip(one, eight):
        np.testing.assert_allclose(a8, a, atol=1e-5, rtol=0)
        np.testing.assert_allclose(b8, b, atol=1e-5, rtol=0)
