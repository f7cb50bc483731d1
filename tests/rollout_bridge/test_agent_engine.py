"""Agents as episodes (`rollout_bridge.agent_engine`): an agent program drives the model through the
endpoint; the engine's completion is the episode's training data. The inner engine here is scripted and
gated (a turn waits until the test lets it finish), so a weight update can land in the middle of a turn."""

import asyncio
import sys
import threading

import pytest
from agent_helpers import model_tokens

from jaxflow.data import checks
from jaxflow.data.records import Sample
from jaxflow.envs import calculator_agent
from jaxflow.models.tiny import write_tiny_tokenizer
from rollout_bridge.agent_engine import AgentEngine, CommandAgent, FunctionAgent, IsolatedAgent
from rollout_bridge.engine import Completion, Engine, EngineLoad, Request, SamplingParams

TOOL_END = "</tool>"
PARAMS = SamplingParams(max_tokens=200, temperature=1.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), extra_tokens=("<tool>", TOOL_END, "<result>",
                                                                               "</result>"))


class GatedEngine(Engine):
    """Answers each request with its episode's next scripted turn (cut after a stop token). gated: a turn waits
    in `pending` until `finish_pending`; `pause("abort")` hands a waiting turn back with its first `partial`
    tokens generated, and the request resubmitted with them generates the rest. The i-th token sampled has
    log-prob -(i + 1) / 64 and the engine's version."""

    def __init__(self, turns: dict[str, list[list[int]]], *, gated=False, partial=2):
        self._init_admission()
        self.turns, self.gated, self.partial = {k: list(v) for k, v in turns.items()}, gated, partial
        self._version, self._paused, self.sampled = 0, False, 0
        self.pending: dict[str, Sample] = {}
        self.submitted: list[Request] = []
        self._generated: dict[str, int] = {}  # tokens of the episode's current turn already handed back

    @property
    def version(self):
        return self._version

    @property
    def paused(self):
        return self._paused

    def _invalid(self, request):
        return None

    def _in_flight(self, request_id):
        return request_id in self.pending

    def _accept(self, request, sample):
        self.submitted.append(request)
        self.pending[request.request_id] = sample
        if not self.gated and not self._paused:
            self._finish(request.request_id)

    def _sample(self, sample, ids):
        sample.tokens += ids
        sample.logprobs += [-(self.sampled + i + 1) / 64 for i in range(len(ids))]
        sample.versions += [self._version] * len(ids)
        self.sampled += len(ids)

    def _finish(self, rid):
        sample = self.pending.pop(rid)
        stops = self.submitted[-1].params.stop_token_ids
        ids = []
        for t in self.turns[rid].pop(0)[self._generated.pop(rid, 0):]:
            ids.append(t)
            if t in stops:
                break
        self._sample(sample, ids)
        sample.finish_reason = "stop"
        self._hand_out(Completion(rid, sample))

    def finish_pending(self):
        with self._lock:
            for rid in list(self.pending):
                self._finish(rid)

    def abort(self, request_ids):
        out = []
        with self._lock:
            for rid in request_ids:
                if rid in self.pending:
                    sample = self.pending.pop(rid)
                    sample.finish_reason = "abort"
                    out.append(Completion(rid, sample))
        return out

    def progress(self, request_ids):
        return []

    def update_weights(self, version, tensors, *, keep_kv=False):
        self._version = version

    def pause(self, mode="keep"):
        self._paused = True
        out = []
        if mode == "abort":
            with self._lock:
                for rid in list(self.pending):
                    sample = self.pending.pop(rid)
                    self._sample(sample, self.turns[rid][0][:self.partial])
                    self._generated[rid] = self.partial
                    sample.finish_reason = "abort"
                    out.append(Completion(rid, sample))
        return out

    def resume(self):
        self._paused = False
        if not self.gated:
            self.finish_pending()

    def load(self):
        return EngineLoad(len(self.pending), 0, 0.0, 0.0, self._version)

    def close(self):
        with self._lock:
            self._closing = True
            self._finished.notify_all()


