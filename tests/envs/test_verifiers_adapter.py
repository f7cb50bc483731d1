"""Verifiers environments as jaxflow agents (`jaxflow.envs.verifiers_agent`): a verifiers environment runs
unmodified through the agent engine's endpoint, on a scripted model, and its episode's reward is verifiers'
own score. The environments are `jaxflow.envs.verifiers_examples`'s, written in verifiers' v1 API."""

import pytest

vf = pytest.importorskip("verifiers.v1")

from jaxflow.envs import verifiers_agent  # noqa: E402
from jaxflow.models.tiny import write_tiny_tokenizer  # noqa: E402
from rollout_bridge.agent_engine import AgentEngine, FunctionAgent  # noqa: E402
from rollout_bridge.engine import Request, SamplingParams  # noqa: E402
from rollout_bridge.scripted import ScriptedEngine  # noqa: E402

SINGLE = "jaxflow.envs.verifiers_examples.arithmetic"
MULTI = "jaxflow.envs.verifiers_examples.calculator"
TOOL_END = "</tool>"
PARAMS = SamplingParams(max_tokens=200, temperature=1.0)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), extra_tokens=("<tool>", TOOL_END, "<result>",
                                                                               "</result>"))


def scripted(tok, turns: dict[str, list[str]]):
    """An engine answering each episode's turns in order: the text of each, then `</tool>` or end of sequence."""
    left = {rid: list(ts) for rid, ts in turns.items()}

    def script(request):
        text = left[request.request_id].pop(0)
        if text.endswith(TOOL_END):
            return tok.encode(text[:-len(TOOL_END)]) + [tok.token_to_id(TOOL_END)]
        return tok.encode(text) + [tok.eos_id]

    return ScriptedEngine(script)


def run(tok, env, turns, metas, **options):
    """Runs one episode per (id, meta) through an AgentEngine whose agent is the adapter on `env`."""
    agent = FunctionAgent(verifiers_agent.agent, {"env": env, **options}, ref="jaxflow.envs.verifiers_agent:agent")
    engine = AgentEngine(scripted(tok, turns), agent, tok, max_context=256, timeout_s=60)
    requests = [Request(rid, tok.encode_chat([{"role": "user", "content": m["question"]}]), PARAMS, meta=m)
                for rid, m in metas.items()]
    try:
        return {c.request_id: c for c in engine.generate(requests, timeout=120)}
    finally:
        engine.close()


def meta(question, answer):
    return {"task": "arithmetic", "question": question, "answer": answer, "format_score": 0.0}


def test_a_single_turn_env_scores_its_reply(tok):
    out = run(tok, SINGLE, {"right": ["= 5\n<answer>5</answer>"], "wrong": ["<answer>6</answer>"]},
              {"right": meta("Compute 2 + 3.", 5), "wrong": meta("Compute 2 + 3.", 5)})
    assert out["right"].info.get("env_failure") is None, out["right"].info
    assert out["right"].sample.reward == 1.0 and out["wrong"].sample.reward == 0.0
    text = tok.decode(out["right"].sample.tokens, skip_special_tokens=False)
    assert "Compute 2 + 3." in text and text.endswith("<answer>5</answer>" + tok.decode([tok.eos_id],
                                                                                      skip_special_tokens=False))


def test_a_multi_turn_env_answers_its_tool_calls(tok):
    turns = ["<tool>7 + 5 * 3" + TOOL_END, "<answer>22</answer>"]
    out = run(tok, MULTI, {"e1": list(turns), "e2": ["<tool>7 + 5 * 3" + TOOL_END, "<answer>21</answer>"]},
              {"e1": meta("Compute 7 + 5 * 3.", 22), "e2": meta("Compute 7 + 5 * 3.", 22)})
    c = out["e1"]
    assert c.info.get("env_failure") is None, c.info
    assert c.sample.reward == 1.0 and out["e2"].sample.reward == 0.0 and c.info["turns"] == 2
    s = c.sample
    assert s.sequence_starts == [0]  # one sequence: the harness only appended to its conversation
    # The model's tokens are exactly the two sampled turns; the tool's answer is environment tokens.
    mask = s.model_mask()
    sampled = [t for t, m in zip(s.tokens, mask) if m]
    assert sampled == (tok.encode("<tool>7 + 5 * 3") + [tok.token_to_id(TOOL_END)]
                       + tok.encode("<answer>22</answer>") + [tok.eos_id])
    env_text = "".join(tok.decode(s.tokens[a:b], skip_special_tokens=False) for a, b in s.env_spans)
    assert "<result>22</result>" in env_text and "Compute 7 + 5 * 3." in env_text


def test_the_reward_is_verifiers_weighted_score(tok):
    """tests/envs/verifiers_even_env.py, loaded by its verifiers id: rewards `even` (weight 1) and `tagged`
    (weight 0.5) and a metric; the episode's reward is their weighted sum, the metric left out."""
    replies = {"even": "<answer>4</answer>", "odd": "<answer>3</answer>", "none": "four"}
    out = run(tok, "verifiers_even_env", {k: [v] for k, v in replies.items()},
              {k: {"question": "Name an even number."} for k in replies})
    assert {k: c.sample.reward for k, c in out.items()} == {"even": 1.5, "odd": 0.5, "none": 0.0}


