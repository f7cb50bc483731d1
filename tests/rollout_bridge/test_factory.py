"""`rollout_bridge.factory`: the engine named by a string, and the episodes wrapper that is the identity
without an environment. No engine is started here."""

import pytest

from rollout_bridge.factory import make_engine, runs_episodes, with_episodes


def test_make_engine_names_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown engine 'sglang'; valid: jax, vllm"):
        make_engine("sglang", "/nonexistent", 64, 4)


@pytest.mark.parametrize("env", [None, {"ref": None}])
def test_no_environment_leaves_the_engine_as_it_is(env):
    engine = object()
    assert not runs_episodes(env)
    assert with_episodes(env, tokenizer=None)(engine) is engine
