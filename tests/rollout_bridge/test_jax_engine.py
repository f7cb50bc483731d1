"""The JAX rollout engine against transformers' greedy generate and jaxflow's own teacher-forced forward:
continuous batching, log-probs, in-flight weight updates, abort/resume, sampling, bad input, sharding."""

import dataclasses
import threading
import time

import engine_helpers
import jax
import numpy as np
import pytest
import torch
import transformers
from engine_helpers import GREEDY, counting_lowerings, lively_tiny_model, perturbed, poll_all, prompts, run
from jax_engine_setup import ENGINE_KW, forward_logits, pause_after_decode, teacher_forced

from jaxflow import sharding
from jaxflow.models.hf_io import iter_hf_tensors
from rollout_bridge import jax_decode
from rollout_bridge.engine import EngineError, Request, SamplingParams
from rollout_bridge.jax_engine import JaxEngine, PrefillStats

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    eng = JaxEngine(qwen3_dir, **ENGINE_KW)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def greedy_reference(engine):
    """The module engine's greedy completions of `prompts()`: the baseline other tests compare with."""
    out = [c.sample.tokens for c in run(engine, prompts())]
    assert all(len(set(tokens)) > 5 for tokens in out)  # not a degenerate repeat
    return out


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_matches_transformers_generate(architecture, tmp_path, engine, qwen3_dir):
    if architecture == "Qwen3ForCausalLM":
        directory, eng = qwen3_dir, engine
    else:
        # Qwen2 untied covers the separate lm_head.
        directory = lively_tiny_model(tmp_path, architecture,
                                      tie_word_embeddings=architecture != "Qwen2ForCausalLM")
        eng = JaxEngine(directory, **ENGINE_KW)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    eos = hf.config.eos_token_id
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(eos,))
    try:
        out = run(eng, prompts(), params)  # 6 requests on 4 slots: refills mid-run
    finally:
        if eng is not engine:
            eng.close()
    for prompt, c in zip(prompts(), out):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
        if eos in ref:
            ref = ref[:ref.index(eos) + 1]
        assert c.sample.tokens == ref, (len(prompt), c.sample.tokens, ref)
        assert c.sample.finish_reason == ("stop" if ref[-1] == eos else "length")
        assert c.sample.versions == [0] * len(ref) and c.error is None


def test_logprobs_equal_teacher_forced_forward(engine, qwen3_model):
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    for p, c in zip(prompts(1), run(engine, prompts(1), params)):
        ref, _ = teacher_forced(qwen3_model, p, c.sample.tokens)
        np.testing.assert_allclose(c.sample.logprobs, ref, atol=1e-4, rtol=0)


def test_processed_logprobs_mode(qwen3_dir, qwen3_model):
    eng = JaxEngine(qwen3_dir, logprobs_mode="processed", **ENGINE_KW)
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=4)
    try:
        out = run(eng, prompts(5)[:4], params)
    finally:
        eng.close()
    for p, c in zip(prompts(5), out):
        logits = forward_logits(qwen3_model, p, c.sample.tokens) / 0.7
        kth = np.sort(logits, -1)[:, -20][:, None]
        logp = np.asarray(jax.nn.log_softmax(np.where(logits >= kth, logits, -np.inf), -1))
        ref = logp[np.arange(len(c.sample.tokens)), c.sample.tokens]
        np.testing.assert_allclose(c.sample.logprobs, ref, atol=1e-4, rtol=0)


def test_close_hands_back_in_flight_requests(qwen3_dir):
    eng = JaxEngine(qwen3_dir, **ENGINE_KW)
    for i, p in enumerate(prompts()):
        eng.submit(Request(f"c{i}", p, SamplingParams(max_tokens=100, temperature=0.0)))
    eng.close()
    out = eng.poll()
    assert sorted(c.request_id for c in out) == [f"c{i}" for i in range(6)]
    assert all(c.sample.finish_reason == "abort" for c in out)
    with pytest.raises(EngineError, match="closed"):
        eng.submit(Request("late", [3], GREEDY))


