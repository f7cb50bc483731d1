"""An OpenAI-compatible chat endpoint over jaxflow's engines, so that a black-box agent trains unchanged.

`OpenAIEndpoint(backend, model=...)` serves, on 127.0.0.1 and a free port, from a thread of its own
(a `uvicorn.Server` with its own event loop; `start()` returns the base URL, `close()` stops it):

- `GET /v1/models`: the served model.
- `POST /v1/chat/completions`: OpenAI's chat completion body (messages, tools, temperature, top_p,
  max_tokens or max_completion_tokens, stop, seed, n = 1, logprobs, stream) answered with OpenAI's
  response schema, so the official `openai` client parses it. A streamed answer (`stream: true`) comes
  as server-sent events once the whole turn is generated: the message in one chunk, then the finish
  reason (and the usage, with `stream_options: {"include_usage": true}`), then `[DONE]`.
  Options the engines do not sample with (presence and frequency penalties, logit_bias, top_logprobs,
  n > 1, a stop string of more than one token) are refused, never ignored; fields that do not change
  the sampling (tool_choice, user, metadata, ...) are ignored. With `tools`, a reply holding Hermes-style
  `<tool_call>{json}</tool_call>` blocks comes back as OpenAI `tool_calls` (finish_reason "tool_calls").
Needs the `agents` extra (fastapi, uvicorn).

Each request names its episode, in the URL or in a header:

- `/episodes/{episode_id}/v1/...`: give the agent `base_url="http://127.0.0.1:PORT/episodes/ID/v1"`
  (`OpenAIEndpoint.episode_url(ID)`); the agent needs no change at all.
- `X-Episode-Id: ID` on a request to `/v1/...` (e.g. the `openai` client's `default_headers`).
Both at once must agree.

Every request carries the endpoint's token, `Authorization: Bearer <token>` (the `openai` client's
api_key), checked with `hmac.compare_digest` as `jaxflow.transport.rpc` checks its handshake; the token
is made with `secrets` unless given.

The endpoint only parses and answers; a backend (`ChatBackend`: `async chat(episode_id, messages, tools,
sampling) -> Reply`) does the work. `SessionBackend` keeps an `AgentSession`
(`rollout_bridge.agent_session`) per episode and calls an async `generate(episode_id, prompt, prefix,
params) -> Sample` (an engine's `Request(prompt, params, prefix=...)`) for each turn; an episode's
requests are answered one at a time, in the order they come. Whoever runs the episodes opens one
(`open(id)`) before its agent starts and ends it (`end(id)` -> its session, whose `sample()` and
`sequence_starts()` are the episode's training data) when the agent is done.

Errors have OpenAI's body {"error": {"message", "type", "param", "code"}} and a header telling the
`openai` client not to retry: 401 a missing or wrong token ("invalid_api_key"), 404 an unknown episode
("episode_not_found") or model ("model_not_found"), 409 a request for an episode that has ended
("episode_ended"), 400 a malformed body (code "invalid_request", `param` names the field), a
conversation longer than the context ("context_length_exceeded") or messages the chat template cannot
render ("invalid_messages"), 413 a body over `max_body_bytes`, 500 a failed generation
("generation_failed"). A refused request changes nothing the episode has recorded.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import hmac
import json
import logging
import math
import re
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from jaxflow.data.records import Sample
from rollout_bridge.agent_session import (
    AgentSession,
    BadGeneration,
    ContextTooLong,
    InvalidMessages,
    Reply,
    StaleTurn,
    Turn,
    parse_tool_calls,
    stop_ids_of,
)
from rollout_bridge.engine import SamplingParams

__all__ = ["EPISODE_HEADER", "ChatBackend", "ChatSampling", "EndpointError", "EpisodeEnded", "OpenAIEndpoint",
           "SessionBackend", "UnknownEpisode", "check_episode_id"]

log = logging.getLogger(__name__)

EPISODE_HEADER = "X-Episode-Id"
MAX_EPISODE_ID_CHARS = 256
MAX_STOP = 4  # stop strings a request may give, as OpenAI's API allows (an engine takes only so many stop ids)
_EPISODE_ID = re.compile(r"[A-Za-z0-9._:~-]+")
DEFAULT_MAX_BODY_BYTES = 16 << 20
# How many ended episodes' ids are remembered, so that a late request gets 409 rather than 404.
_ENDED_KEPT = 100_000


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP `status`, OpenAI error `code` and `type`, and the body field
    at fault (`param`), if any."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error"):  # noqa: A002 - OpenAI's name for the field
        super().__init__(message)
        self.status, self.code, self.param, self.type = status, code, param, type

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> EndpointError:
    """A 400 for a malformed body field (or header) `param`."""
    return EndpointError(400, "invalid_request", f"{param}: {message}", param=param)


class UnknownEpisode(EndpointError):
    """404: a request for an episode that is not open (nor recently ended)."""

    def __init__(self, episode_id: str):
        super().__init__(404, "episode_not_found", f"episode {episode_id!r:.300} is not open on this endpoint",
                         type="not_found_error")


class EpisodeEnded(EndpointError):
    """409: a request for an episode that has ended (`SessionBackend.end`)."""

    def __init__(self, episode_id: str):
        super().__init__(409, "episode_ended", f"episode {episode_id!r:.300} has ended; it takes no more requests",
                         type="conflict_error")


@dataclasses.dataclass(frozen=True)
class ChatSampling:
    """A request's sampling options. max_tokens None: up to the context's end. stop: strings, each one
    token. logprobs: return the sampled tokens' log-probs in the response."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False


