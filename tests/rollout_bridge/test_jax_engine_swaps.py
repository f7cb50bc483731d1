"""The JAX engine's weight swaps with requests in flight: recomputing their caches under the new weights
(the default) or keeping them (`keep_kv`), against jaxflow's teacher-forced forward of each version."""

import dataclasses

import numpy as np
import pytest
from engine_helpers import perturbed, poll_all, prompts
from jax_engine_setup import ENGINE_KW, pause_after_decode, teacher_forced

from jaxflow.models.hf_io import iter_hf_tensors
from rollout_bridge import jax_decode
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end


def _run_with_a_swap(monkeypatch, eng, reqs, version, tensors, **kw):
    """`reqs` run with a weight swap after the engine's second decode call: their samples, and the prefill
    rows the swap itself computed."""
    monkeypatch.undo()
    rows, in_swap, swap_rows = [], [], []
    prefill, swap = jax_decode.prefill, eng._swap_weights

    def counting(graphdef, params, cache, tokens_pt, lengths_p, slots_pr, **k):
        if in_swap:
            rows.append(int((np.asarray(slots_pr) < eng.max_slots).any(-1).sum()))
        return prefill(graphdef, params, cache, tokens_pt, lengths_p, slots_pr, **k)

    def counted_swap(*args):
        in_swap.append(1)
        swap(*args)
        swap_rows.append(sum(rows))
        in_swap.clear()

    monkeypatch.setattr(jax_decode, "prefill", counting)
    monkeypatch.setattr(eng, "_swap_weights", counted_swap)
    held = pause_after_decode(monkeypatch, eng, 2)
    for r in reqs:
        eng.submit(r)
    assert held.wait(30)
    eng.update_weights(version, tensors, **kw)
    assert eng.version == version
    done = poll_all(eng, len(reqs))
    return {r.request_id: done[r.request_id].sample for r in reqs}, swap_rows


def _swap_index(s, old: int, new: int) -> int:
    """Where version `new` starts in a 60-token sample of `old` then `new`: requests admitted together swap
    16 tokens in, one admitted a chunk late 8 tokens in."""
    swap = s.versions.index(new)
    assert swap in (8, 16) and s.versions == [old] * swap + [new] * (60 - swap), s.versions
    return swap


def test_weight_update_mid_generation(qwen3_dir, qwen3_model, monkeypatch):
    eng = JaxEngine(qwen3_dir, **ENGINE_KW)
    new_model, new = perturbed(qwen3_model, seed=0)
    reqs = [Request(f"w{i}", p, SamplingParams(max_tokens=60, temperature=0.0))
            for i, p in enumerate(prompts(2, lens=(5, 20, 9)))]
    # By default the swap recomputes every in-flight cache under the new weights.
    done, swap_rows = _run_with_a_swap(monkeypatch, eng, reqs, 1, new)
    assert swap_rows[0] > 0
    # prefill_stats counts it apart from admissions: each sequence's context at the swap, computed again.
    recomputed = eng.prefill_stats().recomputed_tokens
    assert recomputed == sum(len(r.prompt) + done[r.request_id].versions.index(1) - 1 for r in reqs)
    for r in reqs:
        s = done[r.request_id]
        swap = _swap_index(s, 0, 1)
        old_lp, old_argmax = teacher_forced(qwen3_model, r.prompt, s.tokens)
        new_lp, new_argmax = teacher_forced(new_model, r.prompt, s.tokens)
        np.testing.assert_allclose(s.logprobs[:swap], old_lp[:swap], atol=1e-4, rtol=0)
        np.testing.assert_allclose(s.logprobs[swap:], new_lp[swap:], atol=1e-4, rtol=0)
        assert s.tokens[:swap] == old_argmax[:swap].tolist()
        # The new weights' greedy continuation of the pre-swap prefix, token by token.
        assert s.tokens[swap:] == new_argmax[swap:].tolist()

    # keep_kv: no recompute. Swapped to the weights it already serves, the run is the uninterrupted one.
    reqs = [dataclasses.replace(r, request_id=f"k{i}") for i, r in enumerate(reqs)]
    done, swap_rows = _run_with_a_swap(monkeypatch, eng, reqs, 2, new, keep_kv=True)
    assert swap_rows == [0] and eng.prefill_stats().recomputed_tokens == recomputed
    for r in reqs:
        s = done[r.request_id]
        new_lp, new_argmax = teacher_forced(new_model, r.prompt, s.tokens)
        assert s.tokens == new_argmax.tolist() and s.versions.count(2) > 0
        np.testing.assert_allclose(s.logprobs, new_lp, atol=1e-4, rtol=0)
    # Swapped to other weights (the original ones), the tokens after the swap are theirs attending to the
    # keys and values version 2 computed: not what a recompute under them gives.
    done, swap_rows = _run_with_a_swap(monkeypatch, eng, reqs, 3, dict(iter_hf_tensors(qwen3_model)),
                                       keep_kv=True)
    eng.close()
    assert swap_rows == [0]
    for r in reqs:
        s = done[r.request_id]
        swap, (new_lp, _), (old_lp, _) = (_swap_index(s, 2, 3), teacher_forced(new_model, r.prompt, s.tokens),
                                          teacher_forced(qwen3_model, r.prompt, s.tokens))
        np.testing.assert_allclose(s.logprobs[:swap], new_lp[:swap], atol=1e-4, rtol=0)
        # After the swap, the positions before it keep version 2's keys and values: not a recompute's log-probs.
        assert np.abs(np.asarray(s.logprobs[swap:]) - old_lp[swap:]).max() > 100 * 1e-4
