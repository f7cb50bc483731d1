"""The RPC server's limits against slow, silent, greedy and hostile clients: frames read as they arrive,
idle and mid-frame timeouts, a cap on connections, decoded-size limits, and finite call timeouts."""

import logging
import math
import socket
import struct
import threading
import time
import tracemalloc

import msgpack
import pytest
from waiting import wait_until

from jaxflow.data.param_service import ParameterService
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.transport import client as rpc_client
from jaxflow.transport import rpc, wire

MB = 1 << 20


class Echo:
    def echo(self, value):
        return value

    def add(self, a, b):
        return a + b


def _serve(**kw):
    return rpc.Server(Echo(), ["echo", "add"], **kw).start()


def _raw(server) -> socket.socket:
    return socket.create_connection(server.address, timeout=10)


def _closed_by_server(raw: socket.socket) -> bool:
    """Reads what the server sends until it closes; True when it closed (an error frame may come first)."""
    try:
        while True:
            wire.read_frame(raw)
    except (ConnectionError, OSError):
        return True
    except wire.WireError:
        return True


def _connection_threads() -> int:
    return sum(t.name.startswith("rpc-conn") for t in threading.enumerate())


def _message_with_header(header: bytes) -> bytes:
    """A wire message whose msgpack header is `header` (raw bytes, possibly hostile), no tensor region."""
    return struct.pack("!4sQQ", b"JFW\x01", len(header), 0) + header


# --- 1. frames are read as their bytes arrive ---------------------------------------------------------

def test_a_declared_length_allocates_nothing_before_the_body_arrives():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("!Q", 256 * MB) + b"x" * 1000)
        a.close()
        tracemalloc.start()
        try:
            with pytest.raises(ConnectionError, match="1000 of the 268435456 bytes"):
                wire.read_frame(b, max_bytes=512 * MB)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 16 * MB, f"reading a frame header allocated {peak / MB:.0f} MiB before its body"


def test_frames_of_every_size_still_arrive_whole():
    a, b = socket.socketpair()
    with a, b:
        for size in (0, 1, 4095, 1 * MB + 3, 9 * MB + 17):
            payload = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            sender = threading.Thread(target=wire.write_frame, args=(a, payload))
            sender.start()
            got = wire.read_frame(b)
            sender.join()
            assert len(got) == size and got == payload


def test_the_server_holds_no_memory_for_a_declared_but_unsent_frame():
    with _serve(max_frame_bytes=256 * MB) as srv, rpc.Client(srv.address, timeout=10) as cli:
        tracemalloc.start()
        try:
            with _raw(srv) as raw:
                raw.sendall(struct.pack("!Q", 256 * MB - 1) + b"x" * 100)
                assert cli.add(1, 2) == 3, "other calls go on"
                # The server thread has read the header by now or soon: give it the chance to allocate.
                time.sleep(1.0)
                _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 16 * MB, f"the server allocated {peak / MB:.0f} MiB for a frame that never came"


# --- 2. idle and stalled connections are closed; the number of connections is capped -------------------

def test_a_silent_connection_is_closed_after_the_idle_timeout(caplog):
    with caplog.at_level(logging.INFO, logger="jaxflow.transport.rpc"):
        with _serve(idle_timeout_s=0.3, frame_timeout_s=5) as srv:
            with _raw(srv) as raw:
                wire.send_message(raw, {"token": None})
                assert wire.recv_message(raw)["ok"] is True
                assert _closed_by_server(raw)
            wait_until(lambda: _connection_threads() == 0, 10, "the silent connection's thread to end")
            # A client whose pooled connection was closed while idle reconnects transparently.
            with rpc.Client(srv.address, timeout=10) as cli:
                assert cli.add(1, 1) == 2
                wait_until(lambda: _connection_threads() == 0, 10, "the idle pooled connection closed")
                assert cli.add(2, 2) == 4
    assert any("idle" in r.getMessage() and "0.3" in r.getMessage() for r in caplog.records)


def test_a_frame_stalled_or_dripped_is_closed_after_the_frame_timeout(caplog):
    with caplog.at_level(logging.INFO, logger="jaxflow.transport.rpc"):
        with _serve(idle_timeout_s=30, frame_timeout_s=0.5) as srv:
            with _raw(srv) as raw:  # stalls after part of a frame
                raw.sendall(struct.pack("!Q", 100) + b"partial")
                assert _closed_by_server(raw)
            with _raw(srv) as raw:  # sends one byte at a time, never quite silent
                raw.sendall(struct.pack("!Q", 1000))
                closed_after = None
                started = time.monotonic()
                for _ in range(200):
                    try:
                        raw.sendall(b"x")
                    except OSError:
                        closed_after = time.monotonic() - started
                        break
                    time.sleep(0.05)
                assert closed_after is not None, "a dripping frame was never cut off"
    assert any("frame" in r.getMessage() and "0.5" in r.getMessage() for r in caplog.records)


