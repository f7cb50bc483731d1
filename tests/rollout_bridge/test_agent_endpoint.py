"""The OpenAI-compatible endpoint, driven by the official `openai` client as a black-box agent would drive
it: the episode's Sample holds exactly the tokens the model sampled, a rewritten history splits it, and
every refused request gets its named HTTP error and leaves the episode's record as it was."""

import asyncio
import copy
import itertools
import json
import threading
import urllib.request

import httpx
import openai
import pytest
from agent_helpers import TOOL_END, TOOLS_TEMPLATE, ScriptedModel, env_tokens_are_context, model_tokens

from jaxflow.data import checks
from jaxflow.models.tiny import write_tiny_tokenizer
from jaxflow.tokenizer import Tokenizer
from rollout_bridge.openai_endpoint import (
    EPISODE_HEADER,
    ChatSampling,
    EpisodeEnded,
    OpenAIEndpoint,
    SessionBackend,
    UnknownEpisode,
)

MODEL = "tiny-policy"
MAX_CONTEXT = 256
_ids = itertools.count()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), extra_tokens=(TOOL_END,))


class Served:
    """The endpoint over a SessionBackend whose generate is the test's current ScriptedModel."""

    def __init__(self, tok):
        self.model = ScriptedModel()
        self.backend = SessionBackend(tok, lambda *a: self.model.generate(*a), max_context=MAX_CONTEXT)
        self.endpoint = OpenAIEndpoint(self.backend, model=MODEL)

    def episode(self, turns=()):
        """A new open episode whose model answers with `turns`; (its id, an openai client for it)."""
        self.model = ScriptedModel(list(turns))
        episode_id = f"ep-{next(_ids)}"
        self.backend.open(episode_id)
        return episode_id, self.client(episode_id)

    def client(self, episode_id, api_key=None, **kw):
        return openai.OpenAI(base_url=self.endpoint.episode_url(episode_id), api_key=api_key or self.endpoint.token,
                             max_retries=0, timeout=30, **kw)


@pytest.fixture(scope="module")
def served(tok):
    s = Served(tok)
    s.endpoint.start()
    yield s
    s.endpoint.close()


def answer(tok, text):
    return tok.encode(text) + [tok.eos_id]


def chat(client, messages, **kw):
    return client.chat.completions.create(messages=messages, **{"model": MODEL, **kw})


def test_models_lists_the_served_model(served):
    _, client = served.episode()
    assert [m.id for m in client.models.list()] == [MODEL]


def test_an_agent_with_a_tool_trains_on_exactly_the_sampled_tokens(tok, served):
    episode_id, client = served.episode([answer(tok, "I will add. <tool>2+3</tool>"),
                                         answer(tok, "Now double. <tool>5*2</tool>"), answer(tok, "It is 10.")])
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "(2+3)*2?"}]
    for tool_result in ("5", "10", None):
        response = chat(client, messages, temperature=0.7, max_tokens=64)
        message = response.choices[0].message
        assert response.choices[0].finish_reason == "stop" and response.object == "chat.completion"
        assert response.usage.completion_tokens == len(served.model.calls[-1].new)
        if tool_result is not None:
            messages += [{"role": "assistant", "content": message.content},
                         {"role": "tool", "content": tool_result}]
    assert message.content == "It is 10."
    calls = served.model.calls
    assert [c.params.temperature for c in calls] == [0.7] * 3
    assert all(c.prompt == calls[0].prompt for c in calls)  # one request continued turn after turn
    # max_tokens counts the new tokens; the engine's count includes the prefix.
    assert [c.params.max_tokens - len(c.prefix.tokens) for c in calls] == [64] * 3
    session = served.backend.end(episode_id)
    sample = session.sample()
    assert session.sequence_starts() == [0]
    assert model_tokens(sample) == served.model.sampled()  # tokens, log-probs and versions as generated
    assert env_tokens_are_context(sample)
    checks.check_sample("episode", sample, min(sample.versions), max(sample.versions), finished=False)


