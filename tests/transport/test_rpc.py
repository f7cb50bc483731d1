"""RPC: a served object behaves like the embedded one, and the server survives bad clients."""

import logging
import socket
import threading
import time

import numpy as np
import pytest
from toy_service import ERRORS, METHODS, StaleGroupError, Toy
from waiting import wait_until

from jaxflow.data.records import Sample
from jaxflow.transport import process_server, rpc, wire


@pytest.fixture
def served():
    """The object the `server` fixture serves."""
    obj = Toy()
    yield obj
    obj.release.set()  # ends a hold() call the test left running


@pytest.fixture
def server(served):
    with rpc.Server(served, METHODS).start() as srv:
        yield srv


@pytest.fixture
def client(server):
    with rpc.Client(server.address, timeout=30) as cli:
        yield cli


@pytest.fixture(params=["embedded", "remote"])
def toy(request):
    """The same object, embedded or behind a client: the tests below must not tell the difference."""
    obj = Toy()
    if request.param == "embedded":
        yield obj
        return
    with rpc.Server(obj, METHODS).start() as srv, rpc.Client(srv.address) as cli:
        yield cli


def _raw_connection(server) -> socket.socket:
    """A socket speaking the protocol by hand, as a buggy or hostile client would."""
    return socket.create_connection(server.address, timeout=10)


# --- one API, two placements --------------------------------------------------------------------------

def test_calls_work(toy):
    assert toy.add(2, b=3) == 5
    assert toy.samples(2) == [Sample([0], [-0.5], [0], "stop"), Sample([1], [-0.5], [0], "stop")]
    out = toy.echo(np.arange(3, dtype=np.int16), key=None)
    np.testing.assert_array_equal(out["args"][0], np.arange(3, dtype=np.int16))
    assert out["kwargs"] == {"key": None}


@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_exceptions_keep_type_and_message(toy, kind):
    embedded = None
    try:
        Toy().fail(kind, "unknown group 5")
    except Exception as exc:
        embedded = exc
    with pytest.raises(ERRORS[kind], match="unknown group 5") as info:
        toy.fail(kind, "unknown group 5")
    assert type(info.value) is type(embedded)
    assert str(info.value) == str(embedded)
    assert toy.add(1) == 1, "still serving after an exception"


def test_os_errors_keep_errno_and_filename(toy, tmp_path):
    missing = str(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError) as info:
        toy.open_missing(missing)
    assert info.value.errno == 2 and info.value.filename == missing
    assert str(info.value) == f"[Errno 2] No such file or directory: {missing!r}"


def test_custom_exceptions(toy):
    with pytest.raises(ValueError, match="bad toy"):
        toy.fail_custom("toy")
    with pytest.raises(StaleGroupError, match="group 7 is 5 versions stale") as info:
        toy.fail_custom("stale")
    assert (info.value.group_id, info.value.lag) == (7, 5)


# --- remote only --------------------------------------------------------------------------------------

def test_unknown_exception_type_becomes_remote_error(client):
    with pytest.raises(rpc.RemoteError, match="something odd") as info:
        client.fail_custom("weird")
    assert info.value.remote_type.endswith("WeirdError")
    assert "WeirdError" in info.value.remote_traceback
    with pytest.raises(ValueError) as info:
        client.fail_custom("toy")
    assert info.value.remote_type.endswith("ToyError") and "ToyError: bad toy" in str(info.value)


def test_only_allow_listed_methods(client):
    assert client.methods == frozenset(METHODS)
    with pytest.raises(AttributeError, match="'hidden' is not served"):
        _ = client.hidden
    with pytest.raises(AttributeError, match="'hidden' is not served.*allowed: add, echo"):
        client.call("hidden")
    with pytest.raises(AttributeError, match="'__class__' is not served"):
        client.call("__class__")
    assert client.add(1, 2) == 3


def test_server_validates_its_methods():
    with pytest.raises(ValueError, match="no method 'nope'"):
        rpc.Server(Toy(), ["nope"])
    with pytest.raises(ValueError, match="public"):
        rpc.Server(Toy(), ["__init__"])
    with pytest.raises(TypeError):
        rpc.Server(Toy(), "add")


def test_results_and_arguments_must_be_wire_encodable(client):
    with pytest.raises(wire.WireError, match="result of unencodable is not wire-encodable"):
        client.unencodable()
    with pytest.raises(wire.WireError):
        client.echo(object())
    assert client.add(1) == 1


def test_large_arrays_round_trip(client):
    arr = np.random.default_rng(0).standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB
    out = client.echo(arr)["args"][0]
    assert out.dtype == np.float32 and out.tobytes() == arr.tobytes()


def test_oversized_frame_closes_only_that_connection(caplog):
    with rpc.Server(Toy(), METHODS, max_frame_bytes=1 << 20).start() as srv, rpc.Client(srv.address) as cli:
        with caplog.at_level(logging.WARNING, logger="jaxflow.transport.rpc"):
            with _raw_connection(srv) as raw:
                raw.sendall((1 << 40).to_bytes(8, "big"))
                reply = wire.recv_message(raw)
                assert reply["ok"] is False and reply["error"]["type"].endswith("FrameTooLarge")
                with pytest.raises(ConnectionError):
                    wire.read_frame(raw)
            with pytest.raises((wire.FrameTooLarge, ConnectionError)):
                cli.echo(np.zeros(4 << 20, np.uint8))
        assert cli.add(2, 2) == 4
        assert any("exceeds the limit" in r.getMessage() for r in caplog.records)
        assert all(r.exc_info is None for r in caplog.records), "no traceback spam"


