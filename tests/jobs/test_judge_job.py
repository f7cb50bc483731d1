"""The RL job with an LLM judge (`rollout.judge.dir`): a tiny JAX model generates a verdict for each rollout on
its own engine, a user parse function reads the score, the judge's counts are the run's reward accounting, and
a judge that times out on some samples has them counted while the run trains on."""

import json
import pathlib
import textwrap

import pytest
from small_runs import records, small_config

from jaxflow.jobs import rl

pytestmark = pytest.mark.slow  # a run of the RL job end to end

# The user's judge functions: the question and the response as one user turn; the score, a rule of the verdict
# (its length mod 5, in quarters), but every eighth parse takes longer than the judge's timeout_s (one thread of
# the judge's two parse threads: the others go on).
JUDGE_MODULE = """
import itertools
import time

calls = itertools.count()


def prompt(response, meta):
    return [{"role": "user", "content": meta["question"] + " " + response}]


def parse(verdict, meta):
    if next(calls) % 8 == 7:
        time.sleep(6.0)
    return 0.25 * (len(verdict) % 5)
"""


@pytest.fixture
def user_judge(tmp_path, monkeypatch):
    """A module `user_judge` in a directory on sys.path."""
    directory = tmp_path / "user_code"
    directory.mkdir()
    (directory / "user_judge.py").write_text(textwrap.dedent(JUDGE_MODULE))
    monkeypatch.syspath_prepend(str(directory))
    return "user_judge"


def _judge_config(tmp_path, base_dir, user_judge, **more):
    # The judge is the small run's own base model (a causal LM with a chat template), on an engine of its own.
    return small_config(tmp_path, base_dir, **{
        "rollout.judge.dir": str(base_dir), "rollout.judge.prompt_ref": f"{user_judge}:prompt",
        "rollout.judge.parse_ref": f"{user_judge}:parse", "rollout.judge.max_tokens": "16",
        "rollout.judge.max_len": "128", "rollout.judge.max_slots": "8", "trainer.steps": "2", "eval.every": "100",
        "eval.num_prompts": "4",
        **more})


def test_a_judge_scores_the_rollouts_and_its_timeouts_are_counted_while_the_run_goes_on(tmp_path, base_dir,
                                                                                         user_judge, capsys):
    config = _judge_config(tmp_path, base_dir, user_judge, **{"rollout.judge.timeout_s": "3.0",
                                                              "rollout.judge.failed_value": "-1"})
    assert rl.run(config) == 0
    captured = capsys.readouterr()
    assert f"rollouts are scored by the judge {base_dir} on its own jax engine" in captured.out
    # The slow parses: their samples score -1, counted, each distinct message printed once.
    says = f"judge judge:{base_dir} parse function {user_judge}:parse did not return within timeout_s=3s"
    assert captured.err.count(says) == 1
    workdir = pathlib.Path(config.workdir)
    steps = [r for r in records(workdir) if "loss" in r]
    assert len(steps) == 2
    samples = config.trainer.batch_groups * config.rollout.group_size
    # The parse rule's scores and failed_value are quarters; the task's reward is 0 or 1 or its format score
    # 0.1: the rewards trained on are the judge's.
    assert all(abs(r["reward_mean"] * samples * 4 - round(r["reward_mean"] * samples * 4)) < 1e-6 for r in steps)
    a = json.loads((workdir / "result.json").read_text())["accounting"]
    assert a["reward_calls"] >= a["reward_scored"] + a["reward_timed_out"]
    assert a["reward_scored"] >= samples and a["reward_timed_out"] >= 1
    assert a["reward_raised"] == a["reward_invalid"] == a["reward_crashed"] == 0
    # The judge's counts are in every step's metrics, cumulative.
    assert 0 < steps[-1]["reward_timed_out"] <= a["reward_timed_out"]
