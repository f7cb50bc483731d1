"""Where the RL job builds a reward model, judge or rollout-side teacher (`jaxflow.jobs.scorers`): nothing when the
config has none (groups scored in the coordinator's loop), and a scorers' actor that Ray cannot place stops the
job with an error naming it and what it asked for. (Runs with each placed: tests/jobs/test_distill_job.py and
tests/cluster/test_ray_rl.py.)"""

import contextlib
import re

import pytest
from service_placements import ray_session
from small_runs import small_config

from jaxflow.cluster import names
from jaxflow.jobs import scorers


def test_a_config_without_scoring_models_builds_nothing(tmp_path, base_dir):
    with contextlib.ExitStack() as cleanup:
        built = scorers.start_scorers(small_config(tmp_path, base_dir), cleanup, in_ray=True)
    assert (built.answers, built.teacher, built.placed, built.threads) == (None, None, None, 0)


@pytest.mark.slow  # a local Ray
def test_a_scorers_actor_ray_cannot_place_is_named_with_what_it_asked_for(tmp_path, base_dir, monkeypatch):
    from jaxflow.models.tiny import write_tiny_reward_model

    ray_session()  # a local Ray, connected
    monkeypatch.setattr(scorers, "PLACE_TIMEOUT_S", 2.0)
    config = small_config(tmp_path, base_dir, **{
        "rollout.reward_model.dir": str(write_tiny_reward_model(tmp_path / "rm")), "cluster.mode": "ray",
        "cluster.rollout_actors": 1, "cluster.node_resource.scorers": "no_such_node"})
    name = names.scorers(names.run_tag(config.workdir))
    with contextlib.ExitStack() as cleanup, pytest.raises(TimeoutError, match=re.escape(
            f"the scorers' Ray actor {name} (asking for {{'no_such_node': 1.0}}) was not placed within 2s")):
        scorers.start_scorers(config, cleanup, in_ray=True)
