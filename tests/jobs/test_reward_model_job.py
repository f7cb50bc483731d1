"""The RL job with a reward model (`rollout.reward_model.dir`): the model scores the rollouts in place of the
task's reward function, its counts are the run's reward accounting, and the evals keep the task's reward; a
reward model that never gives a finite score stops the run before an update."""

import json
import pathlib

import numpy as np
import pytest
from small_runs import records, small_config

from jaxflow.jobs import rl
from jaxflow.models.classifier import SCORE_TENSOR
from jaxflow.models.safetensors_io import CheckpointReader, write_checkpoint
from jaxflow.models.tiny import write_tiny_reward_model

pytestmark = pytest.mark.slow  # a run of the RL job end to end


def test_a_reward_model_scores_the_rollouts(tmp_path, base_dir, capsys):
    reward_dir = write_tiny_reward_model(tmp_path / "reward_model")
    config = small_config(tmp_path, base_dir, **{"rollout.reward_model.dir": str(reward_dir),
                                                  "rollout.reward_model.batch_size": "4",
                                                  "trainer.steps": "2", "eval.every": "100"})
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    assert f"rollouts are scored by the reward model {reward_dir}" in out
    workdir = pathlib.Path(config.workdir)
    steps = [r for r in records(workdir) if "loss" in r]
    assert len(steps) == 2
    # The task's reward is 0 or 1 per sample, so its batch means are multiples of 1/samples; the reward
    # model's scores are real numbers.
    samples = config.trainer.batch_groups * config.rollout.group_size
    assert any(abs(r["reward_mean"] * samples - round(r["reward_mean"] * samples)) > 1e-3 for r in steps), steps
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    assert a["reward_calls"] >= a["reward_scored"] >= 2 * samples
    assert all(a[f"reward_{k}"] == 0 for k in ("raised", "timed_out", "crashed", "invalid"))
    assert 0.0 <= result["base_accuracy"] <= 1.0  # the evals: the task's reward


def test_a_reward_model_that_never_gives_a_finite_score_stops_the_run_before_an_update(tmp_path, base_dir, capsys):
    """Every sample of the first batch scores failed_value, counted invalid: the run stops before it trains on
    them, naming the reward model and what it gave."""
    reward_dir = write_tiny_reward_model(tmp_path / "reward_model")
    with CheckpointReader(reward_dir) as reader:
        tensors = {name: np.array(reader.get(name)) for name in reader}
    tensors[SCORE_TENSOR][:] = np.nan
    write_checkpoint(reward_dir, tensors)
    config = small_config(tmp_path, base_dir, **{"rollout.reward_model.dir": str(reward_dir), "trainer.steps": "2"})
    assert rl.run(config) == 2
    err = capsys.readouterr().err
    assert f"reward model {reward_dir} gave nan, not a finite number" in err
    assert "failed on all" in err and "first batch" in err
    workdir = pathlib.Path(config.workdir)
    assert not [r for r in records(workdir) if "loss" in r]  # not one update on the failed values
    a = json.loads((workdir / "result.json").read_text())["accounting"]
    assert a["reward_scored"] == 0 and a["reward_invalid"] >= config.trainer.batch_groups * config.rollout.group_size
