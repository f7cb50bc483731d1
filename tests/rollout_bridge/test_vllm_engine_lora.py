"""The vLLM engine serving LoRA versions through vLLM's public LoRA interface (real vLLM on CPU, no mocks):
each version is its adapters alone, written in PEFT's format and added as a new adapter; new requests run on
the newest, requests in flight finish on theirs; tokens and log-probs against jaxflow's forward with the same
adapters (fp32, within 1e-4) and away from the base's; bad adapters refused with the engine still serving.
Then its engine core dies mid-generation: the failure surfaces as EngineError and nothing is left behind.

One engine serves the module's one test (a vLLM start costs ~50 s of process imports on CPU); its checks run
in order, the engine's death last, and the engine is not used after it.
Skipped when vLLM is not importable, except under CI, where vLLM must run.
"""


import numpy as np
import pytest
from engine_helpers import require_vllm

require_vllm("the vLLM LoRA engine tests")

import psutil  # noqa: E402  (a vLLM dependency)
from engine_helpers import GREEDY, adapted, lively_tiny_model, prompts, run, teacher_forced  # noqa: E402
from waiting import wait_until  # noqa: E402

from jaxflow.models import hf_io, lora  # noqa: E402
from jaxflow.models.lora import LoRASpec  # noqa: E402
from rollout_bridge.engine import EngineError, Request, SamplingParams, WeightsRejected  # noqa: E402
from rollout_bridge.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes

SPEC = LoRASpec(rank=8, alpha=16.0)
ATOL = 1e-4  # fp32 on both sides: vLLM's CPU kernels and XLA's differ only in summation order
ASKED = prompts(seed=3, lens=(3, 9, 20))
MAX_LEN = 256  # room for the long request that is mid-generation when the engine core is killed


@pytest.fixture
def base_dir(tmp_path):
    return lively_tiny_model(tmp_path / "base", head_dim=32)


@pytest.fixture
def engine(base_dir):
    """(a LoRA vLLM engine, its engine-core and worker processes). The test kills the engine: closed here
    whatever happened, and no process of it outlives the close."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    eng = VllmEngine(base_dir, max_len=MAX_LEN, max_slots=8, kv_cache_gib=0.5, enforce_eager=True, lora=SPEC)
    # multiprocessing's resource tracker, started with the first spawned child, is not vLLM's.
    spawned = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    try:
        yield eng, spawned
    finally:
        eng.close()
    _, alive = psutil.wait_procs(spawned, timeout=30)  # the worker does not outlive its engine core
    assert not alive, [p.cmdline() for p in alive]


def check_served(completions, model, version):
    for prompt, c in zip(ASKED, completions, strict=True):
        logp, argmax = teacher_forced(model, prompt, c.sample.tokens, pad_to=64)
        assert c.sample.tokens == argmax.tolist()  # greedy under this version's adapters
        np.testing.assert_allclose(c.sample.logprobs, logp, atol=ATOL, rtol=0)
        assert c.sample.versions == [version] * len(c.sample.tokens)


def check_versions_are_adapters_and_bad_adapters_are_refused(engine, base_dir):
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


def check_requests_in_flight_finish_on_their_adapter(engine, base_dir):
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


def check_engine_death_surfaces_as_engine_error(engine, spawned):
    """vLLM's engine core dies mid-generation: poll and submit raise EngineError, and abort still hands back
    the partial sample (the fixture then checks that close() leaves no process behind)."""
    n = MAX_LEN - 8
    engine.submit(Request("x", [5, 6, 7], SamplingParams(max_tokens=n, temperature=0.0)))
    wait_until(lambda: engine.load().running >= 1, 60, lambda: f"a running request; {engine.load()}",
               interval=0.002)
    (core,) = [p for p in spawned if "EngineCore" in " ".join(p.cmdline())]
    core.kill()
    with pytest.raises(EngineError):
        engine.poll(timeout=60)
    with pytest.raises(EngineError):
        engine.submit(Request("y", [5], GREEDY))
    (partial,) = engine.abort(["x"])
    s = partial.sample
    assert partial.request_id == "x" and s.finish_reason == "abort"
    assert 0 < len(s.tokens) < n and len(s.logprobs) == len(s.versions) == len(s.tokens)


def test_adapters_as_versions_requests_in_flight_and_engine_death(engine, base_dir):
    """The module's checks on one engine, in order: versions are adapters and bad adapters are refused;
    requests in flight finish on their adapter; the engine core's death (last: the engine is dead after)."""
    eng, spawned = engine
    check_versions_are_adapters_and_bad_adapters_are_refused(eng, base_dir)
    check_requests_in_flight_finish_on_their_adapter(eng, base_dir)
    check_engine_death_surfaces_as_engine_error(eng, spawned)
