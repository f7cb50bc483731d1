"""The vLLM engine serving LoRA versions through vLLM's public LoRA interface (real vLLM on CPU, no mocks):
each version is its adapters alone, written in PEFT's format and added as a new adapter; new requests run on
the newest, requests in flight finish on theirs; tokens and log-probs against jaxflow's forward with the same
adapters (fp32, within 1e-4) and away from the base's; bad adapters refused with the engine still serving.

Skipped when vLLM is not importable, except under CI, where vLLM must run.
"""


import numpy as np
import pytest
from engine_helpers import require_vllm

require_vllm("the vLLM LoRA engine tests")

from engine_helpers import GREEDY, adapted, lively_tiny_model, prompts, run, teacher_forced  # noqa: E402
from waiting import wait_until  # noqa: E402

from jaxflow.models import hf_io, lora  # noqa: E402
from jaxflow.models.lora import LoRASpec  # noqa: E402
from rollout_bridge.engine import Request, SamplingParams, WeightsRejected  # noqa: E402
from rollout_bridge.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes

SPEC = LoRASpec(rank=8, alpha=16.0)
ATOL = 1e-4  # fp32 on both sides: vLLM's CPU kernels and XLA's differ only in summation order
ASKED = prompts(seed=3, lens=(3, 9, 20))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("base"), head_dim=32)


@pytest.fixture(scope="module")
def engine(base_dir):
    eng = VllmEngine(base_dir, max_len=128, max_slots=8, kv_cache_gib=0.5, enforce_eager=True, lora=SPEC)
    yield eng
    eng.close()


def check_served(completions, model, version):
    for prompt, c in zip(ASKED, completions, strict=True):
        logp, argmax = teacher_forced(model, prompt, c.sample.tokens, pad_to=64)
        assert c.sample.tokens == argmax.tolist()  # greedy under this version's adapters
        np.testing.assert_allclose(c.sample.logprobs, logp, atol=ATOL, rtol=0)
        assert c.sample.versions == [version] * len(c.sample.tokens)


def test_versions_are_adapters_and_bad_adapters_are_refused(engine, base_dir):
    base = hf_io.load_model(base_dir)
    check_served(run(engine, ASKED, GREEDY, tag="base"), base, 0)  # no adapter yet: the base
    models = {v: adapted(base_dir, SPEC, v) for v in (1, 2)}
    tokens = {}
    for v, model in models.items():
        engine.update_weights(v, lora.peft_tensors(model.layers))
        assert engine.version == v
        served = run(engine, ASKED, GREEDY, tag=f"v{v}")
        check_served(served, model, v)
        for prompt, c in zip(ASKED, served):  # ...and not the base alone: the adapters were applied
            base_logp, _ = teacher_forced(base, prompt, c.sample.tokens, pad_to=64)
            assert np.abs(np.asarray(base_logp) - c.sample.logprobs).max() > 10 * ATOL
        tokens[v] = [c.sample.tokens for c in served]
    assert tokens[1] != tokens[2]  # the second version's adapter, not the first's

    good = lora.peft_tensors(models[2].layers)
    name = next(iter(good))
    bad = {
        "rank": lora.peft_tensors(hf_io.load_model(base_dir, lora=LoRASpec(rank=4, alpha=16.0)).layers),
        "target": {k: v for k, v in good.items() if "down_proj" not in k},
        "dtype": {**good, name: good[name].astype(np.float16)},
        "full weights": dict(hf_io.iter_hf_tensors(base)),
    }
    for what, tensors in bad.items():
        with pytest.raises(WeightsRejected, match="adapters of version 3"):
            engine.update_weights(3, tensors)
            pytest.fail(f"the {what} adapters were taken")
    assert engine.version == 2
    check_served(run(engine, ASKED, GREEDY, tag="after"), models[2], 2)  # still serving version 2


def test_requests_in_flight_finish_on_their_adapter(engine, base_dir):
    models = {v: adapted(base_dir, SPEC, v) for v in (4, 5)}
    engine.update_weights(4, lora.peft_tensors(models[4].layers))
    long = SamplingParams(max_tokens=100, temperature=0.0)
    engine.submit(Request("long", ASKED[0], long))
    wait_until(lambda: engine.progress(["long"])[0].sample.tokens, 60, "the long request mid-generation",
               interval=0.002)
    engine.pause("keep")  # holds it mid-generation while the next version's adapter arrives
    assert 0 < len(engine.progress(["long"])[0].sample.tokens) < 100
    engine.update_weights(5, lora.peft_tensors(models[5].layers))
    engine.resume()
    fresh = run(engine, [ASKED[0]], GREEDY, tag="fresh")[0]
    c = wait_until(engine.poll, 120, "the long request's completion", interval=0)[0]
    assert c.request_id == "long" and c.sample.versions == [4] * len(c.sample.tokens)
    logp, argmax = teacher_forced(models[4], ASKED[0], c.sample.tokens, pad_to=128)
    assert c.sample.tokens == argmax.tolist()
    np.testing.assert_allclose(c.sample.logprobs, logp, atol=ATOL, rtol=0)
    assert fresh.sample.versions == [5] * len(fresh.sample.tokens)
    logp, _ = teacher_forced(models[5], ASKED[0], fresh.sample.tokens, pad_to=64)
    np.testing.assert_allclose(fresh.sample.logprobs, logp, atol=ATOL, rtol=0)