def test_refill_does_not_recompile(engine, greedy_reference):
    before = jax_decode.decode._cache_size()
    out = run(engine, prompts(), tag="again")  # slots freed and refilled: the same decode program
    assert [c.sample.tokens for c in out] == greedy_reference
    assert jax_decode.decode._cache_size() == before


def test_shared_prompts_are_prefilled_once(engine, greedy_reference, monkeypatch):
    """A GRPO group's samples share their prompt: one prefill row, written to all their slots; each
    sample then decodes exactly as it would alone."""
    prefill_rows = []
    prefill = jax_decode.prefill

    def counting(graphdef, params, cache, tokens_pt, lengths_p, slots_pr, **kw):
        prefill_rows.append(int((np.asarray(slots_pr) < engine.max_slots).any(-1).sum()))
        return prefill(graphdef, params, cache, tokens_pt, lengths_p, slots_pr, **kw)

    monkeypatch.setattr(jax_decode, "prefill", counting)
    p = prompts()[3]  # 30 tokens
    out = run(engine, [p] * 4, tag="shared")
    assert [c.sample.tokens for c in out] == [greedy_reference[3]] * 4
    assert sum(prefill_rows) == 1
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=s) for s in range(4)]
    together = engine.generate([Request(f"t{s}", p, seeded[s]) for s in range(4)])
    alone = [engine.generate([Request(f"a{s}", p, seeded[s])])[0] for s in range(4)]
    assert [c.sample.tokens for c in together] == [c.sample.tokens for c in alone]
    assert len({tuple(c.sample.tokens) for c in together}) > 1
    np.testing.assert_allclose([c.sample.logprobs for c in together], [c.sample.logprobs for c in alone],
                               atol=1e-5)


def test_a_next_turn_computes_only_its_new_tokens(engine, greedy_reference, qwen3_model, monkeypatch):
    """A request that stopped keeps its cache row; the same request id submitted again with a sequence
    extending it (an episode's next turn: the turn, then the environment's answer) is admitted there and
    computes only the new tokens, and decodes as a request that prefilled its whole context does."""
    calls = {"prefill": 0, "extend": []}
    prefill, extend = jax_decode.prefill, jax_decode.extend

    def counting_prefill(*args, **kw):
        calls["prefill"] += 1
        return prefill(*args, **kw)

    def counting_extend(graphdef, params, cache, tokens_pt, starts_p, slots_p, **kw):
        calls["extend"] += [int(st) for st, sl in zip(starts_p, slots_p) if sl < engine.max_slots]
        return extend(graphdef, params, cache, tokens_pt, starts_p, slots_p, **kw)

    monkeypatch.setattr(jax_decode, "prefill", counting_prefill)
    monkeypatch.setattr(jax_decode, "extend", counting_extend)
    p, reference = prompts()[1], greedy_reference[1]
    stop = reference[5]
    turn = reference[:reference.index(stop) + 1]
    (first,) = engine.generate([Request("ep", p, SamplingParams(max_tokens=40, temperature=0.0,
                                                                stop_token_ids=(stop,)))])
    assert first.sample.tokens == turn and first.sample.finish_reason == "stop"
    answer = [7, 8, 9, 10, 11]  # the environment's tokens
    params = SamplingParams(max_tokens=24, temperature=0.0)
    calls["prefill"] = 0
    (again,) = engine.generate([Request("ep", p + turn + answer, params)])
    assert calls["prefill"] == 0 and calls["extend"] == [len(p) + len(turn) - 1]
    (fresh,) = engine.generate([Request("other", p + turn + answer, params)])  # prefills the whole context
    assert calls["prefill"] == 1 and len(calls["extend"]) == 1
    assert again.sample.tokens == fresh.sample.tokens
    np.testing.assert_allclose(again.sample.logprobs, fresh.sample.logprobs, atol=1e-5)
    # A sequence that does not extend the kept turn is prefilled, whatever its id.
    (differs,) = engine.generate([Request("other", p + answer, params)])
    assert calls["prefill"] == 2 and len(calls["extend"]) == 1
    # A weight swap forgets the kept turns: their keys/values are the old weights'.
    engine.generate([Request("ep2", p, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)))])
    engine.update_weights(engine.version, dict(iter_hf_tensors(qwen3_model)))  # the same weights
    engine.generate([Request("ep2", p + turn + answer, params)])
    assert calls["prefill"] == 4 and len(calls["extend"]) == 1  # ep2's first turn, then its whole context
    # So does releasing the request (its episode ended): its slot is free, and a next turn prefills.
    engine.generate([Request("ep3", p, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)))])
    engine.release(["ep3", "never-seen"])  # an unknown id is ignored
    engine.generate([Request("ep3", p + turn + answer, params)])
    assert calls["prefill"] == 6 and len(calls["extend"]) == 1
    # A swap with keep_kv keeps them (and their keys/values): the next turn computes its new tokens only.
    engine.generate([Request("ep4", p, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)))])
    engine.update_weights(engine.version, dict(iter_hf_tensors(qwen3_model)), keep_kv=True)
    (kept,) = engine.generate([Request("ep4", p + turn + answer, params)])
    assert calls["prefill"] == 7 and calls["extend"][1:] == [len(p) + len(turn) - 1]
    assert kept.sample.tokens == fresh.sample.tokens


