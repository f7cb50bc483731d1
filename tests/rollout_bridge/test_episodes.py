"""Multi-turn episodes on an engine (`rollout_bridge.episodes.EpisodeEngine`): the model's tokens reach the
completion untouched across turns, the environment's are marked and never sampled, failures are
counted and end only their episode, and an episode aborted mid-turn or mid-answer resumes into the
uninterrupted greedy episode."""

import asyncio
import collections
import concurrent.futures
import logging
import time

import pytest
from engine_helpers import lively_tiny_model, poll_all
from waiting import wait_until

from jaxflow.data.records import Sample
from jaxflow.envs.base import Step
from jaxflow.tokenizer import Tokenizer
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.episodes import EpisodeEngine, model_turns
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # rollout engines compiled and run end to end

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("episodes") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


class Echo:
    """Answers each model turn with a numbered observation; done after `turns` turns, reward 1 per turn.
    `behaviour` makes step k (1-based) sleep, raise, or answer a malformed reward."""

    def __init__(self, turns=3, behaviour=None, at=2, latency_s=0.0):
        self.turns, self.behaviour, self.at, self.latency_s = turns, behaviour, at, latency_s
        self.seen = []

    async def reset(self, meta):
        self.meta = meta
        return None

    async def step(self, action):
        self.seen.append(action)
        k = len(self.seen)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if k == self.at and self.behaviour == "sleep":
            await asyncio.sleep(60)
        if k == self.at and self.behaviour == "raise":
            raise RuntimeError("tool crashed")
        if k == self.at and self.behaviour == "malformed":
            return {"reward": "lots"}
        return Step(observation=[{"role": "tool", "content": f"obs {k} for {self.meta['q']}"}], reward=1.0,
                    done=k >= self.turns)

    async def close(self):
        return None


@pytest.fixture(scope="module")
def turn_stops(model_dir):
    """Stand-ins for a tool-call marker: the 6 tokens this model's greedy answers use most, so that its
    turns end after a few tokens."""
    engine = JaxEngine(str(model_dir), max_slots=4, max_len=256)
    try:
        done = engine.generate([Request(r.request_id, r.prompt, SamplingParams(max_tokens=40, temperature=0.0))
                                for r in requests(4)], timeout=120)
    finally:
        engine.close()
    counts = collections.Counter(t for c in done for t in c.sample.tokens)
    return [t for t, _ in counts.most_common(6)]


def episode_engine(model_dir, tokenizer, make_env, stops, **kw):
    inner = JaxEngine(str(model_dir), max_slots=4, max_len=256)
    # Its background compiles done first: a call before then may run in a larger bucket than a later one,
    # whose sums differ in the last bits (enough to flip a near-tie of this random model's greedy choice).
    assert inner.warmed(timeout=300)
    return EpisodeEngine(inner, make_env, tokenizer, turn_stop_ids=stops, step_timeout_s=kw.pop("timeout", 5.0),
                         env_name="echo", **kw)


def requests(n, tag="e"):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return [Request(f"{tag}{i}", [3 + i, 40 + i, 77], params, meta={"q": i}) for i in range(n)]


def check_episode(sample, tokenizer, turns):
    """Environment spans hold the rendered observations, model turns lie between them."""
    assert sample.finish_reason in ("stop", "length")
    assert len(sample.tokens) == len(sample.logprobs) == len(sample.versions)
    for k, (a, b) in enumerate(sample.env_spans, 1):
        assert f"obs {k} for" in tokenizer.decode(sample.tokens[a:b], skip_special_tokens=False)
        assert all(lp == 0.0 for lp in sample.logprobs[a:b])
    assert len(model_turns(sample)) == turns
    for a, b in model_turns(sample):
        assert all(lp < 0.0 or lp == 0.0 for lp in sample.logprobs[a:b])


def test_episodes_alternate_model_and_environment_and_keep_the_model_tokens(model_dir, tokenizer, turn_stops):
    envs = []

    def make_env(meta):
        envs.append(Echo(turns=3))
        return envs[-1]

    engine = episode_engine(model_dir, tokenizer, make_env, turn_stops)
    released = []
    release = engine.inner.release
    engine.inner.release = lambda ids: (released.extend(ids), release(ids))
    try:
        done = {c.request_id: c for c in engine.generate(requests(4), timeout=300)}
    finally:
        engine.close()
    # Each finished episode lets the inner engine forget its last turn's cache (no turn follows it).
    assert sorted(released) == sorted(done)
    for i in range(4):
        c = done[f"e{i}"]
        s = c.sample
        check_episode(s, tokenizer, turns=3 if s.finish_reason == "stop" else len(model_turns(s)))
        assert s.reward == float(len(s.env_spans) + (s.finish_reason == "stop")) and c.info["turns"] >= 1
    # Each turn the environment saw is the decoding of exactly the model's tokens of that turn.
    for env in envs:
        c = next(c for c in done.values() if f"for {env.meta['q']}" in tokenizer.decode(
            c.sample.tokens, skip_special_tokens=False))
        turns = model_turns(c.sample)
        assert env.seen == [tokenizer.decode(c.sample.tokens[a:b]) for a, b in turns[:len(env.seen)]]
    assert engine.counts["episodes"] == 4


