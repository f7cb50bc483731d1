"""The trainer as two Ray actors forming one mesh trains like one process holding all the devices."""

import jax
import numpy as np
import pytest

import ray  # the `cluster` extra, which the setup script installs: a missing Ray fails here, never skips

from jaxflow.cluster.ray_trainer import run_on_ray  # noqa: E402
from jaxflow.models.tiny import write_tiny_model  # noqa: E402
from jaxflow.trainer import distributed  # noqa: E402

from service_placements import ray_session  # noqa: E402
from trainer.test_distributed import BOUND, TIMINGS, buffer, trainer_section  # noqa: E402


def test_two_trainer_actors_train_like_one_process_with_all_the_devices(tmp_path):
    ray_session()  # this session's local Ray (2 CPUs): the two actors ask for no CPU
    model_dir = write_tiny_model(tmp_path / "model")
    config = distributed.process_config(str(model_dir), trainer_section(), seq_len=64, max_sequences=16,
                                        fsdp=4, tensor=2, init_timeout_s=120, return_params=True)
    buffers = [buffer(0, seed=0), buffer(1, seed=1)]
    results = run_on_ray(config, buffers, num_processes=2, cpu_devices_per_process=4, num_cpus=0, timeout_s=400)
    assert len(jax.devices()) == 8
    reference = distributed.train_on_mesh(config, buffers)
    assert [r["process_id"] for r in results] == [0, 1] and all(r["num_processes"] == 2 for r in results)
    assert results[0]["mesh"] == reference["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    computed = lambda metrics: [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics]  # noqa: E731
    assert computed(results[0]["metrics"]) == computed(results[1]["metrics"])  # one computation
    for got, want in zip(results[0]["metrics"], reference["metrics"]):
        assert got["trained_tokens"] == want["trained_tokens"] > 0
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=BOUND * 2 * want["adv_adv_abs_max"])
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=BOUND)
    for name, want in reference["params"].items():
        np.testing.assert_allclose(results[0]["params"][name], want, rtol=0, atol=BOUND, err_msg=name)


def test_a_failing_trainer_process_is_named(tmp_path):
    ray_session()
    # A directory without a model: the group forms, then loading the model fails in every process.
    config = distributed.process_config(str(tmp_path), trainer_section(), seq_len=64, max_sequences=16,
                                        init_timeout_s=60)
    with pytest.raises(distributed.ProcessGroupError, match=r"trainer process 0 failed: \w+"):
        run_on_ray(config, [buffer(0, seed=0)], num_processes=2, cpu_devices_per_process=1, num_cpus=0,
                   timeout_s=300)