def test_prefill_stats_count_what_a_next_turn_reuses(engine, greedy_reference):
    """prefill_stats: an episode's next turn (same request id, extending the turn the engine kept) computes
    only its new tokens and counts the rest as reused; the same context under another id, or after the
    request was released, computes all of it; a context four requests share is computed once."""
    p, reference = prompts()[1], greedy_reference[1]
    stop = reference[5]
    turn = reference[:reference.index(stop) + 1]
    answer = [7, 8, 9, 10, 11]  # the environment's tokens
    first, params = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(stop,)), GREEDY

    def counted(requests):
        before = engine.prefill_stats()
        engine.generate(requests)
        return engine.prefill_stats() - before

    assert counted([Request("stats", p, first)]) == PrefillStats(1, len(p) - 1, 0, len(p) - 1)
    context, kept = len(p) + len(turn) + len(answer) - 1, len(p) + len(turn) - 1  # the stop token is not cached
    assert counted([Request("stats", p + turn + answer, params)]) == PrefillStats(1, context, kept, len(answer))
    assert counted([Request("stats-other", p + turn + answer, params)]) == PrefillStats(1, context, 0, context)
    engine.generate([Request("stats-released", p, first)])
    engine.release(["stats-released"])
    assert counted([Request("stats-released", p + turn + answer, params)]) == PrefillStats(1, context, 0, context)
    shared = counted([Request(f"stats-g{i}", p + answer, params) for i in range(4)])
    assert shared == PrefillStats(4, 4 * (len(p) + len(answer) - 1), 0, len(p) + len(answer) - 1)