def calculator_turns(tok, expression="2 + 3", answer="5"):
    return [tok.encode(f"<tool>{expression}") + [tok.token_to_id(TOOL_END)],
            tok.encode(f"<answer>{answer}</answer>") + [tok.eos_id]]


def request(tok, rid="e1", question="Compute 2 + 3.", answer=5, params=PARAMS, prefix=None):
    prompt = tok.encode_chat([{"role": "user", "content": question}])
    return Request(rid, prompt, params, prefix=prefix, meta={"question": question, "answer": answer,
                                                             "format_score": 0.0})


def make(tok, turns, agent=None, **kw):
    inner = GatedEngine(turns, **{k: kw.pop(k) for k in ("gated", "partial") if k in kw})
    agent = agent or FunctionAgent(calculator_agent.agent, ref="jaxflow.envs.calculator_agent:agent")
    return inner, AgentEngine(inner, agent, tok, max_context=256, **kw)


def test_a_calculator_agent_trains_on_exactly_the_sampled_tokens(tok):
    inner, engine = make(tok, {"e1": calculator_turns(tok)})
    try:
        [c] = engine.generate([request(tok)], timeout=60)
    finally:
        engine.close()
    s = c.sample
    assert c.info.get("env_failure") is None and s.reward == 1.0 and s.finish_reason == "stop"
    assert s.sequence_starts == [0]  # one sequence: the agent only appended to its history
    sampled = calculator_turns(tok)
    assert [t for t, _, _ in model_tokens(s)] == sampled[0] + sampled[1]
    assert [lp for _, lp, _ in model_tokens(s)] == [-(i + 1) / 64 for i in range(len(sampled[0] + sampled[1]))]
    text = tok.decode(s.tokens, skip_special_tokens=False)
    assert "<result>5</result>" in text and text.startswith("<|im_start|>user\nCompute 2 + 3.")
    # The second turn continued the first's sequence: same prompt, the first turn and the tool's answer as prefix.
    first, second = inner.submitted
    assert second.prompt == first.prompt and second.prefix.tokens[:len(sampled[0])] == sampled[0]
    checks.check_sample("group 0 sample 0", s, 0, 0, finished=True)
    assert engine.counts["episodes"] == 1 and engine.counts["episode_turns"] == 2


def test_a_weight_update_that_aborts_is_invisible_to_the_agent(tok):
    inner, engine = make(tok, {"e1": calculator_turns(tok)}, gated=True, partial=2)
    try:
        engine.submit(request(tok))
        _wait(lambda: inner.pending)
        assert engine.pause("abort") == []  # the episode stays: its turn waits here, not in the queue
        engine.update_weights(1, {})
        engine.resume()
        _wait(lambda: inner.pending)
        resumed = inner.submitted[-1]
        assert resumed.prefix.tokens[-2:] == calculator_turns(tok)[0][:2]  # the turn goes on from its tokens
        inner.finish_pending()
        _wait(lambda: len(inner.submitted) == 3)
        inner.finish_pending()
        [c] = _poll(engine)
    finally:
        engine.close()
    versions = [v for _, _, v in model_tokens(c.sample)]
    assert c.sample.reward == 1.0 and versions[:2] == [0, 0] and set(versions[2:]) == {1}
    assert c.info["turns"] == 2  # the agent saw two replies, the aborted turn one of them


