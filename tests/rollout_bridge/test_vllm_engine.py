"""The vLLM engine (real vLLM, no mocks) against jaxflow's own teacher-forced forward: log-probs of
on-disk and pushed weights, in-flight weight updates with exact token versions, abort/resume, bad input.

One engine serves the whole module (a vLLM start costs ~50 s of process imports on CPU). Tests that push
other weights put the on-disk weights back before they end, so every test starts from version-0 behaviour.
The engine core's death mid-generation is checked on the LoRA module's engine, at its end
(tests/rollout_bridge/test_vllm_engine_lora.py), not on an engine of its own.
Skipped when vLLM is not importable, except under CI, where vLLM must run.
"""

import os
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
from engine_helpers import require_vllm  # noqa: E402

require_vllm("the vLLM engine tests")

import engine_helpers  # noqa: E402
import psutil  # noqa: E402  (a vLLM dependency)
from engine_helpers import GREEDY, lively_tiny_model, perturbed, poll_all, prompts, run  # noqa: E402
from waiting import wait_until  # noqa: E402

from jaxflow.models.hf_io import iter_hf_tensors, load_model  # noqa: E402
from rollout_bridge.engine import Request, SamplingParams  # noqa: E402
from rollout_bridge.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes

MAX_LEN = 256
# fp32 on both sides: vLLM's CPU kernels and XLA's differ only in summation order.
ATOL = 1e-4


def teacher_forced(model, prompt, completion):
    """engine_helpers.teacher_forced at one padded length (every sequence here fits in MAX_LEN): one
    compiled forward for the module instead of one per prompt + completion length."""
    return engine_helpers.teacher_forced(model, prompt, completion, pad_to=MAX_LEN)


def wait_running(engine, n, timeout=60.0):
    """Waits until `n` requests have produced tokens (they are mid-generation)."""
    wait_until(lambda: engine.load().running >= n, timeout, lambda: f"{n} running requests; {engine.load()}",
               interval=0.002)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("qwen3"), head_dim=32)


@pytest.fixture(scope="module")
def base_model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def base_tensors(base_model):
    return dict(iter_hf_tensors(base_model))


@pytest.fixture(scope="module")
def engine(model_dir):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # 0.25 GiB holds 262,144 tokens of this model's KV (vLLM's log), 32x what 32 slots of MAX_LEN can use: more
    # only costs memory on a shared machine and its allocation at start.
    eng = VllmEngine(model_dir, max_len=MAX_LEN, max_slots=32, kv_cache_gib=0.25,
                     enforce_eager=True)
    # vLLM's engine core and worker run in child processes. multiprocessing's resource tracker, started
    # with the first spawned child, serves this process until it exits: not vLLM's to stop.
    spawned = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(spawned) >= 2, [p.cmdline() for p in spawned]
    # Eager on CPU: the worker's sampler is eager too (no inductor build at the first request).
    assert eng._call(eng._llm.collective_rpc("jaxflow_eager_sampler")) == [True]
    yield eng
    llm = weakref.ref(eng._llm)
    eng.close()
    # close() frees vLLM's AsyncLLM: left for interpreter exit, its __del__ prints a TypeError traceback.
    assert llm() is None
    # close() leaves no orphan: the engine core and worker processes are gone.
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, [p.name() for p in alive]


@pytest.fixture
def restore(engine, base_tensors):
    """Puts the on-disk weights back (as a fresh version) after a test that pushes others."""
    yield
    engine.update_weights(engine.version + 1, base_tensors)


@pytest.fixture(scope="module")
def greedy_reference(engine, base_model):
    """The engine's greedy completions of `prompts()` under the on-disk weights."""
    out = [c.sample.tokens for c in run(engine, prompts(), tag="ref")]
    assert all(len(set(tokens)) > 5 for tokens in out)  # not a degenerate repeat
    return out


