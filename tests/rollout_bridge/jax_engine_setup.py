"""The JAX engine settings and checks the JAX engine tests share (test_jax_engine.py, test_jax_engine_swaps.py):
a small engine, jaxflow's teacher-forced forward at its length, and a hold on its loop at a known decode call."""

import threading

import engine_helpers
from waiting import wait_until

from rollout_bridge import jax_decode

# Small enough to compile fast, with more prompts than slots and prompts in several prefill buckets.
ENGINE_KW = dict(max_slots=4, max_len=128, decode_chunk=8, prefill_buckets=(16, 32, 64))


def forward_logits(model, prompt, completion):
    """engine_helpers.forward_logits at the engine's context length (one compiled shape)."""
    return engine_helpers.forward_logits(model, prompt, completion, pad_to=ENGINE_KW["max_len"])


def teacher_forced(model, prompt, completion):
    """engine_helpers.teacher_forced at the engine's context length (one compiled shape)."""
    return engine_helpers.teacher_forced(model, prompt, completion, pad_to=ENGINE_KW["max_len"])


def pause_after_decode(monkeypatch, engine, call: int) -> threading.Event:
    """Holds the engine loop right after its `call`-th decode call until another thread has queued a
    command (a swap, an abort), so that the command lands at a known chunk boundary instead of racing the
    loop. Returns an event set when the loop is held there."""
    real, calls, held = jax_decode.decode, [], threading.Event()

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == call:
            held.set()
            wait_until(lambda: engine._commands, 30, "a command for the held engine loop", interval=0.001)
        return out

    monkeypatch.setattr(jax_decode, "decode", wrapped)
    return held
