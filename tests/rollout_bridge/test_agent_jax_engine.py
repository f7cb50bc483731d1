"""An agent through the OpenAI endpoint onto the JAX engine: each turn is an engine `Request(prompt,
prefix=...)`, and the log-prob the engine recorded for every trainable token of the episode's Sample is
the policy's log-prob of that token given only its own sequence's tokens before it (a teacher-forced
forward over the sequence), across tool results and a history edit that splits the episode."""

import asyncio
import itertools

import numpy as np
import openai
import pytest
from engine_helpers import lively_tiny_model, teacher_forced

from jaxflow.data import checks
from jaxflow.models.hf_io import load_model
from jaxflow.tokenizer import Tokenizer
from rollout_bridge.engine import Request
from rollout_bridge.jax_engine import JaxEngine
from rollout_bridge.openai_endpoint import OpenAIEndpoint, SessionBackend

pytestmark = pytest.mark.slow  # a JAX engine compiled and run end to end

MAX_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("agent") / "model")


def test_agent_turns_on_the_jax_engine_are_trained_on_their_own_sequences(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = JaxEngine(str(model_dir), max_slots=2, max_len=MAX_LEN)
    ids = itertools.count()
    returned = []

    async def generate(episode_id, prompt, prefix, params):
        request = Request(f"{episode_id}-{next(ids)}", prompt, params, prefix=prefix)
        (completion,) = await asyncio.to_thread(engine.generate, [request], 300)
        returned.append((len(prefix.tokens), completion.sample))
        return completion.sample

    backend = SessionBackend(tokenizer, generate, max_context=MAX_LEN)
    try:
        with OpenAIEndpoint(backend, model="tiny") as endpoint:
            backend.open("agent-0")
            client = openai.OpenAI(base_url=endpoint.episode_url("agent-0"), api_key=endpoint.token, max_retries=0,
                                   timeout=300)
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            for result in ("5", "10"):
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=1)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "tool", "content": result}]
            # The agent drops its first exchange: a new sequence.
            client.chat.completions.create(model="tiny", messages=[messages[0], *messages[3:]], max_tokens=12, seed=2)
            session = backend.end("agent-0")
    finally:
        engine.close()
    sample, starts = session.sample(), session.sequence_starts()
    assert len(starts) == 2 and len(returned) == 3
    checks.check_sample("episode", sample, 0, 0, finished=False, vocab_size=tokenizer.vocab_size)
    # The trainable tokens are exactly those the engine sampled, turn by turn.
    mask = sample.model_mask()
    sampled = [t for p, s in returned for t in s.tokens[p:]]
    assert [t for t, m in zip(sample.tokens, mask) if m] == sampled
    # Each sequence's log-probs are the model's given that sequence alone.
    model = load_model(model_dir)
    for a, b in zip(starts, [*starts[1:], len(sample.tokens)]):
        context = sample.env_spans[[s[0] for s in sample.env_spans].index(a)][1]  # the sequence's leading span
        logprobs, _ = teacher_forced(model, sample.tokens[a:context], sample.tokens[context:b], pad_to=MAX_LEN)
        trained = mask[context:b]
        assert trained.any()
        np.testing.assert_allclose(np.asarray(sample.logprobs[context:b])[trained], logprobs[trained], atol=1e-4,
                                   rtol=0)