def test_abort_and_resume_equals_uninterrupted(engine, greedy_reference, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ps = prompts()
    aborted = {}
    # 6 requests on 4 slots: after the first decode call, 4 run and 2 wait; abort one of each.
    held = pause_after_decode(monkeypatch, engine, 1)
    for i, p in enumerate(ps):
        engine.submit(Request(f"a{i}", p, params))
    assert held.wait(30)
    for c in engine.abort(["a0", "a5", "unknown"]):
        aborted[c.request_id] = c.sample
    assert set(aborted) == {"a0", "a5"}
    assert aborted["a0"].finish_reason == "abort" and len(aborted["a0"].tokens) == 8
    assert aborted["a5"].tokens == [] and aborted["a5"].finish_reason == "abort"
    monkeypatch.undo()
    rest = {i: c.sample for i, c in poll_all(engine, 4).items()}
    for i in (1, 2, 3, 4):
        assert rest[f"a{i}"].tokens == greedy_reference[i]
    resumed = engine.generate([Request("a0", ps[0], params, prefix=aborted["a0"]),
                               Request("a5", ps[5], params, prefix=aborted["a5"])])
    for c, i in zip(resumed, (0, 5)):
        assert c.sample.tokens == greedy_reference[i] and c.sample.finish_reason == "length"
        assert c.sample.logprobs[:len(aborted[c.request_id].tokens)] == aborted[c.request_id].logprobs


def test_progress_copies_tokens_so_far_without_stopping_anything(engine, greedy_reference, monkeypatch):
    real, calls, held, go = jax_decode.decode, [], threading.Event(), threading.Event()

    def wrapped(*args, **kwargs):  # holds the loop inside its second decode call, after the first's tokens
        calls.append(1)
        if len(calls) == 2:
            held.set()
            go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", wrapped)
    ps = prompts()
    for i, p in enumerate(ps):  # 6 requests on 4 slots: 4 run, 2 wait
        engine.submit(Request(f"p{i}", p, GREEDY))
    assert held.wait(30)
    got = {c.request_id: c.sample for c in engine.progress(["p0", "p5", "unknown"])}
    assert set(got) == {"p0", "p5"}
    assert got["p0"].tokens == greedy_reference[0][:8] and got["p0"].finish_reason is None
    assert got["p0"].versions == [engine.version] * 8 and len(got["p0"].logprobs) == 8
    assert got["p5"].tokens == [] and got["p5"].finish_reason is None  # still waiting for a slot
    go.set()
    monkeypatch.undo()
    done = poll_all(engine, 6)  # nothing was stopped
    assert [done[f"p{i}"].sample.tokens for i in range(6)] == greedy_reference
    assert got["p0"].tokens == greedy_reference[0][:8]  # a copy: the generation since left it alone
    assert engine.progress(["p0"]) == []  # finished: its completion went to poll
    (resumed,) = engine.generate([Request("p0", ps[0], GREEDY, prefix=got["p0"])])
    assert resumed.sample.tokens == greedy_reference[0]
    assert resumed.sample.logprobs[:8] == got["p0"].logprobs


def test_sampling(engine, greedy_reference):
    ps = prompts()[:4]

    def tokens(**kw):
        return [c.sample.tokens for c in run(engine, ps, SamplingParams(max_tokens=24, **kw))]

    seeded = tokens(temperature=1.0, seed=11)
    assert tokens(temperature=1.0, seed=11) == seeded
    assert tokens(temperature=1.0, seed=12) != seeded
    assert seeded != greedy_reference[:4]
    assert tokens(temperature=0.8, top_k=1, seed=5) == greedy_reference[:4]
    assert tokens(temperature=1.0, top_p=1e-6, seed=5) == greedy_reference[:4]
    # Mixed sampling params in one batch: each slot keeps its own.
    mixed = engine.generate([Request("g", ps[0], SamplingParams(max_tokens=24, temperature=0.0)),
                             Request("s", ps[0], SamplingParams(max_tokens=24, temperature=1.0, seed=11)),
                             Request("k", ps[0], SamplingParams(max_tokens=24, temperature=2.0, top_k=1))])
    assert [c.sample.tokens for c in mixed] == [greedy_reference[0], seeded[0], greedy_reference[0]]


def test_stop_tokens_max_tokens_and_context(engine, greedy_reference):
    engine_helpers.check_stop_tokens_and_max_tokens(engine, greedy_reference)
    # The cache holds max_len positions: prompt + completion stops there.
    long_prompt = prompts(4, lens=(124,))[0]
    c = engine.generate([Request("l", long_prompt, SamplingParams(max_tokens=24, temperature=0.0))])[0]
    assert len(c.sample.tokens) == 4 and c.sample.finish_reason == "length"


def test_too_long_prompt_is_a_per_request_error(engine, greedy_reference):
    ps = prompts()
    reqs = [Request("long", list(range(3, 131)), GREEDY)]
    reqs += [Request(f"ok{i}", p, GREEDY) for i, p in enumerate(ps)]
    reqs += [Request("bad", [3, 10_000], GREEDY)]
    out = engine.generate(reqs)
    assert out[0].sample.finish_reason == "error" and out[0].sample.tokens == []
    assert "128 tokens" in out[0].error and "127" in out[0].error
    assert [c.sample.tokens for c in out[1:-1]] == greedy_reference
    assert out[-1].sample.finish_reason == "error" and "vocab" in out[-1].error
    # A prompt that just fits generates one token.
    c = engine.generate([Request("fits", list(range(3, 130)), GREEDY)])[0]
    assert len(c.sample.tokens) == 1 and c.sample.finish_reason == "length"


def test_bad_weights_are_rejected_and_nothing_changes(engine, qwen3_model, greedy_reference):
    engine_helpers.check_bad_weights_are_rejected(engine, dict(iter_hf_tensors(qwen3_model)), greedy_reference)


def test_loop_failure_surfaces_as_engine_error(qwen3_dir, monkeypatch):
    eng = JaxEngine(qwen3_dir, **ENGINE_KW)
    eng.generate([Request("warm", [5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0))])
    fail = threading.Event()
    real = jax_decode.decode

    def failing(*args, **kwargs):
        if fail.is_set():
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", failing)
    fail.set()
    eng.submit(Request("x", [5, 6, 7], SamplingParams(max_tokens=100, temperature=0.0)))
    with pytest.raises(EngineError, match="device fell over"):
        eng.poll(timeout=30)
    with pytest.raises(EngineError, match="device fell over"):
        eng.submit(Request("y", [5], GREEDY))
    partial = eng.abort(["x"])
    assert [c.request_id for c in partial] == ["x"] and partial[0].sample.finish_reason == "abort"
    eng.close()


def test_sharded_engine_matches_one_device(qwen3_dir, greedy_reference):
    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    eng = JaxEngine(qwen3_dir, mesh=mesh, **ENGINE_KW)
    try:
        # slots over fsdp, kv heads over tensor
        for cached in eng._cache:
            assert cached.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None, None)
        assert [c.sample.tokens for c in run(eng, prompts())] == greedy_reference
    finally:
        eng.close()


