"""ParameterService in process: exact round trips, commit-time visibility, eviction, rejected inputs that
change nothing, waiting, shared memory across processes, and a sharded policy's tensors.

ParameterClient against the service (over a wire loopback and over real RPC) is in
test_param_service_client.py."""

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from param_helpers import SHM, W, WireLoopback, assert_same, sample_tensors
from waiting import wait_until

from jaxflow.data.param_service import ALIGNMENT, ParameterService, UnknownVersionError
from jaxflow.transport import wire
from jaxflow.transport.param_client import ParameterClient, attach_shared


def _segment_files(prefix: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))


@pytest.fixture(params=SHM)
def service(request):
    svc = ParameterService(keep=2, shared_memory=request.param == "shm")
    yield svc
    svc.close()


# --- round trips --------------------------------------------------------------------------------------------

def test_publish_pull_is_bit_identical_for_every_dtype(service):
    tensors = sample_tensors()
    service.publish(0, tensors)
    version, pulled = service.pull()
    assert version == 0 and service.latest() == 0 and service.versions() == [0]
    assert_same(pulled, tensors)
    for arr in pulled.values():
        assert not arr.flags.writeable
        assert arr.ctypes.data % ALIGNMENT == 0
    # Zero-copy: two pulls view the same memory.
    again = service.pull(0)[1]
    assert np.shares_memory(again["odd"], pulled["odd"])
    manifest = service.manifest(0)
    assert manifest["tensors"]["model.bfloat16.weight"] == {
        "dtype": "bfloat16", "shape": [3, 5, 7], "nbytes": 210,
        "offset": manifest["tensors"]["model.bfloat16.weight"]["offset"]}
    assert all(t["offset"] % ALIGNMENT == 0 for t in manifest["tensors"].values())
    assert manifest["total_bytes"] >= sum(t.nbytes for t in tensors.values())
    assert (manifest["segment"] is not None) == service.shared_memory
    assert wire.decode(wire.encode(manifest)) == manifest


def test_publish_copies_the_input_once_and_accepts_any_layout(service):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"transposed": base.T, "strided": base[:, ::2], "big_endian": base.astype(">f4"),
               "bf16": base.astype(ml_dtypes.bfloat16)}
    expected = {name: np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("="))
                for name, arr in tensors.items()}
    service.publish(3, list(tensors.items()))
    base[:] = -1  # the trainer reuses its buffers at once
    assert_same(service.pull(3)[1], expected)


def test_streamed_chunked_publish_equals_one_shot(service):
    tensors = sample_tensors(1)
    service.publish(0, tensors)
    manifest = service.manifest(0)
    # A manifest() entry is a valid begin() entry (extra keys ignored).
    service.begin(1, manifest["tensors"])
    rng = np.random.default_rng(0)
    kinds = [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8)]
    chunks = []
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        cuts = sorted({0, len(raw), *rng.integers(0, len(raw) + 1, size=4).tolist()})
        for start, end in zip(cuts, cuts[1:]):
            # Overlapping re-sends are fine: the same bytes land twice.
            end = min(len(raw), end + int(rng.integers(0, 3)))
            chunks.append((name, raw[start:end], start))
    rng.shuffle(chunks)
    for i, (name, data, offset) in enumerate(chunks):
        service.put(1, name, kinds[i % len(kinds)](data), offset)
    assert service.latest() == 0
    service.commit(1)
    assert_same(service.pull(1)[1], service.pull(0)[1])
    assert {k: v for k, v in service.manifest(1).items() if k != "version" and k != "segment"} == \
           {k: v for k, v in manifest.items() if k != "version" and k != "segment"}


@pytest.mark.slow  # a model, or another process
def test_hf_tensors_of_a_tiny_model_round_trip(tmp_path):
    import jax.numpy as jnp

    from jaxflow.models import hf_io, tiny

    model = hf_io.load_model(tiny.write_tiny_model(tmp_path / "tiny"))
    with ParameterService(keep=1) as svc:
        svc.publish(1, hf_io.iter_hf_tensors(model))
        assert_same(svc.pull(1)[1], dict(hf_io.iter_hf_tensors(model)))
        # bf16 through the chunked client path, in small chunks.
        client = ParameterClient(WireLoopback(svc), chunk_bytes=1000)
        client.publish(2, hf_io.iter_hf_tensors(model, dtype=jnp.bfloat16))
        want = dict(hf_io.iter_hf_tensors(model, dtype=jnp.bfloat16))
        assert_same(client.pull(2)[1], want)
        assert {a.dtype.name for a in want.values()} == {"bfloat16"}