@pytest.mark.parametrize("body, kind, match", [
    ("raise RuntimeError('tool crashed')", "error", "agent raised RuntimeError: tool crashed"),
    ("await asyncio.sleep(30)", "timeout", "agent ran for more than 0.5 s"),
    ("return float('nan')", "malformed", "not a finite real reward"),
    ("return 1.0", "malformed", "without asking the model anything"),
])
def test_a_failing_agent_fails_its_episode_alone(tok, body, kind, match):
    namespace = {"asyncio": asyncio}
    exec(f"async def agent(base_url, task, episode, *, api_key):\n    {body}", namespace)
    inner, engine = make(tok, {"e1": calculator_turns(tok), "e2": calculator_turns(tok)},
                         agent=FunctionAgent(namespace["agent"], ref="bad_agent"), timeout_s=0.5)
    try:
        [bad] = engine.generate([request(tok)], timeout=60)
        # The engine serves on: the next episode trains (with time for a first client on a loaded machine).
        engine.agent, engine.timeout_s = FunctionAgent(calculator_agent.agent), 60.0
        [good] = engine.generate([request(tok, "e2")], timeout=60)
    finally:
        engine.close()
    assert bad.info["env_failure"] == kind and match in bad.info["env_error"] and bad.sample.reward == 0.0
    assert engine.counts[f"env_{kind}"] == 1 and good.sample.reward == 1.0


def test_an_aborted_episode_is_handed_back_and_its_agent_refused(tok):
    import openai

    seen = {}

    async def agent(base_url, task, episode, *, api_key):
        seen["url"], seen["key"] = base_url, api_key
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        try:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise
        finally:
            await client.close()
        return 1.0

    inner, engine = make(tok, {"e1": calculator_turns(tok)}, agent=FunctionAgent(agent), gated=True)
    try:
        engine.submit(request(tok))
        _wait(lambda: inner.pending)
        [c] = engine.abort(["e1"])
        assert c.sample.finish_reason == "abort" and c.sample.tokens == [] and not inner.pending
        _wait(lambda: seen.get("cancelled"))  # the agent is stopped with its episode
        late = openai.OpenAI(base_url=seen["url"], api_key=seen["key"], max_retries=0)
        with pytest.raises(openai.ConflictError, match="has ended"):
            late.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        # Resubmitted with its prefix (the coordinator resuming it), it fails at once: its agent is gone.
        engine.submit(request(tok, prefix=Sample(tokens=[1, 2], logprobs=[0.0, 0.0], versions=[0, 0])))
        [resumed] = _poll(engine)
    finally:
        engine.close()
    assert resumed.info["env_failure"] == "error" and "cannot resume" in resumed.info["env_error"]


def test_a_command_agent_gets_the_endpoint_in_its_environment(tok, tmp_path, monkeypatch):
    import pathlib

    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).parents[2]))  # this checkout's jaxflow
    script = tmp_path / "agent.py"
    script.write_text(
        "import asyncio, json, os\n"
        "from jaxflow.envs.calculator_agent import agent\n"
        "task = json.loads(os.environ['JAXFLOW_TASK'])\n"
        "reward = asyncio.run(agent(os.environ['OPENAI_BASE_URL'], task, os.environ['JAXFLOW_EPISODE'],\n"
        "                           api_key=os.environ['OPENAI_API_KEY']))\n"
        "print('log line')\n"
        "print(json.dumps({'reward': reward}))\n")
    failing = tmp_path / "failing.py"
    failing.write_text("import sys\nprint('no tool here', file=sys.stderr)\nsys.exit(3)\n")
    inner, engine = make(tok, {"e1": calculator_turns(tok)}, agent=CommandAgent([sys.executable, str(script)]))
    try:
        [c] = engine.generate([request(tok)], timeout=120)
        engine.agent = CommandAgent([sys.executable, str(failing)])
        [bad] = engine.generate([request(tok, "e2")], timeout=120)
    finally:
        engine.close()
    assert c.sample.reward == 1.0 and c.sample.sequence_starts == [0]
    assert bad.info["env_failure"] == "error" and "exited with code 3: no tool here" in bad.info["env_error"]


