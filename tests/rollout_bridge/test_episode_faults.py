"""Environment faults in episodes (`rollout_bridge.episodes.EpisodeEngine`) on a scripted inner engine and a
character tokenizer, so no model is compiled: an environment that blocks its thread fails its own episode
on time while the others go on, an observation over the token cap fails its episode instead of growing
the sample, and a turn that finished just before its episode's abort is handed back, or else dropped."""

import asyncio
import concurrent.futures
import contextlib
import threading
import time

import pytest
from waiting import wait_until

from jaxflow.envs.base import Step
from jaxflow.envs.config import EnvConfig
from jaxflow.envs.threaded import ThreadedEnv
from rollout_bridge import episodes, scripted
from rollout_bridge.engine import Completion, Request, SamplingParams
from rollout_bridge.episodes import EpisodeEngine, model_turns
from rollout_bridge.scripted import CharTokenizer

TURN = "hi#"  # every model turn; "#" is the tool-call marker that ends it
STOP = ord("#")


def turn_engine():
    """The inner engine these tests run episodes on: TURN for every request, at version 0."""
    return scripted.ScriptedEngine(lambda request: [ord(c) for c in TURN])


class Answers:
    """Answers `turns` turns with a short observation, reward 1 each; `step_hook(meta, k)` runs first and
    may return an observation to answer with instead."""

    def __init__(self, turns=3, step_hook=None):
        self.turns, self.step_hook, self.k = turns, step_hook, 0

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        assert action == TURN
        self.k += 1
        observation = self.step_hook(self.meta, self.k) if self.step_hook else None
        return Step(observation=[{"role": "tool", "content": observation or f"ok {self.k}"}], reward=1.0,
                    done=self.k >= self.turns)

    async def close(self):
        pass


