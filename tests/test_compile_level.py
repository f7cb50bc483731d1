"""The suite compiles at LLVM optimisation level 0 (tests/compile_level.py), users' runs at XLA's default 3: the
model's forward pass and its gradient must be the same functions at both levels, within float32 rounding."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compile_level import SUITE_OPT_LEVEL
from flax import nnx
from tolerances import forward_terms, sum_atol

from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer

pytestmark = pytest.mark.slow  # compiles the model at two optimisation levels

CFG = ModelConfig("Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
XLA_DEFAULT_LEVEL = 3  # DebugOptions' default xla_backend_optimization_level


def test_the_suite_runs_below_the_default_level():
    assert f"--xla_backend_optimization_level={SUITE_OPT_LEVEL}" in os.environ["XLA_FLAGS"]
    assert SUITE_OPT_LEVEL < XLA_DEFAULT_LEVEL


def test_forward_and_gradient_agree_with_the_default_level():
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 48), 0, CFG.vocab_size)

    def loss_and_logits(params, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens)[:, :-1]
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean(), logits
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, logits, grads

    lowered = jax.jit(loss_and_logits).lower(params, tokens)
    results = [lowered.compile(compiler_options={"xla_backend_optimization_level": level})(params, tokens)
               for level in (SUITE_OPT_LEVEL, XLA_DEFAULT_LEVEL)]
    (v_suite, logits_suite, g_suite), (v_default, logits_default, g_default) = jax.tree.map(np.asarray, results)
    # Rounding, from the scale of the terms (tests/tolerances.py); each gradient element also sums one term
    # per token (4 * 47).
    atol = sum_atol(forward_terms(CFG), np.abs(logits_default).max())
    np.testing.assert_allclose(logits_suite, logits_default, rtol=0, atol=atol)
    np.testing.assert_allclose(v_suite, v_default, rtol=0, atol=atol)
    tokens_n = tokens.shape[0] * (tokens.shape[1] - 1)
    for (keypath, b), a in zip(jax.tree_util.tree_leaves_with_path(g_default), jax.tree.leaves(g_suite)):
        atol = sum_atol(tokens_n * forward_terms(CFG), max(float(np.abs(b).max()), 1e-30))
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(keypath))
    # Not trivially equal: the gradient is not zero.
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(g_default)) > 1e-4
