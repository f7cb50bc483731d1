"""The JAX engine computing in bfloat16 over a float32 model: weights and KV cache in bfloat16, log-probs within
bfloat16's rounding of the float32 forward, and float32 versions from a trainer cast when they are synced."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import prompts, run
from flax import nnx
from jax_engine_setup import ENGINE_KW, forward_logits, teacher_forced

from jaxflow.data.device_params import DeviceParamSource
from jaxflow.models import precision
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # a rollout engine compiled and run

# bfloat16 keeps 8 significant bits: a rounding moves a value by up to 2**-8 of it.
BF16_EPS = 2.0 ** -8


def _floating_dtypes(tree):
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_engine_decodes_in_bfloat16_and_casts_synced_float32_weights(qwen3_model):
    engine = JaxEngine(qwen3_model, compute_dtype="bfloat16", warmup=False, **ENGINE_KW)
    try:
        assert _floating_dtypes(engine._params) == {jnp.dtype(jnp.bfloat16)}
        assert {c.dtype for c in engine._cache} == {jnp.dtype(jnp.bfloat16)}
        cfg = qwen3_model.config
        # A logit is rounded after each of the ~8 bfloat16 ops of a block per layer and once in the head,
        # independently: its error grows as the square root of their count, relative to the logits' size,
        # and a log-prob (logit - logsumexp) carries two of them.
        rel = 2 * np.sqrt(8 * cfg.num_layers + 1) * BF16_EPS
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
        chosen = prompts(1)[:3]
        for p, c in zip(chosen, run(engine, chosen, params)):
            assert len(c.sample.tokens) > 0 and c.error is None
            ref, _ = teacher_forced(qwen3_model, p, c.sample.tokens)  # float32
            scale = float(np.abs(forward_logits(qwen3_model, p, c.sample.tokens)).max())
            np.testing.assert_allclose(c.sample.logprobs, ref, rtol=0, atol=2 * rel * scale)

        # A trainer publishes float32 master weights; the engine takes them and serves them in bfloat16.
        source = DeviceParamSource()
        source.add_target(engine.param_shardings)
        source.publish(1, nnx.state(qwen3_model, nnx.Param))
        engine.update_weights(*source.pull(1))
        assert engine.version == 1 and _floating_dtypes(engine._params) == {jnp.dtype(jnp.bfloat16)}
        assert run(engine, chosen[:1], params)[0].sample.versions[0] == 1
    finally:
        engine.close()


def test_a_dtype_the_engine_cannot_take_is_named_before_anything_is_built(qwen3_model):
    with pytest.raises(precision.DtypeError, match="float16"):
        JaxEngine(qwen3_model, compute_dtype="float16", warmup=False, **ENGINE_KW)


def test_episodes_next_turns_extend_their_caches_in_bfloat16(qwen3_model):
    # Episodes' next turns extend the kept turns' cache rows together (`jax_decode.extend`, several rows a
    # call): attention of the new tokens over the cached bfloat16 keys. XLA's CPU backend left that dot
    # unfused, and its runtime has no bfloat16 x bfloat16 -> float32 dot: the engine loop died, and with
    # it every request (`precision.float32_dot_operands`).
    # The main job's engine shape: 8 of its 16 slots, 224 positions (where the CPU backend left the dot alone).
    engine = JaxEngine(qwen3_model, compute_dtype="bfloat16", warmup=False, max_slots=8, max_len=224,
                       decode_chunk=8)
    try:
        chosen = prompts(1)[:8]
        turn = SamplingParams(max_tokens=6, temperature=0.0)
        firsts = engine.generate([Request(f"ep{i}", p, turn) for i, p in enumerate(chosen)])
        assert all(c.error is None and len(c.sample.tokens) == 6 for c in firsts)
        answer = [7, 8, 9, 10, 11]  # the environment's tokens
        nexts = engine.generate([Request(f"ep{i}", p + c.sample.tokens + answer, turn)
                                 for i, (p, c) in enumerate(zip(chosen, firsts))])
        assert all(c.error is None and len(c.sample.tokens) == 6 for c in nexts), nexts
        assert engine.failure() is None
    finally:
        engine.close()
