"""`rollout.compute_dtype`: what the rollout engines (and the evaluator's engine) compute in, apart from what
the update computes in (`model.compute_dtype`, which it follows when unset). A bad value is refused at config
check, naming the key."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from small_runs import small_config

from jaxflow import sharding
from jaxflow.config import ConfigError, load_config
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.jobs import rl, train_loop
from jaxflow.jobs.config import RolloutConfig, compute_dtype, rollout_compute_dtype
from jaxflow.models.hf_io import load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer.rl_trainer import RLTrainer

CONFIG = "configs/arithmetic_tiny.py"


def _floating_dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("model, rollout, want", [
    ("float32", None, "float32"), ("bfloat16", None, "bfloat16"),
    ("float32", "bfloat16", "bfloat16"), ("bfloat16", "float32", "float32")])
def test_the_rollout_dtype_follows_the_model_unless_set(model, rollout, want):
    overrides = {"model.compute_dtype": model, **({"rollout.compute_dtype": rollout} if rollout else {})}
    config = load_config(CONFIG, overrides)
    rl.check_config(config)
    assert (compute_dtype(config), rollout_compute_dtype(config)) == (model, want)


def test_it_can_be_unset_from_the_command_line():
    config = load_config(CONFIG, {"rollout.compute_dtype": "bfloat16"})
    assert config.rollout.compute_dtype == "bfloat16"
    assert load_config(CONFIG, {"rollout.compute_dtype": "None"}).rollout.compute_dtype is None


@pytest.mark.parametrize("value", ["float16", "bf16", "int8"])
def test_a_bad_value_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"rollout\.compute_dtype") as e:
        rl.check_config(load_config(CONFIG, {"rollout.compute_dtype": value}))
    assert repr(value) in str(e.value)
    with pytest.raises(ConfigError, match=r"rollout\.compute_dtype"):
        RolloutConfig.from_config({"compute_dtype": value})


def test_a_float32_trainer_with_bfloat16_rollouts(tmp_path):
    """The RL job's engine computes in bfloat16 and keeps doing so across a weight sync from the trainer,
    whose weights and update stay float32."""
    base = write_tiny_model(tmp_path / "base")
    config = small_config(tmp_path, base, **{"model.compute_dtype": "float32", "rollout.compute_dtype": "bfloat16",
                                             "rollout.max_slots": 4, "rollout.max_len": 64, "rollout.max_tokens": 16})
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    weights = DeviceParamSource(keep=2)
    trainer = RLTrainer(load_model(base, mesh=mesh), config.trainer, mesh, seq_len=config.rollout.max_len,
                        max_sequences=8, device_weights=weights, compute_dtype=compute_dtype(config))
    engine = rl._make_engine(config, trainer, base)
    try:
        assert _floating_dtypes(engine._params) == {jnp.dtype(jnp.bfloat16)}
        assert trainer.step_config.compute_dtype == "float32"
        assert _floating_dtypes(trainer.state.params) == {jnp.dtype(jnp.float32)}
        weights.add_target(engine.param_shardings)
        weights.publish(1, nnx.state(trainer.model(), nnx.Param))  # float32, as the trainer publishes
        engine.update_weights(*weights.pull(1))
        assert engine.version == 1 and _floating_dtypes(engine._params) == {jnp.dtype(jnp.bfloat16)}
    finally:
        engine.close()


def test_the_evaluator_computes_in_the_rollout_dtype(monkeypatch, tmp_path):
    """Held-out evals run on a JAX engine of their own, in the rollout engines' dtype."""
    import rollout_bridge.jax_engine

    built = {}

    class Engine:
        def __init__(self, model, **kwargs):
            built.update(kwargs)

    class Trainer:
        version = 0

        def model(self):
            return None

    monkeypatch.setattr(rollout_bridge.jax_engine, "JaxEngine", Engine)
    monkeypatch.setattr(train_loop, "eval_records", lambda *args: [])
    config = small_config(tmp_path, tmp_path / "base", **{"model.compute_dtype": "float32",
                                                          "rollout.compute_dtype": "bfloat16"})
    train_loop.Evaluator(config, Trainer(), None, task=None, tokenizer=None, pool=None)
    assert built["compute_dtype"] == "bfloat16"