def test_load_reports_progress(engine):
    assert engine.load().version == engine.version
    out = run(engine, prompts()[:2])
    load = engine.load()
    assert load.running == 0 and load.waiting == 0 and load.kv_used == 0.0
    assert load.tokens_per_s > 0 and all(c.sample.done for c in out)


def test_long_tail_mix_is_exact_in_every_bucket_and_window(qwen3_dir, qwen3_model, engine, monkeypatch):
    """16 slots: decode calls of 16 and then 8 rows as a long-tailed mix of requests drains, with short
    sequences in calls with long ones (grouped windows). Greedy tokens are the teacher-forced argmax and
    log-probs the teacher-forced ones, seeded samples equal the 4-slot engine's, and nothing compiles
    after the engine's warm-up (its background compiles included)."""
    eng = JaxEngine(qwen3_dir, **{**ENGINE_KW, "max_slots": 16})
    assert eng.warmed(timeout=300)
    real, calls = jax_decode.decode, []

    def recording(*args, **kwargs):
        calls.append((len(args[4]), tuple(np.asarray(args[5]).tolist())))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax_decode, "decode", recording)
    ps = prompts(7, lens=(1, 3, 11, 30, 50, 7, 2, 20, 40, 5, 9, 13, 25, 35, 4, 8, 16, 60, 6, 10))
    lengths = [60 if i % 7 == 0 else 3 + i for i in range(len(ps))]

    def requests(tag, **kw):
        return [Request(f"{tag}{i}", p, SamplingParams(max_tokens=n, **kw))
                for i, (p, n) in enumerate(zip(ps, lengths))]

    try:
        with counting_lowerings() as lowered:
            greedy = eng.generate(requests("g", temperature=0.0))
            seeded = eng.generate(requests("s", temperature=1.0, seed=5))
        assert "jit_decode" not in lowered  # (prefills of longer buckets compile on first use)
    finally:
        eng.close()
    assert {rows for rows, _ in calls} == {8, 16}
    assert any(len(set(windows)) > 1 for _, windows in calls)
    for p, c in zip(ps, greedy):
        logprobs, argmax = teacher_forced(qwen3_model, p, c.sample.tokens)
        assert c.sample.tokens == argmax.tolist()
        np.testing.assert_allclose(c.sample.logprobs, logprobs, atol=1e-4, rtol=0)
    monkeypatch.undo()
    assert ([c.sample.tokens for c in engine.generate(requests("s4-", temperature=1.0, seed=5))]
            == [c.sample.tokens for c in seeded])


