"""ParameterClient against a ParameterService: over a wire loopback (attach or stream, eviction mid-stream,
chunked publish and its abort, polling) and over real RPC (a loopback server, a server process)."""

import collections
import os
import threading

import numpy as np
import pytest
from param_helpers import SHM, W, WireLoopback, assert_same, sample_tensors

from jaxflow.data.param_service import RPC_METHODS, ParameterService, UnknownVersionError
from jaxflow.transport import process_server, rpc
from jaxflow.transport.param_client import ParameterClient, attach_shared

# --- over a wire loopback -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["shm_attach", "shm_service_streamed", "private_streamed"])
def test_client_pull_attaches_or_streams(mode):
    with ParameterService(keep=2, shared_memory=mode != "private_streamed") as svc:
        tensors = sample_tensors(2)
        svc.publish(4, tensors)
        rpc_client = WireLoopback(svc)
        client = ParameterClient(rpc_client, chunk_bytes=300, shared_memory=mode == "shm_attach")
        assert client.latest() == 4 and client.versions() == [4]
        version, pulled = client.pull()
        assert version == 4
        assert_same(pulled, tensors)
        assert not any(a.flags.writeable for a in pulled.values())
        total = svc.manifest(4)["total_bytes"]
        expected_reads = 0 if mode == "shm_attach" else -(-total // 300)
        assert rpc_client.counts["read"] == expected_reads


def test_client_streams_when_the_segment_is_not_reachable():
    class OtherHost(WireLoopback):
        def call(self, method, *args, **kwargs):
            result = super().call(method, *args, **kwargs)
            if method == "attach":
                result["segment"] = "jxf_no_such_segment_here"
            return result

    with ParameterService(shared_memory=True) as svc:
        svc.publish(0, sample_tensors(3))
        rpc_client = OtherHost(svc)
        assert_same(ParameterClient(rpc_client).pull(0)[1], sample_tensors(3))
        assert rpc_client.counts["read"] == 1


def test_client_pull_of_latest_restarts_when_the_version_is_evicted_mid_stream():
    svc = ParameterService(keep=1)
    svc.publish(0, {"w": np.zeros(1000, np.float32)})

    def publish_during_first_read(method, args):
        if method == "read" and svc.latest() == 0:
            svc.publish(1, {"w": np.ones(1000, np.float32)})

    client = ParameterClient(WireLoopback(svc, publish_during_first_read), chunk_bytes=1024)
    version, pulled = client.pull()
    assert version == 1 and (pulled["w"] == 1).all()
    with pytest.raises(UnknownVersionError):
        client.pull(0)  # an explicit version is never swapped for another
    svc.close()


@pytest.mark.parametrize("shm", SHM)
def test_client_publish_in_chunks(shm):
    with ParameterService(shared_memory=shm == "shm") as svc:
        tensors = sample_tensors(4)
        rpc_client = WireLoopback(svc)
        ParameterClient(rpc_client, chunk_bytes=64).publish(1, tensors)
        assert_same(svc.pull(1)[1], tensors)
        assert rpc_client.counts["put"] == sum(-(-t.nbytes // 64) for t in tensors.values())

        # A failure half-way aborts the version on the service: nothing visible, the number free again.
        def fail_third_put(method, args):
            if method == "put" and rpc_client.counts["put"] == 3:
                raise ConnectionError("link down")

        rpc_client = WireLoopback(svc, fail_third_put)
        with pytest.raises(ConnectionError):
            ParameterClient(rpc_client, chunk_bytes=64).publish(2, tensors)
        assert rpc_client.counts["abort_publish"] == 1
        assert svc.versions() == [1]
        svc.publish(2, tensors)


def test_client_wait_for_version_polls_in_slices():
    with ParameterService() as svc:
        rpc_client = WireLoopback(svc)
        client = ParameterClient(rpc_client)
        with pytest.raises(TimeoutError):
            client.wait_for_version(0, timeout=0.1, poll_s=0.03)
        assert rpc_client.counts["poll_version"] >= 3
        threading.Timer(0.1, lambda: svc.publish(2, {"w": W})).start()
        assert client.wait_for_version(1, timeout=10, poll_s=0.05) == 2


class Counting:
    """Passes calls on to an rpc.Client, counting them by method."""

    def __init__(self, inner):
        self.inner = inner
        self.counts = collections.Counter()

    def call(self, method, *args, **kwargs):
        self.counts[method] += 1
        return self.inner.call(method, *args, **kwargs)


# --- over real RPC ------------------------------------------------------------------------------------------

def test_client_over_loopback_rpc():
    svc = ParameterService(keep=2)
    server = rpc.Server(svc, RPC_METHODS, token="t0k").start()
    rpc_client = rpc.Client(server.address, token="t0k", timeout=30)
    try:
        client = ParameterClient(rpc_client, chunk_bytes=1 << 12)
        tensors = sample_tensors(5) | {"big": np.arange(50_000, dtype=np.float32)}
        client.publish(1, tensors)
        assert_same(client.pull(1)[1], tensors)
        assert_same(svc.pull(1)[1], tensors)
        with pytest.raises(UnknownVersionError, match="version 0 is not published"):
            client.pull(0)
        with pytest.raises(ValueError, match="version 1 is not newer"):
            client.publish(1, tensors)
        with pytest.raises(TimeoutError):
            client.wait_for_version(2, timeout=0.2, poll_s=0.1)
    finally:
        rpc_client.close()
        server.close()
        svc.close()


def test_client_attaches_to_a_server_process_shared_memory():
    process, address = process_server.serve_in_subprocess(
        "jaxflow.data.param_service:ParameterService", {"keep": 2, "shared_memory": True}, RPC_METHODS)
    try:
        rpc_client = rpc.Client(address, timeout=60)
        counting = Counting(rpc_client)
        client = ParameterClient(counting, chunk_bytes=1 << 14)
        tensors = sample_tensors(6) | {"big": np.arange(100_000, dtype=np.float32)}
        client.publish(1, tensors)  # the server copies the chunks into its segment
        version, pulled = client.pull()
        assert version == 1 and counting.counts["read"] == 0  # attached, not streamed
        assert_same(pulled, tensors)
        segment = client.manifest(1)["segment"]
        rpc_client.close()
    finally:
        process_server.stop_subprocess(process)
    assert not os.path.exists(f"/dev/shm/{segment}")  # the server's close() unlinked it
    assert_same(pulled, tensors)  # and our mapping is still good


# --- segments reused across versions for readers that say when they stop reading ---------------------------

def _version(v: int) -> dict[str, np.ndarray]:
    return {"w": np.full((64, 64), v, np.float32), "b": np.arange(7, dtype=np.int64) + v}


def test_a_released_segment_is_written_again_and_read_through_the_same_mapping():
    with ParameterService(keep=2, shared_memory=True) as svc:
        client = ParameterClient(WireLoopback(svc))
        names = []
        for v in range(8):
            svc.publish(v, _version(v))
            version, pulled = client.pull()
            assert version == v
            assert_same(pulled, _version(v))
            names.append(svc._committed[v].buffer.name)  # (manifest() would expose it: never reused)
            del pulled  # the engine moved on: the next pull releases this segment
        # keep=2 kept versions + the one just released: three segments in turn from the fourth version on.
        assert len(set(names[3:])) <= 3 and set(names[4:]) <= set(names[:4]), names
        assert len(client._maps) <= 3
        client.close()
        assert svc._pool.holders == {}


def test_segments_still_read_are_never_written_under():
    with ParameterService(keep=1, shared_memory=True) as svc:
        client = ParameterClient(WireLoopback(svc))
        svc.publish(0, _version(0))
        _, kept = client.pull()  # a registered reader that keeps its arrays for the whole test
        svc.publish(1, _version(1))
        plain = attach_shared(svc.manifest(1))  # a reader that never registers
        for v in range(2, 10):
            svc.publish(v, _version(v))
            _, pulled = client.pull()
            assert_same(pulled, _version(v))
            del pulled
        assert_same(kept, _version(0))
        assert_same(plain, _version(1))


def test_a_reader_that_never_releases_pins_a_bounded_number_of_segments():
    with ParameterService(keep=1, shared_memory=True) as svc:
        for v in range(12):
            svc.publish(v, _version(v))
            svc.attach("gone-reader")  # holds every version, releases none
        assert 1 <= len(svc._pool.retired) <= svc._pool.max_retired
        assert svc.release_reader("gone-reader") >= 1 and svc._pool.holders == {}
        assert svc._pool.retired == {}


@pytest.mark.parametrize("args, error, match", [
    (("", None, []), ValueError, "reader"),
    ((7, None, []), TypeError, "reader"),
    (("r", None, "seg"), ValueError, "release"),
    (("r", None, [3]), ValueError, "release"),
    (("r", 99, []), UnknownVersionError, "99"),
])
def test_bad_attach_is_refused_and_changes_nothing(args, error, match):
    with ParameterService(keep=2, shared_memory=True) as svc:
        svc.publish(0, _version(0))
        svc.attach("r")
        before = {k: set(v) for k, v in svc._pool.holders.items()}
        with pytest.raises(error, match=match):
            svc.attach(*args)
        assert {k: set(v) for k, v in svc._pool.holders.items()} == before
