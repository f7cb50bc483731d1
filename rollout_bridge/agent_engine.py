"""Black-box agents as episodes: `AgentEngine` runs, for each request, an agent program that talks to the
model through an OpenAI-compatible endpoint, behind the same `Engine` interface as single answers and
jaxflow's own episodes, so the coordinator drives agents as it drives everything else.

A request is an episode. Its agent is started with the base URL of the endpoint for that episode
(`rollout_bridge.openai_endpoint`: `.../episodes/<id>/v1`), the task's meta and the episode's id, and
returns the episode's reward: an `async def agent(base_url, task, episode, api_key=..., **options)`
(`FunctionAgent`; `IsolatedAgent` runs it in a process of its own), or a command run as a subprocess with
the URL, key, episode and task in its environment (`CommandAgent`). Each chat request of the agent becomes
a model turn on the inner engine (JAX or vLLM):
the endpoint's session (`rollout_bridge.agent_session`) renders the messages, keeps the tokens the model
sampled as they were, and appends what the agent put in between as environment tokens (or starts a new
training sequence when the agent rewrote its history); the turn then continues the episode's sequence as
`Request(prompt, prefix=...)`, so the JAX engine reuses the cache of the turn before (every turn of an
episode goes to the engine that holds its prefix: the episode runs on this engine). The episode's sample
is every sequence's tokens, with the behaviour log-probs and versions of the sampled ones.

Staleness and versions are per token as for every episode; the admission bound holds per episode (the
coordinator admits the request, not its turns). A weight update that aborts in-flight work
(`pause("abort")`) happens below the endpoint: the turn generating is aborted on the inner engine and
resubmitted from its tokens so far at `resume`, and the agent only sees its reply come later.

An agent that raises, returns something other than a finite real number, makes no chat request, or runs
past `timeout_s` fails its episode alone (reward 0, `info["env_failure"]` one of `jaxflow.envs.base`'s
FAILURE_KINDS, counted in `counts`); later requests of that episode get a named HTTP error. An agent's
state cannot be brought back, so an episode handed back by `abort` does not resume: resubmitted with a
prefix, it fails at once (kind "error") instead of training on a rerun the agent never made.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

from jaxflow.data.records import Sample
from rollout_bridge.engine import Completion, Engine, Request, SamplingParams, WrappingEngine
from rollout_bridge.openai_endpoint import EpisodeEnded, OpenAIEndpoint, SessionBackend

log = logging.getLogger(__name__)

__all__ = ["AgentEngine", "AgentFailed", "CommandAgent", "FunctionAgent", "IsolatedAgent"]


class AgentFailed(RuntimeError):
    """An agent's episode failed. kind: one of jaxflow.envs.base.FAILURE_KINDS."""

    def __init__(self, kind: str, what: str):
        super().__init__(what)
        self.kind = kind


class FunctionAgent:
    """An agent that is an async function: `await fn(base_url, task, episode, api_key=key, **options)`
    returns the episode's reward. ref: "module:function", named in errors."""

    def __init__(self, fn, options: Mapping[str, Any] | None = None, ref: str = "agent"):
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"agent {ref!r} must be an async function (async def agent(base_url, task, episode, "
                            f"...) -> reward), got {fn!r}")
        self.fn, self.options, self.ref = fn, dict(options or {}), ref

    async def __call__(self, base_url: str, task: dict, episode: str, api_key: str) -> Any:
        return await self.fn(base_url, task, episode, api_key=api_key, **self.options)


