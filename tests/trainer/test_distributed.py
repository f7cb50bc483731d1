"""One mesh over two trainer processes: the same train steps as one process with all the devices, and a
group that cannot form says which process is at fault instead of hanging."""

import concurrent.futures
import re
import socket
import threading

import jax
import numpy as np
import pytest
from distributed_setup import BOUND, TIMINGS, buffer, trainer_section
from flax import nnx

from jaxflow.models.hf_io import load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer import distributed
from jaxflow.trainer.distributed import ProcessGroupError

pytestmark = pytest.mark.slow  # trainer processes forming one mesh


def test_two_processes_train_like_one_process_with_all_the_devices(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    config = distributed.process_config(str(model_dir), trainer_section(), seq_len=64, max_sequences=16,
                                        fsdp=4, tensor=2, init_timeout_s=60, return_params=True)
    buffers = [buffer(0, seed=0), buffer(1, seed=1)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the reference compiles while they do
        both = pool.submit(distributed.run_local, config, buffers, num_processes=2, cpu_devices_per_process=4,
                           timeout_s=300)
        assert len(jax.devices()) == 8 and jax.process_count() == 1
        reference = distributed.train_on_mesh(config, buffers)
        results = both.result()

    assert [r["process_id"] for r in results] == [0, 1]
    for r in results:
        assert r["num_processes"] == 2
        assert r["mesh"] == reference["mesh"] == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
        assert r["batch_shape"] == reference["batch_shape"] == (1, 16, 64)
    # One computation: both processes read the same replicated metrics and gather the same parameters.
    computed = lambda metrics: [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics]  # noqa: E731
    assert computed(results[0]["metrics"]) == computed(results[1]["metrics"])
    for name, value in results[0]["params"].items():
        np.testing.assert_array_equal(results[1]["params"][name], value, err_msg=name)

    for got, want in zip(results[0]["metrics"], reference["metrics"]):
        assert got["trained_tokens"] == want["trained_tokens"] > 0 and got["rows_filled"] == 16
        assert got["num_tokens"] == want["num_tokens"]  # counted on device: every row fed once
        # The policy loss is a sum of advantage-weighted terms of size up to 2 max|A|, which nearly cancel.
        term_scale = 2 * want["adv_adv_abs_max"]
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=BOUND * term_scale)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=BOUND)
        assert want["grad_norm"] > 0 and want["updates_skipped"] == 0
    initial = distributed.gather_params(nnx.state(load_model(model_dir), nnx.Param))
    assert set(results[0]["params"]) == set(reference["params"]) == set(initial)
    moved = max(np.abs(reference["params"][k] - initial[k]).max() for k in initial)
    assert moved > 50 * BOUND  # two steps moved the weights far more than the bound
    for name, want in reference["params"].items():
        np.testing.assert_allclose(results[0]["params"][name], want, rtol=0, atol=BOUND, err_msg=name)


def test_a_peer_that_never_starts_is_named_within_the_timeout(tmp_path):
    # The group never forms, so the model directory is never read.
    config = distributed.process_config(str(tmp_path), trainer_section(), seq_len=64, max_sequences=16,
                                        fsdp=4, tensor=2, init_timeout_s=2)
    # Only process 0 starts: it names process 1 (without the handshake JAX would abort the process).
    with pytest.raises(ProcessGroupError, match=r"process 0 failed: .*process\(es\) \[1\] of 2 did not join "
                                                r"the group on port \d+ within 2 s"):
        distributed.run_local(config, [], num_processes=2, process_ids=[0], cpu_devices_per_process=4,
                              timeout_s=120)
    # Only process 1 starts: nobody serves the group.
    with pytest.raises(ProcessGroupError, match=r"process 1 failed: .*process 0 \(the coordinator at "
                                                r"127.0.0.1:\d+\) did not answer within 2 s"):
        distributed.run_local(config, [], num_processes=2, process_ids=[1], cpu_devices_per_process=4,
                              timeout_s=120)