class ChatBackend(Protocol):
    """What the endpoint calls. Raises EndpointError (or an AgentSessionError) for a refused request."""

    async def chat(self, episode_id: str, messages: list[dict], tools: list[dict] | None,
                   sampling: ChatSampling) -> Reply: ...


Generate = Callable[[str, list[int], Sample, SamplingParams], Awaitable[Sample]]


@dataclasses.dataclass
class _Episode:
    session: AgentSession
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class SessionBackend:
    """A `ChatBackend` over `AgentSession`s: one per open episode, built with `tokenizer`, `max_context`
    (at most the engine's context), `max_episode_tokens` (at most a trainer row) and `template_kwargs`.
    generate(episode_id, prompt, prefix, params) -> the engine's Sample (a copy of the turn's prefix plus
    the new tokens) for one turn, finished "stop" or "length"; it raises (a 500 for the agent) rather than
    never returning. params.max_tokens counts the prefix, as `SamplingParams` does; a sequence split shows
    as a new `prompt`. override: sampling options that replace the request's (e.g. {"temperature": 1.0}:
    the run trains at its own temperature, whatever the agent asks). Thread-safe: `open`/`end` may come
    from any thread, `chat` runs on the endpoint's loop."""

    _OVERRIDABLE = ("temperature", "top_p", "top_k", "seed")

    def __init__(self, tokenizer: Any, generate: Generate, *, max_context: int, max_episode_tokens: int | None = None,
                 override: dict[str, Any] | None = None, **template_kwargs: Any):
        bad = sorted(set(override or {}) - set(self._OVERRIDABLE))
        if bad:
            raise ValueError(f"override: {bad} cannot be overridden; only {list(self._OVERRIDABLE)}")
        try:  # the request body's own checks, so an override cannot set what a request may not
            _sampling_options(dict(override or {}))
        except EndpointError as e:
            raise ValueError(f"override: {e}") from None
        # Checks the arguments now, not at the first request.
        AgentSession(tokenizer, max_context=max_context, max_episode_tokens=max_episode_tokens)
        self.tokenizer, self.generate, self.max_context = tokenizer, generate, max_context
        self.max_episode_tokens = max_episode_tokens
        self.override, self.template_kwargs = dict(override or {}), template_kwargs
        self._lock = threading.Lock()
        self._episodes: dict[str, _Episode] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tools_checked = False

    def open(self, episode_id: str) -> AgentSession:
        """Starts taking requests for `episode_id`; its session. Raises ValueError for an id open or ended."""
        check_episode_id(episode_id)
        with self._lock:
            if episode_id in self._episodes or episode_id in self._ended:
                state = "open" if episode_id in self._episodes else "ended"
                raise ValueError(f"episode {episode_id!r} is already {state}")
            session = AgentSession(self.tokenizer, max_context=self.max_context,
                                   max_episode_tokens=self.max_episode_tokens, **self.template_kwargs)
            self._episodes[episode_id] = _Episode(session)
            return session

    def end(self, episode_id: str) -> AgentSession:
        """Stops taking requests for `episode_id` (later ones get 409) and returns its session, whose record
        is final: `sample()` and `sequence_starts()` are the episode's training data. A turn still
        generating is not recorded. Raises KeyError for an episode not open."""
        with self._lock:
            ep = self._episodes.pop(episode_id, None)
            if ep is None:
                raise KeyError(f"episode {episode_id!r} is not open")
            self._ended[episode_id] = None
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
            return ep.session

    def forget(self, episode_id: str) -> None:
        """Lets an ended episode's id be opened again (its late requests then get 404). Unknown ids are
        ignored; an open episode must be ended first (ValueError)."""
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} is open; end it before forgetting it")
            self._ended.pop(episode_id, None)

    def session(self, episode_id: str) -> AgentSession:
        """The open episode's session; UnknownEpisode or EpisodeEnded otherwise."""
        return self._episode(episode_id).session

    def _episode(self, episode_id: str) -> _Episode:
        with self._lock:
            ep = self._episodes.get(episode_id)
            if ep is None:
                raise EpisodeEnded(episode_id) if episode_id in self._ended else UnknownEpisode(episode_id)
            return ep

    def _still_open(self, episode_id: str, ep: _Episode) -> None:
        with self._lock:
            if self._episodes.get(episode_id) is not ep:
                raise EpisodeEnded(episode_id)

    async def chat(self, episode_id: str, messages: list[dict], tools: list[dict] | None,
                   sampling: ChatSampling) -> Reply:
        ep = self._episode(episode_id)
        try:
            stops = stop_ids_of(self.tokenizer, sampling.stop)
        except ValueError as e:
            raise invalid("stop", str(e)) from None
        async with ep.lock:  # one turn at a time: each is prepared from the one before
            self._still_open(episode_id, ep)
            turn = ep.session.prepare(messages, tools, stop_token_ids=stops)
            if tools and not self._tools_checked:
                self._check_tools_render(ep.session, messages, tools, turn.rendered)
            params = self.params(turn, sampling)
            sample = await self.generate(episode_id, list(turn.prompt), copy.deepcopy(turn.prefix), params)
            with self._lock:  # so that once `end` returns, nothing more is recorded
                if self._episodes.get(episode_id) is not ep:
                    raise EpisodeEnded(episode_id)
                return ep.session.record(turn, sample)

    def _check_tools_render(self, session: AgentSession, messages: list[dict], tools: list[dict],
                            rendered: str) -> None:
        """Warns (once) when the chat template leaves a request's tools out: the model does not see them."""
        self._tools_checked = True
        if session.render(messages) == rendered:
            log.warning("the chat template does not render the `tools` of requests: the model does not see "
                        "them (the agent must describe its tools in its messages)")

    def params(self, turn: Turn, sampling: ChatSampling) -> SamplingParams:
        """The engine's SamplingParams for `turn`: the request's options (or the override's), at most the
        turn's room in new tokens, counted with the prefix."""
        options = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                   "seed": sampling.seed, **self.override}
        new = turn.room if sampling.max_tokens is None else min(sampling.max_tokens, turn.room)
        return SamplingParams(max_tokens=len(turn.prefix.tokens) + new, stop_token_ids=turn.stop_token_ids,
                              **options)


