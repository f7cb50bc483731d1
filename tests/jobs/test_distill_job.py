"""The RL job with on-policy distillation (`trainer.distill`): `--config.trainer.distill.teacher=DIR` runs, the
teacher scored in the train step, every step reporting its per-token KL and moving the policy, groups whose task
rewards are all equal trained too (their distillation advantage is not 0)."""

import pytest
from engine_helpers import perturbed
from small_runs import records, small_config

from jaxflow.jobs import rl
from jaxflow.models import hf_io

pytestmark = pytest.mark.slow  # a run of the RL job end to end


def test_pure_distillation_from_a_teacher_directory_trains_every_step(tmp_path, base_dir, capsys):
    # The teacher: the base with every weight moved (its tokenizer and vocab, another policy).
    teacher, _ = perturbed(hf_io.load_model(base_dir), seed=7, scale=0.1)
    teacher_dir = hf_io.export_model(teacher, tmp_path / "teacher", tokenizer_dir=base_dir)
    steps = 2
    config = small_config(tmp_path, base_dir, **{"trainer.steps": steps, "trainer.distill.teacher": teacher_dir,
                                                 "trainer.distill.task_coef": 0.0, "eval.every": 1000})
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    assert f"jaxflow: distilling from the teacher {teacher_dir}" in out, out
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    for r in trained:
        assert r["distill_adv_abs_mean"] > 0 and r["distill_kl"] != 0, r
        assert r["update_norm"] > 0 and r["groups_trained"] == r["groups"] - r["groups_rejected"], r