class IsolatedAgent:
    """A `FunctionAgent` whose episodes run in a process of its own (`rollout.env.isolate`;
    `jaxflow.envs.isolated`): one child process hosts every episode's agent on its event loop, so the
    agents' work (an HTTP client's, a tool's) does not hold this interpreter's lock while the engine and the
    trainer need it, and an agent that crashes or hangs its process fails its episodes, not the run (the
    process is replaced). The task and the reward cross the process boundary by pickle, over a pipe this
    process made for its child."""

    def __init__(self, agent: FunctionAgent):
        from jaxflow.envs.isolated import isolated

        self.ref, self.options = agent.ref, agent.options
        self._episodes = isolated("jaxflow.envs.isolated:AgentEpisode", {"ref": agent.ref, "options": agent.options})

    async def __call__(self, base_url: str, task: dict, episode: str, api_key: str) -> Any:
        one = self._episodes(None)
        reward = await one.reset({"base_url": base_url, "task": task, "episode": episode, "api_key": api_key})
        await one.close()
        return reward


class CommandAgent:
    """An agent that is a program: `argv` runs as a subprocess with OPENAI_BASE_URL, OPENAI_API_KEY,
    JAXFLOW_EPISODE and JAXFLOW_TASK (the task's meta as JSON) in its environment, and prints its reward
    as the last line of its standard output (a number, or JSON {"reward": number}). A nonzero exit fails
    the episode, naming the exit code and the end of its standard error."""

    def __init__(self, argv: list[str] | tuple[str, ...]):
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"an agent command must be a non-empty list of strings, got {argv!r}")
        self.argv, self.ref = list(argv), " ".join(argv)

    async def __call__(self, base_url: str, task: dict, episode: str, api_key: str) -> Any:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "JAXFLOW_EPISODE": episode,
               "JAXFLOW_TASK": json.dumps(task)}
        proc = await asyncio.create_subprocess_exec(*self.argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:  # timed out or handed back: the program goes with its episode
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        if proc.returncode != 0:
            raise AgentFailed("error", f"agent command exited with code {proc.returncode}: "
                                       f"{err.decode(errors='replace')[-500:].strip()}")
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines:
            raise AgentFailed("malformed", "agent command printed no reward (its last line of output)")
        last = lines[-1].strip()
        try:
            value = json.loads(last)
        except json.JSONDecodeError:
            raise AgentFailed("malformed", f"agent command's last line is not a reward: {last[:200]!r}") from None
        return value.get("reward") if isinstance(value, dict) else value


def check_reward(value: Any) -> float:
    """The agent's reward as a float; AgentFailed("malformed") when it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise AgentFailed("malformed", f"agent returned {value!r}, not a finite real reward")
    return float(value)


@dataclasses.dataclass
class _Turn:
    """A model turn on the inner engine: what went there, and where its completion goes."""

    request: Request
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    held: Sample | None = None  # aborted by pause("abort"): resubmitted from these tokens at resume


@dataclasses.dataclass
class _Episode:
    request: Request
    run: Any = None  # the concurrent future of the agent's run
    turn: _Turn | None = None
    turns: int = 0


class AgentEngine(WrappingEngine):
    """See the module docstring.

    inner: the engine generating the model's turns. agent: a `FunctionAgent` or `CommandAgent`.
    tokenizer: renders the agents' conversations (its chat template) and decodes replies. max_context:
    the most tokens one training sequence may hold (the inner engine's context). timeout_s: seconds an
    agent may run. model: the name the endpoint serves (requests must name it). token: the endpoint's
    bearer token (None: a random one). agent_name: names the agent in logs and errors (default its ref).
    Every turn samples with the episode request's temperature, top_p, top_k and seed, whatever the agent
    asks: the behaviour policy is the run's, and an eval's greedy decoding stays greedy.
    """

    _failure_subject = "the agent engine"

    def __init__(self, inner: Engine, agent, tokenizer: Any, *, max_context: int, timeout_s: float = 300.0,
                 model: str = "policy", token: str | None = None, agent_name: str | None = None):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        self._init_admission()
        self.agent, self.tokenizer, self.timeout_s = agent, tokenizer, float(timeout_s)
        self.agent_name = agent_name or getattr(agent, "ref", "agent")
        self.counts: collections.Counter = collections.Counter()
        self._episodes: dict[str, _Episode] = {}
        self._held: list[_Turn] = []  # turns aborted by pause("abort"), resubmitted at resume
        self.backend = SessionBackend(tokenizer, self._generate, max_context=max_context)
        self.endpoint = OpenAIEndpoint(self.backend, model=model, token=token, tokenizer=tokenizer)
        self.endpoint.start()
        self._start_wrapping(inner, "agents")  # its loop runs the function agents and waits on the commands

    # ----- the Engine interface (the weights, pausing and load are the inner engine's) -----

    def submit(self, request: Request) -> None:
        with self._lock:
            self._raise_if_down()
            rid = request.request_id
            if rid in self._episodes:
                raise ValueError(f"request id {rid!r} is already in flight")
            if request.prefix is not None and request.prefix.tokens:
                # Handed back earlier (abort): its agent is gone, and a rerun would not be the episode it was.
                self.counts["env_error"] += 1
                sample = Sample(finish_reason="stop", reward=0.0)
                self._hand_out(Completion(rid, sample, info={
                    "turns": 0, "env_failure": "error",
                    "env_error": f"agent episode {rid} cannot resume from a prefix: its agent's state is gone"}))
                return
            # An id whose episode ended here before (an eval's ids recur every eval) starts afresh; until
            # then, late requests of the old episode got 409.
            self.backend.forget(rid)
            self.backend.open(rid)
            ep = self._episodes[rid] = _Episode(request)
            ep.run = asyncio.run_coroutine_threadsafe(self._run(ep), self._loop)

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Hands episodes back with the turns they finished (finish_reason "abort"); their agents are
        cancelled and their later requests get 409. They do not resume (module docstring)."""
        out = []
        for rid in dict.fromkeys(request_ids):
            with self._lock:
                ep = self._episodes.pop(rid, None)
                if ep is None:
                    continue
                turn, ep.turn = ep.turn, None
                if turn is not None and turn in self._held:
                    self._held.remove(turn)
            if turn is not None:
                self.inner.abort([rid])
                turn.loop.call_soon_threadsafe(_fail, turn.future, EpisodeEnded(rid))
            ep.run.cancel()
            sample = self._end(rid)
            sample.finish_reason = "abort"
            out.append(Completion(rid, sample))
        return out

    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Episodes' finished turns so far (a turn generating shows once recorded)."""
        with self._lock:
            rids = [rid for rid in dict.fromkeys(request_ids) if rid in self._episodes]
        out = []
        for rid in rids:
            try:
                out.append(Completion(rid, self.backend.session(rid).sample()))
            except Exception:  # noqa: BLE001 - ended meanwhile: its completion is on its way
                continue
        return out

    def pause(self, mode: str = "keep") -> list[Completion]:
        """Pauses the inner engine. "abort" aborts the turns generating there and keeps them here, to go on
        from their tokens at `resume`: an agent's episode is never handed back for a weight update."""
        aborted = self.inner.pause(mode)
        with self._lock:
            for c in aborted:
                ep = self._episodes.get(c.request_id)
                if ep is not None and ep.turn is not None and ep.turn not in self._held:
                    ep.turn.held = c.sample
                    self._held.append(ep.turn)
        return []

    def resume(self) -> None:
        with self._lock:
            held, self._held = self._held, []
            for turn in held:
                prefix, turn.held = turn.held, None
                prefix.finish_reason = None
                r = turn.request
                self.inner.submit(Request(r.request_id, r.prompt, r.params, prefix=prefix))
        self.inner.resume()

    def close(self) -> None:
        for ep in self._take_all():
            ep.run.cancel()
            if ep.turn is not None:
                ep.turn.loop.call_soon_threadsafe(_fail, ep.turn.future, EpisodeEnded(ep.request.request_id))
        self.endpoint.close()
        self._stop_wrapping()

    # ----- turns -----

    async def _generate(self, episode_id: str, prompt: list[int], prefix: Sample, params: SamplingParams) -> Sample:
        """One model turn on the inner engine (the endpoint's `generate`, on the endpoint's loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            ep = self._episodes.get(episode_id)
            if ep is None:
                raise EpisodeEnded(episode_id)
            ep_params = ep.request.params
            # The run's sampling (and an eval's greedy decoding), whatever the agent asked; its stops and
            # its room in tokens are its own.
            params = dataclasses.replace(params, temperature=ep_params.temperature, top_p=ep_params.top_p,
                                         top_k=ep_params.top_k, seed=ep_params.seed)
            turn = ep.turn = _Turn(Request(episode_id, prompt, params, prefix=prefix), loop, loop.create_future())
            ep.turns += 1
            self.inner.submit(turn.request)
        try:
            completion = await turn.future
        finally:
            with self._lock:
                if ep.turn is turn:
                    ep.turn = None
        if completion.sample.finish_reason == "error":
            raise RuntimeError(f"the engine refused the turn: {completion.error}")
        return completion.sample

    def _inner_done(self, c: Completion) -> None:
        """A finished turn goes to the chat request waiting for it."""
        with self._lock:
            ep = self._episodes.get(c.request_id)
            turn = ep.turn if ep is not None else None
        if turn is not None and turn.held is None:
            turn.loop.call_soon_threadsafe(_resolve, turn.future, c)

    # ----- episodes -----

    async def _run(self, ep: _Episode) -> None:
        rid = ep.request.request_id
        try:
            try:
                value = await asyncio.wait_for(
                    self.agent(self.endpoint.episode_url(rid), dict(ep.request.meta or {}), rid, self.endpoint.token),
                    self.timeout_s)
            except TimeoutError:
                raise AgentFailed("timeout", f"agent ran for more than {self.timeout_s:g} s") from None
            except AgentFailed:
                raise
            except Exception as e:  # noqa: BLE001 - whatever the agent raises fails its episode alone
                raise AgentFailed("error", f"agent raised {type(e).__name__}: {e}") from e
            reward = check_reward(value)
            self._finish(ep, reward, None)
        except AgentFailed as e:
            self._finish(ep, 0.0, e)

    def _end(self, rid: str) -> Sample:
        """Ends the episode's session (its later requests get 409); its sample so far."""
        try:
            return self.backend.end(rid).sample()
        except KeyError:
            return Sample()

    def _finish(self, ep: _Episode, reward: float, failure: AgentFailed | None) -> None:
        rid = ep.request.request_id
        with self._lock:
            if self._episodes.get(rid) is not ep:
                return  # handed back meanwhile
            del self._episodes[rid]
        turn = ep.turn
        if turn is not None:  # the agent returned with a turn still generating (it stopped waiting)
            self.inner.abort([rid])
            turn.loop.call_soon_threadsafe(_fail, turn.future, EpisodeEnded(rid))
        sample = self._end(rid)
        if failure is None and not any(True for _ in _model_tokens(sample)):
            failure = AgentFailed("malformed", "agent returned without asking the model anything")
        info: dict[str, Any] = {"turns": ep.turns}
        if failure is not None:
            self.counts[f"env_{failure.kind}"] += 1
            log.warning("agent %r, episode %s: %s", self.agent_name, rid, failure)
            info.update(env_failure=failure.kind, env_error=f"agent {self.agent_name!r}, episode {rid}: {failure}")
            reward = 0.0
        sample.finish_reason = "stop"
        sample.reward = float(reward)
        with self._lock:
            self.counts["episodes"] += 1
            self.counts["episode_turns"] += ep.turns
            self._hand_out(Completion(rid, sample, info=info))
        self.inner.release([rid])


def _model_tokens(sample: Sample):
    mask = sample.model_mask()
    return (t for t, m in zip(sample.tokens, mask) if m)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
