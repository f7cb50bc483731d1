"""`rollout_bridge.factory`: the engine named by a string, both engines' limits by the same names, and the
episodes wrapper that is the identity without an environment. No engine is started here."""

import inspect

import pytest

from rollout_bridge.factory import make_engine, runs_episodes, with_episodes
from rollout_bridge.jax_engine import JaxEngine
from rollout_bridge.vllm_engine import VllmEngine


def test_make_engine_names_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown engine 'sglang'; valid: jax, vllm"):
        make_engine("sglang", "/nonexistent", 64, 4)


@pytest.mark.parametrize("engine", [JaxEngine, VllmEngine])
def test_both_engines_take_the_limits_by_the_same_names(engine):
    # What make_engine passes them: max_len (prompt + completion tokens) and max_slots (sequences at once).
    params = inspect.signature(engine.__init__).parameters
    assert {"max_len", "max_slots"} <= params.keys()
    assert not {"max_model_len", "max_num_seqs"} & params.keys()


@pytest.mark.parametrize("vllm_name, name", [("max_model_len", "max_len"), ("max_num_seqs", "max_slots")])
def test_vllm_engine_refuses_vllms_names_for_the_limits(vllm_name, name):
    # They would reach vLLM through engine_kwargs and bypass the engine's own limits.
    with pytest.raises(TypeError, match=f"VllmEngine takes {name}, not {vllm_name}"):
        VllmEngine("/nonexistent", **{vllm_name: 64})


@pytest.mark.parametrize("env", [None, {"ref": None}])
def test_no_environment_leaves_the_engine_as_it_is(env):
    engine = object()
    assert not runs_episodes(env)
    assert with_episodes(env, tokenizer=None)(engine) is engine


def test_a_dtype_no_engine_takes_is_named_before_an_engine_starts():
    from jaxflow.models.precision import DtypeError

    for kind in ("jax", "vllm"):
        with pytest.raises(DtypeError, match="model.compute_dtype"):
            make_engine(kind, "/nonexistent", 64, 4, dtype="float16")