def test_decode_calls_use_only_compiled_buckets_until_the_background_compiles_end(qwen3_dir, qwen3_model,
                                                                                  monkeypatch):
    """The engine serves before its smaller decode buckets are compiled: until then a call runs in the
    largest one (padding rows), with the same greedy tokens; the background compiles are the programs
    the loop then uses (nothing more compiles); an engine of the same shapes takes them without
    compiling; closing stops them."""
    from rollout_bridge import jax_warmup
    monkeypatch.setattr(jax_warmup, "COMPILED", set())  # as in a process where no engine compiled yet
    real, calls = jax_decode.decode, []

    def recording(*args, **kwargs):
        calls.append(len(args[4]))
        return real(*args, **kwargs)

    ps = prompts(11, lens=(3, 9, 30, 5))
    requests = [Request(f"b{i}", p, SamplingParams(max_tokens=40 if i == 2 else 4, temperature=0.0))
                for i, p in enumerate(ps)]
    with jax_warmup.COMPILE_LOCK:  # holds the background compiles back: only the largest bucket is ready
        eng = JaxEngine(qwen3_dir, **{**ENGINE_KW, "max_slots": 16})
        monkeypatch.setattr(jax_decode, "decode", recording)
        try:
            assert eng._slots.ready == {16} and not eng.warmed(timeout=0.1)
            held = eng.generate(requests)
            assert set(calls) == {16}  # one long request drains alone: still in the largest bucket
        finally:
            monkeypatch.setattr(jax_decode, "decode", real)
    try:
        assert eng.warmed(timeout=300) and eng._slots.ready == {8, 12, 16}
        monkeypatch.setattr(jax_decode, "decode", recording)
        calls.clear()
        with counting_lowerings() as lowered:
            again = eng.generate([dataclasses.replace(r, request_id="a" + r.request_id) for r in requests])
        assert 8 in calls and "jit_decode" not in lowered
        monkeypatch.setattr(jax_decode, "decode", real)
        with jax_warmup.COMPILE_LOCK:
            twin = JaxEngine(qwen3_dir, **{**ENGINE_KW, "max_slots": 16})
            assert twin.warmed(timeout=60) and twin._slots.ready == {8, 12, 16}
            twin.close()
    finally:
        monkeypatch.setattr(jax_decode, "decode", real)
        eng.close()
    assert [c.sample.tokens for c in again] == [c.sample.tokens for c in held]
    for p, c in zip(ps, held):
        assert c.sample.tokens == teacher_forced(qwen3_model, p, c.sample.tokens)[1].tolist()
    with jax_warmup.COMPILE_LOCK:  # closed while its compiles wait: they never run
        waiting = JaxEngine(qwen3_dir, **{**ENGINE_KW, "max_slots": 24, "max_len": 96})
        waiting.close()
    assert waiting.warmed(timeout=0) and waiting._slots.ready == {24}