def test_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None; import jaxflow, rollout_bridge.engine, "
            "rollout_bridge.vllm_engine, jaxflow.coordination")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_on_disk_weights_match_teacher_forced_forward(engine, base_model, greedy_reference):
    version = engine.version
    for p, c in zip(prompts(), run(engine, prompts())):
        s = c.sample
        ref_lp, ref_argmax = teacher_forced(base_model, p, s.tokens)
        assert s.tokens == ref_argmax.tolist() and len(s.tokens) == 24
        np.testing.assert_allclose(s.logprobs, ref_lp, atol=ATOL, rtol=0)
        assert s.versions == [version] * 24 and s.finish_reason == "length" and c.error is None


def test_pushed_jaxflow_weights_match_teacher_forced_forward(engine, base_model, greedy_reference,
                                                             restore):
    new_model, new_tensors = perturbed(base_model, seed=0, scale=0.1)
    version = engine.version + 1
    engine.update_weights(version, new_tensors)
    assert engine.version == version and engine.load().version == version
    out = run(engine, prompts(), tag="pushed")
    for p, c in zip(prompts(), out):
        s = c.sample
        ref_lp, ref_argmax = teacher_forced(new_model, p, s.tokens)
        assert s.tokens == ref_argmax.tolist()
        np.testing.assert_allclose(s.logprobs, ref_lp, atol=ATOL, rtol=0)
        assert s.versions == [version] * len(s.tokens)
    # The push took effect: the new weights' greedy output is not the old one.
    assert [c.sample.tokens for c in out] != greedy_reference


def test_sampled_logprobs_are_the_raw_distribution(engine, base_model, greedy_reference):
    ps = prompts()[:4]
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=20, top_p=0.9, seed=11)
    out = run(engine, ps, params, tag="s")
    for p, c in zip(ps, out):
        ref_lp, _ = teacher_forced(base_model, p, c.sample.tokens)  # temperature 1, no filters
        np.testing.assert_allclose(c.sample.logprobs, ref_lp, atol=ATOL, rtol=0)
    assert [c.sample.tokens for c in out] != greedy_reference[:4]
    assert [c.sample.tokens for c in run(engine, ps, params, tag="t")] == [c.sample.tokens for c in out]
    assert run(engine, ps[:1], SamplingParams(max_tokens=24, temperature=1.0, top_k=1, seed=5),
               tag="k")[0].sample.tokens == greedy_reference[0]


def test_weight_update_mid_generation(engine, base_model, restore, capsys, caplog):
    new_model, new_tensors = perturbed(base_model, seed=1)
    old_version, new_version = engine.version, engine.version + 1
    n = 200
    reqs = [Request(f"w{i}", p, SamplingParams(max_tokens=n, temperature=0.0))
            for i, p in enumerate(prompts(2, lens=(5, 20, 9)))]
    for r in reqs:
        engine.submit(r)
    wait_running(engine, len(reqs))
    engine.update_weights(new_version, new_tensors)
    latency = engine.last_update_s
    done = poll_all(engine, len(reqs))
    with capsys.disabled():
        print(f"\nupdate_weights with {len(reqs)} requests in flight: {latency * 1e3:.1f} ms")
    for r in reqs:
        s = done[r.request_id].sample
        assert len(s.tokens) == n and s.finish_reason == "length"
        # Contiguous: the old version, then the new one, both present.
        swap = s.versions.index(new_version)
        assert 0 < swap < n and s.versions == [old_version] * swap + [new_version] * (n - swap)
        old_lp, old_argmax = teacher_forced(base_model, r.prompt, s.tokens)
        new_lp, new_argmax = teacher_forced(new_model, r.prompt, s.tokens)
        # Each token's log-prob is its own version's forward of the full sequence: the boundary is
        # exact, and the KV of the pre-update tokens was recomputed under the new weights.
        np.testing.assert_allclose(s.logprobs[:swap], old_lp[:swap], atol=ATOL, rtol=0)
        np.testing.assert_allclose(s.logprobs[swap:], new_lp[swap:], atol=ATOL, rtol=0)
        assert s.tokens[:swap] == old_argmax[:swap].tolist()
        assert s.tokens[swap:] == new_argmax[swap:].tolist()
        # The two versions disagree enough for the check above to locate the boundary.
        assert np.abs(old_lp[swap:] - new_lp[swap:]).max() > 100 * ATOL
    assert "labelled no weight versions" not in caplog.text  # versions came from vLLM's own labels