def test_a_client_that_stops_reading_its_reply_is_closed_after_the_frame_timeout(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxflow.transport.rpc"):
        with _serve(idle_timeout_s=30, frame_timeout_s=0.5) as srv:
            with _raw(srv) as raw:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                wire.send_message(raw, {"id": 1, "method": "echo", "args": [b"x" * (64 * MB)], "kwargs": {}})
                wait_until(lambda: _connection_threads() == 0, 10, "the unread reply to free its thread")
    assert any("reply was not taken" in r.getMessage() for r in caplog.records)


def test_a_connection_with_a_token_must_send_its_handshake_within_the_frame_timeout():
    with rpc.Server(Echo(), ["add"], token="s3cret", idle_timeout_s=30, frame_timeout_s=0.3).start() as srv:
        with _raw(srv) as raw:
            reply = wire.recv_message(raw)  # sent nothing: told why, then closed
            assert reply["ok"] is False and "idle timeout of 0.3 s" in reply["error"]["message"]
            assert _closed_by_server(raw)
        with rpc.Client(srv.address, token="s3cret", timeout=10) as cli:
            assert cli.add(1, 2) == 3


def test_the_number_of_connections_is_capped():
    with _serve(max_connections=2) as srv:
        first, second = rpc.Client(srv.address, timeout=10), rpc.Client(srv.address, timeout=10)
        with pytest.raises(ConnectionError, match="max_connections=2") as info:
            rpc.Client(srv.address, timeout=10)
        assert isinstance(info.value, rpc.TooManyConnections)
        with _raw(srv) as raw:  # a raw connection gets the error frame too, then is closed
            reply = wire.recv_message(raw)
            assert reply["ok"] is False and "2 connections" in reply["error"]["message"]
            assert _closed_by_server(raw)
        assert first.add(1, 2) == 3 and second.add(3, 4) == 7
        first.close()
        wait_until(lambda: _connection_threads() <= 1, 10, "the closed client's thread to end")
        with rpc.Client(srv.address, timeout=10) as third:
            assert third.add(5, 6) == 11
        second.close()


def test_server_limits_are_validated():
    for kw, match in (({"max_connections": 0}, "max_connections"),
                      ({"max_connections": 2.5}, "max_connections"),
                      ({"idle_timeout_s": math.nan}, "idle_timeout_s"),
                      ({"idle_timeout_s": 0}, "idle_timeout_s"),
                      ({"frame_timeout_s": math.inf}, "frame_timeout_s"),
                      ({"frame_timeout_s": -1}, "frame_timeout_s"),
                      ({"max_frame_bytes": 0}, "max_frame_bytes")):
        with pytest.raises(ValueError, match=match):
            rpc.Server(Echo(), ["echo"], **kw)


# --- 3. decoding cannot cost much more memory than the frame ------------------------------------------

def _decode_peak(message: bytes):
    tracemalloc.start()
    try:
        try:
            result = wire.decode(message)
        except wire.WireError as exc:
            result = exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


HOSTILE_HEADERS = {
    "4 MB of empty maps": b"\xdd" + struct.pack(">I", 4_000_000) + b"\x80" * 4_000_000,
    "4 MB of empty arrays": b"\xdd" + struct.pack(">I", 4_000_000) + b"\x90" * 4_000_000,
    "nested arrays declaring 4 M items": (b"\xdd" + struct.pack(">I", 4_000_000)) * 1000 + b"\0" * 3_995_000,
    "arrays of 15 empty maps": b"\xdd" + struct.pack(">I", 250_000) + (b"\x9f" + b"\x80" * 15) * 250_000,
}


@pytest.mark.slow  # decodes megabytes of hostile input
@pytest.mark.parametrize("name", list(HOSTILE_HEADERS))
def test_hostile_msgpack_costs_a_bounded_multiple_of_its_size(name):
    message = _message_with_header(HOSTILE_HEADERS[name])
    result, peak = _decode_peak(message)
    assert peak < 50 * MB, f"{name}: decoding {len(message) / MB:.1f} MiB cost {peak / MB:.0f} MiB"
    assert isinstance(result, wire.WireError), f"{name} decoded to a {type(result).__name__}"
    assert "limit" in str(result) or "incomplete" in str(result)


def test_nested_records_do_not_copy_their_payload_per_level():
    # Registered dataclasses nest as msgpack extensions, and each level's payload is a copy of all it holds.
    inner = msgpack.packb(b"\0" * 3_000_000, use_bin_type=True)
    for _ in range(150):
        name, key = msgpack.packb("jaxflow.data.records.Sample"), msgpack.packb("tokens")
        fields = b"\x92" + name + b"\x81" + key + inner
        inner = msgpack.packb(msgpack.ExtType(3, fields))
    result, peak = _decode_peak(_message_with_header(inner))
    assert peak < 50 * MB, f"decoding {len(inner) / MB:.1f} MiB of nested records cost {peak / MB:.0f} MiB"
    assert isinstance(result, wire.WireError) and "limit" in str(result)


def test_ordinary_messages_still_decode():
    from jaxflow.data.records import FinishedGroup, Sample
    samples = [Sample(list(range(300 + i)), [-0.5] * (300 + i), [0] * (300 + i), "stop") for i in range(64)]
    value = {"id": 1, "method": "finish", "args": [[[i, i + 1] for i in range(20_000)], samples],
             "kwargs": {"names": {f"layer.{i}": [i, 4096] for i in range(2000)}, "empty": [[], {}, [[]]]}}
    assert wire.decode(wire.encode(value)) == value
    small = {"maps": [{} for _ in range(1000)], "lists": [[] for _ in range(1000)]}
    assert wire.decode(wire.encode(small)) == small
    del FinishedGroup


def test_a_hostile_request_gets_an_error_and_the_connection_goes_on():
    with _serve() as srv, _raw(srv) as raw:
        wire.write_frame(raw, _message_with_header(HOSTILE_HEADERS["4 MB of empty maps"]))
        reply = wire.recv_message(raw)
        assert reply["ok"] is False and reply["error"]["type"].endswith("WireError")
        wire.send_message(raw, {"id": 2, "method": "add", "args": [1, 2], "kwargs": {}})
        assert wire.recv_message(raw) == {"id": 2, "ok": True, "result": 3}


# --- 4. call timeouts are finite, and no server thread outlives its client ------------------------------

def _trajectory_service():
    source = PromptSource([{"prompt": [1, 2]} for _ in range(8)], shuffle=False, num_epochs=1)
    return TrajectoryService(source, batch_groups=4, group_size=2, eta=1)


def _raised_within(fn, seconds=10.0) -> BaseException | None:
    """Runs `fn` in a daemon thread; returns what it raised (None if it returned). A call still running
    after `seconds` (a safety net far above the milliseconds it takes) fails the test as hung."""
    outcome = []

    def run():
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{fn} still running after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, "5", True])
def test_consume_and_poll_version_refuse_a_bad_timeout(bad):
    service = _trajectory_service()
    params = ParameterService(keep=1)
    try:
        for call in (lambda: service.consume(0, timeout=bad), lambda: params.poll_version(0, timeout=bad),
                     lambda: params.wait_for_version(0, timeout=bad)):
            exc = _raised_within(call)
            assert isinstance(exc, (ValueError, TypeError)) and "timeout" in str(exc), repr(exc)
    finally:
        params.close()
    assert service.stats()["counts"]["consumed"] == 0