def _token_counts(engine):
    return {run.request.request_id: len(run.sample.tokens) for run in list(engine._running.values())}


def test_pause_keep_then_update_weights_then_resume(qwen3_dir, qwen3_model, monkeypatch):
    """PipelineRL's update: pause with requests kept, swap weights, resume. Nothing is generated while
    paused, requests submitted meanwhile wait, and the version boundary sits exactly at the pause."""
    eng = JaxEngine(qwen3_dir, **ENGINE_KW)
    new_model, new = perturbed(qwen3_model, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0)
    ps = prompts(2, lens=(5, 20, 9))
    held = pause_after_decode(monkeypatch, eng, 2)
    for i, p in enumerate(ps):
        eng.submit(Request(f"k{i}", p, params))
    assert held.wait(30)
    assert eng.pause("keep") == [] and eng.paused
    before = _token_counts(eng)
    assert sorted(before.values()) == [16, 16, 16]
    eng.submit(Request("late", prompts()[1], GREEDY))
    time.sleep(0.3)
    assert _token_counts(eng) == before and eng.poll(timeout=0.2) == []
    assert eng.load().waiting == 1
    eng.update_weights(1, new)
    time.sleep(0.2)
    assert eng.paused and _token_counts(eng) == before  # the update did not resume it
    eng.resume()
    done = poll_all(eng, 4)
    eng.close()
    assert not eng.paused
    for i, p in enumerate(ps):
        s = done[f"k{i}"].sample
        assert s.versions == [0] * 16 + [1] * 24
        _, old_argmax = teacher_forced(qwen3_model, p, s.tokens)
        new_lp, new_argmax = teacher_forced(new_model, p, s.tokens)
        assert s.tokens[:16] == old_argmax[:16].tolist() and s.tokens[16:] == new_argmax[16:].tolist()
        np.testing.assert_allclose(s.logprobs[16:], new_lp[16:], atol=1e-4, rtol=0)
    assert done["late"].sample.versions == [1] * 24


def test_pause_abort_hands_back_everything_and_resume_continues(engine, greedy_reference, monkeypatch):
    """AReaL's update: pause aborting everything in flight (running and waiting), resubmit from the
    prefixes while paused, resume: the same tokens as an uninterrupted run."""
    ps = prompts()
    held = pause_after_decode(monkeypatch, engine, 1)
    for i, p in enumerate(ps):
        engine.submit(Request(f"p{i}", p, GREEDY))
    assert held.wait(30)
    partial = {c.request_id: c.sample for c in engine.pause("abort")}
    monkeypatch.undo()
    assert set(partial) == {f"p{i}" for i in range(6)} and engine.paused
    assert all(s.finish_reason == "abort" for s in partial.values())
    assert sorted(len(s.tokens) for s in partial.values()) == [0, 0, 8, 8, 8, 8]  # 4 slots ran, 2 waited
    assert engine.load().running == 0 and engine.poll(timeout=0.2) == []
    for i, p in enumerate(ps):
        engine.submit(Request(f"p{i}", p, GREEDY, prefix=partial[f"p{i}"]))
    assert engine.poll(timeout=0.3) == [] and engine.load().waiting == 6
    engine.resume()
    done = poll_all(engine, 6)
    for i in range(6):
        assert done[f"p{i}"].sample.tokens == greedy_reference[i]
    assert not engine.paused and engine.pause("keep") == [] and engine.pause("abort") == []
    engine.resume()


def test_pause_mode_is_checked(engine):
    with pytest.raises(ValueError, match="'wait'.*keep.*abort"):
        engine.pause("wait")
    assert not engine.paused
