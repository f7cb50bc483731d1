"""`Judge`: scoring responses with an LLM judge, generating on a rollout engine, behind the reward pool's interface.

A judge is a causal LM asked about each sample. For a response, a user prompt function `prompt_ref`
("module:function", `fn(response: str, meta: dict) -> [{"role", "content"}, ...]`) writes the judge's
conversation; the judge's tokenizer renders it with its chat template (with the generation prompt); the engine
generates a verdict (greedy by default, at most `max_tokens` tokens, up to the tokenizer's end of turn); and a
user parse function `parse_ref` (`fn(verdict: str, meta: dict) -> float`) reads the sample's score from the
verdict's text. The defaults (`jaxflow.rewards.judging`): ask whether the response answers the question
(given the reference answer when the meta has one), reply `<score>1</score>` or `<score>0</score>`; read the
number in the last `<score>...</score>`.

The engine is any `rollout_bridge.engine.Engine`: jaxflow's JAX engine or vLLM built from the judge's HF
directory (`build_judge`, what the RL job's `rollout.judge` section does), or one passed in (tests use a
scripted one). Batching across groups is the engine's continuous batching: every sample's request is
submitted to the engine as soon as it is queued, whichever group and caller it came from (`score_groups` hands
several groups at once), up to `max_in_flight` at a time (the engine's slots); the rest wait in order.

`Judge` has the calls the job makes of a `RewardPool` (`score_group(fn_ref, responses, meta)`, `submit`,
`stats()` with the pool's `STAT_KEYS`, `close()`), so `group_reward_fn(judge, judge.name, decode)` is a
rollout worker's reward function as with a pool, and the job's accounting and first-batch check read its
counts unchanged. Failures score `failed_value`, are counted as the pool's are, and never stall a caller:

- a prompt function that raises or returns something that is not a list of {"role": str, "content": str}
  messages, a conversation the chat template cannot render, and a request the engine answers with an error
  (a prompt longer than its context) or cannot take (an engine that failed): `raised`;
- a verdict not parsed within `timeout_s` of the engine taking its request: `timed_out`; the request is
  aborted on the engine, freeing its slot, and the queue moves on (a parse still running is left to finish,
  its result dropped);
- a parse function that raises, or returns something that is not a finite real number: `invalid`.

Each distinct failure message is logged once (or handed once to `on_failure`).

Threads: callers build and render their samples' prompts in their own threads and queue them; one dispatcher
thread submits queued requests to the engine, polls its completions, and aborts requests past their deadline;
`parse_threads` threads run the parse function, so a slow parse holds neither the engine nor the deadlines.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from jaxflow import refs
from jaxflow.rewards.judge_config import JudgeConfig, judge_options
from jaxflow.rewards.judging import DEFAULT_PARSE_REF, DEFAULT_PROMPT_REF
from jaxflow.rewards.pool import STAT_KEYS
from jaxflow.rewards.worker import check_result
from rollout_bridge.engine import Engine, Request, SamplingParams

__all__ = ["Judge", "build_judge"]

log = logging.getLogger(__name__)

# Seconds the dispatcher waits on the engine's completions before it looks at its queue and deadlines again.
POLL_S = 0.02
# Distinct failure messages remembered for log-once.
_MAX_REMEMBERED_ERRORS = 1000


@dataclasses.dataclass(eq=False)
class _Sample:
    """One sample being judged: its request id, its rendered judge prompt, its meta, its caller's future;
    `deadline` once the engine has its request; `settled` once its future is answered."""
    key: str
    ids: list[int]
    meta: dict
    future: Future
    deadline: float = math.inf
    settled: bool = False


def _function(ref, what: str) -> tuple[Callable, str]:
    """(the function, its name): a "module:function" reference resolved (`jaxflow.refs`), or a callable."""
    if callable(ref):
        return ref, f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"
    return refs.resolve(ref, what=what, expect="function", arity=2), ref


def _messages_problem(messages) -> str | None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return f"returned {str(messages)[:200]}, not a non-empty list of {{'role': str, 'content': str}} messages"
    return None


class Judge:
    """Scores responses with an LLM judge generating on `engine`; a `RewardPool` stand-in.

    Args:
      engine: where verdicts are generated (`rollout_bridge.engine.Engine`); the judge closes it on `close()`
        unless `close_engine` is False.
      tokenizer: the judge's: `apply_chat_template(messages, add_generation_prompt=True)` -> text, `encode`,
        `decode`, `eos_id` (a `jaxflow.tokenizer.Tokenizer`, or `rollout_bridge.scripted.CharTokenizer`).
      prompt_ref, parse_ref: "module:function" references (or the functions): the judge's prompt for a sample,
        fn(response, meta) -> chat messages, and its score from the verdict, fn(verdict, meta) -> float.
      max_tokens, temperature: the verdict's sampling (its end: the tokenizer's eos, or max_tokens).
      timeout_s: the longest a sample may take from the engine taking its request to its parsed score.
      failed_value: the score of a sample that failed (raised, timed out, invalid).
      max_in_flight: requests on the engine at once at most (its slots); the rest wait in order.
      parse_threads: threads running the parse function.
      on_failure: called as on_failure(message) with the first occurrence of each distinct failure message
        instead of logging it (on a judge or caller thread: it must be quick).
      name: the reference callers pass as `fn_ref` (default "judge:<prompt_ref>,<parse_ref>").

    Use as a context manager, or call `close()`.
    """

    def __init__(self, engine: Engine, tokenizer, *, prompt_ref=DEFAULT_PROMPT_REF, parse_ref=DEFAULT_PARSE_REF,
                 max_tokens: int = 256, temperature: float = 0.0, timeout_s: float = 60.0,
                 failed_value: float = 0.0, max_in_flight: int = 16, parse_threads: int = 2,
                 on_failure: Callable[[str], None] | None = None, name: str | None = None,
                 close_engine: bool = True):
        for key, value in (("max_tokens", max_tokens), ("max_in_flight", max_in_flight),
                           ("parse_threads", parse_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Judge: {key} must be an integer >= 1, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"Judge: timeout_s must be a finite number > 0, got {timeout_s!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                0 <= temperature < math.inf):
            raise ValueError(f"Judge: temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(failed_value, bool) or check_result(failed_value) is None:
            raise ValueError(f"Judge: failed_value must be a finite number, got {failed_value!r}")
        self._prompt_fn, self.prompt_ref = _function(prompt_ref, "judge prompt function reference")
        self._parse_fn, self.parse_ref = _function(parse_ref, "judge parse function reference")
        self.engine, self.tokenizer, self._close_engine = engine, tokenizer, close_engine
        self.name = name or f"judge:{self.prompt_ref},{self.parse_ref}"
        eos = getattr(tokenizer, "eos_id", None)
        self.params = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                                     stop_token_ids=() if eos is None else (int(eos),))
        self.timeout_s, self.failed_value = float(timeout_s), float(failed_value)
        self.max_in_flight = max_in_flight
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Sample] = collections.deque()
        self._generating: dict[str, _Sample] = {}  # request id -> sample, its request on the engine
        self._parsing: dict[str, _Sample] = {}  # request id -> sample, its verdict with a parse thread
        self._parse_queue: queue.SimpleQueue = queue.SimpleQueue()
        # Request ids unique to this judge, so that judges sharing an engine never answer each other's.
        self._ids = (f"judge-{secrets.token_hex(4)}-{n}" for n in itertools.count())
        self._stats = dict.fromkeys((*STAT_KEYS, "requests", "aborted"), 0)
        self._logged: set[str] = set()
        self._closing = False
        self._parsers = [threading.Thread(target=self._parse_loop, name=f"judge-parse-{i}", daemon=True)
                         for i in range(parse_threads)]
        self._thread = threading.Thread(target=self._run, name="judge", daemon=True)
        for t in [*self._parsers, self._thread]:
            t.start()

    # ---- public API (the RewardPool calls the job makes) ----

    def submit(self, fn_ref: str, response: str, meta: dict) -> Future:
        """Queues one sample; the future's result is its score (`failed_value` if it failed)."""
        return self._submit(fn_ref, [response], meta)[0]

    def score_group(self, fn_ref: str, responses: Sequence[str], meta: dict) -> list[float]:
        """Scores the responses of one group (they share `meta`); blocks. Its verdicts are generated
        alongside whatever else is on the engine."""
        return [f.result() for f in self._submit(fn_ref, list(responses), meta)]

    def score_groups(self, fn_ref: str, groups: Sequence[tuple[Sequence[str], dict]]) -> list[list[float]]:
        """Scores several (responses, meta) groups, their requests submitted together; blocks."""
        futures = [self._submit(fn_ref, list(responses), meta) for responses, meta in groups]
        return [[f.result() for f in fs] for fs in futures]

    def stats(self) -> dict[str, int]:
        """Counts since start, as `RewardPool.stats` (submitted, scored, raised, timed_out, crashed (always 0:
        nothing here runs in a process of its own), invalid, workers_started (0), pending) plus requests
        (submitted to the engine), aborted (timed-out requests aborted on it) and in_flight (on it now)."""
        with self._lock:
            done = sum(self._stats[k] for k in ("scored", "raised", "timed_out", "crashed", "invalid"))
            return {**self._stats, "pending": self._stats["submitted"] - done, "in_flight": len(self._generating)}

    def close(self) -> None:
        """Stops the dispatcher, aborts the requests on the engine and closes it (unless `close_engine` is
        False); samples not answered yet fail with RuntimeError. Idempotent."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        self._thread.join()
        for _ in self._parsers:
            self._parse_queue.put(None)
        for t in self._parsers:  # a parse that hangs is not waited for long (daemon threads)
            t.join(timeout=1.0)

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- callers' side ----

    def _submit(self, fn_ref: str, responses: list[str], meta: dict) -> list[Future]:
        if fn_ref != self.name:
            raise ValueError(f"this judge is {self.name!r}, asked to score for {fn_ref!r}: pass its name as the "
                             "reward reference")
        with self._lock:
            keys = [next(self._ids) for _ in responses]
        samples = [_Sample(key, [], meta, Future()) for key in keys]
        for s in samples:
            s.future.set_running_or_notify_cancel()
        with self._lock:
            if self._closing:
                raise RuntimeError("Judge is closed")
            self._stats["submitted"] += len(samples)
        queued = []
        for response, s in zip(responses, samples):
            try:
                messages = self._prompt_fn(str(response), meta)
            except Exception as e:  # noqa: BLE001 - whatever the user's prompt function raises
                self._fail(s, "raised", f"prompt function {self.prompt_ref} raised {type(e).__name__}: {e}")
                continue
            problem = _messages_problem(messages)
            if problem is not None:
                self._fail(s, "raised", f"prompt function {self.prompt_ref} {problem}")
                continue
            try:
                s.ids = list(self.tokenizer.encode(self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True)))
            except Exception as e:  # noqa: BLE001 - whatever the template raises (raise_exception, bad roles)
                self._fail(s, "raised", f"cannot render the judge's prompt: {type(e).__name__}: {e}")
                continue
            queued.append(s)
        with self._lock:
            if self._closing:
                for s in queued:
                    s.settled = True
                    s.future.set_exception(RuntimeError("Judge closed before the sample was scored"))
                return [s.future for s in samples]
            self._queue.extend(queued)
            self._wake.notify_all()
        return [s.future for s in samples]

    # ---- dispatcher ----

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        break
                    room = self.max_in_flight - len(self._generating)
                    take = [self._queue.popleft() for _ in range(max(0, min(room, len(self._queue))))]
                    if not take and not self._generating:
                        deadlines = [s.deadline for s in self._parsing.values()]
                        self._wake.wait(None if not deadlines else max(0.0, min(deadlines) - time.monotonic()))
                if take:
                    self._launch(take)
                if self._generating:
                    self._poll()
                self._expire()
        except Exception as e:  # noqa: BLE001 - a bug here must fail the samples, not hang callers
            log.exception("judge dispatcher failed")
            with self._lock:
                self._closing = True
                left = [*self._queue, *self._generating.values(), *self._parsing.values()]
            for s in left:
                self._fail(s, "raised", f"the dispatcher failed: {type(e).__name__}: {e}")
        self._shutdown()

    def _launch(self, samples: list[_Sample]) -> None:
        """Submits the samples' requests to the engine; their deadlines run from now."""
        for s in samples:
            with self._lock:
                s.deadline = time.monotonic() + self.timeout_s
                self._generating[s.key] = s
                self._stats["requests"] += 1
            try:
                self.engine.submit(Request(s.key, s.ids, self.params))
            except Exception as e:  # noqa: BLE001 - an engine that failed or refuses: this sample fails, not the run
                with self._lock:
                    self._generating.pop(s.key, None)
                self._fail(s, "raised", f"the engine did not take the request: {type(e).__name__}: {e}")

    def _poll(self) -> None:
        """Hands each finished verdict to the parse threads; an engine that failed fails what it held."""
        with self._lock:
            deadlines = [s.deadline for s in self._generating.values()]
        wait = min(POLL_S, max(0.0, min(deadlines, default=math.inf) - time.monotonic()))
        try:
            done = self.engine.poll(timeout=wait)
        except Exception as e:  # noqa: BLE001 - EngineError: the engine is down; what it held cannot finish
            with self._lock:
                lost, self._generating = list(self._generating.values()), {}
            for s in lost:
                self._fail(s, "raised", f"the engine failed: {type(e).__name__}: {e}")
            return
        for c in done:
            with self._lock:
                s = self._generating.pop(c.request_id, None)
                if s is not None and c.sample.finish_reason not in ("error", "abort"):
                    self._parsing[s.key] = s
            if s is None:
                continue  # aborted at its deadline meanwhile
            if c.sample.finish_reason == "error":
                self._fail(s, "raised", f"the engine refused the judge's request: {c.error}")
            elif c.sample.finish_reason == "abort":
                self._fail(s, "raised", "the engine aborted the judge's request")
            else:
                self._parse_queue.put((s, c.sample.tokens))

    def _expire(self) -> None:
        """Fails the samples past their deadline (timed_out), aborting their requests on the engine."""
        now = time.monotonic()
        with self._lock:
            generating = [s for s in self._generating.values() if s.deadline <= now]
            parsing = [s for s in self._parsing.values() if s.deadline <= now]
            for s in generating:
                del self._generating[s.key]
            for s in parsing:
                del self._parsing[s.key]
            self._stats["aborted"] += len(generating)
        if generating:
            try:
                self.engine.abort([s.key for s in generating])
            except Exception as e:  # noqa: BLE001 - the engine is down: nothing of it to free
                log.warning("judge: aborting %d timed-out requests failed: %s", len(generating), e)
        for s in generating:
            self._fail(s, "timed_out", f"generated for longer than timeout_s={self.timeout_s:g}s; its request was "
                                       "aborted")
        for s in parsing:
            self._fail(s, "timed_out", f"parse function {self.parse_ref} did not return within timeout_s="
                                       f"{self.timeout_s:g}s")

    def _shutdown(self) -> None:
        """On close: aborts what is on the engine, closes it, and fails every sample not answered yet."""
        with self._lock:
            left = [*self._queue, *self._generating.values(), *self._parsing.values()]
            generating = list(self._generating)
            self._queue.clear()
            self._generating.clear()
            self._parsing.clear()
        try:
            if generating:
                self.engine.abort(generating)
        except Exception:  # noqa: BLE001 - the engine is down: nothing to abort
            pass
        if self._close_engine:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - closing must finish: the futures below still need answers
                log.exception("judge: closing its engine failed")
        for s in left:
            with self._lock:
                if s.settled:
                    continue
                s.settled = True
            s.future.set_exception(RuntimeError("Judge closed before the sample was scored"))

    # ---- parse threads ----

    def _parse_loop(self) -> None:
        while True:
            item = self._parse_queue.get()
            if item is None:
                return
            s, tokens = item
            with self._lock:
                if s.settled:
                    continue  # timed out while it waited
            try:
                verdict = self.tokenizer.decode(tokens)
                value = self._parse_fn(verdict, s.meta)
            except Exception as e:  # noqa: BLE001 - whatever the user's parse function raises
                self._settle_parsed(s, "invalid", f"parse function {self.parse_ref} raised {type(e).__name__}: {e}")
                continue
            score = None if isinstance(value, bool) else check_result(value)
            if score is None:
                self._settle_parsed(s, "invalid", f"parse function {self.parse_ref} returned {str(value)[:100]}, "
                                                  "not a finite number")
            else:
                self._settle_parsed(s, "scored", score)

    def _settle_parsed(self, s: _Sample, outcome: str, what) -> None:
        with self._lock:
            if self._parsing.pop(s.key, None) is None:
                return  # timed out (or closed) meanwhile: answered already
        if outcome == "scored":
            self._answer(s, "scored", what)
        else:
            self._fail(s, outcome, what)

    # ---- answers ----

    def _answer(self, s: _Sample, outcome: str, value: float) -> bool:
        """Answers `s` with `value`, counted as `outcome`; False if it was answered already."""
        with self._lock:
            if s.settled:
                return False
            s.settled = True
            self._stats[outcome] += 1
        s.future.set_result(value)
        return True

    def _fail(self, s: _Sample, outcome: str, what: str) -> None:
        message = f"judge {self.name} {what}"
        with self._lock:
            if s.settled:
                return
            first = message not in self._logged
            if first and len(self._logged) < _MAX_REMEMBERED_ERRORS:
                self._logged.add(message)
        if self._answer(s, outcome, self.failed_value):
            if first and self._on_failure is not None:
                try:
                    self._on_failure(message)
                except Exception:  # noqa: BLE001 - a reporting bug must not break scoring
                    log.exception("judge on_failure callback failed on: %s", message)
            elif first:
                log.warning("%s; the sample scores %g (logged once per distinct message)", message,
                            self.failed_value)