def test_a_process_that_dies_without_a_word_is_named(tmp_path):
    # XLA aborts both processes at start-up on an unknown flag, as JAX aborts a process whose peer died:
    # no Python exception, no result. The launcher names a dead process instead of waiting for it.
    config = distributed.process_config(str(tmp_path), trainer_section(), seq_len=64, max_sequences=16,
                                        fsdp=4, tensor=2, init_timeout_s=30)
    with pytest.raises(ProcessGroupError, match=r"trainer process [01] exited with code \S+ before reporting"):
        distributed.run_local(config, [], num_processes=2, timeout_s=120,
                              env={"XLA_FLAGS": "--xla_no_such_flag=1", "JAX_PLATFORMS": "cpu"})


def _handshake(port, members, timeout_s=1.0):
    """Runs `rendezvous` for each (num_processes, process_id) in threads; {process_id: error or None}."""
    outcome = {}

    def one(count, pid):
        try:
            distributed.rendezvous(f"127.0.0.1:{port}", count, pid, timeout_s)
            outcome.setdefault(pid, []).append(None)
        except ProcessGroupError as e:
            outcome.setdefault(pid, []).append(str(e))

    threads = [threading.Thread(target=one, args=member) for member in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "the handshake hung"
    return outcome


def test_handshake_forms_a_group_and_names_what_is_wrong():
    port = distributed.free_port()
    assert _handshake(port, [(3, 0), (3, 2), (3, 1)]) == {0: [None], 1: [None], 2: [None]}
    # The port is free again for JAX's coordination service.
    with socket.socket() as s:
        s.bind(("", port))

    missing = _handshake(port, [(3, 0), (3, 1)], timeout_s=0.5)
    assert all(re.search(r"process\(es\) \[2\] of 3 did not join", e[0]) for e in missing.values()), missing
    duplicate = _handshake(port, [(3, 0), (3, 1), (3, 1)])
    assert all("a second process claims process_id=1" in e for errors in duplicate.values() for e in errors)
    counts = _handshake(port, [(2, 0), (3, 1)])
    assert "process 1 was started with num_processes=3, process 0 with 2" in counts[0][0]
    assert "the group did not form" in counts[1][0]
    alone = _handshake(port, [(2, 1)], timeout_s=0.5)
    assert "process 0 (the coordinator at 127.0.0.1" in alone[1][0]
    with socket.socket() as held:  # another service listens on the port
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        busy = _handshake(taken, [(2, 0)])
    assert f"cannot serve the group on port {taken}: it is in use" in busy[0][0]


def test_bad_arguments_are_named_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="coordinator_address 'localhost' is not host:port"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ValueError, match=r"process_id=2 must be an int in 0..1 \(num_processes=2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match="num_processes=0 must be a positive int"):
        distributed.initialize("127.0.0.1:1234", 0, 0)
    with pytest.raises(ValueError, match="without one JAX detects all three"):
        distributed.initialize(None, 2, None)
    jax.devices()  # this process has started JAX: it can no longer join a group
    with pytest.raises(ProcessGroupError, match="JAX already started in this process"):
        distributed.initialize("127.0.0.1:1234", 2, 0)
    config = distributed.process_config(str(tmp_path / "nowhere"), trainer_section(), seq_len=64,
                                        max_sequences=16, fsdp=0, init_timeout_s=0)
    with pytest.raises(ValueError, match=r"mesh.fsdp=0 must be a positive int or -1; init_timeout_s=0 must be "
                                         r"> 0 seconds; model_dir='.*nowhere' is not a directory"):
        distributed.run_trainer_process("127.0.0.1:1234", 2, 0, config, [])
    with pytest.raises(ValueError, match=r"process_ids \[0, 0\] must be distinct ids in 0..1"):
        distributed.run_local(distributed.process_config(str(tmp_path), trainer_section(), seq_len=64,
                                                         max_sequences=16), [], num_processes=2,
                              process_ids=[0, 0])