# --- visibility ---------------------------------------------------------------------------------------------

def test_a_version_is_invisible_until_committed(service):
    tensors = sample_tensors()
    service.begin(0, {n: {"dtype": a.dtype.name, "shape": list(a.shape)} for n, a in tensors.items()})
    for name, arr in tensors.items():
        service.put(0, name, arr)
    assert service.latest() is None and service.versions() == []
    for call in (lambda: service.pull(0), lambda: service.pull(), lambda: service.manifest(0),
                 lambda: service.read(0, None, 0, 1)):
        with pytest.raises(UnknownVersionError):
            call()
    with pytest.raises(TimeoutError):
        service.wait_for_version(0, timeout=0.01)
    service.commit(0)
    assert service.latest() == 0
    assert_same(service.pull(0)[1], tensors)


def test_a_polling_reader_never_sees_an_uncommitted_version():
    svc = ParameterService(keep=2)
    names = [f"t{i}" for i in range(4)]
    manifest = {n: {"dtype": "int32", "shape": [256]} for n in names}
    errors, seen = [], []
    committing = [-1]  # the newest version whose commit() has been called
    done = threading.Event()

    def writer():
        for v in range(1, 16):
            svc.begin(v, manifest)
            for name in names:
                raw = np.full(256, v, np.int32).tobytes()
                for start in range(0, len(raw), 128):
                    svc.put(v, name, raw[start:start + 128], start)
                time.sleep(0.001)  # let the reader run while the version is half written
            committing[0] = v
            svc.commit(v)
        done.set()

    def check(version, arrays):
        if version > committing[0]:
            errors.append(f"version {version} was visible before its commit")
        if any((a != version).any() for a in arrays.values()):
            errors.append(f"version {version} was visible incomplete")

    def reader():
        while not done.is_set():
            latest = svc.latest()
            if latest is None:
                continue
            check(*svc.pull(latest))
            seen.append(latest)
            try:
                check(*svc.pull(latest + 1))  # being written, or not begun: visible only once committed
            except UnknownVersionError:
                pass

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    svc.close()
    assert not errors, errors[:3]
    assert seen and seen == sorted(seen)


# --- eviction -----------------------------------------------------------------------------------------------

def test_keeps_the_newest_versions_and_pulled_arrays_stay_valid(service):
    first = sample_tensors(0)
    service.publish(0, first)
    _, held = service.pull(0)
    held_read = service.read(0, "odd", 0, 13)
    for v in range(1, 6):
        service.publish(v, sample_tensors(v))
    assert service.versions() == [4, 5] and service.latest() == 5
    for gone in (0, 3):
        with pytest.raises(UnknownVersionError, match=f"version {gone} is not published"):
            service.pull(gone)
    # Buffers of evicted versions are reused, but never one a pulled array still views.
    assert_same(held, first)
    assert held_read.tobytes() == first["odd"].tobytes()
    assert_same(service.pull(5)[1], sample_tensors(5))


def test_an_evicted_buffer_nobody_views_is_reused():
    tensors = {"w": np.ones((64, 64), np.float32)}
    with ParameterService(keep=1) as svc:
        svc.publish(0, tensors)
        address = svc.pull(0)[1]["w"].ctypes.data  # the pulled array is dropped at once
        svc.publish(1, tensors)  # evicts 0
        svc.publish(2, tensors)
        assert svc.pull(2)[1]["w"].ctypes.data == address
    with ParameterService(keep=1, prefault=False) as svc:
        for v in range(4):
            svc.publish(v, {"w": np.full(8, v, np.int64)})
            assert (svc.pull()[1]["w"] == v).all()


