"""The RL job with `rollout.env` set: episodes with an environment between model turns, on the tiny
config; and the env section's bad input."""

import json
import textwrap

import pytest
from small_runs import records, small_config

from jaxflow.config import ConfigError
from jaxflow.jobs import rl

pytestmark = pytest.mark.slow  # runs of the RL job end to end

ENV_MODULE = '''
    from jaxflow.tasks.arithmetic import reward


    class AreYouSure:
        """Answers the first turn with a question; scores the second turn with the arithmetic reward."""

        def __init__(self, question="Are you sure? Answer again."):
            self.question = question

        async def reset(self, meta):
            self.meta, self.turns = meta, 0

        async def step(self, action):
            self.turns += 1
            if self.turns == 1:
                return {"observation": [{"role": "user", "content": self.question}]}
            return {"reward": reward(action, self.meta), "done": True}

        async def close(self):
            pass
'''


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    directory = tmp_path / "envs"
    directory.mkdir()
    (directory / "user_env.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.syspath_prepend(str(directory))
    return "user_env:AreYouSure"


@pytest.mark.parametrize("overrides, match", [
    ({"rollout.env.ref": "no_colon"}, "rollout.env.ref: environment reference 'no_colon' is not of the form"),
    ({"rollout.env.ref": "jaxflow.envs.calculator:CalculatorEnv", "rollout.env.step_timeout_s": "0"},
     "rollout.env.step_timeout_s must be > 0"),
    ({"rollout.env.ref": "jaxflow.envs.calculator:CalculatorEnv", "rollout.env.max_turns": "0"},
     "rollout.env.max_turns must be >= 1"),
])
def test_bad_env_sections_are_named(tmp_path, overrides, match):
    config = small_config(tmp_path, tmp_path / "base", **overrides)
    with pytest.raises(ConfigError, match=match):
        rl.check_config(config)


def test_a_turn_stop_of_several_tokens_is_refused_before_the_run(tmp_path, base_dir, capsys):
    config = small_config(tmp_path, base_dir, **{"rollout.env.ref": "jaxflow.envs.calculator:CalculatorEnv",
                                                 "rollout.env.turn_stop": "</not-one-token>"})
    assert rl.run(config) == 2
    assert "rollout.env.turn_stop '</not-one-token>' is" in capsys.readouterr().err


def test_a_skyrl_gym_environment_trains_through_the_adapter(tmp_path, monkeypatch, shared_base):
    """tests/envs/skyrl_even_env.py is written against SkyRL-gym's public API only (BaseTextEnv): two turns,
    the second rewarded for an even answer. Run unmodified through jaxflow.envs.adapters, its reward rises.

    The base answers the second turn in the rewarded form about 6% of the time, so early steps have few
    groups with any signal. In groups of 4 (8 a step; 22% of them with signal) a step often trained on one
    group alone, and a run could drift into episodes that ran to max_tokens, where no group has signal and
    the reward stays 0. Groups of 8 (4 a step: the same 32
    episodes; 39% with signal) compare each rewarded episode with 7 others, and the runs rise steadily."""
    import math
    import pathlib
    import statistics

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "envs"))
    steps, groups, group_size, window = 24, 4, 8, 8
    config = small_config(tmp_path, tmp_path / "base", **{
        "base.steps": "300", "base.num_examples": "2000", "task.max_ops": "1", "trainer.lr": "3e-4",
        "trainer.batch_groups": str(groups), "rollout.group_size": str(group_size), "trainer.steps": str(steps),
        "trainer.eta": "2", "eval.every": "1000", "checkpoint.every": "1000", "rollout.max_tokens": "96",
        "rollout.max_len": "192", "rollout.env.ref": "jaxflow.envs.adapters:SkyRLGymEnv"})
    with config.unlocked():
        config.rollout.env.options = {"env": "skyrl_even_env:EvenAnswerEnv"}
    shared_base(config, tmp_path / "base")  # the run finds it built for its settings
    assert rl.run(config) == 0
    trained = [r for r in records(tmp_path / "run") if "reward_mean" in r]
    assert len(trained) == steps and all(r["env_tokens_mean"] > 0 for r in trained)
    rewards = [r["reward_mean"] for r in trained]
    first, last = statistics.mean(rewards[:window]), statistics.mean(rewards[-window:])
    # Rewards are 0 or 1: with no learning (lr ~0) the two windows' means, of n episodes each, differ by
    # noise of standard error sqrt(2 p (1 - p) / n) at the pooled rate p; the rise must stand 4 of them clear.
    n = window * groups * group_size
    pooled = (first + last) / 2
    noise = math.sqrt(2 * pooled * (1 - pooled) / n)
    assert last - first > 4 * noise, ([round(x, 3) for x in rewards], round(noise, 3))


def test_a_users_two_turn_episodes_run_in_a_ray_rollout_actor(tmp_path, base_dir, user_env, monkeypatch):
    """A user's environment module (two turns: a question between them) in a Ray rollout actor (the trainer in
    the job, the data services in their own actor): the actor runs its episodes, their samples cross Ray with
    their environment spans (masked out of the loss), the bound holds per token on multi-turn episodes and the
    accounting closes. The module reaches the actor's process as a user's would: on PYTHONPATH (or installed)
    where the actor runs. (SkyRL-gym's adapter: the learning test above.)"""
    import os

    from service_placements import ray_session_end

    ray_session_end()  # the job starts a local Ray of its own, which its workers inherit PYTHONPATH from
    envs = str(tmp_path / "envs")  # user_env's folder, already on this process's sys.path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (envs, os.environ.get("PYTHONPATH")) if p))
    eta, steps = 1, 3
    config = small_config(tmp_path, base_dir, **{
        "trainer.steps": str(steps), "trainer.eta": str(eta), "eval.every": "1000", "checkpoint.every": "1000",
        "rollout.max_tokens": "96", "rollout.max_len": "192", "rollout.env.ref": user_env,
        "cluster.mode": "ray", "cluster.rollout_actors": "1"})
    assert rl.run(config) == 0
    workdir = tmp_path / "run"
    trained = [r for r in records(workdir) if "env_tokens_mean" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    # The question sits between the turns: every sample carries it (unless its first turn used every token),
    # and it is not trained.
    assert all(r["env_tokens_mean"] > 5 and r["trained_tokens"] < r["consumed_tokens"] for r in trained)
    # Every trained token was generated at most eta versions before the step that trained it (the
    # environment's tokens are not counted).
    assert all(max(map(int, r["staleness"])) <= eta for r in trained)
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert a["ledger_duplicates"] == 0
    actors = result["cluster"]["rollout_actors"]
    assert len(actors) == 1 and actors[0]["pid"] != os.getpid()
