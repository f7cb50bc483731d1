"""Fixtures of the rollout engine tests: a tiny Qwen3 model with lively weights, built once per module."""

import pytest
from engine_helpers import lively_tiny_model

from jaxflow.models.hf_io import load_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("qwen3"), "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def qwen3_model(qwen3_dir):
    return load_model(qwen3_dir)
