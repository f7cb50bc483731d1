"""Multi-turn episodes on any engine: `EpisodeEngine` wraps an engine (JAX or vLLM) and an environment
factory behind the same `Engine` interface, so the coordinator drives episodes as it drives single
answers.

A request is an episode. The inner engine generates a model turn, which ends at the end-of-turn token
(EOS) or at a tool-call marker (`turn_stop_ids`, e.g. the token of `</tool>`); the environment then gets
the turn as text (`step`, under `step_timeout_s`), and its observation is rendered through the chat
template (`jaxflow.envs.render`, on a worker thread) and appended to the sample as token ids recorded in
`env_spans` (log-prob 0, the version of the turn before them: context, never trained; with a
mixture-of-experts model's routes, -1 until the inner engine's forward that admits the next turn records
theirs); the inner engine then continues from prompt + everything so far (`Request(prefix=...)`).
The model's tokens are the inner engine's, untouched: they are never decoded and re-encoded on their
way to the trainer. The episode ends when the environment says done, after `max_turns` model turns,
or when the sample reaches `max_tokens` ("length"); its sample carries the sum of the environment's
rewards (`Sample.reward`, 0.0 for a failed episode; the coordinator trains on it instead of the task's
reward function) and its completion the turns taken (`Completion.info`).

Many episodes are in flight at once: while one waits on its environment (a remote tool's latency,
`asyncio.sleep` costs no CPU) the inner engine generates the others'. Each episode's environment is built
and called on a thread of its own (`jaxflow.envs.threaded.ThreadedEnv`; an isolated environment, whose
calls only wait on its process, is called from this engine's loop), so an environment that blocks its
thread inside `async def step` holds up its own episode only, and `step_timeout_s` fails that episode on
time. An environment that times out, raises, answers something malformed, or answers with an observation
of more than `max_observation_tokens` tokens (default: the request's `max_tokens`; kind "oversized") fails
its episode only: the completion comes back finished, with reward 0.0 and info {"env_failure": kind,
"env_error": message}, and `counts` records the kind.

Abort and resume: `abort` (and `pause("abort")`) hand an episode back as a partial sample whether its
model turn was generating or had just finished, or its environment was answering (the answer is
dropped); the sample holds at least what `progress` showed before. A resubmitted episode
(`Request(prefix=...)`) gets a fresh environment, which is brought to the same state by replaying the
episode's finished model turns (`reset`, then a `step` per turn; their observations are already in the
prefix and are not added again), then continues: with the environment's answer to
the prefix's last turn if that turn had ended, else by generating the rest of that turn. This assumes
an environment answers the same turns the same way (the calculator does; an environment that cannot
must not be aborted mid-episode).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

from jaxflow.data.records import Sample, fit_routes
from jaxflow.envs import base
from jaxflow.envs.render import ObservationRenderer
from jaxflow.envs.threaded import ThreadedEnv
from rollout_bridge.engine import (
    Completion,
    Engine,
    Request,
    SamplingParams,
    WrappingEngine,
    copy_prefix,
    in_flight_copy,
)

log = logging.getLogger(__name__)

# How long `abort` waits for the pump to bring a turn the inner engine had just finished (it is already
# out of that engine, so this is milliseconds unless the pump is stuck).
_CLAIM_TIMEOUT_S = 30.0

__all__ = ["EpisodeEngine"]


@dataclasses.dataclass
class _Episode:
    request: Request
    sample: Sample
    env: Any = None
    rewards: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    task: Any = None  # the asyncio future of the environment work in progress, if any
    in_inner: bool = False


def model_turns(sample: Sample) -> list[tuple[int, int]]:
    """[start, end) of each stretch of model tokens between the environment's spans."""
    out, start = [], 0
    for a, b in sample.env_spans:
        if a > start:
            out.append((start, a))
        start = b
    if start < len(sample.tokens):
        out.append((start, len(sample.tokens)))
    return out


