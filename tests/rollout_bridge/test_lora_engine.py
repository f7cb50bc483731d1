"""A JAX engine serving LoRA adapters: a weight sync moves the adapters alone (on device from a trainer's
adapter state, or PEFT-named host tensors), the base stays; what it then serves is exactly what an engine
started from the adapted model serves (tokens and log-probs); bad adapters are refused with nothing changed."""

import jax
import numpy as np
import pytest
from engine_helpers import lively_tiny_model, prompts, run
from flax import nnx

from jaxflow import sharding
from jaxflow.data.device_params import DeviceParamSource, reshard
from jaxflow.models import lora
from jaxflow.models.hf_io import load_model
from jaxflow.models.lora import LoRASpec
from rollout_bridge.engine import WeightsRejected
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end

ENGINE_KW = dict(max_slots=4, max_len=128, decode_chunk=8, prefill_buckets=(16, 32, 64))
SPEC = LoRASpec(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("lora-engine"), "Qwen3ForCausalLM")


def trained(base_dir, seed):
    """A LoRA model whose adapters moved (B no longer zero), as a trainer's would after some steps."""
    model = load_model(base_dir, lora=SPEC)
    key = jax.random.key(seed)
    for t in SPEC.targets:
        for w in "ab":
            var = getattr(model.layers, f"{t}_lora_{w}")
            key, sub = jax.random.split(key)
            var[...] = 0.3 * jax.random.normal(sub, var[...].shape)
    return model


def served(engine):
    """(tokens, log-probs) of the engine's greedy answers to `prompts()`, once its background compiles are
    done: until then a call may run in a larger bucket than the next one, whose sums differ in the last bits."""
    assert engine.warmed(timeout=300)
    return [(c.sample.tokens, c.sample.logprobs) for c in run(engine, prompts(), tag=f"v{engine.version}")]


def test_adapter_only_syncs_serve_what_the_adapted_model_serves(base_dir):
    target = trained(base_dir, seed=1)
    reference = JaxEngine(target, **ENGINE_KW)
    device = JaxEngine(load_model(base_dir, lora=SPEC), **ENGINE_KW)
    host = JaxEngine(load_model(base_dir, lora=SPEC), **ENGINE_KW)
    try:
        want = served(reference)
        before = served(device)
        assert [t for t, _ in before] != [t for t, _ in want]  # the adapters change what is generated
        # On device: the trainer's adapter state (its TrainState.params under LoRA), from another mesh.
        adapters = nnx.state(target, nnx.LoRAParam)
        trainer_mesh = sharding.make_mesh(fsdp=8)
        source = DeviceParamSource()
        source.add_target(device.param_shardings)
        source.publish(1, reshard(adapters, sharding.state_shardings(adapters, trainer_mesh), copy=True))
        version, weights = source.pull()
        assert len(jax.tree.leaves(weights.params)) == 2 * len(SPEC.targets)  # adapters only
        device.update_weights(version, weights)
        # Through the host: PEFT-named tensors, as a parameter service carries an adapter version.
        tensors = lora.peft_tensors(target.layers)
        full = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target, nnx.Param)))
        assert sum(x.nbytes for x in tensors.values()) < full / 10
        host.update_weights(1, tensors)
        for engine in (device, host):
            got = served(engine)
            assert [t for t, _ in got] == [t for t, _ in want]
            for (_, a), (_, b) in zip(got, want):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            assert engine.version == 1
    finally:
        for e in (reference, device, host):
            e.close()


@pytest.mark.parametrize("wrong, match", [
    (LoRASpec(rank=4, alpha=4.0, targets=SPEC.targets), r"shape \(4, "),
    (LoRASpec(rank=2, alpha=4.0, targets=("q_proj",)), "missing"),
    (None, "not this model's adapters"),
])
def test_adapters_of_another_rank_target_or_a_full_model_are_refused(base_dir, wrong, match):
    engine = JaxEngine(trained(base_dir, seed=2), **ENGINE_KW)
    try:
        before = served(engine)
        if wrong is None:  # full HF weights: this engine takes adapters only
            from jaxflow.models.hf_io import iter_hf_tensors
            tensors = dict(iter_hf_tensors(load_model(base_dir)))
        else:
            other = load_model(base_dir, lora=wrong)
            tensors = lora.peft_tensors(other.layers)
        with pytest.raises(WeightsRejected, match=match):
            engine.update_weights(1, tensors)
        assert engine.version == 0
        # Still serving the version it had: the same tokens, the same log-probs but for float32 rounding (a
        # request's KV slot, free slots being taken in another order, can change its row's summation path).
        after = served(engine)
        assert [t for t, _ in after] == [t for t, _ in before]
        for (_, a), (_, b) in zip(after, before):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    finally:
        engine.close()
