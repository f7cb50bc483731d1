"""Weights through Ray's object store: a pulled version is bit-identical, old versions are let go, and bad
manifests and unknown versions are clear errors. The test session's local Ray (2 CPUs)."""


import ml_dtypes
import numpy as np
import pytest
import ray  # the `cluster` extra, which the setup script installs: a missing Ray fails here, never skips
from service_placements import kill_and_wait, ray_session  # noqa: E402
from waiting import wait_until  # noqa: E402

from jaxflow.cluster.weights import (  # noqa: E402
    RayWeightPublisher,
    UnknownVersionError,
    merge_manifests,
    pull,
    put_shards,
)

pytestmark = pytest.mark.slow  # Ray clusters and actors


@pytest.fixture(scope="module")
def local_ray():
    """This test session's local Ray (2 CPUs), shared with the service-placement tests."""
    ray_session()
    yield


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 16), np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": rng.standard_normal(16).astype(np.float16),
        "counts": rng.integers(-5, 5, (3, 4), np.int32),
    }


def _live_object_ids() -> set[str]:
    # The ids this process counts references to: an object freed by its owner (this process) is gone.
    core_worker = ray._private.worker.global_worker.core_worker
    return {oid.decode() if isinstance(oid, bytes) else str(oid) for oid in core_worker.get_all_reference_counts()}


def _ids(manifest) -> set[str]:
    return {s["ref"].hex() for e in manifest["tensors"].values() for s in e["shards"]}


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_a_pulled_version_is_bit_identical(local_ray):
    tensors = _tensors(0)
    publisher = RayWeightPublisher(keep=2)
    publisher.publish(3, tensors)
    version, got = pull(publisher.manifest())
    assert version == 3 and list(got) == list(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert _bits(got[name]) == _bits(want), name
        assert not got[name].flags.writeable, name


def test_a_version_put_in_shards_by_two_processes_is_assembled(local_ray):
    whole = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    bias = np.arange(6, dtype=np.float32)
    # Process 0 holds the top rows and the (replicated) bias; process 1 the bottom rows, in two columns.
    part0 = put_shards(5, [("w", (8, 6), (0, 0), whole[:4]), ("b", (6,), (0,), bias)])
    part1 = put_shards(5, [("w", (8, 6), (4, 0), whole[4:, :3]), ("w", (8, 6), (4, 3), whole[4:, 3:])])
    publisher = RayWeightPublisher()
    publisher.commit(merge_manifests([part0, part1]))
    version, got = pull(publisher.manifest(5))
    assert version == 5
    assert _bits(got["w"]) == _bits(whole) and _bits(got["b"]) == _bits(bias)


def test_the_publisher_keeps_only_keep_versions_alive(local_ray):
    publisher = RayWeightPublisher(keep=2)
    publisher.publish(1, _tensors(1))
    first = _ids(publisher.manifest(1))
    assert first <= _live_object_ids()
    publisher.publish(2, _tensors(2))
    publisher.publish(3, _tensors(3))
    assert publisher.versions() == [2, 3] and publisher.latest() == 3
    with pytest.raises(UnknownVersionError, match="version 1 is not published"):
        publisher.manifest(1)
    assert not first & _live_object_ids(), "version 1's objects are still referenced after eviction"
    assert _ids(publisher.manifest(2)) | _ids(publisher.manifest(3)) <= _live_object_ids()
    assert _bits(pull(publisher.manifest(2))[1]["counts"]) == _bits(_tensors(2)["counts"])


def test_a_held_manifest_stays_pullable_after_eviction(local_ray):
    publisher = RayWeightPublisher(keep=1)
    held = publisher.publish(1, _tensors(1))
    publisher.publish(2, _tensors(2))
    with pytest.raises(UnknownVersionError):
        publisher.manifest(1)
    assert _bits(pull(held)[1]["model.norm.weight"]) == _bits(_tensors(1)["model.norm.weight"])


def test_unknown_versions_and_bad_input_are_clear_errors(local_ray):
    publisher = RayWeightPublisher(keep=2)
    with pytest.raises(UnknownVersionError, match="version None is not published"):
        publisher.manifest()
    assert publisher.latest() is None
    publisher.publish(4, _tensors(4))
    with pytest.raises(UnknownVersionError, match="version 9 is not published"):
        publisher.manifest(9)
    with pytest.raises(ValueError, match="version 4 is not newer than the latest published version 4"):
        publisher.publish(4, _tensors(4))
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        RayWeightPublisher(keep=0)
    with pytest.raises(ValueError, match="tensor 'x' has dtype complex64"):
        put_shards(5, [("x", (2,), (0,), np.zeros(2, np.complex64))])
    with pytest.raises(ValueError, match="tensor 'x': a piece of shape \\[3\\] at \\[0\\] overruns shape \\[2\\]"):
        put_shards(5, [("x", (2,), (0,), np.zeros(3, np.float32))])
    a = put_shards(5, [("x", (4,), (0,), np.zeros(3, np.float32))])
    b = put_shards(5, [("x", (4,), (2,), np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="tensor 'x': the pieces at \\[0\\] and \\[2\\] overlap"):
        merge_manifests([a, b])
    with pytest.raises(ValueError, match="tensor 'x': its pieces cover 3 of 4 elements"):
        merge_manifests([a])
    with pytest.raises(ValueError, match="versions 5 and 6 cannot be merged"):
        merge_manifests([a, put_shards(6, [("x", (4,), (3,), np.zeros(1, np.float32))])])
    assert publisher.versions() == [4]


def test_a_manifest_that_does_not_match_its_objects_is_refused(local_ray):
    manifest = put_shards(1, [("x", (4,), (0,), np.zeros(4, np.float32))])
    manifest["tensors"]["x"]["dtype"] = "int32"
    with pytest.raises(ValueError, match="tensor 'x': a piece at \\[0\\] is float32"):
        pull(manifest)


def test_small_tensors_share_objects_up_to_bucket_bytes(local_ray):
    tensors = {f"t{i}": np.full(256, i, np.float32) for i in range(10)}  # 1 KiB each
    tensors["big"] = np.arange(1024, dtype=np.float32)  # 4 KiB: over the bucket, an object of its own
    publisher = RayWeightPublisher(bucket_bytes=3 * 1024)
    manifest = publisher.publish(1, tensors)
    refs = [s["ref"] for e in manifest["tensors"].values() for s in e["shards"]]
    assert len(set(refs)) == 5  # t0-t2, t3-t5, t6-t8, t9, big
    got = pull(manifest)[1]
    assert all(_bits(got[name]) == _bits(want) for name, want in tensors.items())
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 0"):
        RayWeightPublisher(bucket_bytes=-1)


def test_a_version_whose_owner_died_is_unknown(local_ray):
    n = 1 << 16  # 256 KiB: over Ray's limit for objects inlined into the reply, so it stays with its owner

    @ray.remote(num_cpus=0)
    class Trainer:
        # Builds the manifest by hand: the worker need not import jaxflow.
        def put(self):
            return [ray.put(np.arange(n, dtype=np.float32))]

    trainer = Trainer.remote()
    [ref] = ray.get(trainer.put.remote())
    manifest = {"version": 1, "tensors": {"x": {"dtype": "float32", "shape": [n], "shards": [
        {"start": [0], "shape": [n], "ref": ref, "item": None}]}}}
    kill_and_wait(trainer)
    # News of the owner's death reaches this process a moment later; until then the local copy still reads.
    with pytest.raises(UnknownVersionError, match="version 1: a tensor's object is gone"):
        wait_until(lambda: pull(manifest, timeout=60) and False, 60, "the pull to fail", interval=0.1)
