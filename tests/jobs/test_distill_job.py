"""The RL job with on-policy distillation (`trainer.distill`): `--config.trainer.distill.teacher=DIR` runs, the
teacher scored in the train step or (`trainer.distill.where = "rollout"`) beside the rollout engines, every step
reporting its per-token KL and moving the policy, groups whose task rewards are all equal trained too (their
distillation advantage is not 0); the job refuses a teacher beside the rollout where it does not place one."""

import pytest
from engine_helpers import perturbed
from small_runs import records, small_config

from jaxflow.config import ConfigError
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


def test_a_teacher_beside_the_rollout_is_refused_with_rollout_actors(tmp_path, base_dir):
    config = small_config(tmp_path, base_dir, **{"trainer.distill.teacher": str(base_dir),
                                                 "trainer.distill.where": "rollout", "cluster.rollout_actors": 1})
    with pytest.raises(ConfigError, match="trainer.distill.where = 'rollout' scores with a teacher in the job's "
                                          "process"):
        rl.check_config(config)
