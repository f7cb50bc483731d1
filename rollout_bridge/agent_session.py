"""The bookkeeping of one black-box agent's episode: the token sequences its chat requests add up to.

An agent written against the OpenAI chat API sends its whole conversation with every request; the model
sees it as the chat template renders it. `AgentSession` turns that stream of conversations into training
data without ever re-encoding what the model sampled:

- `prepare(messages, tools)` renders the request with the generation prompt to text R. The session holds
  the current sequence's token ids and the text they stand for, T: the last request's rendering followed
  by the decoded model turn (special tokens kept). If R starts with T, the agent only appended to its
  history: the new context is the current ids plus `encode(R[len(T):])`, environment tokens (the agent's
  and its tools' messages, the next assistant header). Otherwise the agent rewrote its history (truncated
  it, edited an earlier turn, retried a request): the next turn starts a new sequence whose tokens are
  `encode(R)`, all environment. One leniency: when the model's last turn ended at a stop token whose text
  the agent's echo leaves out (OpenAI's `stop` strings are not part of the reply; the template then
  closes the turn with its own end-of-turn text), R may start with T less that token's text; the
  sampled stop token stays in the sequence, as the model saw it.
  T is kept as the concatenation of exactly the texts that produced the ids (the rendered requests and
  the decoded turns) rather than `decode(ids)`: a tokenizer's decode does not always give back the text
  it encoded (normalisation, a character split between two pieces), and a T that differs from what the
  template renders would split every turn.
  `prepare` changes nothing: it returns a `Turn` holding what an engine needs to continue, the sequence's
  first-turn context as `prompt` and the rest as a prefix `Sample` (the `Request(prompt, prefix=...)`
  shape of `rollout_bridge.engine`), so the caller submits it as `rollout_bridge.episodes` does.
- `record(turn, sample)` takes the engine's Sample (the prefix plus the new tokens, their log-probs and
  versions), commits the turn (a sequence split included) and returns the `Reply`: the decoded new tokens
  without a trailing stop token, the finish reason and the token counts. A turn that generated no token
  changes nothing. A turn prepared before another was recorded is refused (`StaleTurn`): the caller
  serialises an episode's requests.
- `sample()` is the whole episode as one Sample: every sequence's tokens one after another, each opening
  with its context as an environment span; `sequence_starts()` lists where each sequence begins (0 first:
  every sequence is its own context, the group's prompt is not part of it). Environment tokens have
  log-prob 0 and the version of the model token before them, a sequence's leading context that of the
  sequence's first model token, so every version lies in the model turns' range.

Everything is checked before anything changes: a context longer than `max_context` raises
`ContextTooLong` (an episode that would outgrow `max_episode_tokens`, `EpisodeTooLong`), messages the
template cannot render `InvalidMessages`, an engine's sample that does not continue the turn's prefix
`BadGeneration`. The record is read and written under a lock, so `sample()`
may be called from any thread while turns are recorded.

Also here, for the endpoint: `stop_ids_of` (OpenAI `stop` strings as the stop token ids an engine takes)
and `parse_tool_calls` (a Hermes-style `<tool_call>{json}</tool_call>` reply as OpenAI `tool_calls`).
The reply's content is never rewritten in the record: tool calls parsed from it are only a view for the
agent, and an agent that sends them back gets them rendered by the template (which, if it renders them
differently from the model's text, starts a new sequence).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from jaxflow.data import checks
from jaxflow.data.records import Sample
from jaxflow.data.service_errors import SampleRefused
from rollout_bridge.engine import Request, SamplingParams

__all__ = ["AgentSessionError", "AgentSession", "BadGeneration", "ContextTooLong", "EpisodeTooLong", "InvalidMessages",
           "Reply",
           "StaleTurn", "Turn", "parse_tool_calls", "stop_ids_of"]


class AgentSessionError(ValueError):
    """A request or a generation the session refused; nothing changed."""


class ContextTooLong(AgentSessionError):
    """The request's context (`tokens`) leaves no room for a generated token within `max_context`."""

    def __init__(self, tokens: int, max_context: int, message: str | None = None):
        self.tokens, self.max_context = tokens, max_context
        super().__init__(message or f"the conversation is {tokens} tokens; with at least one generated token that "
                         f"is more than the context of {max_context} tokens")


class EpisodeTooLong(ContextTooLong):
    """The turn would take the episode (all its sequences: `tokens` with the request's context) past
    `max_episode_tokens` (the most a trainer row holds)."""

    def __init__(self, tokens: int, max_episode_tokens: int):
        super().__init__(tokens, max_episode_tokens, f"the episode would hold {tokens} tokens with this request's "
                         f"context; with at least one generated token that is more than its limit of "
                         f"{max_episode_tokens} tokens")


