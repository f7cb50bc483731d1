"""AgentSession: an agent's chat requests become training sequences whose model tokens are exactly the
sampled ones; a rewritten history splits the episode; refused input changes nothing."""

import copy
import json

import pytest
from agent_helpers import TOOL_END, TOOLS_TEMPLATE, ScriptedModel, env_tokens_are_context, model_tokens

from jaxflow.data import checks
from jaxflow.data.records import Sample
from jaxflow.models.tiny import write_tiny_tokenizer
from jaxflow.tokenizer import Tokenizer
from rollout_bridge.agent_session import (
    AgentSession,
    BadGeneration,
    ContextTooLong,
    EpisodeTooLong,
    InvalidMessages,
    StaleTurn,
    parse_tool_calls,
    stop_ids_of,
)
from rollout_bridge.engine import SamplingParams
from rollout_bridge.scripted import ScriptedEngine


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), extra_tokens=(TOOL_END,))


def answer(tok, text, stop=True):
    return tok.encode(text) + ([tok.eos_id] if stop else [])


def run_turn(session, model, messages, tools=None, stop_token_ids=(), max_tokens=10_000):
    turn = session.prepare(messages, tools, stop_token_ids=stop_token_ids)
    params = SamplingParams(max_tokens=len(turn.prefix.tokens) + min(max_tokens, turn.room),
                            stop_token_ids=turn.stop_token_ids)
    return turn, session.record(turn, model.turn("e", turn.prompt, turn.prefix, params))


def state(session):
    return session.sample(), session.sequence_starts(), session.turns


def check_valid(sample):
    checks.check_sample("episode", sample, min(sample.versions), max(sample.versions), finished=False)


