"""The RL job with on-policy distillation (`trainer.distill`): `--config.trainer.distill.teacher=DIR` runs, the
teacher scored in the train step or (`trainer.distill.where = "rollout"`) beside the rollout engines, every step
reporting its per-token KL and moving the policy, groups whose task rewards are all equal trained too (their
distillation advantage is not 0); with rollout actors, the teacher and a reward model run in the scorers' Ray
actor that every rollout actor calls."""

import pytest
from engine_helpers import perturbed
from small_runs import records, small_config

from jaxflow.jobs import rl
from jaxflow.models import hf_io

pytestmark = pytest.mark.slow  # a run of the RL job end to end


@pytest.mark.parametrize("where", ["step", "rollout"])
def test_pure_distillation_from_a_teacher_directory_trains_every_step(tmp_path, base_dir, capsys, where):
    # The teacher: the base with every weight moved (its tokenizer and vocab, another policy).
    teacher, _ = perturbed(hf_io.load_model(base_dir), seed=7, scale=0.1)
    teacher_dir = hf_io.export_model(teacher, tmp_path / "teacher", tokenizer_dir=base_dir)
    steps = 2 if where == "step" else 1  # beside the rollout: the scorer's compiles are the job's longest wait
    config = small_config(tmp_path, base_dir, **{"trainer.steps": steps, "trainer.distill.teacher": teacher_dir,
                                                 "trainer.distill.task_coef": 0.0, "trainer.distill.where": where,
                                                 "eval.every": 1000})
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    placed = "in the train step" if where == "step" else "beside the rollout engines"
    assert f"jaxflow: distilling from the teacher {teacher_dir}" in out and f"scored {placed}" in out, out
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    for r in trained:
        assert r["distill_adv_abs_mean"] > 0 and r["distill_kl"] != 0, r
        assert r["update_norm"] > 0 and r["groups_trained"] == r["groups"] - r["groups_rejected"], r
        assert r["groups_rejected"] == 0 and r["train_step_compiles"] == 1, r  # its batches: the compiled shape


def test_with_rollout_actors_a_teacher_and_a_reward_model_score_in_the_scorers_actor(tmp_path, base_dir, capsys):
    """`cluster.rollout_actors`: the teacher beside the rollout and the reward model are built in one Ray actor of
    their own (`jaxflow.jobs.scorers`), apart from the job and the rollout actor; the rollout actor's samples carry
    the teacher's log-probs (the step's distillation terms are not 0) and the reward model's scores (its counts
    are the run's reward accounting)."""
    import json
    import os

    from service_placements import ray_session_end

    from jaxflow.models.tiny import write_tiny_reward_model

    ray_session_end()  # the job starts a local Ray of its own
    teacher, _ = perturbed(hf_io.load_model(base_dir), seed=7, scale=0.1)
    teacher_dir = hf_io.export_model(teacher, tmp_path / "teacher", tokenizer_dir=base_dir)
    reward_dir = write_tiny_reward_model(tmp_path / "reward_model")
    steps = 2
    config = small_config(tmp_path, base_dir, **{
        "trainer.steps": steps, "trainer.distill.teacher": teacher_dir, "trainer.distill.where": "rollout",
        "rollout.reward_model.dir": str(reward_dir), "rollout.reward_model.batch_size": "4", "eval.every": 1000,
        "checkpoint.every": 1000, "cluster.mode": "ray", "cluster.rollout_actors": 1})
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    assert f"jaxflow: distilling from the teacher {teacher_dir}" in out and "scored beside the rollout" in out, out
    assert f"rollouts are scored by the reward model {reward_dir} in the Ray actor jaxflow-" in out, out
    workdir = tmp_path / "run"
    trained = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    for r in trained:
        assert r["distill_adv_abs_mean"] > 0 and r["distill_kl"] != 0, r
    result = json.loads((workdir / "result.json").read_text())
    scorers, actors = result["cluster"]["scorers"], result["cluster"]["rollout_actors"]
    assert scorers["pid"] not in (os.getpid(), *(a["pid"] for a in actors))
    samples = config.trainer.batch_groups * config.rollout.group_size
    a = result["accounting"]
    assert a["reward_calls"] >= a["reward_scored"] >= steps * samples, a
    assert all(a[f"reward_{k}"] == 0 for k in ("raised", "timed_out", "crashed", "invalid")), a