def check_episode_id(episode_id: Any) -> str:
    """`episode_id` if it is a valid episode id: 1 to MAX_EPISODE_ID_CHARS characters of A-Z a-z 0-9 and
    "-_.:~" (it goes into a URL's path as it is); else ValueError."""
    if (not isinstance(episode_id, str) or not 0 < len(episode_id) <= MAX_EPISODE_ID_CHARS
            or not _EPISODE_ID.fullmatch(episode_id)):
        raise ValueError(f"episode id must be 1 to {MAX_EPISODE_ID_CHARS} characters of A-Z a-z 0-9 and "
                         f"'-_.:~', got {episode_id!r:.300}")
    return episode_id


# ----- the request body -----

_UNSUPPORTED_NONZERO = ("presence_penalty", "frequency_penalty")


@dataclasses.dataclass(frozen=True)
class ChatBody:
    """A parsed chat completion body. stream: answer as server-sent events; include_usage: with a last
    chunk holding the usage (stream_options)."""

    messages: list[dict]
    tools: list[dict] | None
    sampling: ChatSampling
    stream: bool = False
    include_usage: bool = False


def parse_body(raw: bytes, model: str) -> ChatBody:
    """A chat completion body's fields; EndpointError naming the bad field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid("body", f"not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise invalid("body", f"must be a JSON object, got {type(body).__name__}")
    if not isinstance(body.get("model"), str):
        raise invalid("model", "must be a string")
    if body["model"] != model:
        raise EndpointError(404, "model_not_found", f"model {body['model']!r:.200} is not served here; this "
                            f"endpoint serves {model!r}", param="model", type="not_found_error")
    messages = _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise invalid("tools", "must be a list of objects")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream", "must be a boolean")
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict)
                                       or not isinstance(stream_options.get("include_usage", False), bool)):
        raise invalid("stream_options", "must be an object whose include_usage is a boolean")
    if body.get("n") not in (None, 1):
        raise invalid("n", f"only n = 1 is supported, got {body['n']!r:.80}")
    for name in _UNSUPPORTED_NONZERO:
        if body.get(name) not in (None, 0, 0.0):
            raise invalid(name, "is not supported (only 0): the trained policy samples without it")
    if body.get("logit_bias") not in (None, {}):
        raise invalid("logit_bias", "is not supported: the trained policy samples without it")
    if body.get("top_logprobs") not in (None, 0):
        raise invalid("top_logprobs", "is not supported (only 0)")
    options = _sampling_options(body)
    max_tokens = _integer(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", None, 1)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise invalid("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", "must be a boolean")
    sampling = ChatSampling(max_tokens=max_tokens, stop=tuple(stop), logprobs=bool(logprobs), **options)
    return ChatBody(messages, tools, sampling, stream=bool(stream),
                    include_usage=bool((stream_options or {}).get("include_usage", False)))


def _sampling_options(body: dict) -> dict[str, Any]:
    """temperature, top_p, top_k and seed of a body (defaults where absent); EndpointError naming a bad one."""
    return {"temperature": _number(body, "temperature", 1.0, lambda x: x >= 0, ">= 0"),
            "top_p": _number(body, "top_p", 1.0, lambda x: 0 < x <= 1, "in (0, 1]"),
            "top_k": _integer(body, "top_k", 0, 0), "seed": _integer(body, "seed", None, None)}


def _messages(messages: Any) -> list[dict]:
    """The messages as the chat template takes them: content given as a list of text parts is joined into
    one string; everything else (tool_calls, tool_call_id, name) is passed on as it came."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "must be an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid(f"messages[{i}].role", "must be a non-empty string")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": "
                                  "...}) are supported")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise invalid(f"messages[{i}].content", "must be a string, a list of text parts or null")
        out.append(m)
    return out