def test_shared_segments_are_unlinked_on_eviction_and_close():
    svc = ParameterService(keep=1, shared_memory=True)
    svc.publish(0, sample_tensors(0))
    manifest = svc.manifest(0)
    prefix = manifest["segment"].rsplit("_", 1)[0] + "_"
    attached = attach_shared(manifest)
    assert_same(attached, sample_tensors(0))
    assert not any(a.flags.writeable for a in attached.values())
    svc.publish(1, sample_tensors(1))
    # Evicted segments are unlinked on a background thread.
    wait_until(lambda: not os.path.exists(f"/dev/shm/{manifest['segment']}"), 5, "the evicted segment unlinked")
    with pytest.raises(FileNotFoundError):
        attach_shared(manifest)
    assert_same(attached, sample_tensors(0))  # an existing mapping outlives the name
    _, pulled = svc.pull(1)
    svc.close()
    assert _segment_files(prefix) == []
    assert_same(pulled, sample_tensors(1))
    with pytest.raises(RuntimeError, match="closed"):
        svc.latest()


# --- rejected inputs ----------------------------------------------------------------------------------------

MANIFEST = {"w": {"dtype": "float32", "shape": [3, 4]}, "b": {"dtype": "bfloat16", "shape": [2]}}

BAD_CALLS = {
    "publish_same_version": (lambda s: s.publish(5, {"w": W}), ValueError,
                             "version 5 is not newer than the latest published version 5"),
    "publish_older_version": (lambda s: s.publish(3, {"w": W}), ValueError,
                              "version 3 is not newer than the latest published version 5"),
    "begin_older_version": (lambda s: s.begin(4, MANIFEST), ValueError, "version 4 is not newer"),
    "begin_pending_again": (lambda s: s.begin(6, MANIFEST), ValueError, "version 6 is already being"),
    "begin_negative": (lambda s: s.begin(-7, MANIFEST), ValueError, "non-negative int"),
    "begin_bool": (lambda s: s.begin(True, MANIFEST), ValueError, "non-negative int"),
    "begin_empty": (lambda s: s.begin(7, {}), ValueError, "non-empty"),
    "begin_bad_dtype": (lambda s: s.begin(7, {"x": {"dtype": "complex64", "shape": [2]}}), ValueError,
                        "tensor 'x' has dtype 'complex64'; supported: float64"),
    "begin_bad_shape": (lambda s: s.begin(7, {"x": {"dtype": "float32", "shape": [2, -1]}}), ValueError,
                        "tensor 'x' has shape"),
    "begin_missing_key": (lambda s: s.begin(7, {"x": {"dtype": "float32"}}), ValueError,
                          "must have 'dtype' and 'shape'"),
    "publish_complex": (lambda s: s.publish(7, {"w": W, "x": np.zeros(2, np.complex64)}), ValueError,
                        "'x' has dtype 'complex64'"),
    "publish_object": (lambda s: s.publish(7, {"x": np.array([None])}), ValueError, "dtype 'object'"),
    "publish_strings": (lambda s: s.publish(7, {"x": np.array(["a"])}), ValueError, "dtype 'str32'"),
    "publish_duplicate": (lambda s: s.publish(7, [("w", W), ("w", W)]), ValueError, "'w' is given twice"),
    "put_unknown_name": (lambda s: s.put(6, "nope", b"1234"), ValueError, "version 6 has no tensor 'nope'"),
    "put_wrong_dtype": (lambda s: s.put(6, "w", W.astype(np.float16)), ValueError,
                        "'w': got an array of dtype float16 and shape \\[3, 4\\], the manifest says float32"),
    "put_wrong_shape": (lambda s: s.put(6, "w", W.reshape(4, 3)), ValueError, "shape \\[4, 3\\]"),
    "put_beyond_end": (lambda s: s.put(6, "w", b"\0" * 8, 44), ValueError,
                       "chunk \\[44, 52\\) is outside the tensor's 48 bytes"),
    "put_negative_offset": (lambda s: s.put(6, "w", b"\0", -1), ValueError, "outside the tensor's"),
    "put_array_at_offset": (lambda s: s.put(6, "w", W, 4), ValueError, "at offset 0"),
    "put_not_bytes": (lambda s: s.put(6, "w", "some text"), ValueError, "bytes-like"),
    "put_not_begun": (lambda s: s.put(9, "w", W), ValueError, "version 9: it is not being published"),
    "put_committed": (lambda s: s.put(5, "w", W), ValueError, "version 5: it is already committed"),
    "commit_incomplete": (lambda s: s.commit(6), ValueError,
                          "cannot commit version 6: tensor 'w' is missing 36 of its 48 bytes "
                          "\\(first gap: bytes \\[4, 16\\)\\); 1 more tensor"),
    "commit_not_begun": (lambda s: s.commit(9), ValueError, "not being published"),
    "read_out_of_range": (lambda s: s.read(5, "w", 40, 9), ValueError, "cannot read 9 bytes at offset 40"),
    "read_unknown_name": (lambda s: s.read(5, "nope", 0, 1), ValueError, "no tensor 'nope'"),
    "pull_pending": (lambda s: s.pull(6), UnknownVersionError, "being published but not committed"),
    "pull_evicted": (lambda s: s.pull(3), UnknownVersionError, "available: \\[4, 5\\]"),
    "manifest_pending": (lambda s: s.manifest(6), UnknownVersionError, "version 6"),
}