def test_garbage_and_malformed_frames_keep_the_connection(server):
    with _raw_connection(server) as raw:
        for junk in (b"not msgpack at all", wire.encode([1, 2, 3]), wire.encode({"id": 9, "method": 5})):
            wire.write_frame(raw, junk)
            reply = wire.recv_message(raw)
            assert reply["ok"] is False and reply["error"]["type"].endswith("WireError")
        assert reply["id"] == 9
        wire.send_message(raw, {"id": 10, "method": "add", "args": [1, 2], "kwargs": {}})
        assert wire.recv_message(raw) == {"id": 10, "ok": True, "result": 3}


def test_non_loopback_bind_needs_a_token():
    for host in ("0.0.0.0", "", "10.1.2.3", "example.com", "::"):
        with pytest.raises(ValueError, match="without a token"):
            rpc.Server(Toy(), METHODS, host=host)
    for host in ("127.0.0.1", "127.0.0.5", "localhost", "::1"):
        rpc.Server(Toy(), METHODS, host=host)
    rpc.Server(Toy(), METHODS, host="0.0.0.0", token="s3cret")  # constructed, not bound
    with pytest.raises(ValueError, match="without a token"):
        process_server.serve_in_subprocess("toy_service:make_toy", {"scale": 1}, METHODS, host="0.0.0.0")


def test_token_authentication():
    with rpc.Server(Toy(), METHODS, token="s3cret").start() as srv:
        for token in ("wrong", None):
            with pytest.raises(PermissionError, match="authentication failed"):
                rpc.Client(srv.address, token=token)
        with _raw_connection(srv) as raw:  # a request without the handshake
            wire.send_message(raw, {"id": 1, "method": "add", "args": [1], "kwargs": {}})
            assert wire.recv_message(raw)["error"]["type"] == "PermissionError"
            with pytest.raises(ConnectionError):
                wire.read_frame(raw)
        with rpc.Client(srv.address, token="s3cret") as cli:
            assert cli.add(40, 2) == 42


def test_a_blocked_call_does_not_block_other_calls(client, server, served):
    # Another thread of the same client, and another client, both get through while one call is in flight.
    blocked = threading.Thread(target=client.hold)
    blocked.start()
    wait_until(served.holding.is_set, 30, "the held call to reach the served object")
    with rpc.Client(server.address) as other:
        assert other.add(1, 1) == 2
    assert client.add(2, 2) == 4
    assert blocked.is_alive()  # still in flight: the calls above went around it
    served.release.set()
    blocked.join()


def test_client_timeout_and_server_close(server, served):
    with rpc.Client(server.address, timeout=0.2) as cli:
        with pytest.raises(TimeoutError):
            cli.slow(1.0)
        assert cli.add(1, 1) == 2, "a fresh connection replaces the timed-out one"
    cli = rpc.Client(server.address)
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(pytest.raises(ConnectionError, cli.hold, 60.0)))
    waiter.start()
    wait_until(served.holding.is_set, 30, "the held call to reach the served object")
    server.close()
    # The call would run for 60 s; closing the server ends it long before (the bound is slack, not speed).
    waiter.join(timeout=30.0)
    assert not waiter.is_alive() and errors, "a call in flight fails when the server closes"


def test_many_threads_share_one_client(client):
    results = [None] * 16

    def work(i):
        results[i] = [client.add(i, j) for j in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[i + j for j in range(20)] for i in range(16)]


def test_trivial_call_throughput(client):
    client.add(0)
    n = 2000
    started = time.perf_counter()
    for i in range(n):
        client.add(i)
    elapsed = time.perf_counter() - started
    print(f"\nrpc loopback: {n / elapsed:,.0f} trivial calls/s, {elapsed / n * 1e6:.0f} us round trip")


# --- a server in its own process ----------------------------------------------------------------------

def test_serve_in_subprocess():
    process, address = process_server.serve_in_subprocess("toy_service:make_toy", {"scale": 3}, METHODS, token="t0k")
    try:
        with rpc.Client(address, token="t0k") as cli:
            assert cli.add(1, 2) == 9
            with pytest.raises(KeyError, match="unknown group"):
                cli.fail("KeyError", "unknown group 3")
    finally:
        assert process_server.stop_subprocess(process) == 0
    assert not process.is_alive()


def test_failing_factory_raises_promptly():
    start_timeout = 60
    started = time.perf_counter()
    with pytest.raises(ValueError, match="bad config: scale=4") as info:
        process_server.serve_in_subprocess("toy_service:make_failing", {"scale": 4}, METHODS,
                                           start_timeout=start_timeout)
    assert "make_failing" in info.value.remote_traceback
    with pytest.raises(ValueError, match="factory .*no_such_factory"):  # jaxflow.refs.RefError
        process_server.serve_in_subprocess(f"{__name__}:no_such_factory", {}, METHODS)
    # The failure is reported as soon as the child says so, not when the start timeout runs out.
    assert time.perf_counter() - started < start_timeout