def build_judge(section: JudgeConfig, *, seed: int = 0, dtype: str | None = None,
                on_failure: Callable[[str], None] | None = None, name: str | None = None) -> Judge:
    """The judge a checked `rollout.judge` section describes: its engine (`section.engine`) built from
    `section.dir` with `section.max_slots` slots of `section.max_len` tokens, its tokenizer from the same
    directory, its prompt and parse functions resolved. dtype: what the engine computes in (None: the
    checkpoint's for JAX, float32 for vLLM). name: the judge's `fn_ref` (default "judge:<section.dir>").

    Raises:
      ValueError: the directory's tokenizer has no chat template; jaxflow.refs.RefError: a reference does not
        resolve to a function of (text, meta).
    """
    from jaxflow.tokenizer import Tokenizer
    from rollout_bridge.factory import make_engine

    tokenizer = Tokenizer.from_dir(section.dir)
    if tokenizer.chat_template is None:
        raise ValueError(f"rollout.judge.dir: the tokenizer of {section.dir} has no chat template to render the "
                         "judge's prompt with")
    for ref, key in ((section.prompt_ref, "rollout.judge.prompt_ref"), (section.parse_ref, "rollout.judge.parse_ref")):
        _function(ref, key)  # before the engine is built: a bad reference costs no compile
    engine = make_engine(section.engine, section.dir, section.max_len, section.max_slots, seed=seed,
                         kv_cache_gib=section.kv_cache_gib, episodes=False, dtype=dtype)
    try:
        warmed = getattr(engine, "warmed", None)
        if callable(warmed):
            # The time limits count generating and parsing a verdict, not compiling the engine's programs: those
            # (compiled in the background since the engine was built) are ready before the first sample comes.
            warmed()
        return Judge(engine, tokenizer, prompt_ref=section.prompt_ref, parse_ref=section.parse_ref,
                     **judge_options(section), on_failure=on_failure,
                     name=name or f"judge:{section.dir}")
    except BaseException:
        engine.close()
        raise