class InvalidMessages(AgentSessionError):
    """The chat template could not render the request's messages (or tools)."""


class BadGeneration(AgentSessionError):
    """An engine's sample that does not continue the turn it was asked for (or failed)."""


class StaleTurn(AgentSessionError):
    """A turn prepared before another turn of the same session was recorded."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """What `AgentSession.prepare` hands the caller for one request.

    prompt: the sequence's first-turn context (token ids). prefix: the rest of the sequence so far and the
    request's new environment tokens (env_spans relative to the prefix); the engine continues from
    prompt + prefix.tokens. new_sequence: whether this turn starts a sequence (the first request, or the
    agent rewrote its history). sequence_index: which sequence of the episode the turn belongs to (0, 1,
    ...; a caller whose engine keeps a request's cache between turns may key it on this). room: the most
    tokens the turn may generate within max_context (and max_episode_tokens). stop_token_ids: the tokens
    that end the turn (the tokenizer's end of sequence and the request's own), for the engine's
    SamplingParams.
    """

    prompt: list[int]
    prefix: Sample
    new_sequence: bool
    sequence_index: int
    room: int
    stop_token_ids: tuple[int, ...]
    rendered: str
    env_ids: list[int]  # the environment tokens this turn adds (all of `prompt` for a new sequence)
    base: int  # the session's record count when prepared

    @property
    def context_tokens(self) -> int:
        """The tokens the model is given: prompt + prefix."""
        return len(self.prompt) + len(self.prefix.tokens)

    def request(self, request_id: str, params: SamplingParams) -> Request:
        """The engine request that generates this turn (prompt, a copy of the prefix); `params.max_tokens`
        counts the prefix, as an engine's does."""
        return Request(request_id, list(self.prompt), params, prefix=copy.deepcopy(self.prefix))


@dataclasses.dataclass(frozen=True)
class Reply:
    """A recorded turn as the agent gets it. content: the new tokens decoded (special tokens kept) without
    a trailing stop token. finish_reason: "stop" (ended at a stop token) or "length" (ran out of tokens).
    prompt_tokens / completion_tokens: the context given to the model and the tokens it sampled.
    token_ids / logprobs: the sampled tokens of `content` (the stop token left out) and their log-probs."""

    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()


@dataclasses.dataclass
class _Sequence:
    """One training sequence: its context `tokens[:prompt_len]` (environment) then model turns and the
    environment's tokens between them; env_spans relative to the sequence."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    env_spans: list[list[int]]
    prompt_len: int
    text: str = ""  # the text the tokens stand for (see the module docstring)
    stop_text: str = ""  # the text of the stop token that ended the last model turn, "" if none


class AgentSession:
    """See the module docstring. tokenizer: a `jaxflow.tokenizer.Tokenizer` (or one with the same
    `apply_chat_template`, `encode`, `decode` and `eos_id`). max_context: the most tokens one sequence
    may hold, its context and the tokens generated into it. max_episode_tokens: the most tokens the whole
    episode (`sample()`, every sequence) may hold, None for no limit: a trainer row's length, so that the
    agent is refused a turn rather than the trainer the episode. template_kwargs: further chat template
    variables (e.g. `enable_thinking=False`)."""

    def __init__(self, tokenizer: Any, *, max_context: int, max_episode_tokens: int | None = None,
                 **template_kwargs: Any):
        checks.check_int("max_context", max_context, lo=2)
        if max_episode_tokens is not None:
            checks.check_int("max_episode_tokens", max_episode_tokens, lo=2)
        self.tokenizer, self.max_context, self.template_kwargs = tokenizer, max_context, template_kwargs
        self.max_episode_tokens = max_episode_tokens
        eos = getattr(tokenizer, "eos_id", None)
        self._eos: tuple[int, ...] = () if eos is None else (int(eos),)
        self._lock = threading.RLock()  # the record is read (sample) from other threads than the one recording
        self._closed: list[_Sequence] = []
        self._current: _Sequence | None = None
        self._records = 0

    # ----- reading -----

    @property
    def turns(self) -> int:
        """The turns recorded so far (those that generated at least one token)."""
        return self._records

    @property
    def sequences(self) -> int:
        """The training sequences so far."""
        return len(self._closed) + (self._current is not None)

    def sequence_starts(self) -> list[int]:
        """Where each sequence begins in `sample().tokens`: [0, ...] ([] before the first turn)."""
        starts, offset = [], 0
        with self._lock:
            sequences = self._all()
        for seq in sequences:
            starts.append(offset)
            offset += len(seq.tokens)
        return starts

    def sample(self) -> Sample:
        """The episode so far as one Sample (see the module docstring); finish_reason None, for the caller
        to set. When `Sample` has a `sequence_starts` field, it is filled in too."""
        out = Sample()
        with self._lock:
            for seq in self._all():
                offset = len(out.tokens)
                out.env_spans += [[offset + a, offset + b] for a, b in seq.env_spans]
                out.tokens += seq.tokens
                out.logprobs += seq.logprobs
                out.versions += seq.versions
            if "sequence_starts" in {f.name for f in dataclasses.fields(Sample)}:
                out.sequence_starts = self.sequence_starts()
        return out

    def _all(self) -> list[_Sequence]:
        return [*self._closed, *([self._current] if self._current is not None else [])]

    # ----- a turn -----

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The request's text: `messages` (and `tools`, if any) through the chat template, with the
        generation prompt. Raises InvalidMessages when the template cannot render them."""
        kwargs = dict(self.template_kwargs)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template's failure is the request's fault, whatever it raises
            raise InvalidMessages(f"messages: the chat template cannot render them ({type(e).__name__}: {e})") \
                from None
        if not isinstance(text, str) or not text:
            raise InvalidMessages("messages: the chat template renders them to no text")
        return text

    def prepare(self, messages: list[dict], tools: list[dict] | None = None, *,
                stop_token_ids: Iterable[int] = ()) -> Turn:
        """The turn that answers a request (see the module docstring); changes nothing. stop_token_ids:
        tokens that end the turn besides the tokenizer's end of sequence. Raises InvalidMessages,
        ContextTooLong (EpisodeTooLong)."""
        rendered = self.render(messages, tools)
        stops = tuple(dict.fromkeys((*self._eos, *(int(t) for t in stop_token_ids))))
        with self._lock:
            return self._prepare(rendered, stops)

    def _prepare(self, rendered: str, stops: tuple[int, ...]) -> Turn:
        cur = self._current
        delta = self._continuation(cur, rendered)
        if delta is None:  # a new sequence: everything the model is given is context
            prompt = self.tokenizer.encode(rendered)
            if not prompt:
                raise InvalidMessages("messages: the chat template's text encodes to no tokens")
            return self._turn(prompt, Sample(), True, len(self._closed) + (cur is not None), stops, rendered,
                              prompt)
        env_ids = self.tokenizer.encode(delta) if delta else []
        version = cur.versions[-1]
        n = len(cur.tokens) - cur.prompt_len
        prefix = Sample(tokens=cur.tokens[cur.prompt_len:] + env_ids,
                        logprobs=cur.logprobs[cur.prompt_len:] + [0.0] * len(env_ids),
                        versions=cur.versions[cur.prompt_len:] + [version] * len(env_ids),
                        env_spans=[[a - cur.prompt_len, b - cur.prompt_len] for a, b in cur.env_spans[1:]]
                        + ([[n, n + len(env_ids)]] if env_ids else []))
        return self._turn(cur.tokens[:cur.prompt_len], prefix, False, len(self._closed), stops, rendered, env_ids)

    def _continuation(self, cur: _Sequence | None, rendered: str) -> str | None:
        """The text `rendered` adds to the current sequence, or None if it does not continue it."""
        if cur is None:
            return None
        if rendered.startswith(cur.text):
            return rendered[len(cur.text):]
        if cur.stop_text and cur.text.endswith(cur.stop_text):
            kept = cur.text[:len(cur.text) - len(cur.stop_text)]
            if rendered.startswith(kept):
                return rendered[len(kept):]
        return None

    def _turn(self, prompt: list[int], prefix: Sample, new: bool, index: int, stops: tuple[int, ...],
              rendered: str, env_ids: list[int]) -> Turn:
        context = len(prompt) + len(prefix.tokens)
        if context + 1 > self.max_context:
            raise ContextTooLong(context, self.max_context)
        room = self.max_context - context
        if self.max_episode_tokens is not None:
            total = sum(len(seq.tokens) for seq in self._all()) + len(env_ids)
            if total + 1 > self.max_episode_tokens:
                raise EpisodeTooLong(total, self.max_episode_tokens)
            room = min(room, self.max_episode_tokens - total)
        return Turn(prompt=list(prompt), prefix=prefix, new_sequence=new, sequence_index=index,
                    room=room, stop_token_ids=stops, rendered=rendered,
                    env_ids=list(env_ids), base=self._records)

    def record(self, turn: Turn, sample: Sample) -> Reply:
        """Commits `turn` with the engine's `sample` (its prefix followed by the new tokens) and returns the
        reply. Raises StaleTurn if another turn was recorded since `turn` was prepared, BadGeneration if
        `sample` is not a finished ("stop"/"length") continuation of the turn's prefix; nothing changes
        then."""
        with self._lock:
            return self._record(turn, sample)

    def _record(self, turn: Turn, sample: Sample) -> Reply:
        if turn.base != self._records:
            raise StaleTurn(f"the turn was prepared after {turn.base} recorded turns, but {self._records} are "
                            f"recorded now; an episode's requests must be answered one at a time")
        new = self._check_generation(turn, sample)
        context = turn.context_tokens
        if not new:
            return Reply("", sample.finish_reason, context, 0)
        ids, logprobs, versions = (list(getattr(sample, f)[len(turn.prefix.tokens):])
                                   for f in ("tokens", "logprobs", "versions"))
        ends_at_stop = sample.finish_reason == "stop" and ids[-1] in turn.stop_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        stop_text = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ends_at_stop else ""
        content = self.tokenizer.decode(ids[:-1] if ends_at_stop else ids, skip_special_tokens=False)
        # From here on nothing raises: the turn is committed whole.
        if turn.new_sequence:
            if self._current is not None:
                self._closed.append(self._current)
            n = len(turn.prompt)
            self._current = _Sequence(tokens=list(turn.prompt), logprobs=[0.0] * n, versions=[versions[0]] * n,
                                      env_spans=[[0, n]], prompt_len=n)
        else:
            cur, env = self._current, turn.env_ids
            if env:
                cur.env_spans.append([len(cur.tokens), len(cur.tokens) + len(env)])
                cur.versions += [cur.versions[-1]] * len(env)
                cur.tokens += env
                cur.logprobs += [0.0] * len(env)
        cur = self._current
        cur.tokens += ids
        cur.logprobs += logprobs
        cur.versions += versions
        cur.text, cur.stop_text = turn.rendered + text, stop_text
        self._records += 1
        shown = len(ids) - ends_at_stop
        return Reply(content, sample.finish_reason, context, len(ids), tuple(ids[:shown]), tuple(logprobs[:shown]))

    def _check_generation(self, turn: Turn, sample: Sample) -> int:
        """The number of new tokens in `sample`, after checking it continues `turn`; else BadGeneration."""
        if not isinstance(sample, Sample):
            raise BadGeneration(f"generate returned a {type(sample).__name__}, not a Sample")
        if sample.finish_reason not in ("stop", "length"):
            raise BadGeneration(f"generation ended with finish_reason {sample.finish_reason!r}, not 'stop' or "
                                f"'length'")
        for field in ("tokens", "logprobs", "versions"):
            if not isinstance(getattr(sample, field), list):
                raise BadGeneration(f"generated sample: {field} must be a list")
        p = len(turn.prefix.tokens)
        n = len(sample.tokens)
        if len(sample.logprobs) != n or len(sample.versions) != n:
            raise BadGeneration(f"generated sample: {n} tokens but {len(sample.logprobs)} log-probs and "
                                f"{len(sample.versions)} versions")
        if n < p or sample.tokens[:p] != turn.prefix.tokens:
            raise BadGeneration(f"generated sample does not start with the turn's {p} prefix tokens")
        if n - p > turn.room:
            raise BadGeneration(f"generated {n - p} tokens, more than the turn's room of {turn.room}")
        try:
            checks.check_token_ids("generated sample", "tokens", sample.tokens[p:], None)
        except SampleRefused as e:
            raise BadGeneration(str(e)) from None
        for i in range(p, n):
            lp, v = sample.logprobs[i], sample.versions[i]
            if not checks.is_number(lp) or not math.isfinite(lp) or lp > 0:
                raise BadGeneration(f"generated sample: logprobs[{i}] = {lp!r}; log-probs must be finite numbers "
                                    f"<= 0")
            if not checks.is_int(v) or v < 0:
                raise BadGeneration(f"generated sample: versions[{i}] = {v!r}; versions must be ints >= 0")
        return n - p


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(content: str) -> tuple[str | None, list[dict]]:
    """Hermes-style tool calls in a reply (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as
    Qwen's templates teach them) as OpenAI `tool_calls`, and the content left around them (None when
    nothing is left). A reply with no call, or with a call that is not such a JSON object, stays plain
    content: ([], content unchanged)."""
    calls = []
    for match in _TOOL_CALL.finditer(content):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return content, []
        if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments", {}), (dict, str))):
            return content, []
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    if not calls:
        return content, []
    rest = _TOOL_CALL.sub("", content).strip()
    return rest or None, calls


def stop_ids_of(tokenizer: Any, stop: Sequence[str]) -> tuple[int, ...]:
    """The token ids of OpenAI `stop` strings, each of which must be exactly one token (an engine stops at
    tokens, and the tokens trained on must be exactly those sampled: a stop string inside a token cannot
    end a turn). Raises ValueError naming the first string that is not one token."""
    out = []
    for i, s in enumerate(stop):
        ids = tokenizer.encode(s)
        if len(ids) != 1:
            raise ValueError(f"stop[{i}] = {s!r:.80} is {len(ids)} tokens; only stop strings of exactly one "
                             f"token are supported")
        out.append(ids[0])
    return tuple(out)