def test_the_parameter_client_refuses_a_bad_timeout_before_calling():
    class NoCalls:
        def call(self, *args):
            raise AssertionError(f"called the server with {args}")

    from jaxflow.transport.param_client import ParameterClient
    client = ParameterClient(NoCalls(), shared_memory=False)
    for kw in ({"timeout": math.nan}, {"timeout": -3}, {"poll_s": 0}, {"poll_s": math.inf}):
        exc = _raised_within(lambda kw=kw: client.wait_for_version(1, **kw))
        assert isinstance(exc, ValueError) and list(kw)[0] in str(exc), repr(exc)


def test_good_timeouts_still_work():
    service = _trajectory_service()
    with pytest.raises(TimeoutError):
        service.consume(0, timeout=0.05)
    with pytest.raises(TimeoutError):
        service.consume(0, timeout=0)
    params = ParameterService(keep=1)
    try:
        assert params.poll_version(0, timeout=0.01) is None
        assert params.poll_version(0, timeout=1) is None
    finally:
        params.close()


def test_a_nan_timeout_over_rpc_fails_fast_and_leaves_no_thread_behind():
    service = _trajectory_service()
    with rpc.Server(service, ["consume", "stats"]).start() as srv:
        with rpc.Client(srv.address, timeout=5) as cli:
            exc = _raised_within(lambda: cli.consume(0, timeout=math.nan))
            assert isinstance(exc, ValueError) and "timeout" in str(exc), repr(exc)
            assert cli.stats()["counts"]["consumed"] == 0
        wait_until(lambda: _connection_threads() == 0, 10, "every server thread to end with its client")