@pytest.mark.parametrize("behaviour, kind", [("sleep", "timeout"), ("raise", "error"), ("malformed", "malformed")])
def test_a_failing_environment_fails_its_episode_only(model_dir, tokenizer, turn_stops, behaviour, kind):
    def make_env(meta):
        return Echo(turns=3, behaviour=behaviour if meta["q"] == 0 else None, at=1)

    engine = episode_engine(model_dir, tokenizer, make_env, turn_stops, timeout=0.5)
    try:
        done = {c.request_id: c for c in engine.generate(requests(3), timeout=300)}
    finally:
        engine.close()
    bad = done["e0"]
    assert bad.sample.reward == 0.0 and bad.info["env_failure"] == kind and "environment 'echo', episode e0" in \
        bad.info["env_error"]
    assert bad.sample.finish_reason == "stop" and not bad.sample.env_spans
    assert engine.counts[f"env_{kind}"] == 1
    assert all(done[f"e{i}"].info.get("env_failure") is None for i in (1, 2))


@pytest.mark.parametrize("resume_from", ["abort", "progress"])
def test_abort_mid_episode_and_resume_gives_the_uninterrupted_greedy_episode(model_dir, tokenizer, turn_stops,
                                                                             resume_from, caplog):
    """resume_from "progress": each episode resumes from what `progress` read just before the abort (what a
    dead worker's coordinator last reported), not from the abort's own sample."""
    engine = episode_engine(model_dir, tokenizer, lambda meta: Echo(turns=3), turn_stops)
    try:
        reference = {c.request_id: c.sample for c in engine.generate(requests(3), timeout=300)}
    finally:
        engine.close()
    # Slow answers: aborts land while environments answer and while turns generate.
    engine = episode_engine(model_dir, tokenizer, lambda meta: Echo(turns=3, latency_s=0.3), turn_stops)
    try:
        by_id = {r.request_id: r for r in requests(3)}
        for r in by_id.values():
            engine.submit(r)
        partial, got, rounds = [], {}, []
        for delay in (0.25, 0.5, 0.4):
            time.sleep(delay)
            read = {c.request_id: c.sample for c in engine.progress([rid for rid in by_id if rid not in got])}
            aborted = engine.abort([rid for rid in by_id if rid not in got])
            got.update({c.request_id: c for c in engine.poll(timeout=0)})  # finished before the abort
            rounds.append({c.request_id: (len(read[c.request_id].tokens), len(c.sample.tokens), c.sample.env_spans)
                           for c in aborted})
            for c in aborted:
                assert c.sample.finish_reason == "abort"
                prefix = c.sample
                if resume_from == "progress":
                    prefix = read[c.request_id]
                    assert prefix.finish_reason is None and prefix.reward is None
                    assert c.sample.tokens[:len(prefix.tokens)] == prefix.tokens
                    assert prefix.env_spans == [sp for sp in c.sample.env_spans if sp[1] <= len(prefix.tokens)]
                partial.append(prefix)
                r = by_id[c.request_id]
                engine.submit(Request(r.request_id, r.prompt, r.params, prefix=prefix, meta=r.meta))
        got.update(poll_all(engine, 3 - len(got), timeout=300))
    finally:
        engine.close()
    # Aborts are not environment failures.
    assert not {k: n for k, n in engine.counts.items() if k.startswith("env_") and n}
    assert any(s.env_spans for s in partial)  # aborted after a turn was answered
    assert any(not s.env_spans or s.env_spans[-1][1] < len(s.tokens) for s in partial)  # or within a turn
    for rid, want in reference.items():
        c = got[rid]
        s = c.sample
        # What a mismatch needs to be understood: how each episode ended, what each round read and aborted
        # ({id: (tokens read, tokens aborted, spans)}), and what the engine logged.
        why = (f"{rid}: {s.finish_reason!r} after {len(s.tokens)} tokens, spans {s.env_spans}, error "
               f"{c.error!r}, info {c.info}; uninterrupted: {want.finish_reason!r} after {len(want.tokens)}, "
               f"spans {want.env_spans}; rounds {rounds}; counts {dict(engine.counts)}; log "
               f"{[r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]}")
        assert (s.finish_reason, c.error) == (want.finish_reason, None), why
        assert s.tokens == want.tokens and s.env_spans == want.env_spans, why
        assert s.reward == want.reward, why