def test_an_agent_that_edits_its_history_yields_two_sequences(tok, served):
    episode_id, client = served.episode([answer(tok, "Draft one."), answer(tok, "Draft two."),
                                         answer(tok, "Final.")])
    messages = [{"role": "user", "content": "Write."}]
    first = chat(client, messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
    chat(client, messages)
    # The agent summarises its history: the earlier assistant turn is replaced.
    chat(client, [messages[0], {"role": "assistant", "content": "(summary)"}, messages[2]])
    session = served.backend.end(episode_id)
    sample, starts = session.sample(), session.sequence_starts()
    assert len(starts) == 2 and starts[0] == 0
    # Every trainable token is one generate returned, with its log-prob and version, in order.
    assert model_tokens(sample) == served.model.sampled()
    assert env_tokens_are_context(sample)
    assert sample.env_spans[-1][0] == starts[1]  # the second sequence opens with its context
    checks.check_sample("episode", sample, min(sample.versions), max(sample.versions), finished=False)


def test_the_episode_header_names_the_episode(tok, served):
    episode_id, _ = served.episode([answer(tok, "Hi.")])
    client = openai.OpenAI(base_url=f"{served.endpoint.url}/v1", api_key=served.endpoint.token, max_retries=0,
                           default_headers={EPISODE_HEADER: episode_id})
    assert chat(client, [{"role": "user", "content": "Hello"}]).choices[0].message.content == "Hi."
    assert served.backend.session(episode_id).turns == 1


def test_tool_calls_come_back_as_openai_tool_calls(tok, served):
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    episode_id, client = served.episode([answer(tok, text)])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    choice = chat(client, [{"role": "user", "content": "2+3"}], tools=tools).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_logprobs_are_the_sampled_ones(tok, served):
    _, client = served.episode([answer(tok, "Yes.")])
    response = chat(client, [{"role": "user", "content": "Ok?"}], logprobs=True)
    (call,) = served.model.calls
    # The end-of-turn token ends the reply: it is not part of the content, nor of its log-probs.
    assert [x.logprob for x in response.choices[0].logprobs.content] == call.logprobs[:-1]
    assert "".join(x.token for x in response.choices[0].logprobs.content) == "Yes."


def test_a_streamed_answer_is_the_same_turn(tok, served):
    text = 'Adding. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    episode_id, client = served.episode([answer(tok, "Streamed reply."), answer(tok, text)])
    messages = [{"role": "user", "content": "Stream it"}]
    chunks = list(chat(client, messages, stream=True, stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Streamed reply." and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(served.model.calls[0].new)
    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Now a tool"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chunks = list(chat(client, messages, tools=tools, stream=True))
    (call,) = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert call.index == 0 and call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    session = served.backend.end(episode_id)
    assert session.sequence_starts() == [0] and model_tokens(session.sample()) == served.model.sampled()


def test_a_stop_string_of_one_token_ends_the_turn(tok, served):
    episode_id, client = served.episode([tok.encode("Compute <tool>1+1") + tok.encode(TOOL_END) + tok.encode("junk"),
                                         answer(tok, "2.")])
    messages = [{"role": "user", "content": "1+1"}]
    choice = chat(client, messages, stop=[TOOL_END]).choices[0]
    assert choice.message.content == "Compute <tool>1+1" and choice.finish_reason == "stop"
    messages += [{"role": "assistant", "content": choice.message.content}, {"role": "tool", "content": "2"}]
    chat(client, messages)
    assert served.backend.session(episode_id).sequence_starts() == [0]  # the echo without the stop string continues


def record_of(served, episode_id):
    session = served.backend.session(episode_id)
    return copy.deepcopy((session.sample(), session.sequence_starts(), session.turns))


def expect_error(call, status, code, param=None):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    assert (e.value.status_code, e.value.code) == (status, code), e.value.body
    if param is not None:
        assert e.value.body["param"] == param
    return e.value


def test_bad_requests_get_named_errors_and_leave_the_episode_as_it_was(tok, served):
    episode_id, client = served.episode([answer(tok, "Fine.")])
    messages = [{"role": "user", "content": "How are you?"}]
    chat(client, messages)
    messages += [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Good."}]
    before, calls = record_of(served, episode_id), len(served.model.calls)

    def refused(status, code, param=None, **kw):
        expect_error(lambda: chat(kw.pop("client", client), kw.pop("messages", messages), **kw), status, code, param)
        assert record_of(served, episode_id) == before and len(served.model.calls) == calls

    refused(401, "invalid_api_key", client=served.client(episode_id, api_key="wrong"))
    refused(404, "episode_not_found", client=served.client("no-such-episode"))
    refused(404, "model_not_found", "model", model="gpt-4o")  # `model` as a keyword replaces MODEL
    refused(400, "invalid_request", "messages", messages=[])
    refused(400, "invalid_request", "messages[1].role", messages=[messages[0], {"content": "x"}])
    refused(400, "invalid_request", "temperature", temperature=-1)
    refused(400, "invalid_request", "top_p", top_p=0)
    refused(400, "invalid_request", "max_tokens", max_tokens=0)
    refused(400, "invalid_request", "n", n=2)
    refused(400, "invalid_request", "stop", stop=["two tokens at least"])
    refused(400, "invalid_request", "stop", stop=[TOOL_END] * 5)
    refused(400, "invalid_request", "presence_penalty", presence_penalty=0.5)
    refused(400, "invalid_request", "stream", stream="yes")
    refused(400, "invalid_messages", "messages", messages=[{"role": "user", "content": None}])
    long = [{"role": "user", "content": "word " * MAX_CONTEXT}]
    refused(400, "context_length_exceeded", "messages", messages=long)
    # Requests the client cannot send malformed: raw HTTP.
    url = f"{served.endpoint.episode_url(episode_id)}/chat/completions"
    for body, param in ((b"{not json", "body"), (b"[1, 2]", "body"), (json.dumps({"messages": messages}), "model")):
        response = httpx.post(url, content=body, headers={"Authorization": f"Bearer {served.endpoint.token}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert response.headers["x-should-retry"] == "false"
    no_token = httpx.post(url, json={"model": MODEL, "messages": messages})
    assert no_token.status_code == 401 and "missing" in no_token.json()["error"]["message"]
    assert record_of(served, episode_id) == before and len(served.model.calls) == calls
    # The episode still serves.
    served.model.turns.append(answer(tok, "Great."))
    assert chat(client, messages).choices[0].message.content == "Great."


def test_requests_after_the_end_get_409(tok, served):
    episode_id, client = served.episode([answer(tok, "Bye.")])
    chat(client, [{"role": "user", "content": "Bye"}])
    sample = served.backend.end(episode_id).sample()
    expect_error(lambda: chat(client, [{"role": "user", "content": "Still there?"}]), 409, "episode_ended")
    assert len(served.model.calls) == 1 and sample.tokens
    with pytest.raises(ValueError, match="ended"):
        served.backend.open(episode_id)


def test_a_failed_generation_is_a_named_500_and_records_nothing(tok, served):
    episode_id, client = served.episode([answer(tok, "One.")])
    chat(client, [{"role": "user", "content": "1"}])
    before = record_of(served, episode_id)

    async def failing(*args):
        raise RuntimeError("the engine is down")

    served.backend.generate, generate = failing, served.backend.generate
    try:
        expect_error(lambda: chat(client, [{"role": "user", "content": "2"}]), 500, "generation_failed")
    finally:
        served.backend.generate = generate
    assert record_of(served, episode_id) == before


def test_concurrent_requests_of_one_episode_are_answered_one_at_a_time(tok, served):
    episode_id, client = served.episode([answer(tok, "A."), answer(tok, "B.")])
    replies, errors = [], []

    def agent(text):
        try:
            replies.append(chat(client, [{"role": "user", "content": text}]).choices[0].message.content)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(t,)) for t in ("x", "y")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(replies) == ["A.", "B."]
    session = served.backend.end(episode_id)
    sample = session.sample()
    assert len(session.sequence_starts()) == 2  # two unrelated conversations: two sequences
    assert model_tokens(sample) == served.model.sampled()


def test_close_stops_serving(tok):
    endpoint = OpenAIEndpoint(SessionBackend(tok, ScriptedModel().generate, max_context=64), model=MODEL)
    url = endpoint.start()
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {endpoint.token}"})
    assert json.load(urllib.request.urlopen(request, timeout=10))["data"][0]["id"] == MODEL
    endpoint.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(request, timeout=5)


def test_an_episode_ended_during_its_turn_records_nothing(tok, served):
    episode_id, client = served.episode([answer(tok, "Late.")])
    session, generate = served.backend.session(episode_id), served.backend.generate

    async def ended_meanwhile(*args):
        sample = await generate(*args)
        served.backend.end(episode_id)  # the agent's episode is ended while its turn generates
        return sample

    served.backend.generate = ended_meanwhile
    try:
        expect_error(lambda: chat(client, [{"role": "user", "content": "Hi"}]), 409, "episode_ended")
    finally:
        served.backend.generate = generate
    assert len(served.model.calls) == 1 and session.turns == 0 and session.sample().tokens == []


def test_a_run_may_fix_the_sampling_whatever_the_agent_asks(tok):
    model = ScriptedModel([answer(tok, "Ok.")])
    backend = SessionBackend(tok, model.generate, max_context=MAX_CONTEXT, override={"temperature": 1.0, "top_p": 1.0})
    backend.open("e")
    sampling = ChatSampling(temperature=0.1, top_p=0.5, max_tokens=10_000)
    reply = asyncio.run(backend.chat("e", [{"role": "user", "content": "Hi"}], None, sampling))
    (call,) = model.calls
    assert reply.content == "Ok." and (call.params.temperature, call.params.top_p) == (1.0, 1.0)
    assert call.params.max_tokens == MAX_CONTEXT - len(call.prompt)  # max_tokens capped at the context's end
    for bad, field in (({"max_tokens": 5}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                       ({"top_k": 0.5}, "top_k")):
        with pytest.raises(ValueError, match=field):
            SessionBackend(tok, model.generate, max_context=MAX_CONTEXT, override=bad)


def test_episode_ids_open_end_and_forget(tok):
    backend = SessionBackend(tok, ScriptedModel().generate, max_context=MAX_CONTEXT)
    for bad in ("", "a/b", "x" * 257, 7):
        with pytest.raises(ValueError, match="episode id"):
            backend.open(bad)
    backend.open("g:1:0")
    with pytest.raises(ValueError, match="already open"):
        backend.open("g:1:0")
    with pytest.raises(ValueError, match="is open"):
        backend.forget("g:1:0")
    backend.end("g:1:0")
    with pytest.raises(KeyError):
        backend.end("g:1:0")
    with pytest.raises(EpisodeEnded):
        backend.session("g:1:0")
    backend.forget("g:1:0")
    with pytest.raises(UnknownEpisode):
        backend.session("g:1:0")
    assert backend.open("g:1:0").turns == 0


def test_a_template_that_leaves_tools_out_is_reported_once(tok, caplog):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = Tokenizer(tok.backend, tok.special_tokens, {"default": TOOLS_TEMPLATE})
    for tokenizer, warnings in ((tok, 1), (with_tools, 0)):
        caplog.clear()
        model = ScriptedModel([answer(tok, "a"), answer(tok, "b")])
        backend = SessionBackend(tokenizer, model.generate, max_context=MAX_CONTEXT)
        backend.open("e")
        for text in ("x", "y"):
            asyncio.run(backend.chat("e", [{"role": "user", "content": text}], tools, ChatSampling()))
        assert sum("does not render the `tools`" in r.getMessage() for r in caplog.records) == warnings
