"""Log-probs in chunks and mixed precision: the chunked LM head equals the whole-sequence one within float32
rounding, a bfloat16-compute update agrees with the float32 one within bfloat16's rounding, and master
weights and optimizer state stay float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tolerances import F32_EPS, policy_loss_scale
from train_step_setup import CFG, SEQ_LEN, one_device, optimizer, trajectories

from jaxflow import sharding
from jaxflow.config import ConfigError
from jaxflow.jobs.config import CheckpointConfig, ModelSection
from jaxflow.models import precision
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.batch import make_batch
from jaxflow.trainer.rl_trainer import TrainerConfig
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, float32_state, token_logprobs, vocab_parallel_rules

pytestmark = pytest.mark.slow  # compiles the model

# bfloat16 keeps 8 significant bits: a rounding moves a value by up to 2**-8 of it.
BF16_EPS = 2.0 ** -8


def _micro_batch():
    batch, _ = make_batch(trajectories(seed=2), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
    return jax.tree.map(lambda x: x[0], batch)


# (fsdp, tensor): the logits' vocab axis over a tensor axis of 2 with the model's own rules, and
# vocab-parallel over fsdp x tensor = 8 devices (`vocab_parallel_rules`).
@pytest.mark.parametrize("fsdp, tensor", [(1, 2), (4, 2)])
def test_chunked_logprobs_entropy_and_gradients_equal_the_whole_sequence(fsdp, tensor):
    mb = _micro_batch()
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    weights_bt = jnp.asarray(rng.normal(size=mb.tokens.shape).astype(np.float32) * (mb.loss_mask > 0))
    # 31 predicted positions in chunks of 5: 7 chunks, the last one padded.
    mesh = sharding.make_mesh(fsdp=fsdp, tensor=tensor, devices=jax.devices()[:fsdp * tensor])
    assert (vocab_parallel_rules(mesh, CFG.vocab_size) is not None) == (fsdp > 1)

    def run(chunk, mesh):
        def loss(p):
            logp, entropy = token_logprobs(nnx.merge(graphdef, p), mb, chunk=chunk, mesh=mesh)
            return jnp.sum(logp * weights_bt), (logp, entropy)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, (logp, entropy)), grads = run(0, None)
    (_, (logp_c, entropy_c)), grads_c = run(5, mesh)
    logits = np.asarray(model(mb.tokens, mb.positions, mb.segment_ids, mb.context_ids))
    # A log-prob is a logit (a dot product over the hidden size) minus a logsumexp over the vocabulary; the
    # entropy sums a term per vocabulary entry. Each is rounded in float32 over that many terms of the
    # logits' magnitude; the two paths differ only in how the head's matmul is cut.
    scale = float(np.abs(logits).max()) + 1.0
    atol = (CFG.hidden_size + CFG.vocab_size) * F32_EPS * scale
    np.testing.assert_allclose(logp_c, logp, rtol=0, atol=atol)
    np.testing.assert_allclose(entropy_c, entropy, rtol=0, atol=atol)
    # Each gradient element sums one term per position (b x T of them), accumulated chunk by chunk in one
    # path and at once in the other.
    terms = mb.tokens.size
    for (path, g_c), g in zip(jax.tree_util.tree_flatten_with_path(grads_c)[0], jax.tree.leaves(grads)):
        g, g_c = np.asarray(g), np.asarray(g_c)
        np.testing.assert_allclose(g_c, g, rtol=0, atol=4 * terms * F32_EPS * float(np.abs(g).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_the_lm_head_is_vocab_parallel_only_where_the_vocab_splits_over_fsdp():
    devices = jax.devices()[:8]
    rules = vocab_parallel_rules(sharding.make_mesh(data=2, fsdp=2, tensor=2, devices=devices), 512)
    assert rules["vocab"] == ("fsdp", "tensor") and rules["batch"] == ("data", "expert")
    assert vocab_parallel_rules(sharding.make_mesh(fsdp=8, devices=devices), 512)["vocab"] == ("fsdp",)
    assert vocab_parallel_rules(sharding.make_mesh(fsdp=8, devices=devices), 100) is None  # 100 % 8
    assert vocab_parallel_rules(sharding.make_mesh(fsdp=1, tensor=8, devices=devices), 512) is None
    assert vocab_parallel_rules(None, 512) is None


def _one_update(step_cfg, param_dtype=jnp.float32):
    """(loss, gradient, state after) of one update from the same weights: SGD with lr 1 and momentum, so the
    update is minus the gradient and the momentum trace (the optimizer state) holds it."""
    mesh = one_device()
    model = Transformer(CFG, rngs=nnx.Rngs(0), param_dtype=param_dtype)
    tx = float32_state(optax.sgd(1.0, momentum=0.5))
    state = create_train_state(model, tx, mesh)
    before = jax.tree.map(lambda x: np.asarray(x, np.float32), state.params)
    step = TrainStep(nnx.graphdef(model), tx, step_cfg, mesh, train_state_shardings(state.params, tx, mesh))
    batch, _ = make_batch(trajectories(seed=5), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
    state, metrics = step(state, batch)
    grads = jax.tree.map(lambda new, old: old - np.asarray(new, np.float32), state.params, before)
    return float(metrics["loss"]), grads, state, batch


def test_bfloat16_compute_agrees_with_float32_and_keeps_float32_state():
    loss_32, grads_32, _, batch = _one_update(StepConfig())
    loss_16, grads_16, state, _ = _one_update(StepConfig(compute_dtype="bfloat16"))
    # Master weights, their gradients' updates and the optimizer state stay float32.
    for tree in (state.params, state.opt_state):
        for x in jax.tree.leaves(tree):
            if jnp.issubdtype(x.dtype, jnp.floating):
                assert x.dtype == jnp.float32, x.dtype
    # Every bfloat16 rounding moves a value by up to BF16_EPS of it. Along the forward pass a hidden state is
    # rounded after each of the ~8 ops of a block (norms, projections, attention, MLP, residual adds) per
    # layer, and the head's input once more; the errors are independent, so they grow as the square root
    # of their count, and the backward pass repeats them.
    roundings = 8 * CFG.num_layers + 1
    rel = 2 * np.sqrt(roundings) * BF16_EPS
    n, term_scale = policy_loss_scale(batch)
    # The policy loss averages terms A * ratio of size up to term_scale; each ratio is exp(logp - logp_prox),
    # both in the same dtype, so a term moves by at most term_scale * rel.
    assert abs(loss_16 - loss_32) <= term_scale * rel, (loss_16, loss_32)
    flat_32 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads_32)])
    flat_16 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads_16)])
    norm_32 = np.linalg.norm(flat_32)
    assert np.linalg.norm(flat_16 - flat_32) <= 2 * rel * norm_32, np.linalg.norm(flat_16 - flat_32) / norm_32
    cosine = flat_16 @ flat_32 / (np.linalg.norm(flat_16) * norm_32)
    assert cosine >= 1 - 2 * rel ** 2, cosine


def test_bfloat16_master_weights_keep_float32_adam_moments():
    model = Transformer(CFG, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    params = nnx.state(model, nnx.Param)
    tx = optimizer()
    opt_state = jax.eval_shape(tx.init, params)
    floating = [x.dtype for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floating and all(d == jnp.float32 for d in floating), floating
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = jax.eval_shape(tx.update, grads, opt_state, params)
    new = jax.eval_shape(optax.apply_updates, params, updates)
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}


def test_bad_dtypes_and_chunks_are_named():
    with pytest.raises(precision.DtypeError, match="model.compute_dtype"):
        StepConfig(compute_dtype="float16")
    with pytest.raises(ValueError, match="logprob_chunk"):
        StepConfig(logprob_chunk=-1)
    with pytest.raises(precision.DtypeError, match="trainer.param_dtype"):
        precision.dtype_of("int8", precision.PARAM_DTYPES, "trainer.param_dtype")
    assert dataclasses.replace(StepConfig(), logprob_chunk=0).logprob_chunk == 0


@pytest.mark.parametrize("section, key, value", [
    (ModelSection, "compute_dtype", "float16"), (TrainerConfig, "param_dtype", "int8"),
    (TrainerConfig, "logprob_chunk", -1), (CheckpointConfig, "export_dtype", "fp8")])
def test_bad_precision_keys_are_named(section, key, value):
    with pytest.raises(ConfigError, match=f"{section.SECTION}.{key}"):
        section.from_config({key: value})


def test_float32_dot_operands_upcast_bfloat16_on_the_cpu_backend_only():
    a, b = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3,), jnp.float32)
    out = precision.float32_dot_operands(a, b)
    want = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    assert out[0].dtype == want and out[1] is b
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), np.asarray(a, np.float32))  # exact
