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
    out = run(tok, MULTI, {"e1": ["<tool>7 + 5 * 3" + TOOL_END, "<answer>22</answer>"]},
              {"e1": meta("Compute 7 + 5 * 3.", 22)})
    c = out["e1"]
    assert c.info.get("env_failure") is None, c.info
    assert c.sample.reward == 1.0 and c.info["turns"] == 2
    text = tok.decode(c.sample.tokens, skip_special_tokens=False)
    assert "<result>22</result>" in text
