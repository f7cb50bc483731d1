"""A checkpoint step is valid only as a whole: the job state in its extra (the trajectory snapshot, the data
iterator's position in it, the base accuracy) is checksummed like the arrays and checked by the job's
`validate` before anything is restored; a step damaged in any piece is named and the step before used."""

import logging

import jax.numpy as jnp
import pytest
from checkpoint_faults import damage_extra

from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.jobs.resume import ExtraCheck
from jaxflow.trainer.checkpoint import CheckpointDamaged, Checkpointer

TARGET = {"step": jnp.int32(0), "w": jnp.zeros(4)}


def _service() -> TrajectoryService:
    records = [{"prompt": [1 + i, 2], "meta": {"index": i}} for i in range(8)]
    return TrajectoryService(PromptSource(records, shuffle=False, num_epochs=1), batch_groups=2, group_size=2, eta=1)


def _extra(service: TrajectoryService, step: int) -> dict:
    """The rl job's extra at checkpoint `step`: the snapshot is at that train version."""
    return {"trajectories": {**service.snapshot(), "v_train": step, "published": step}, "base_accuracy": 0.25}


@pytest.fixture
def two_steps(tmp_path):
    service = _service()
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            assert ckpt.save(step, {"step": jnp.int32(step), "w": jnp.arange(4.0) * step}, _extra(service, step))
    return tmp_path, ExtraCheck.for_service(service)


def _restore(directory, check):
    with Checkpointer(directory) as ckpt:
        state, extra = ckpt.restore(TARGET, validate=check)
        return ckpt.restored_step, ckpt.damaged, state, extra


@pytest.mark.parametrize("how, says", [
    ("wrong-value", "its extra piece 'trajectories' differs from the checksum saved with it"),
    ("missing-key", "its extra piece 'trajectories' differs from the checksum saved with it"),
    ("missing-piece", "its extra piece 'trajectories' is missing"),
])
def test_a_snapshot_edited_on_disk_falls_back_to_the_previous_step(two_steps, how, says, caplog):
    directory, check = two_steps
    damage_extra(directory / "2", how)
    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.checkpoint"):
        restored, damaged, state, extra = _restore(directory, check)
    assert restored == 1 and int(state["step"]) == 1 and extra["trajectories"]["v_train"] == 1
    assert [s for s, _ in damaged] == [2] and says in damaged[0][1]
    assert f"checkpoint step 2 in {directory} is damaged: {says}" in caplog.text


@pytest.mark.parametrize("how, says", [
    ("wrong-value", "its trajectory snapshot ('trajectories') is at train version 3, the checkpoint's step is 2"),
    ("missing-key", "its trajectory snapshot ('trajectories') is invalid: snapshot must be a dict with keys"),
    ("missing-piece", "its trajectory snapshot ('trajectories') is missing"),
])
def test_a_snapshot_saved_wrong_is_refused_by_the_jobs_check_and_the_previous_step_used(two_steps, how, says,
                                                                                         caplog):
    """Valid JSON whose checksum matches (the saver was wrong, not the disk): the job's check refuses it."""
    directory, check = two_steps
    damage_extra(directory / "2", how, resign=True)
    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.checkpoint"):
        restored, damaged, _, extra = _restore(directory, check)
    assert restored == 1 and extra["base_accuracy"] == 0.25
    assert [s for s, _ in damaged] == [2] and says in damaged[0][1]
    assert f"checkpoint step 2 in {directory} is damaged: {says}" in caplog.text


@pytest.mark.parametrize("value", [1.5, "high", float("nan"), True])
def test_other_pieces_are_checked_too(tmp_path, value):
    service = _service()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"step": jnp.int32(1), "w": jnp.ones(4)}, {**_extra(service, 1), "base_accuracy": value})
    with pytest.raises(CheckpointDamaged, match=r"base-model accuracy \('base_accuracy'\) is"):
        _restore(tmp_path, ExtraCheck.for_service(service))


def test_no_usable_step_names_each_steps_damage(two_steps):
    directory, check = two_steps
    damage_extra(directory / "1", "wrong-value")
    damage_extra(directory / "2", "missing-key", resign=True)
    with pytest.raises(CheckpointDamaged, match=f"no intact checkpoint in {directory}") as e:
        _restore(directory, check)
    assert "checkpoint step 1" in str(e.value) and "checkpoint step 2" in str(e.value)
    assert "'trajectories'" in str(e.value)


def test_the_reserved_checksum_keys_stay_out_of_the_extra(two_steps):
    directory, check = two_steps
    _, damaged, _, extra = _restore(directory, check)
    assert damaged == [] and set(extra) == {"trajectories", "base_accuracy"}
    with Checkpointer(directory) as ckpt, pytest.raises(ValueError, match="_jaxflow_extra_checksums"):
        ckpt.save(3, {"step": jnp.int32(3), "w": jnp.ones(4)}, {"_jaxflow_extra_checksums": {}})