def test_a_turn_that_finishes_after_its_episode_was_handed_back_is_dropped(model_dir, tokenizer, turn_stops,
                                                                          caplog):
    """An abort (or close) hands the episode back and closes its environment while the turn that just
    finished may already be scheduled on the event loop: that turn must end quietly, not count an
    environment failure, call the closed environment, or end the episode resumed under the same id."""
    envs = []

    def make_env(meta):
        envs.append(Echo(turns=3, latency_s=2.0))  # the episode cannot end before the abort
        return envs[-1]

    engine = episode_engine(model_dir, tokenizer, make_env, turn_stops)
    try:
        (r,) = requests(1)
        engine.submit(r)
        while not engine.progress([r.request_id])[0].sample.tokens:
            time.sleep(0.01)
        with engine._lock:
            ep = engine._episodes[r.request_id]
        (aborted,) = engine.abort([r.request_id])
        assert ep.env is None
        answered = list(envs[0].seen)
        aborted.sample.finish_reason = "stop"  # as if the turn had ended just before the abort
        late = asyncio.run_coroutine_threadsafe(engine._turn_done(ep, aborted), engine._loop)
        with pytest.raises(concurrent.futures.CancelledError):  # cancelled: the episode is gone
            late.result(timeout=10)
        assert engine.poll(timeout=0.2) == []
        # The episode resumes under the same id; a late turn of the one handed back that ends it ("length")
        # must leave the resumed episode alone, which then finishes.
        engine.submit(Request(r.request_id, r.prompt, r.params, prefix=aborted.sample, meta=r.meta))
        aborted.sample.finish_reason = "length"
        asyncio.run_coroutine_threadsafe(engine._turn_done(ep, aborted), engine._loop).result(timeout=10)
        assert engine.poll(timeout=0.2) == []
        resumed = poll_all(engine, 1, timeout=120)[r.request_id].sample
    finally:
        engine.close()
    assert not {k: n for k, n in engine.counts.items() if k.startswith("env_") and n}
    assert envs[0].seen == answered and "raised" not in caplog.text
    assert resumed.finish_reason in ("stop", "length") and len(resumed.env_spans) > len(aborted.sample.env_spans)


def test_reset_may_not_add_messages(model_dir, tokenizer, turn_stops):
    class Chatty(Echo):
        async def reset(self, meta):
            self.meta = meta
            return "hello"

    engine = episode_engine(model_dir, tokenizer, lambda meta: Chatty(), turn_stops)
    try:
        (c,) = engine.generate(requests(1), timeout=120)
    finally:
        engine.close()
    assert c.info["env_failure"] == "malformed" and "reset returned messages" in c.info["env_error"]
    assert c.sample == Sample(finish_reason="stop", reward=0.0)


def test_a_coordinator_trains_episodes_on_their_environments_rewards(model_dir, tokenizer, turn_stops):
    """Through the coordinator and the trajectory service: each request carries its task's meta to the
    environment, and the group's rewards are the episodes' (not the reward function's)."""
    from jaxflow.coordination import Coordination, Coordinator
    from jaxflow.data.param_service import ParameterService
    from jaxflow.data.prompt_source import PromptSource
    from jaxflow.data.trajectory_service import TrajectoryService
    from jaxflow.models.hf_io import iter_hf_tensors, load_model

    records = [{"prompt": [5 + i, 6, 7], "meta": {"q": 100 + i}} for i in range(8)]
    traj = TrajectoryService(PromptSource(records, shuffle=False), batch_groups=2, group_size=2, eta=0)
    params = ParameterService(keep=2)
    params.publish(0, dict(iter_hf_tensors(load_model(model_dir))))
    seen = []

    def make_env(meta):
        seen.append(meta["q"])
        return Echo(turns=2)

    engine = episode_engine(model_dir, tokenizer, make_env, turn_stops)
    w = Coordinator("w0", [engine], traj, params, strategy=Coordination(max_running=4, sync="all"), eta=0,
                    sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0),
                    reward_fn=lambda task, samples: [-7.0] * len(samples))
    try:
        def stepped():
            if traj.buffer_state() == "ready":
                return True
            w.step()
            return False
        wait_until(stepped, 300, lambda: f"a ready buffer; coordinator stats {w.stats()}", interval=0.005)
        batch = traj.consume(0, timeout=1)
    finally:
        w.stop(abort_in_flight=True)
        engine.close()
    assert set(seen) <= {100 + i for i in range(8)} and len(seen) >= 4
    for g in batch.groups:
        assert g.rewards == [s.reward for s in g.samples] and -7.0 not in g.rewards
        assert all(s.env_spans for s in g.samples if s.finish_reason == "stop")
        q = records[g.group_id]["meta"]["q"] if g.group_id < len(records) else None
        for s in g.samples:
            assert f"for {q}" in tokenizer.decode(s.tokens, skip_special_tokens=False)


def test_a_tool_that_kills_its_process_fails_its_episodes_and_the_engine_serves_on(model_dir, tokenizer, turn_stops,
                                                                                  monkeypatch):
    import pathlib

    from jaxflow.envs.isolated import isolated

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "envs"))
    make_env = isolated("crashing_env:CrashOn", {"crash_q": 0})
    engine = episode_engine(model_dir, tokenizer, make_env, turn_stops, timeout=60)
    try:
        first = engine.generate(requests(1), timeout=300)  # q=0: its tool kills the environment process
        later = {c.request_id: c for c in engine.generate(requests(3, tag="l")[1:], timeout=300)}
    finally:
        engine.close()
    (crashed,) = first
    assert crashed.info["env_failure"] == "error" and "environment process exited" in crashed.info["env_error"]
    assert crashed.sample.reward == 0.0 and engine.counts["env_error"] == 1
    assert all(c.sample.reward == 1.0 for c in later.values()) and make_env.restarts == 1