def test_weight_update_keeping_kv(engine, base_model, base_tensors, restore):
    """keep_kv (PipelineRL's in-flight update): the KV in flight is kept, not recomputed. Swapped to the
    weights it already serves, the run is the uninterrupted one; swapped to others, the tokens after the
    swap attend to keys and values the old weights computed, so their log-probs are not a recompute's."""
    new_model, new_tensors = perturbed(base_model, seed=3)
    n = 200
    for model, tensors in ((base_model, base_tensors), (new_model, new_tensors)):
        old_version, new_version = engine.version, engine.version + 1
        reqs = [Request(f"kv{new_version}-{i}", p, SamplingParams(max_tokens=n, temperature=0.0))
                for i, p in enumerate(prompts(2, lens=(5, 20, 9)))]
        for r in reqs:
            engine.submit(r)
        wait_running(engine, len(reqs))
        engine.update_weights(new_version, tensors, keep_kv=True)
        done = poll_all(engine, len(reqs))
        for r in reqs:
            s = done[r.request_id].sample
            swap = s.versions.index(new_version)
            assert 0 < swap < n and s.versions == [old_version] * swap + [new_version] * (n - swap)
            old_lp, old_argmax = teacher_forced(base_model, r.prompt, s.tokens)
            np.testing.assert_allclose(s.logprobs[:swap], old_lp[:swap], atol=ATOL, rtol=0)
            if model is base_model:
                assert s.tokens == old_argmax.tolist()
                np.testing.assert_allclose(s.logprobs, old_lp, atol=ATOL, rtol=0)
            else:
                new_lp, _ = teacher_forced(new_model, r.prompt, s.tokens)
                assert np.abs(np.asarray(s.logprobs[swap:]) - new_lp[swap:]).max() > 100 * ATOL


def test_abort_and_resume_equals_uninterrupted(engine, caplog):
    n = 200
    params = SamplingParams(max_tokens=n, temperature=0.0)
    ps = prompts(3, lens=(4, 17, 8))
    reference = run(engine, ps, params, tag="u")
    for i, p in enumerate(ps):
        engine.submit(Request(f"a{i}", p, params))
    wait_running(engine, len(ps))
    aborted = {c.request_id: c.sample for c in engine.abort(["a0", "a2", "unknown"])}
    assert set(aborted) == {"a0", "a2"}
    assert engine.abort(["a0"]) == []  # already handed back
    rest = poll_all(engine, 1)
    assert rest["a1"].sample.tokens == reference[1].sample.tokens
    assert engine.poll(timeout=0.5) == []  # aborted requests come back from abort() only
    for rid in ("a0", "a2"):
        s = aborted[rid]
        assert s.finish_reason == "abort" and 0 < len(s.tokens) < n, len(s.tokens)
        assert len(s.logprobs) == len(s.versions) == len(s.tokens)
    resumed = engine.generate([Request("a0", ps[0], params, prefix=aborted["a0"]),
                               Request("a2", ps[2], params, prefix=aborted["a2"])])
    for c, i in zip(resumed, (0, 2)):
        prefix, ref = aborted[c.request_id], reference[i].sample
        assert c.sample.tokens == ref.tokens and c.sample.finish_reason == "length"
        assert c.sample.logprobs[:len(prefix.tokens)] == prefix.logprobs
        assert c.sample.versions == [engine.version] * n
        np.testing.assert_allclose(c.sample.logprobs, ref.logprobs, atol=ATOL, rtol=0)
    assert "labelled no weight versions" not in caplog.text