def _snapshot(svc: ParameterService):
    return svc.latest(), svc.versions(), {v: {n: a.tobytes() for n, a in svc.pull(v)[1].items()}
                                          for v in svc.versions()}


@pytest.mark.parametrize("shm", SHM)
def test_every_rejected_call_leaves_the_service_unchanged(shm):
    svc = ParameterService(keep=2, shared_memory=shm == "shm")
    for v in range(3, 6):
        svc.publish(v, {"w": W + v})
    svc.begin(6, MANIFEST)
    svc.put(6, "w", W.tobytes()[:4])  # bytes [0, 4) and [16, 24) of w; the rest after the bad calls
    svc.put(6, "w", memoryview(W.tobytes())[16:24], 16)
    before = _snapshot(svc)
    for name, (call, error, match) in BAD_CALLS.items():
        with pytest.raises(error, match=match):
            call(svc)
        assert _snapshot(svc) == before, name
    # Version 6 kept its bytes through all of that and completes; 7 still publishes.
    svc.put(6, "w", W.tobytes()[4:], 4)
    svc.put(6, "b", np.array([1.5, -2], ml_dtypes.bfloat16))
    svc.commit(6)
    svc.publish(7, {"w": W})
    assert svc.versions() == [6, 7]
    assert_same(svc.pull(6)[1], {"w": W, "b": np.array([1.5, -2], ml_dtypes.bfloat16)})
    svc.close()


def test_failed_one_shot_publish_leaves_nothing_pending():
    with ParameterService() as svc:
        with pytest.raises(ValueError, match="dtype 'complex64'"):
            svc.publish(1, {"w": W, "x": np.zeros(2, np.complex64)})
        svc.publish(1, {"w": W})  # the version number is free again
        assert svc.versions() == [1]


def test_abort_and_stale_commit():
    with ParameterService() as svc:
        svc.begin(1, MANIFEST)
        svc.put(1, "w", W)
        assert svc.abort_publish(1) is True
        assert svc.abort_publish(1) is False
        with pytest.raises(ValueError, match="not being published"):
            svc.commit(1)
        assert svc.versions() == []
        # Two versions in flight: the newer commits first, the older can then never become visible.
        svc.begin(2, {"w": MANIFEST["w"]})
        svc.begin(3, {"w": MANIFEST["w"]})
        svc.put(2, "w", W)
        svc.put(3, "w", W + 3)
        svc.commit(3)
        with pytest.raises(ValueError, match="version 2 is not newer than the latest published version 3"):
            svc.commit(2)
        assert svc.abort_publish(2) is False  # already dropped
        assert svc.versions() == [3]
        assert_same(svc.pull()[1], {"w": W + 3})


# --- waiting ------------------------------------------------------------------------------------------------

def test_wait_for_version():
    svc = ParameterService()
    with pytest.raises(TimeoutError, match="no version >= 0 was published within 0.05 s"):
        svc.wait_for_version(0, timeout=0.05)
    assert svc.poll_version(0, 0.01) is None
    timer = threading.Timer(0.1, lambda: [svc.publish(v, {"w": W}) for v in (1, 2, 3)])
    timer.start()
    assert svc.wait_for_version(3, timeout=10) == 3
    assert svc.wait_for_version(1, timeout=0) == 3
    # close() wakes a waiter, which then fails rather than waiting forever.
    failures = []

    def waiter():
        try:
            svc.wait_for_version(99)
        except RuntimeError as exc:
            failures.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    # Closed only once the waiter waits (on the service's condition), so that close() has to wake it.
    wait_until(lambda: len(svc._lock._waiters) == 1, 10, "the waiter blocked in wait_for_version")
    svc.close()
    thread.join(timeout=5)
    assert len(failures) == 1 and "closed" in str(failures[0])