def test_appending_conversation_is_one_sequence_of_exactly_the_sampled_tokens(tok):
    model = ScriptedModel([answer(tok, "Let me add <tool>2+3</tool>"), answer(tok, "It is 5, <tool>5*2</tool>"),
                           answer(tok, "The answer is 10.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "What is (2+3)*2?"}]
    first, reply = run_turn(session, model, messages)
    assert first.new_sequence and first.prefix.tokens == []
    assert first.prompt == tok.encode(tok.apply_chat_template(messages))
    assert reply.content == "Let me add <tool>2+3</tool>" and reply.finish_reason == "stop"
    assert (reply.prompt_tokens, reply.completion_tokens) == (len(first.prompt), len(model.calls[0].new))
    for observation in ("5", "10"):
        messages += [{"role": "assistant", "content": reply.content}, {"role": "tool", "content": observation}]
        turn, reply = run_turn(session, model, messages)
        assert not turn.new_sequence and turn.prompt == first.prompt  # the engine continues the same request
        # The prefix is everything after the prompt so far, then the tool's message as environment tokens.
        assert turn.prefix.tokens[:-len(turn.env_ids)] == session.sample().tokens[len(first.prompt):][
            :len(turn.prefix.tokens) - len(turn.env_ids)]
        assert turn.prefix.env_spans[-1] == [len(turn.prefix.tokens) - len(turn.env_ids), len(turn.prefix.tokens)]
    sample = session.sample()
    assert session.sequences == 1 and session.sequence_starts() == [0] and session.turns == 3
    assert model_tokens(sample) == model.sampled()  # bit-identical tokens, their log-probs and versions
    assert env_tokens_are_context(sample)
    # The sequence is the whole conversation as the template renders it, the final reply included.
    final = [*messages, {"role": "assistant", "content": reply.content}]
    assert tok.decode(sample.tokens, skip_special_tokens=False) == tok.apply_chat_template(final, False).rstrip("\n")
    # Environment tokens take the version of the model turn before them; the leading context the first's.
    starts = [a for a, _ in sample.env_spans]
    assert [sample.versions[a] for a in starts] == [3, 3, 4]
    check_valid(sample)


def test_edited_history_splits_into_a_new_sequence_and_only_sampled_tokens_are_trained(tok):
    model = ScriptedModel([answer(tok, "First try."), answer(tok, "Second."), answer(tok, "Again, better.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Say something."}]
    _, r1 = run_turn(session, model, messages)
    messages += [{"role": "assistant", "content": r1.content}, {"role": "user", "content": "More."}]
    _, r2 = run_turn(session, model, messages)
    before = session.sample()
    # The agent rewrites its first reply (a summary in place of history, an edited turn).
    edited = [messages[0], {"role": "assistant", "content": "First try, edited."}, messages[2]]
    turn, _ = run_turn(session, model, edited)
    assert turn.new_sequence and turn.sequence_index == 1 and turn.prefix.tokens == []
    assert turn.prompt == tok.encode(tok.apply_chat_template(edited))
    sample = session.sample()
    assert session.sequences == 2 and session.sequence_starts() == [0, len(before.tokens)]
    assert sample.tokens[:len(before.tokens)] == before.tokens  # the closed sequence is kept as it was
    # The second sequence opens with its whole context, as environment tokens.
    assert sample.env_spans[-1] == [len(before.tokens), len(before.tokens) + len(turn.prompt)]
    assert sample.tokens[len(before.tokens):][:len(turn.prompt)] == turn.prompt
    # whose version is that of the sequence's first model token (the third turn's, 5)
    assert set(sample.versions[len(before.tokens):len(before.tokens) + len(turn.prompt)]) == {5}
    assert model_tokens(sample) == model.sampled()
    assert env_tokens_are_context(sample)
    check_valid(sample)
    if "sequence_starts" in Sample.__dataclass_fields__:
        assert sample.sequence_starts == [0, len(before.tokens)]


def test_a_retried_request_starts_a_new_sequence(tok):
    model = ScriptedModel([answer(tok, "One."), answer(tok, "Two.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Hi"}]
    run_turn(session, model, messages)
    turn, _ = run_turn(session, model, messages)  # the same request again (a client retry)
    assert turn.new_sequence and session.sequences == 2
    assert model_tokens(session.sample()) == model.sampled()


def test_stop_string_left_out_of_the_echo_keeps_the_sequence_and_the_sampled_stop_token(tok):
    """An agent that stops at "</tool>" (OpenAI `stop`: not in the reply) and echoes the reply without it
    continues the same sequence; the sampled "</tool>" stays in it, where the model wrote it."""
    (tool_end,) = stop_ids_of(tok, [TOOL_END])
    model = ScriptedModel([tok.encode("Compute <tool>2+3") + [tool_end], answer(tok, "5.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "2+3?"}]
    _, reply = run_turn(session, model, messages, stop_token_ids=[tool_end])
    assert reply.content == "Compute <tool>2+3" and reply.completion_tokens == len(model.calls[0].new)
    messages += [{"role": "assistant", "content": reply.content}, {"role": "tool", "content": "5"}]
    turn, _ = run_turn(session, model, messages)
    assert not turn.new_sequence
    # The environment tokens after the stop token close the turn as the template does.
    assert tok.decode(turn.env_ids, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>tool\n5")
    sample = session.sample()
    assert session.sequences == 1 and model_tokens(sample) == model.sampled()
    assert tool_end in sample.tokens


def test_exact_text_is_kept_where_decoding_would_not_give_it_back(tok):
    """The tokenizer normalises to NFC, so a tool answer with a decomposed "é" does not decode to the text
    that was encoded; the session still sees the next request as a continuation, since it compares with
    the texts it rendered, not with a decode of its ids."""
    decomposed = "cafe\u0301"
    assert tok.decode(tok.encode(decomposed)) != decomposed
    model = ScriptedModel([answer(tok, "Look up <tool>menu</tool>"), answer(tok, "Coffee.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Menu?"}]
    _, reply = run_turn(session, model, messages)
    messages += [{"role": "assistant", "content": reply.content}, {"role": "tool", "content": decomposed}]
    run_turn(session, model, messages)
    messages += [{"role": "assistant", "content": "Coffee."}, {"role": "user", "content": "Thanks"}]
    turn = session.prepare(messages)
    assert not turn.new_sequence and session.sequences == 1


def test_length_finish_continues_with_the_template_closing_the_turn(tok):
    model = ScriptedModel([answer(tok, "A long answer that is cut"), answer(tok, "ok")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Talk"}]
    _, reply = run_turn(session, model, messages, max_tokens=4)
    assert reply.finish_reason == "length" and reply.completion_tokens == 4
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "go on"}]
    turn, _ = run_turn(session, model, messages)
    assert not turn.new_sequence
    assert tok.decode(turn.env_ids, skip_special_tokens=False).startswith("<|im_end|>")


def test_prepare_changes_nothing_and_refused_generations_leave_the_state_as_it_was(tok):
    model = ScriptedModel([answer(tok, "Hello there.")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Hi"}]
    run_turn(session, model, messages)
    messages += [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "And?"}]
    before = copy.deepcopy(state(session))
    turn = session.prepare(messages)
    session.prepare([{"role": "user", "content": "something else entirely"}])
    assert state(session) == before
    p = turn.prefix
    new = tok.encode("Fine.") + [tok.eos_id]

    def reply(tokens=None, logprobs=None, versions=None, finish="stop"):
        return Sample(tokens=p.tokens + new if tokens is None else tokens,
                      logprobs=p.logprobs + [-0.5] * len(new) if logprobs is None else logprobs,
                      versions=p.versions + [7] * len(new) if versions is None else versions,
                      finish_reason=finish)

    bad = {"an aborted turn": reply(finish="abort"), "an engine error": reply(finish="error"),
           "a different prefix": reply(tokens=[5, *p.tokens[1:], *new]),
           "too few log-probs": reply(logprobs=p.logprobs + [-0.5]),
           "a positive log-prob": reply(logprobs=p.logprobs + [0.5] * len(new)),
           "a NaN log-prob": reply(logprobs=p.logprobs + [float("nan")] * len(new)),
           "a negative version": reply(versions=p.versions + [-1] * len(new)),
           "a negative token": reply(tokens=p.tokens + [-3] * len(new)),
           "more than the room": reply(tokens=p.tokens + [5] * (turn.room + 1),
                                       logprobs=p.logprobs + [-0.5] * (turn.room + 1),
                                       versions=p.versions + [7] * (turn.room + 1)),
           "not a Sample": {"tokens": []}}
    for what, sample in bad.items():
        with pytest.raises(BadGeneration):
            session.record(turn, sample)
        assert state(session) == before, what
    session.record(turn, reply())  # the turn still records after the refusals
    assert session.turns == 2


def test_a_turn_without_tokens_changes_nothing(tok):
    model = ScriptedModel([[]])
    session = AgentSession(tok, max_context=2048)
    turn, reply = run_turn(session, model, [{"role": "user", "content": "Hi"}])
    assert reply.content == "" and reply.completion_tokens == 0
    assert session.sequences == 0 and session.sample() == Sample() and session.sequence_starts() == []


def test_context_over_the_limit_is_refused_before_anything_changes(tok):
    model = ScriptedModel([answer(tok, "ok")])
    messages = [{"role": "user", "content": "Hi"}]
    n = len(tok.encode(tok.apply_chat_template(messages)))
    with pytest.raises(ContextTooLong) as e:
        AgentSession(tok, max_context=n).prepare(messages)  # no room for a generated token
    assert (e.value.tokens, e.value.max_context) == (n, n)
    session = AgentSession(tok, max_context=n + 3)
    turn, _ = run_turn(session, model, messages)
    assert turn.room == 3
    before = copy.deepcopy(state(session))
    with pytest.raises(ContextTooLong):
        session.prepare(messages + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More"}])
    assert state(session) == before


def test_a_stale_turn_is_refused(tok):
    model = ScriptedModel([answer(tok, "a"), answer(tok, "b")])
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "Hi"}]
    first = session.prepare(messages)
    second = session.prepare(messages)
    params = SamplingParams(max_tokens=100, stop_token_ids=first.stop_token_ids)
    session.record(first, model.turn("e", first.prompt, first.prefix, params))
    before = copy.deepcopy(state(session))
    with pytest.raises(StaleTurn):
        session.record(second, model.turn("e", second.prompt, second.prefix, params))
    assert state(session) == before


def test_messages_the_template_cannot_render_are_refused(tok):
    session = AgentSession(tok, max_context=2048)
    with pytest.raises(InvalidMessages, match="messages"):
        session.prepare([{"role": "user"}])  # no content: the template cannot add it to a string
    with pytest.raises(ValueError, match="max_context"):
        AgentSession(tok, max_context=1)


def test_tools_reach_a_template_that_renders_them(tok):
    with_tools = Tokenizer(tok.backend, tok.special_tokens, {"default": TOOLS_TEMPLATE})
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Hi"}]
    turn = AgentSession(with_tools, max_context=2048).prepare(messages, tools)
    text = tok.decode(turn.prompt, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nTools: " + json.dumps(tools))
    assert AgentSession(with_tools, max_context=2048).prepare(messages).prompt == tok.encode(
        tok.apply_chat_template(messages))


def test_hermes_tool_calls_parse_into_openai_tool_calls():
    content, calls = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                                      '</tool_call>')
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "add", {"a": 2, "b": 3})]
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[0] is None
    for plain in ("no call here", "<tool_call>{not json}</tool_call>", '<tool_call>["add"]</tool_call>'):
        assert parse_tool_calls(plain) == (plain, [])


def test_stop_strings_must_be_one_token(tok):
    assert stop_ids_of(tok, [TOOL_END, "<|im_end|>"]) == (tok.encode(TOOL_END)[0], tok.eos_id)
    with pytest.raises(ValueError, match=r"stop\[1\]"):
        stop_ids_of(tok, [TOOL_END, "Observation:"])


def test_turns_run_on_an_engine_as_requests(tok):
    """A turn is an engine `Request(prompt, prefix=...)`: run on the scripted engine, turn after turn."""
    replies = iter([answer(tok, "Use <tool>1+1</tool>"), answer(tok, "Two.")])
    engine = ScriptedEngine(lambda request: next(replies), logprob=-0.75)
    session = AgentSession(tok, max_context=2048)
    messages = [{"role": "user", "content": "1+1?"}]
    for version in (4, 5):
        engine.version = version
        turn = session.prepare(messages)
        params = SamplingParams(max_tokens=len(turn.prefix.tokens) + 50, stop_token_ids=turn.stop_token_ids)
        (completion,) = engine.generate([turn.request("episode-0", params)])
        reply = session.record(turn, completion.sample)
        messages += [{"role": "assistant", "content": reply.content}, {"role": "tool", "content": "2"}]
    sample = session.sample()
    assert session.sequences == 1
    assert [(lp, v) for _, lp, v in model_tokens(sample)] == [(-0.75, 4)] * len(answer(tok, "Use <tool>1+1</tool>")) \
        + [(-0.75, 5)] * len(answer(tok, "Two."))
    check_valid(sample)


def test_an_episode_over_its_token_limit_is_refused_a_turn_before_anything_changes(tok):
    """max_episode_tokens bounds every sequence together: a split's whole new context counts, a
    continuation only its new tokens."""
    messages = [{"role": "user", "content": "Count the words of this sentence, slowly and carefully, please."}]
    more = [*messages, {"role": "assistant", "content": "Ten."}, {"role": "user", "content": "Go"}]
    probe = AgentSession(tok, max_context=2048)
    run_turn(probe, ScriptedModel([answer(tok, "Ten.")]), messages)
    total, n, env = len(probe.sample().tokens), len(probe.prepare(messages).prompt), len(probe.prepare(more).env_ids)
    assert n > env + 2  # so the limit below admits the continuation but not a split
    limit = total + env + 3
    session = AgentSession(tok, max_context=2048, max_episode_tokens=limit)
    first, _ = run_turn(session, ScriptedModel([answer(tok, "Ten.")]), messages)
    assert first.room == limit - n  # the episode's limit, tighter than the context's
    before = copy.deepcopy(state(session))
    with pytest.raises(EpisodeTooLong) as e:  # the same request again: a new sequence of n more tokens
        session.prepare(messages)
    assert isinstance(e.value, ContextTooLong) and e.value.tokens == total + n
    assert state(session) == before
    turn = session.prepare(more)
    assert not turn.new_sequence and turn.room == 3