class EpisodeEngine(WrappingEngine):
    """See the module docstring.

    inner: the engine generating the model's turns. make_env(meta) -> a new environment (jaxflow's
    protocol) for an episode whose task meta is `meta` (`Request.meta`). tokenizer: decodes turns for
    the environment and renders its observations. turn_stop_ids: tokens that end a model turn besides
    the request's own stop tokens (a tool-call marker). env_name: names the environment in errors.
    max_observation_tokens: the most tokens one environment answer may render to (None: the request's
    max_tokens); a longer one fails its episode (kind "oversized").
    """

    _failure_subject = "the episode engine"

    def __init__(self, inner: Engine, make_env: Callable[[dict], Any], tokenizer: Any, *,
                 turn_stop_ids: Iterable[int] = (), step_timeout_s: float | None = 30.0, max_turns: int = 8,
                 env_name: str = "env", default_role: str = "tool", max_observation_tokens: int | None = None):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        if max_observation_tokens is not None and (isinstance(max_observation_tokens, bool) or not isinstance(
                max_observation_tokens, int) or max_observation_tokens < 1):
            raise ValueError(f"max_observation_tokens must be None or an int >= 1, got {max_observation_tokens!r}")
        self.max_observation_tokens = max_observation_tokens
        self._init_admission()
        self.make_env, self.tokenizer = make_env, tokenizer
        self.turn_stop_ids = tuple(int(t) for t in turn_stop_ids)
        self.step_timeout_s, self.max_turns, self.env_name, self.default_role = \
            step_timeout_s, max_turns, env_name, default_role
        self.renderer = ObservationRenderer(tokenizer)
        self.counts: collections.Counter = collections.Counter()
        self._episodes: dict[str, _Episode] = {}
        # Turns the inner engine had already finished when their episode was handed back, by request id:
        # `_claims[id]` is None until the pump brings that turn's completion, which `_hand_back` then hands
        # back in place of the sample from before the turn. `_stale_turns[id]` counts those nobody waits for
        # any more: the pump drops that many completions of the id, which belong to no live episode (a
        # resubmitted episode of the same id must not take them).
        self._claims: dict[str, Completion | None] = {}
        self._stale_turns: collections.Counter = collections.Counter()
        self._closing_envs: set[asyncio.Task] = set()
        self._start_wrapping(inner, "episodes")

    # ----- the Engine interface (the weights, pausing and load are the inner engine's) -----

    def submit(self, request: Request) -> None:
        with self._lock:
            self._raise_if_down()
            if request.request_id in self._episodes:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            ep = self._episodes[request.request_id] = _Episode(request, copy_prefix(request))
            ep.task = asyncio.run_coroutine_threadsafe(self._start(ep), self._loop)

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        rids = list(request_ids)
        return self._hand_back(rids, {c.request_id: c for c in self.inner.abort(rids)})

    def _hand_back(self, rids: list[str], returned: dict[str, Completion]) -> list[Completion]:
        """Episodes `rids` stop: each comes back as a partial sample (finish_reason "abort"), the one the
        inner engine `returned` for a turn it was generating, or the turn it had just finished, else the
        episode's sample so far. Never less than `progress` showed before the call."""
        eps, claimed = [], []
        for rid in rids:
            with self._lock:
                ep = self._episodes.pop(rid, None)
                if ep is not None and ep.in_inner and rid not in returned:
                    # Its turn went to the inner engine after that engine's abort ran (abort it now), or the
                    # turn finished and its completion is on its way to the pump (claim it).
                    returned.update({c.request_id: c for c in self.inner.abort([rid])})
                    if rid not in returned:
                        self._claims[rid] = None
                        claimed.append(rid)
            if ep is not None:
                if ep.task is not None:
                    ep.task.cancel()
                self._close_env(ep)
                eps.append(ep)
        if claimed:
            with self._lock:
                self._finished.wait_for(lambda: all(self._claims[rid] is not None for rid in claimed)
                                        or self._error is not None or self._closing, timeout=_CLAIM_TIMEOUT_S)
                for rid in claimed:
                    c = self._claims.pop(rid)
                    if c is not None:
                        returned[rid] = c
                    else:  # the pump is gone or late: it must drop the turn when it comes
                        self._stale_turns[rid] += 1
        out = []
        for ep in eps:
            rid = ep.request.request_id
            sample = returned[rid].sample if rid in returned else ep.sample
            sample.finish_reason = "abort"
            out.append(Completion(rid, sample))
        return out

    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Episodes' samples so far: the inner engine's for a model turn generating, else the episode's own
        (its environment answering; observations are appended under the lock, so the copy is whole)."""
        with self._lock:
            eps = [ep for ep in map(self._episodes.get, dict.fromkeys(request_ids)) if ep is not None]
            own = {ep.request.request_id: in_flight_copy(ep.sample) for ep in eps if not ep.in_inner}
        inner = {c.request_id: c.sample for c in self.inner.progress([ep.request.request_id for ep in eps
                                                                      if ep.request.request_id not in own])}
        with self._lock:  # a turn that ended meanwhile: the episode's sample, which now holds it
            out = {**inner, **own}
            for ep in eps:
                if ep.request.request_id not in out and self._episodes.get(ep.request.request_id) is ep:
                    out[ep.request.request_id] = in_flight_copy(ep.sample)
        return [Completion(rid, sample) for rid, sample in out.items()]

    def pause(self, mode: str = "keep") -> list[Completion]:
        aborted = self.inner.pause(mode)
        if mode != "abort":
            return aborted
        with self._lock:
            rids = list(self._episodes)
        # Those with a turn on the inner engine came back from it; the others wait on their environments.
        return self._hand_back(rids, {c.request_id: c for c in aborted})

    def resume(self) -> None:
        self.inner.resume()

    def close(self) -> None:
        for ep in self._take_all():
            if ep.task is not None:
                ep.task.cancel()
            self._close_env(ep)
        # What is left on the loop (environments closing) finishes before it stops.
        self._stop_wrapping(drain_s=(self.step_timeout_s or 30.0) + 1)

    # ----- episodes -----

    def _inner_done(self, c: Completion) -> None:
        """A finished turn goes to its episode's coroutine on the event loop."""
        with self._lock:
            if self._stale_turns[c.request_id]:  # the turn of an episode handed back (older ones first)
                self._stale_turns[c.request_id] -= 1
                return
            if c.request_id in self._claims:  # the turn of an episode being handed back
                self._claims[c.request_id] = c
                self._finished.notify_all()
                return
            ep = self._episodes.get(c.request_id)
            if ep is None or not ep.in_inner:
                return
            # The episode holds the turn from here on: `progress` and `abort` see it at once.
            ep.in_inner, ep.sample = False, c.sample
            ep.task = asyncio.run_coroutine_threadsafe(self._turn_done(ep, c), self._loop)

    async def _start(self, ep: _Episode) -> None:
        meta = dict(ep.request.meta or {})
        try:
            ep.env = self._environment(ep, meta)
            if await self._call(ep, "reset", meta):
                raise base.EnvironmentFailed("malformed", self.env_name, ep.request.request_id,
                                             "reset returned messages; an episode starts from its task's "
                                             "prompt (put them there)")
            tokens = ep.sample.tokens
            for a, b in model_turns(ep.sample):  # a resumed episode: its environment replays what it answered
                if b < len(tokens):
                    ep.turns += 1
                    step = await self._call(ep, "step", self._text(tokens[a:b]))
                    if step.reward is not None:  # the same turn earns the same reward again
                        ep.rewards.append(step.reward)
                elif self._turn_ended(ep, tokens[b - 1]):  # the last turn ended, unanswered: answer it
                    await self._answer(ep, a, b)
                    return
            self._generate(ep)  # the first turn, the rest of an interrupted one, or the one after an answer
        except base.EnvironmentFailed as e:
            self._fail(ep, e)
        except Exception as e:  # noqa: BLE001 - the episode fails, the engine serves on
            self._crash(ep, e)

    def _environment(self, ep: _Episode, meta: dict) -> Any:
        """The episode's environment: on a thread of its own (built there, at reset), unless the factory's
        environments only wait on another process (`off_loop`, as isolated ones do)."""
        if getattr(self.make_env, "off_loop", False):
            return self.make_env(meta)
        return ThreadedEnv(lambda: self.make_env(meta), name=ep.request.request_id)

    def _turn_ended(self, ep: _Episode, token: int) -> bool:
        return token in self.turn_stop_ids or token in ep.request.params.stop_token_ids

    async def _turn_done(self, ep: _Episode, c: Completion) -> None:
        ep.sample = c.sample
        reason = c.sample.finish_reason
        if reason != "stop":  # "length": the episode's budget is spent; "error": the engine's verdict
            self._finish(ep, c.error)
            return
        turns = model_turns(ep.sample)
        a, b = turns[-1] if turns else (0, 0)
        try:
            await self._answer(ep, a, b)
        except base.EnvironmentFailed as e:
            self._fail(ep, e)
        except Exception as e:  # noqa: BLE001 - the episode fails, the engine serves on
            self._crash(ep, e)

    def _crash(self, ep: _Episode, e: BaseException) -> None:
        if self._gone(ep):
            return
        log.exception("episode %s failed", ep.request.request_id)
        ep.sample.finish_reason = "error"
        self._finish(ep, f"episode engine: {type(e).__name__}: {e}")

    async def _answer(self, ep: _Episode, a: int, b: int) -> None:
        """The environment's answer to the model turn at tokens [a, b); then the next turn or the end."""
        ep.turns += 1
        step = await self._call(ep, "step", self._text(ep.sample.tokens[a:b]))
        if step.reward is not None:
            ep.rewards.append(step.reward)
        if step.done or ep.turns >= self.max_turns or not step.observation:
            ep.sample.finish_reason = "stop"
            self._finish(ep, None, info=step.info)
            return
        last = ep.sample.tokens[-1] if ep.sample.tokens else None
        turn_closed = last in ep.request.params.stop_token_ids
        # Off the loop: a long observation takes a while to render and encode.
        ids = await asyncio.get_running_loop().run_in_executor(None, self.renderer.ids, step.observation,
                                                               turn_closed)
        cap = self.max_observation_tokens or ep.request.params.max_tokens
        if len(ids) > cap:
            raise base.EnvironmentFailed(
                "oversized", self.env_name, ep.request.request_id,
                f"step's observation is {len(ids)} tokens, more than the cap of {cap} ("
                f"{'max_observation_tokens' if self.max_observation_tokens else 'the episode max_tokens'}); "
                f"have the tool shorten its answer, or raise rollout.env.max_observation_tokens")
        self._append_observation(ep, ids)
        if len(ep.sample.tokens) >= ep.request.params.max_tokens:
            ep.sample.finish_reason = "length"
            self._finish(ep, None, info=step.info)
            return
        self._generate(ep)

    def _append_observation(self, ep: _Episode, ids: list[int]) -> None:
        s = ep.sample
        version = s.versions[-1] if s.versions else self.inner.version
        with self._lock:  # whole for `progress`
            s.env_spans.append([len(s.tokens), len(s.tokens) + len(ids)])
            s.tokens += ids
            s.logprobs += [0.0] * len(ids)
            s.versions += [version] * len(ids)
            s.routes = fit_routes(s.routes, len(s.tokens))  # -1 until the forward admitting the next turn records them
            s.finish_reason = None

    def _generate(self, ep: _Episode) -> None:
        p = ep.request.params
        params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                stop_token_ids=tuple(dict.fromkeys((*p.stop_token_ids, *self.turn_stop_ids))),
                                seed=p.seed)
        # Under the lock, so that an abort sees the turn either not yet submitted (and this returns) or on the
        # inner engine (whose abort returns it). The inner engine never takes this lock.
        with self._lock:
            if self._episodes.get(ep.request.request_id) is not ep:
                return  # aborted meanwhile
            ep.in_inner = True
            self.inner.submit(Request(ep.request.request_id, ep.request.prompt, params, prefix=ep.sample,
                                      meta=ep.request.meta))

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    async def _call(self, ep: _Episode, method: str, *args: Any) -> Any:
        if ep.env is None:  # handed back (abort, pause, close) with this coroutine already scheduled
            raise asyncio.CancelledError(f"episode {ep.request.request_id} was handed back")
        return await base.call(ep.env, method, *args, timeout_s=self.step_timeout_s, env_name=self.env_name,
                               episode=ep.request.request_id, default_role=self.default_role)

    def _gone(self, ep: _Episode) -> bool:
        """The episode was handed back (abort, pause, close): what its environment does now is not counted."""
        with self._lock:
            return self._episodes.get(ep.request.request_id) is not ep

    def _fail(self, ep: _Episode, e: base.EnvironmentFailed) -> None:
        if self._gone(ep):
            return
        self.counts[f"env_{e.kind}"] += 1
        log.warning("%s", e)
        if ep.sample.finish_reason not in ("stop", "length"):
            ep.sample.finish_reason = "stop"
        ep.rewards = []
        self._finish(ep, None, info={"env_failure": e.kind, "env_error": str(e)}, failed=True)

    def _finish(self, ep: _Episode, error: str | None, info: dict | None = None, failed: bool = False) -> None:
        with self._lock:
            if self._episodes.get(ep.request.request_id) is not ep:
                return  # aborted meanwhile: abort handed it back (its id may already run a resumed episode)
            del self._episodes[ep.request.request_id]
            self.counts["episodes"] += 1
            self.counts["episode_turns"] += ep.turns
            if ep.sample.finish_reason != "error":
                ep.sample.reward = 0.0 if failed else float(sum(ep.rewards))
            self._hand_out(Completion(ep.request.request_id, ep.sample, error,
                                      info={"turns": ep.turns, **(info or {})}))
        self.inner.release([ep.request.request_id])  # its last turn's cache is not needed again
        self._close_env(ep)

    def _close_env(self, ep: _Episode):
        """Closes the episode's environment on the loop; the future of that, or None."""
        if ep.env is None or not hasattr(ep.env, "close"):
            return None
        env, ep.env = ep.env, None

        async def close():
            try:
                async with asyncio.timeout(self.step_timeout_s):
                    await env.close()
            except Exception as e:  # noqa: BLE001 - a failing close costs the environment, not the run
                self.counts["env_close_failed"] += 1
                log.warning("environment %r, episode %s: close failed: %s", self.env_name, ep.request.request_id, e)

        if not self._loop.is_running():
            return None
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # called from another thread
            on_loop = False
        if not on_loop:
            return asyncio.run_coroutine_threadsafe(close(), self._loop)
        task = self._loop.create_task(close())  # from an episode's coroutine: no hand-off through the loop's pipe
        self._closing_envs.add(task)  # the loop keeps only a weak reference to its tasks
        task.add_done_callback(self._closing_envs.discard)
        return task