def test_a_task_the_env_cannot_take_fails_its_episode_alone(tok):
    out = run(tok, SINGLE, {"bad": ["<answer>5</answer>"], "good": ["<answer>5</answer>"]},
              {"bad": {"question": "Compute 2 + 3."}, "good": meta("Compute 2 + 3.", 5)})
    bad = out["bad"]
    assert bad.info["env_failure"] == "error" and bad.sample.reward == 0.0
    assert "is not a task of" in bad.info["env_error"] and "answer" in bad.info["env_error"]
    assert out["good"].sample.reward == 1.0


@pytest.mark.parametrize("env, agent_config, match", [
    ("json", None, "'json' is not a verifiers environment jaxflow can run"),
    ("jaxflow.envs.no_such_module", None, "cannot import module 'jaxflow.envs.no_such_module'"),
    ("", None, "env must name a verifiers environment"),
    (SINGLE, {"max_turns": "many"}, "(?s)is not a verifiers environment jaxflow can run.*max_turns"),
    (SINGLE, {"retries": {"max_retries": 1}}, "agent.retries must be 0 in jaxflow"),
])
def test_what_jaxflow_cannot_run_is_named(env, agent_config, match):
    with pytest.raises(ValueError, match=match):
        verifiers_agent.load_env(env, agent_config=agent_config)


def test_a_missing_extra_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"pip install 'jaxflow\[envs\]'"):
        verifiers_agent.load_env(SINGLE)


def test_the_config_trains_the_calculator_env_through_the_adapter():
    from jaxflow.config import load_config
    from jaxflow.envs.config import env_problems

    config = load_config("configs/arithmetic_verifiers_tiny.py")
    env = config.rollout.env
    assert env.kind == "agent" and env.ref == "jaxflow.envs.verifiers_agent:agent" and env_problems(env) == []
    assert env.options["env"] == MULTI and verifiers_agent.load_env(MULTI).taskset is not None
    # A bad environment or field mapping is named by the run's config check, before any episode.
    with env.unlocked():
        env.options = {"env": "json"}
    [problem] = env_problems(env)
    assert problem.startswith("rollout.env.options: 'json' is not a verifiers environment jaxflow can run")
    with env.unlocked():
        env.options = {"env": MULTI, "task_fields": {"question": "question"}}
    [problem] = env_problems(env)
    assert "task_fields names ['question'], not fields of" in problem and "ArithmeticData" in problem


@pytest.mark.slow  # a run of the RL job end to end
def test_a_verifiers_environment_trains_through_the_adapter(tmp_path, shared_base):
    """A verifiers environment (tests/envs/verifiers_even_env.py, loaded by its verifiers id) trains through the
    adapter: its episodes run in verifiers, through the endpoint, scored by verifiers, and the reward rises.
    The run and its base model are the SkyRL-gym adapter's learning test's (tests/jobs/test_episodes_job.py:
    the same warm start, built once a session)."""
    import statistics

    from small_runs import records, small_config

    from jaxflow.envs.config import env_section
    from jaxflow.jobs import rl

    steps = 16
    config = small_config(tmp_path, tmp_path / "base", **{
        "base.steps": "300", "base.num_examples": "2000", "task.max_ops": "1", "trainer.lr": "3e-4",
        "trainer.batch_groups": "8", "trainer.steps": str(steps), "trainer.eta": "2", "eval.every": "1000",
        "checkpoint.every": "1000", "rollout.max_tokens": "96", "rollout.max_len": "192"})
    with config.unlocked():
        config.rollout.env = env_section(kind="agent", ref="jaxflow.envs.verifiers_agent:agent",
                                         options={"env": "verifiers_even_env"}, agent_timeout_s=120.0)
    shared_base(config, tmp_path / "base")
    assert rl.run(config) == 0
    trained = [r for r in records(tmp_path / "run") if "reward_mean" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    assert all(r["env_tokens_mean"] > 0 and r["groups_failed"] == 0 for r in trained)
    rewards = [r["reward_mean"] for r in trained]
    first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-4:])
    assert last > first, [round(x, 3) for x in rewards]


@pytest.mark.slow  # a run of the RL job end to end
def test_the_calculator_env_config_runs(tmp_path, shared_base):
    """configs/arithmetic_verifiers_tiny.py at its small size, for a step on the agent job test's base model
    (tests/jobs/test_agent_job.py: the same warm start): the multi-turn verifiers environment's episodes run in
    the job through the endpoint, none fails, and the accounting closes."""
    import json

    from small_runs import records

    from jaxflow.config import load_config
    from jaxflow.jobs import rl

    steps = 1  # the job through the adapter end to end; the learning test above trains for longer
    config = load_config("configs/arithmetic_verifiers_tiny.py:async,small", {
        "base.dir": str(tmp_path / "base"), "workdir": str(tmp_path / "run"), "trainer.steps": str(steps),
        "trainer.batch_groups": "2", "eval.every": "1000", "eval.num_prompts": "8"})
    shared_base(config, tmp_path / "base")
    assert rl.run(config) == 0
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    assert all(r["env_tokens_mean"] > 0 and r["groups_failed"] == 0 for r in trained)
    a = json.loads((tmp_path / "run" / "result.json").read_text())["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"] and a["failed"] == 0
