"""The trainer as two Ray actors forming one mesh trains like one process holding all the devices."""

import jax
import numpy as np
import pytest
import ray  # noqa: F401 - the `cluster` extra, which the setup script installs: missing Ray fails, never skips
from distributed_setup import BOUND, TIMINGS, buffer, trainer_section
from service_placements import ray_session

from jaxflow.cluster.trainer_group import TrainerGroup, TrainerGroupFailed
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer import distributed

pytestmark = pytest.mark.slow  # Ray clusters and actors


def group_of(tmp_path, model_dir, **mesh):
    spec = TrainerGroup.spec(str(model_dir), trainer_section(), seq_len=64, max_sequences=16,
                             checkpoints=str(tmp_path / "checkpoints"), max_to_keep=2, **mesh)
    return TrainerGroup(spec, num_processes=2, tag="0123abcd", cpu_devices=4, timeout_s=400)


def test_two_trainer_actors_train_like_one_process_with_all_the_devices(tmp_path):
    ray_session()  # this session's local Ray (2 CPUs): the two actors ask for one CPU each
    model_dir = write_tiny_model(tmp_path / "model")
    group = group_of(tmp_path, model_dir, fsdp=4, tensor=2)
    try:
        assert group.start() == (0, None)  # no checkpoint yet
        assert group.started[0]["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
        assert len({s["pid"] for s in group.started}) == 2
        buffers = [buffer(0, seed=0), buffer(1, seed=1)]
        metrics = []
        for b in buffers:
            metrics.append(group.train(b)[0])
            group.checkpoint(None, {"v": group.version})
        params = group.params()
        # The newest checkpoint damaged: the group rolls back to the one before, keeps the damaged step
        # aside (process 0 moves it, every process re-reads the step list) and can save that step again.
        ckpts = tmp_path / "checkpoints"
        (ckpts / "2" / "state" / "_METADATA").write_text('{"tree_metadata": ')
        assert group.restore_latest() == (1, {"v": 1})
        assert (ckpts / "damaged-2" / "state").is_dir() and not (ckpts / "2").exists()
        group.train(buffers[1])
        group.checkpoint(None, {"v": group.version})
        assert group.version == 2 and (ckpts / "2" / "state").is_dir()
    finally:
        group.close()
    assert len(jax.devices()) == 8
    config = distributed.process_config(str(model_dir), trainer_section(), seq_len=64, max_sequences=16,
                                        fsdp=4, tensor=2, return_params=True)
    reference = distributed.train_on_mesh(config, buffers)
    assert reference["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    for got, want in zip(metrics, reference["metrics"]):
        assert got["trained_tokens"] == want["trained_tokens"] > 0
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=BOUND * 2 * want["adv_adv_abs_max"])
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=BOUND)
        assert set(got) - set(TIMINGS) == set(want) - set(TIMINGS)
    assert sorted(params) == sorted(reference["params"])
    for name, want in reference["params"].items():
        np.testing.assert_allclose(params[name], want, rtol=0, atol=BOUND, err_msg=name)


def test_a_failing_trainer_process_is_named(tmp_path):
    ray_session()
    # A directory without a model: the group forms, then loading the model fails in every process.
    group = group_of(tmp_path, tmp_path)
    try:
        with pytest.raises(TrainerGroupFailed, match=r"trainer process \d \(jaxflow-0123abcd-trainer-\d\) "
                                                     r"failed in start: \w+"):
            group.start()
    finally:
        group.close(graceful=False)
