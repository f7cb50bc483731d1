"""The RL job with an agent program (configs/arithmetic_agent_tiny.py): the calculator agent talks to the
endpoint through the `openai` client, and its episodes train like any others."""

import json

import pytest
from small_runs import records

from jaxflow.config import load_config
from jaxflow.jobs import rl

pytestmark = pytest.mark.slow  # a run of the RL job end to end

CONFIG = "configs/arithmetic_agent_tiny.py:async,small"


def test_the_calculator_agent_trains_through_the_endpoint(tmp_path, shared_base):
    steps = 3
    config = load_config(CONFIG, {"base.dir": str(tmp_path / "base"), "workdir": str(tmp_path / "run"),
                                  "trainer.steps": str(steps), "eval.every": "1000",
                                  "rollout.env.options.latency_s": "0.05"})
    shared_base(config, tmp_path / "base")
    assert rl.run(config) == 0
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    # Every episode went through the endpoint: the question, the chat headers and any tool result are
    # environment tokens, and no group failed.
    assert all(r["env_tokens_mean"] > 0 and r["groups_failed"] == 0 for r in trained)
    evals = [r for r in records(tmp_path / "run") if "eval_accuracy" in r]
    assert evals and all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    a = result["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"] and a["failed"] == 0