def test_client_settings_are_validated_before_connecting():
    with _serve() as srv:
        for kw, match in (({"timeout": math.nan}, "timeout"), ({"timeout": -1}, "timeout"),
                          ({"timeout": math.inf}, "timeout"), ({"max_idle": -1}, "max_idle"),
                          ({"max_frame_bytes": 0}, "max_frame_bytes")):
            with pytest.raises(ValueError, match=match):
                rpc.Client(srv.address, **kw)
        with pytest.raises(ValueError, match="address"):
            rpc.Client("no-port-here")
        with rpc.Client(f"127.0.0.1:{srv.address[1]}", timeout=10) as cli:
            assert cli.add(1, 1) == 2


def test_serve_in_subprocess_checks_and_applies_the_limits():
    from jaxflow.transport import process_server
    factory = "toy_service:make_toy"  # tests/transport is on sys.path, which the child inherits
    for kw, match in (({"max_connections": 0}, "max_connections"),
                      ({"idle_timeout_s": math.nan}, "idle_timeout_s"),
                      ({"start_timeout": math.nan}, "start_timeout"), ({"start_timeout": -1}, "start_timeout")):
        exc = _raised_within(lambda kw=kw: process_server.serve_in_subprocess(factory, {"scale": 1}, ["add"], **kw))
        assert isinstance(exc, ValueError) and match in str(exc), repr(exc)
    process, address = process_server.serve_in_subprocess(factory, {"scale": 2}, ["add"], max_connections=1)
    try:
        with rpc.Client(address, timeout=10) as cli:
            assert cli.add(1, 2) == 6
            with pytest.raises(rpc.TooManyConnections, match="max_connections=1"):
                rpc.Client(address, timeout=10)
    finally:
        process_server.stop_subprocess(process)


def test_a_call_racing_the_idle_close_of_its_pooled_connection_is_sent_again(monkeypatch):
    # The client checks a pooled connection before reusing it, but the server may close it for idleness
    # just after. The server's idle error frame proves the request was never read, so it is safe to resend.
    with _serve(idle_timeout_s=0.2, frame_timeout_s=5) as srv, rpc.Client(srv.address, timeout=10) as cli:
        assert cli.add(1, 1) == 2
        wait_until(lambda: _connection_threads() == 0, 10, "the server to close the pooled connection")
        # As if the server closed it just after the client's check:
        monkeypatch.setattr(rpc_client, "_looks_closed", lambda conn: False)
        assert cli.add(2, 3) == 5


def test_the_bytes_of_requests_being_read_are_capped_across_connections():
    request = wire.encode({"id": 1, "method": "echo", "args": [b"x" * (6 * MB)], "kwargs": {}})
    frame = struct.pack("!Q", len(request)) + request
    with _serve(max_pending_bytes=8 * MB) as srv, _raw(srv) as first:
        first.sendall(frame[:5 * MB])
        # Five 1 MiB growths, the sixth not yet.
        wait_until(lambda: srv.pending_bytes == 5 * MB, 10, lambda: f"5 MiB pending, not {srv.pending_bytes}")
        with _raw(srv) as second:
            try:
                second.sendall(frame)
            except OSError:
                pass  # refused while still sending
            reply = wire.recv_message(second)
            assert reply["ok"] is False and reply["error"]["type"].endswith("ServerBusy")
            assert "max_pending_bytes=8388608" in reply["error"]["message"]
        first.sendall(frame[5 * MB:])
        assert wire.recv_message(first)["result"] == b"x" * (6 * MB)
        wait_until(lambda: srv.pending_bytes == 0, 10, lambda: f"no bytes pending, not {srv.pending_bytes}")
        wire.write_frame(first, request)  # the budget is back
        assert wire.recv_message(first)["ok"] is True
    with pytest.raises(ValueError, match="max_pending_bytes"):
        rpc.Server(Echo(), ["echo"], max_pending_bytes=0)