# --- another process ----------------------------------------------------------------------------------------

_READER_SCRIPT = textwrap.dedent('''
    import json, multiprocessing as mp, os, subprocess, sys, time
    import numpy as np
    from jaxflow.transport.param_client import attach_shared
    from jaxflow.data.param_service import ParameterService
    from waiting import wait_until  # tests/ is on PYTHONPATH

    def tensors(v):
        rng = np.random.default_rng(v)
        return {"a": rng.standard_normal((64, 33)).astype(np.float32),
                "b": rng.integers(0, 2**16, (17,), dtype=np.uint16).view("bfloat16"),
                "c": rng.integers(0, 2, (5, 3)).astype(bool)}

    def digest(arrays):
        return {n: bytes(np.ascontiguousarray(a).tobytes()) for n, a in arrays.items()}

    def reader(manifest, conn):
        views = attach_shared(manifest)
        conn.send((digest(views), any(v.flags.writeable for v in views.values())))
        later = conn.recv()           # meanwhile the service evicted the version and unlinked it
        conn.send(digest(views))      # the mapping is still valid
        attach_shared(later)          # attached, never released: exiting must not unlink it

    if __name__ == "__main__":
        svc = ParameterService(keep=2, shared_memory=True)
        svc.publish(1, tensors(1))
        first = svc.manifest(1)
        prefix = first["segment"].rsplit("_", 1)[0] + "_"
        conn, child_conn = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(target=reader, args=(first, child_conn))
        child.start()
        got, writable = conn.recv()
        assert got == digest(tensors(1)) and not writable
        svc.publish(2, tensors(2))
        svc.publish(3, tensors(3))
        wait_until(lambda: not os.path.exists("/dev/shm/" + first["segment"]), 10, "the evicted segment unlinked")
        conn.send(svc.manifest(3))
        assert conn.recv() == digest(tensors(1))
        child.join(30)
        assert child.exitcode == 0, child.exitcode
        # An unrelated process (its own resource tracker) attaches and exits: the segment must survive.
        code = ("import json, sys; from jaxflow.transport.param_client import attach_shared; "
                "print(float(attach_shared(json.loads(sys.argv[1]))['a'].sum()))")
        out = subprocess.run([sys.executable, "-c", code, json.dumps(svc.manifest(3))], check=True,
                             capture_output=True, text=True)
        assert float(out.stdout) == float(tensors(3)["a"].sum()), out
        sys.stderr.write(out.stderr)
        assert os.path.exists("/dev/shm/" + svc.manifest(3)["segment"])
        assert digest(svc.pull(3)[1]) == digest(tensors(3))
        svc.close()
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
        print("OK")
''')


@pytest.mark.slow  # a model, or another process
def test_a_reader_process_attaches_without_resource_tracker_trouble(tmp_path):
    script = tmp_path / "shm_reader.py"
    script.write_text(_READER_SCRIPT)
    root = str(pathlib.Path(__file__).resolve().parents[2])
    tests = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, tests, os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="default")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK"
    # The resource tracker reports leaked or doubly-unlinked segments on stderr; there must be none.
    assert done.stderr == "", done.stderr


# --- a sharded policy ---------------------------------------------------------------------------------------

@pytest.mark.slow  # a model, or another process
def test_sharded_policy_publishes_the_same_hf_tensors(tmp_path):
    # The trainer's state lives sharded on a mesh; what it publishes must be the plain HF tensors.
    import jax

    from jaxflow import sharding
    from jaxflow.models.hf_io import iter_hf_tensors, load_model
    from jaxflow.models.tiny import write_tiny_model

    write_tiny_model(tmp_path, architecture="Qwen2ForCausalLM", tie_word_embeddings=False)
    sharded = load_model(tmp_path, mesh=sharding.make_mesh(1, 4, 2))
    assert len(sharded.layers.q_proj[...].sharding.device_set) == 8
    single = dict(iter_hf_tensors(load_model(tmp_path, mesh=sharding.make_mesh(devices=jax.devices()[:1]))))
    service = ParameterService(keep=1)
    service.publish(3, iter_hf_tensors(sharded))
    version, pulled = service.pull()
    assert version == 3 and sorted(pulled) == sorted(single)
    for name, value in single.items():
        np.testing.assert_array_equal(pulled[name], value)
