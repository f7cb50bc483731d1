"""`rollout.weight_transport`: what `auto` resolves to for each engine kind and deployment, the values that
do not fit (WeightTransportMismatch, before anything starts), the config keys' checks, and the engines that
refuse a transport or a bucket before vLLM or JAX starts anything. No engine starts here (the NCCL path's
own tests: test_nccl_weights.py)."""

import ml_collections
import pytest

from jaxflow.config import ConfigError
from jaxflow.jobs import rl
from jaxflow.jobs.config import RolloutConfig
from jaxflow.models.lora import LoRASpec
from rollout_bridge.engine import WeightsRejected
from rollout_bridge.factory import make_engine
from rollout_bridge.weight_transport import (
    MAX_BUCKET_MB,
    WEIGHT_TRANSPORTS,
    WeightBucketTooLarge,
    WeightTransportMismatch,
    resolve_weight_transport,
)

# (engine, rollout_actors, trainer_processes) -> what auto is today, and what else fits.
DEPLOYMENTS = {
    ("jax", 0, 0): ("device", set()),
    ("vllm", 0, 0): ("param_service", {"nccl"}),
    ("jax", 2, 0): ("param_service", set()),
    ("vllm", 2, 0): ("param_service", set()),
    ("jax", 2, 2): ("object_store", set()),
    ("vllm", 2, 2): ("object_store", set()),
}


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_auto_is_todays_path_and_only_fitting_values_resolve(deployment):
    engine, actors, trainers = deployment
    auto, others = DEPLOYMENTS[deployment]
    resolve = lambda t: resolve_weight_transport(t, engine, rollout_actors=actors, trainer_processes=trainers)  # noqa: E731
    assert resolve("auto") == auto
    for transport in WEIGHT_TRANSPORTS[1:]:
        if transport == auto or transport in others:
            assert resolve(transport) == transport
        else:
            with pytest.raises(WeightTransportMismatch):
                resolve(transport)
    with pytest.raises(ValueError, match="weight_transport"):
        resolve("ncl")


def test_the_errors_are_weight_rejections():
    # Raised before anything is sent: the engine keeps serving the version it has (WeightsRejected's promise).
    assert issubclass(WeightTransportMismatch, WeightsRejected)
    assert issubclass(WeightBucketTooLarge, WeightsRejected)


def test_the_config_keys_are_checked():
    assert RolloutConfig().weight_transport == "auto"
    assert RolloutConfig.config_problems({"weight_transport": "nccl", "weight_bucket_mb": MAX_BUCKET_MB}) == []
    problems = RolloutConfig.config_problems({"weight_transport": "gloo", "weight_bucket_mb": MAX_BUCKET_MB + 1})
    assert any(p.startswith("rollout.weight_transport") for p in problems)
    assert any(p.startswith("rollout.weight_bucket_mb") for p in problems)


def _config(engine="vllm", transport="nccl", rollout_actors=0, lora=None):
    config = ml_collections.ConfigDict({
        "rollout": {"engine": engine, "weight_transport": transport},
        "cluster": {"rollout_actors": rollout_actors, "trainer_processes": 0},
        "trainer": {"lora": lora}})
    return config


def test_the_job_resolves_the_transport_for_its_engines_and_deployment():
    assert rl.weight_transport(_config()) == "nccl"
    assert rl.weight_transport(_config(engine="jax", transport="auto")) == "device"
    for config in (_config(engine="jax"), _config(rollout_actors=2),
                   _config(lora={"rank": 4, "alpha": 8.0, "targets": ["q_proj"]})):
        with pytest.raises(WeightTransportMismatch):
            rl.weight_transport(config)
    # Config files predating the key resolve as they always did.
    config = _config(transport="auto")
    del config.rollout["weight_transport"]
    assert rl.weight_transport(config) == "param_service"


def test_engines_refuse_a_transport_or_bucket_before_starting(tmp_path):
    with pytest.raises(WeightTransportMismatch):
        make_engine("jax", object(), 64, 4, weight_transport="nccl")  # refused before the model is looked at
    from rollout_bridge.vllm_engine import VllmEngine

    missing = tmp_path / "no-model"  # nothing is read: each refusal comes before the model directory
    with pytest.raises(WeightTransportMismatch):
        VllmEngine(missing, weight_transport="object_store")
    with pytest.raises(WeightTransportMismatch):
        VllmEngine(missing, weight_transport="nccl", lora=LoRASpec(4, 8.0, ("q_proj",)))
    with pytest.raises(WeightBucketTooLarge):
        VllmEngine(missing, weight_transport="nccl", weight_bucket_bytes=(MAX_BUCKET_MB + 1) << 20)


def test_a_mismatch_is_a_config_error_of_the_job(tmp_path):
    from jaxflow.config import load_config

    config = load_config("configs/arithmetic_tiny.py", {"rollout.weight_transport": "nccl"})  # the JAX engine
    with pytest.raises(ConfigError, match="rollout.weight_transport"):
        rl.check_config(config)


def test_a_vllm_engine_refuses_a_dtype_it_cannot_take_by_name(tmp_path):
    # The check every vLLM update runs before anything changes (both transports; nccl casts any float).
    import numpy as np

    from jaxflow.models.config import from_hf_config, read_hf_config
    from jaxflow.models.hf_io import iter_hf_tensors, load_model
    from jaxflow.models.tiny import write_tiny_model
    from rollout_bridge.vllm_weights import check_weights, expected_hf_tensors
    from rollout_bridge.weight_transport import WeightDtypeRefused

    directory = write_tiny_model(tmp_path / "m")
    cfg = from_hf_config(read_hf_config(directory))
    layer_names, expected = expected_hf_tensors(cfg)
    tensors = dict(iter_hf_tensors(load_model(directory)))
    half = {k: v.astype(np.float16) for k, v in tensors.items()}
    check_weights(cfg, layer_names, expected, half, np.dtype("float32"), cast=True, source="v1")
    with pytest.raises(WeightDtypeRefused):
        check_weights(cfg, layer_names, expected, half, np.dtype("float32"), cast=False, source="v1")
    ints = {**tensors, "model.norm.weight": tensors["model.norm.weight"].astype(np.int32)}
    with pytest.raises(WeightDtypeRefused):
        check_weights(cfg, layer_names, expected, ints, np.dtype("float32"), cast=True, source="v1")