def test_an_isolated_agent_runs_in_a_process_of_its_own_whose_crash_fails_its_episode_alone(tok, tmp_path,
                                                                                            monkeypatch):
    (tmp_path / "crashing_agent.py").write_text(
        "import os\n"
        "from jaxflow.envs.calculator_agent import agent as calculator\n\n"
        "async def agent(base_url, task, episode, *, api_key, crash_on='crash'):\n"
        "    if task.get(crash_on):\n"
        "        os._exit(7)  # takes its whole process down: only the agents' process may go\n"
        "    return await calculator(base_url, task, episode, api_key=api_key)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the child process imports the agent from the parent's path
    import crashing_agent

    agent = IsolatedAgent(FunctionAgent(crashing_agent.agent, {"crash_on": "crash"}, ref="crashing_agent:agent"))
    crash = request(tok, "e2")
    crash.meta["crash"] = True
    inner, engine = make(tok, {rid: calculator_turns(tok) for rid in ("e1", "e3")}, agent=agent)
    try:
        [first] = engine.generate([request(tok, "e1")], timeout=120)
        [crashed] = engine.generate([crash], timeout=120)
        [after] = engine.generate([request(tok, "e3")], timeout=120)  # on a new agents' process
    finally:
        engine.close()
    sampled = calculator_turns(tok)
    for c in (first, after):
        assert c.info.get("env_failure") is None and c.sample.reward == 1.0
        assert [t for t, _, _ in model_tokens(c.sample)] == sampled[0] + sampled[1]
    assert crashed.info["env_failure"] == "error" and "exited (code 7)" in crashed.info["env_error"]
    assert crashed.sample.reward == 0.0


def test_agent_sections_are_checked(tmp_path, monkeypatch):
    from jaxflow.envs.config import EnvConfig, env_problems, env_section

    (tmp_path / "user_agents.py").write_text(
        "def not_async(base_url, task, episode, *, api_key):\n    return 1.0\n\n"
        "async def agent(base_url, task, episode, *, api_key, tries=1):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "must name an async function" in env_problems(env_section(kind="agent", ref="user_agents:not_async"))[0]
    assert "does not take" in env_problems(env_section(kind="agent", ref="user_agents:agent",
                                                       options={"retries": 2}))[0]
    assert env_problems(env_section(kind="agent", ref="user_agents:agent", options={"tries": 2})) == []
    assert "needs rollout.env.ref" in env_problems(env_section(kind="agent"))[0]
    assert "is not found" in env_problems(env_section(kind="command", command=["no-such-agent-program"]))[0]
    assert "needs rollout.env.command" in EnvConfig.config_problems({"kind": "command"})[0]
    assert "rollout.env.kind" in EnvConfig.config_problems({"kind": "robot"})[0]
    assert "already runs each agent in a process" in EnvConfig.config_problems(
        {"kind": "command", "command": ["agent"], "isolate": True})[0]


def _wait(predicate, timeout=30.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("timed out waiting")


def _poll(engine, n=1, timeout=60.0):
    out = []
    for _ in range(int(timeout / 0.05)):
        out += engine.poll(timeout=0.05)
        if len(out) >= n:
            return out
    raise AssertionError(f"got {len(out)} of {n} completions")



@pytest.mark.parametrize("overrides, match", [
    ({"rollout.num_engines": "2", "rollout.coordination.stuck": "wait"}, "rollout.coordination.migrate moves"),
    ({"rollout.num_engines": "2", "rollout.coordination.migrate": "False"}, "stuck 'retry' moves stragglers"),
    ({"trainer.moe.routing_replay": "rollout"}, "agent episodes .* record no routes"),
])
def test_what_agents_cannot_do_is_refused_before_the_run(overrides, match):
    import pathlib

    from jaxflow.config import ConfigError, load_config
    from jaxflow.jobs import rl

    path = pathlib.Path(__file__).parents[2] / "configs" / "arithmetic_agent_tiny.py"
    rl.check_config(load_config(str(path)))
    with pytest.raises(ConfigError, match=match):
        rl.check_config(load_config(str(path), overrides))