def request(i, max_tokens=200):
    return Request(f"e{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0), meta={"q": i})


def collect(engine, got, rid):
    for c in engine.poll(timeout=0.05):
        got[c.request_id] = c
    return rid in got


def test_an_environment_that_blocks_its_thread_fails_its_episode_only():
    """Episode e0's step blocks its thread (not an await): e1, submitted while it blocks, runs its three
    turns to the end, and e0 fails as a timeout after step_timeout_s, its thread still blocked."""
    entered, release = threading.Event(), threading.Event()

    def block(meta, k):
        if meta["q"] == 0:
            entered.set()
            release.wait(120)  # a blocking call inside `async def step`

    engine = EpisodeEngine(turn_engine(), lambda meta: Answers(step_hook=block), CharTokenizer(),
                           turn_stop_ids=[STOP], step_timeout_s=1.5, env_name="blocking")
    got: dict[str, Completion] = {}
    try:
        engine.submit(request(0))
        wait_until(entered.is_set, 60, "episode e0's environment to block")
        engine.submit(request(1))
        wait_until(lambda: collect(engine, got, "e1"), 60, "episode e1 to finish while e0's environment blocks")
        wait_until(lambda: collect(engine, got, "e0"), 60, "episode e0 to fail on its step_timeout_s")
        blocked_threads = ThreadedEnv.running()
        assert not release.is_set()
    finally:
        release.set()
        engine.close()
    ok, blocked = got["e1"], got["e0"]
    assert ok.info.get("env_failure") is None and ok.info["turns"] == 3 and ok.sample.reward == 3.0
    assert blocked.info["env_failure"] == "timeout" and "episode e0" in blocked.info["env_error"]
    assert blocked.sample.reward == 0.0 and engine.counts["env_timeout"] == 1
    assert blocked_threads >= 1  # e0's, until its call returns
    wait_until(lambda: ThreadedEnv.running() < blocked_threads, 60, "e0's thread to end once released")


@pytest.mark.parametrize("cap, max_tokens", [(None, 64), (100, 10_000)])
def test_an_observation_over_the_token_cap_fails_its_episode(cap, max_tokens):
    """A 5,000-token observation (well under the byte limit) against the cap (max_observation_tokens, by
    default the request's max_tokens): its episode fails as "oversized" with the sample as it was, and the
    other episode, with short observations, is untouched."""
    def huge(meta, k):
        return "x" * 5000 if meta["q"] == 0 else None

    kwargs = {} if cap is None else {"max_observation_tokens": cap}
    engine = EpisodeEngine(turn_engine(), lambda meta: Answers(step_hook=huge), CharTokenizer(),
                           turn_stop_ids=[STOP], step_timeout_s=30, env_name="chatty", **kwargs)
    try:
        done = {c.request_id: c for c in engine.generate([request(0, max_tokens), request(1, max_tokens)],
                                                         timeout=120)}
    finally:
        engine.close()
    big = done["e0"]
    assert big.info.get("env_failure") == "oversized", big.info
    assert "episode e0" in big.info["env_error"] and "5" in big.info["env_error"]
    assert big.sample.tokens == [ord(c) for c in TURN] and not big.sample.env_spans  # nothing appended
    assert big.sample.reward == 0.0 and engine.counts["env_oversized"] == 1
    assert done["e1"].info.get("env_failure") is None and done["e1"].sample.reward == 3.0


def test_max_observation_tokens_is_checked():
    assert EnvConfig.config_problems({"max_observation_tokens": 0}) == [
        "rollout.env.max_observation_tokens must be None or >= 1, got 0"]
    assert EnvConfig.config_problems({"max_observation_tokens": None}) == []
    with pytest.raises(ValueError, match="max_observation_tokens"):
        EpisodeEngine(turn_engine(), lambda meta: Answers(), CharTokenizer(), max_observation_tokens=0)


def test_a_threaded_environment_keeps_its_loop_across_calls():
    """Every call of one environment runs on the same loop (its thread's), not the caller's: loop-bound
    state made at reset (here an asyncio.Event) still works at step."""
    class LoopBound:
        async def reset(self, meta):
            self.loop, self.ready = asyncio.get_running_loop(), asyncio.Event()

        async def step(self, action):
            self.ready.set()
            await self.ready.wait()
            return asyncio.get_running_loop() is self.loop

        async def close(self):
            pass

    async def calls():
        env = ThreadedEnv(LoopBound, name="loop-bound")
        await env.reset({})
        same = await env.step("x")
        await env.close()
        return same, env.env.loop is not asyncio.get_running_loop()

    assert asyncio.run(calls()) == (True, True)


class GatedEngine(scripted.ScriptedEngine):
    """A ScriptedEngine (TURN for every request) whose finished turns reach `poll` only while `gate` is set: a
    turn handed out before its episode's abort is still on its way when the episode is resubmitted."""

    def __init__(self):
        super().__init__(lambda request: [ord(c) for c in TURN])
        self.gate = threading.Event()
        self.handed_out = 0

    def _hand_out(self, completion):
        self.handed_out += 1
        super()._hand_out(completion)

    def poll(self, timeout=None):
        if not self.gate.is_set():
            time.sleep(timeout or 0)
            return []
        return super().poll(timeout)


@contextlib.contextmanager
def first_turn_held():
    """Episode e0 on a GatedEngine, its first turn finished by the inner engine but not yet polled: yields
    (inner, episode engine, e0's request) and closes the engine afterwards."""
    inner = GatedEngine()
    engine = EpisodeEngine(inner, lambda meta: Answers(turns=3), CharTokenizer(), turn_stop_ids=[STOP],
                           step_timeout_s=30, env_name="answers")
    try:
        r = request(0)
        engine.submit(r)
        wait_until(lambda: inner.handed_out == 1, 60, "e0's first turn to finish on the inner engine")
        yield inner, engine, r
    finally:
        inner.gate.set()
        engine.close()


def test_an_abort_just_after_a_turn_finished_hands_that_turn_back():
    """Episode e0's first turn is finished by the inner engine but not yet polled when e0 is aborted: the
    abort waits for that turn and hands it back (progress may already have shown its tokens), and the
    episode resumed from it answers that turn once and runs to its end."""
    got: dict[str, Completion] = {}
    with first_turn_held() as (inner, engine, r), concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(engine.abort, ["e0"])
        wait_until(lambda: "e0" in engine._claims, 30, "the abort to claim e0's finished turn")
        assert not pending.done()  # it waits for the turn
        inner.gate.set()
        (aborted,) = pending.result(timeout=30)
        assert aborted.sample.finish_reason == "abort" and aborted.sample.tokens == [ord(c) for c in TURN]
        engine.submit(Request(r.request_id, r.prompt, r.params, prefix=aborted.sample, meta=r.meta))
        wait_until(lambda: collect(engine, got, "e0"), 60, "the resubmitted e0 to finish")
    done = got["e0"]
    assert done.info.get("env_failure") is None and done.info["turns"] == 3 and done.sample.reward == 3.0
    assert len(done.sample.env_spans) == 2 and [t for a, b in model_turns(done.sample)
                                                 for t in done.sample.tokens[a:b]] == [ord(c) for c in TURN * 3]


def test_a_turn_handed_out_before_its_episode_was_aborted_never_reaches_the_resubmitted_episode(monkeypatch):
    """As above, but the turn does not reach the pump within the abort's wait: the abort returns e0 as it
    was, with no turn, and e0 is resubmitted. The resubmitted episode runs its own turns: the old turn,
    when it comes, is dropped, not applied to it as well (which would answer one turn twice and lose or
    corrupt the episode)."""
    monkeypatch.setattr(episodes, "_CLAIM_TIMEOUT_S", 0.2)
    got: dict[str, Completion] = {}
    with first_turn_held() as (inner, engine, r):
        (aborted,) = engine.abort(["e0"])
        assert aborted.sample.finish_reason == "abort" and aborted.sample.tokens == []
        engine.submit(Request(r.request_id, r.prompt, r.params, prefix=aborted.sample, meta=r.meta))
        wait_until(lambda: inner.handed_out == 2, 60, "the resubmitted e0's first turn to finish")
        inner.gate.set()
        wait_until(lambda: collect(engine, got, "e0"), 60, "the resubmitted e0 to finish")
        assert engine.poll(timeout=0.5) == []  # e0 comes out once
    done = got["e0"]
    assert done.info.get("env_failure") is None and done.info["turns"] == 3 and done.sample.reward == 3.0
    assert done.sample.tokens[:len(TURN)] == [ord(c) for c in TURN]
    assert len(done.sample.env_spans) == 2 and engine.counts["episodes"] == 1