def test_progress_reads_tokens_so_far_without_stopping_and_resumes_into_the_same_run(engine, caplog):
    n = 200
    params = SamplingParams(max_tokens=n, temperature=0.0)
    ps = prompts(3, lens=(4, 17))
    reference = run(engine, ps, params, tag="u")
    for i, p in enumerate(ps):
        engine.submit(Request(f"p{i}", p, params))
    wait_running(engine, len(ps))
    got = {c.request_id: c.sample for c in engine.progress(["p0", "p1", "unknown"])}
    assert set(got) == {"p0", "p1"}
    for i, rid in enumerate(("p0", "p1")):
        s = got[rid]
        assert s.finish_reason is None and 0 < len(s.tokens) < n, len(s.tokens)
        assert len(s.logprobs) == len(s.tokens) and s.versions == [engine.version] * len(s.tokens)
        assert s.tokens == reference[i].sample.tokens[:len(s.tokens)]
    done = poll_all(engine, 2)  # nothing was stopped
    assert [done[f"p{i}"].sample.tokens for i in range(2)] == [r.sample.tokens for r in reference]
    assert engine.progress(["p0"]) == []
    (resumed,) = engine.generate([Request("r0", ps[0], params, prefix=got["p0"])])
    assert resumed.sample.tokens == reference[0].sample.tokens
    assert resumed.sample.logprobs[:len(got["p0"].tokens)] == got["p0"].logprobs
    assert "labelled no weight versions" not in caplog.text


def _token_counts(engine):
    with engine._lock:
        return {rid: len(live.sample.tokens) for rid, live in engine._live.items()}


def test_pause_keep_then_update_weights_then_resume(engine, base_model, restore, caplog):
    """PipelineRL's update done by hand: pause with requests kept, swap weights, resume. Nothing is
    generated while paused (a request submitted meanwhile waits), the update leaves the engine paused,
    and every token carries the version that produced it."""
    new_model, new_tensors = perturbed(base_model, seed=2)
    old_version, new_version = engine.version, engine.version + 1
    n = 200
    params = SamplingParams(max_tokens=n, temperature=0.0)
    ps = prompts(4, lens=(6, 15))
    for i, p in enumerate(ps):
        engine.submit(Request(f"k{i}", p, params))
    wait_running(engine, len(ps))
    assert engine.pause("keep") == [] and engine.paused
    engine.submit(Request("late", prompts()[1], GREEDY))
    time.sleep(0.3)  # outputs already on their way arrive
    before = _token_counts(engine)
    assert all(0 < before[f"k{i}"] < n for i in range(len(ps))), before
    time.sleep(0.5)
    assert _token_counts(engine) == before and engine.poll(timeout=0.1) == []
    engine.update_weights(new_version, new_tensors)
    time.sleep(0.5)
    assert engine.paused and _token_counts(engine) == before
    engine.resume()
    assert not engine.paused
    done = poll_all(engine, len(ps) + 1)
    for i, p in enumerate(ps):
        s, swap = done[f"k{i}"].sample, before[f"k{i}"]
        assert s.versions == [old_version] * swap + [new_version] * (n - swap)
        _, old_argmax = teacher_forced(base_model, p, s.tokens)
        new_lp, new_argmax = teacher_forced(new_model, p, s.tokens)
        assert s.tokens[:swap] == old_argmax[:swap].tolist() and s.tokens[swap:] == new_argmax[swap:].tolist()
        np.testing.assert_allclose(s.logprobs[swap:], new_lp[swap:], atol=ATOL, rtol=0)
    assert done["late"].sample.versions == [new_version] * GREEDY.max_tokens
    assert "labelled no weight versions" not in caplog.text