def _number(body: dict, name: str, default: float, ok: Callable[[float], bool], bounds: str) -> float:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not ok(x):
        raise invalid(name, f"must be a number {bounds}, got {x!r:.80}")
    return float(x)


def _integer(body: dict, name: str, default: int | None, lo: int | None) -> int | None:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, int) or (lo is not None and x < lo):
        raise invalid(name, f"must be an integer{f' >= {lo}' if lo is not None else ''}, got {x!r:.80}")
    return x


def _response(reply: Reply, model: str, tools: list[dict] | None, sampling: ChatSampling, tokenizer: Any) -> dict:
    content, calls = parse_tool_calls(reply.content) if tools else (reply.content, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish = reply.finish_reason
    if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    logprobs = None
    if sampling.logprobs:
        logprobs = {"content": [{"token": (text := tokenizer.decode([t], skip_special_tokens=False)),
                                 "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                                for t, lp in zip(reply.token_ids, reply.logprobs)]}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                      "total_tokens": reply.prompt_tokens + reply.completion_tokens}}


def _chunks(response: dict, include_usage: bool) -> list[dict]:
    """A whole response as the chunks of a stream (`stream=true`): the message in one delta, then the
    finish reason, then (include_usage) the usage; the turn is generated whole before the first is sent."""
    choice = response["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
    if "tool_calls" in message:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    head = {k: response[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    usage = {"usage": None} if include_usage else {}
    chunks = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                    "logprobs": choice["logprobs"]}], **usage},
              {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                                    "logprobs": None}], **usage}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


# ----- the server -----

class OpenAIEndpoint:
    """See the module docstring. backend: a `ChatBackend` (`SessionBackend`). model: the served model's
    name (requests must name it). token: the bearer token requests must carry (None: a new random one,
    `self.token`). tokenizer: decodes tokens for `logprobs` responses (default: the backend's)."""

    def __init__(self, backend: ChatBackend, *, model: str, token: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tokenizer: Any = None,
                 shutdown_timeout_s: float = 5.0):
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("token must be a non-empty string or None")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        self.backend, self.model, self.host, self.port = backend, model, host, port
        self.token = token if token is not None else secrets.token_urlsafe(32)
        self._token = self.token.encode()
        self.max_body_bytes, self.shutdown_timeout_s = max_body_bytes, shutdown_timeout_s
        self.tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
        self._server = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None

    def episode_url(self, episode_id: str) -> str:
        """The base URL an agent of `episode_id` is given (its requests then name the episode)."""
        if self.url is None:
            raise RuntimeError("the endpoint is not started")
        return f"{self.url}/episodes/{check_episode_id(episode_id)}/v1"

    def start(self, timeout: float = 30.0) -> str:
        """Starts serving; returns the base URL (http://127.0.0.1:PORT, without /v1)."""
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("the endpoint is already started")
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=self.shutdown_timeout_s)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound here: the port is known before serving
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="openai-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                sock.close()
                raise RuntimeError(f"the OpenAI endpoint did not start within {timeout} s")
            time.sleep(0.01)
        host, port = sock.getsockname()[:2]
        self.port = port
        self.url = f"http://{host}:{port}"
        return self.url

    def close(self) -> None:
        """Stops serving; requests in flight get `shutdown_timeout_s` to finish, then are cancelled."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(self.shutdown_timeout_s + 10)
        self._server, self._thread, self.url = None, None, None

    def __enter__(self) -> OpenAIEndpoint:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token)

    def _app(self):
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        no_retry = {"x-should-retry": "false"}  # the openai client retries 409 and 5xx unless told not to

        def error(e: EndpointError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status, headers=no_retry)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
            return error(EndpointError(e.status_code, "not_found" if e.status_code == 404 else "bad_request",
                                       f"{request.method} {request.url.path}: {e.detail}"))

        @app.exception_handler(RequestValidationError)
        async def validation_error(request: Request, e: RequestValidationError):
            return error(invalid("request", str(e)))

        def authorize(request: Request) -> None:
            if not self._authorized(request.headers.get("authorization")):
                missing = "authorization" not in request.headers
                raise EndpointError(401, "invalid_api_key", "missing bearer token (Authorization: Bearer <token>)"
                                    if missing else "wrong bearer token", type="authentication_error")

        def episode_of(request: Request, path_id: str | None) -> str:
            header = request.headers.get(EPISODE_HEADER)
            if path_id is not None and header is not None and header != path_id:
                raise invalid(EPISODE_HEADER, f"header names episode {header!r:.300} but the URL {path_id!r:.300}")
            episode_id = path_id if path_id is not None else header
            if episode_id is None:
                raise invalid(EPISODE_HEADER, "no episode: use /episodes/{id}/v1/... or the X-Episode-Id header")
            try:
                return check_episode_id(episode_id)
            except ValueError as e:
                raise invalid(EPISODE_HEADER, str(e)) from None

        async def models(request: Request, episode_id: str | None = None):
            try:
                authorize(request)
            except EndpointError as e:
                return error(e)
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "jaxflow"}]}

        async def completions(request: Request, episode_id: str | None = None):
            try:
                authorize(request)
                episode = episode_of(request, episode_id)
                raw = await self._body(request)
                body = parse_body(raw, self.model)
                reply = await self.backend.chat(episode, body.messages, body.tools, body.sampling)
                response = _response(reply, self.model, body.tools, body.sampling, self.tokenizer)
                if not body.stream:
                    return response
                events = [f"data: {json.dumps(c)}\n\n" for c in _chunks(response, body.include_usage)]
                return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")
            except EndpointError as e:
                return error(e)
            except ContextTooLong as e:
                return error(EndpointError(400, "context_length_exceeded", str(e), param="messages"))
            except InvalidMessages as e:
                return error(EndpointError(400, "invalid_messages", str(e), param="messages"))
            except StaleTurn as e:
                return error(EndpointError(409, "conflict", str(e), type="conflict_error"))
            except BadGeneration as e:
                log.error("episode %s: %s", episode_id, e)
                return error(EndpointError(500, "generation_failed", str(e), type="server_error"))
            except Exception as e:  # noqa: BLE001 - the engine failed: the agent gets a named 500, the server serves on
                log.exception("chat completion failed")
                return error(EndpointError(500, "generation_failed", f"generation failed: {type(e).__name__}: {e}",
                                           type="server_error"))

        for prefix in ("", "/episodes/{episode_id}"):
            app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
            app.add_api_route(f"{prefix}/v1/chat/completions", completions, methods=["POST"])
        return app

    async def _body(self, request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise EndpointError(413, "body_too_large", f"body of {size} bytes is over the limit of "
                                f"{self.max_body_bytes}", param="body")
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body_bytes:
                raise EndpointError(413, "body_too_large", f"body is over the limit of {self.max_body_bytes} bytes",
                                    param="body")
            chunks.append(chunk)
        return b"".join(chunks)