def test_pause_abort_hands_back_everything_and_resume_continues(engine, caplog):
    """AReaL's update: pause aborting everything in flight, resubmit from the prefixes while paused,
    resume: the same tokens as an uninterrupted run."""
    n = 200
    params = SamplingParams(max_tokens=n, temperature=0.0)
    ps = prompts(5, lens=(3, 12, 7))
    reference = run(engine, ps, params, tag="pu")
    for i, p in enumerate(ps):
        engine.submit(Request(f"pa{i}", p, params))
    wait_running(engine, len(ps))
    partial = {c.request_id: c.sample for c in engine.pause("abort")}
    assert set(partial) == {f"pa{i}" for i in range(len(ps))} and engine.paused
    for s in partial.values():
        assert s.finish_reason == "abort" and 0 < len(s.tokens) < n
        assert len(s.logprobs) == len(s.versions) == len(s.tokens)
    for i, p in enumerate(ps):
        engine.submit(Request(f"pa{i}", p, params, prefix=partial[f"pa{i}"]))
    time.sleep(0.5)
    assert engine.poll(timeout=0.1) == [] and engine.load().running == 0
    engine.resume()
    done = poll_all(engine, len(ps))
    for i in range(len(ps)):
        assert done[f"pa{i}"].sample.tokens == reference[i].sample.tokens
    with pytest.raises(ValueError, match="'wait'.*keep.*abort"):
        engine.pause("wait")
    assert not engine.paused
    assert "labelled no weight versions" not in caplog.text


def test_stop_tokens_and_max_tokens_count_the_prefix(engine, greedy_reference):
    engine_helpers.check_stop_tokens_and_max_tokens(engine, greedy_reference)


def test_bad_weights_are_rejected_and_nothing_changes(engine, base_tensors, greedy_reference):
    engine_helpers.check_bad_weights_are_rejected(engine, base_tensors, greedy_reference)


def test_too_long_prompt_is_a_per_request_error(engine, greedy_reference):
    reqs = [Request("long", list(range(3, 3 + MAX_LEN)), GREEDY)]
    reqs += [Request(f"ok{i}", p, GREEDY) for i, p in enumerate(prompts())]
    reqs += [Request("bad", [3, 10_000], GREEDY)]
    out = engine.generate(reqs)
    assert out[0].sample.finish_reason == "error" and out[0].sample.tokens == []
    assert f"{MAX_LEN} tokens" in out[0].error and str(MAX_LEN - 1) in out[0].error
    assert [c.sample.tokens for c in out[1:-1]] == greedy_reference
    assert out[-1].sample.finish_reason == "error" and "vocab" in out[-1].error
    # A prompt that just fits generates one token.
    c = engine.generate([Request("fits", list(range(3, 2 + MAX_LEN)), GREEDY)])[0]
    assert len(c.sample.tokens) == 1 and c.sample.finish_reason == "length"


def test_a_judge_generates_its_verdicts_on_vllm(engine, model_dir):
    """`rollout_bridge.judge.Judge` over vLLM, through the same Engine interface as over the JAX engine."""
    from jaxflow.tokenizer import Tokenizer

    engine_helpers.check_judge(engine, Tokenizer.from_dir(model_dir))


def test_load_and_throughput(engine, base_tensors, capsys):
    """Greedy decode rate with 32 concurrent requests, and update_weights latency (printed)."""
    n, max_tokens = 32, 200
    reqs = [Request(f"t{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
            for i, p in enumerate(prompts(5, lens=(16,) * n))]
    start = time.perf_counter()
    for r in reqs:
        engine.submit(r)
    wait_running(engine, n)
    busy = engine.load()
    done = poll_all(engine, n)
    wall = time.perf_counter() - start
    assert busy.running == n and busy.waiting == 0 and 0 < busy.kv_used <= 1
    assert all(len(c.sample.tokens) == max_tokens for c in done.values())
    idle = engine.load()  # its 5 s window still covers the run
    assert idle.running == idle.waiting == 0 and idle.kv_used == 0.0 and idle.tokens_per_s > 0
    latencies = []
    for _ in range(3):
        engine.update_weights(engine.version + 1, base_tensors)
        latencies.append(engine.last_update_s)
    with capsys.disabled():
        print(f"\nvLLM greedy decode, tiny Qwen3 (hidden 64, head_dim 32, fp32, eager), {n} concurrent "
              f"requests x {max_tokens} tokens: {n * max_tokens / wall:.0f} tokens/s end to end "
              f"({wall:.2f} s; load() reports {idle.tokens_per_s:.0f} tokens/s); update_weights (idle): "
              f"{1e3 * np.median(latencies):.1f} ms median of 3")

