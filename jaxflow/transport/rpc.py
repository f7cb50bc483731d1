"""Serve an object's allow-listed methods over a socket, and call them through a stand-in client.

The trajectory and parameter services run either embedded (the object itself) or in a server process
with a `Client` in its place. The client has the same methods and raises the same exceptions as the
object, so callers and tests do not care which placement they got:

    >>> class Counter:
    ...     def __init__(self):
    ...         self.total = 0
    ...     def add(self, k):
    ...         self.total += k
    ...         return self.total
    >>> with Server(Counter(), ["add"]) as server, Client(server.address) as client:
    ...     client.add(3), client.add(4)       # runs counter.add(...) in the server
    (3, 7)

A trajectory service is served the same way, with the methods its callers need
(`Server(service, ["dispatch", "finish", "reward", "consume"])`), and
`client.dispatch("worker-0", version=3)` runs `service.dispatch("worker-0", version=3)`.

Messages use `jaxflow.transport.wire` (msgpack plus raw tensor bytes); nothing received is unpickled. Arguments and
results must be wire-encodable; tuples arrive as lists.

How exceptions cross the wire is in `jaxflow.transport.errors` (its `RemoteError` and `register_remote_error` are
re-exported here); serving an object from a process of its own is in `jaxflow.transport.process_server`.

Protocol, one frame per message:

- A connection may open with a handshake {"token": str | None}; the server answers
  {"ok": True, "methods": [...]}. When the server has a token the handshake is required and a wrong or
  missing token gets an error frame and the connection closed.
- Request {"id", "method", "args", "kwargs"} -> {"id", "ok": True, "result"} or
  {"id", "ok": False, "error": {"type", "message", "args", "mro", "attrs", "traceback"}}.
  Errors that concern the connection rather than a request (bad token, oversized frame, undecodable
  frame) carry "id": None.

Limits (see `Server`): a frame's buffer grows only as its bytes arrive, up to max_frame_bytes; a
connection idle between requests for idle_timeout_s, or slower than frame_timeout_s to send a request
or take a reply, is closed (the error frame says which); connections beyond max_connections are refused
with an error frame naming the cap; decoding a frame may build at most a fixed multiple of its header
size in objects (`jaxflow.transport.wire`).

The server runs one thread per connection, so a call that blocks (a trainer's `consume(timeout=30)`) holds
up only its own connection; the served object is therefore called from several threads at once and must
be thread-safe, as it must be when embedded in a multi-threaded process.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import socket
import threading
from collections.abc import Iterable
from typing import Any

from jaxflow.transport import wire
from jaxflow.transport.client import Client, _set_nodelay
from jaxflow.transport.errors import (
    RemoteError,
    ServerBusy,
    TooManyConnections,
    error_payload,
    register_remote_error,
)

__all__ = ["Client", "RemoteError", "Server", "ServerBusy", "TooManyConnections", "check_bind",
           "check_limits", "is_loopback", "register_remote_error"]

logger = logging.getLogger(__name__)

# The handshake is tiny; before a connection has authenticated it may not make the server buffer more.
_HANDSHAKE_MAX_BYTES = 1 << 16

# Server limits. A client's pooled connection that the server closed while idle is noticed and replaced
# by the client before its next call, so the idle timeout costs a reconnect, never a call.
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_FRAME_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_PENDING_BYTES = 4 * wire.DEFAULT_MAX_FRAME_BYTES
# A connection that must authenticate sends its handshake at once; one that does not within this long
# (or the idle / frame timeout, if shorter) is closed, so unauthenticated peers cannot sit on the cap.
_HANDSHAKE_TIMEOUT_S = 10.0


def is_loopback(host: str) -> bool:
    """Whether `host` names a loopback address: "localhost", 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Raises ValueError for a malformed token, or for a non-loopback `host` without a token."""
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty string or None")
    if token is None and not is_loopback(host):
        raise ValueError(f"refusing to serve on non-loopback address {host!r} without a token: "
                         f"pass token=... (clients then need the same token)")


def check_limits(**limits: Any) -> None:
    """Raises ValueError naming the first bad one of a Server's limits: the `*_timeout_s` must be finite
    numbers of seconds > 0; `max_connections`, `max_frame_bytes` and `max_pending_bytes` ints >= 1."""
    for name, value in limits.items():
        if name.endswith("_timeout_s"):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        elif name in ("max_connections", "max_frame_bytes", "max_pending_bytes"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        else:
            raise TypeError(f"unknown server limit {name!r}")


def _error_response(req_id: Any, exc: BaseException) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": error_payload(exc)}


class Server:
    """Serves the methods named in `methods` of `obj` to `Client`s, one thread per connection.

    The limits (the last five arguments) guard against slow, silent and greedy clients; each is logged when
    it closes a connection. A call running in the served object is not limited by them: a blocking call's
    duration is its own `timeout` argument's business.

    Args:
      obj: the object served.
      methods: the names of its methods clients may call (public names only).
      host: the address to listen on.
      port: the TCP port to listen on (0 picks a free one; see `address`).
      token: a shared secret every connection must present first; required for any non-loopback host.
      max_frame_bytes: the largest request accepted, in bytes; a larger one gets an error and its connection
        is closed (a request's buffer grows only as its bytes arrive).
      idle_timeout_s: seconds after its last reply within which a connection must start a request, else it
        is closed (a client reconnects by itself).
      frame_timeout_s: seconds within which a request must arrive whole from its first byte, and a reply be
        taken; a connection with a token must send its handshake within this long (at most 10 s) of
        connecting; else it is closed.
      max_connections: connections beyond this many are refused with an error frame naming the cap (the
        client raises TooManyConnections).
      max_pending_bytes: the bytes that all requests being read or handled may hold together; a request
        that would take more is refused with an error frame naming the cap and its connection closed (the
        client raises ServerBusy).
    """

    def __init__(self, obj: Any, methods: Iterable[str], *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES):
        if isinstance(methods, str):
            raise TypeError("methods must be an iterable of method names, not a string")
        check_bind(host, token)
        check_limits(max_frame_bytes=max_frame_bytes, idle_timeout_s=idle_timeout_s,
                     frame_timeout_s=frame_timeout_s, max_connections=max_connections,
                     max_pending_bytes=max_pending_bytes)
        self._methods: dict[str, Any] = {}
        for name in methods:
            if not isinstance(name, str) or not name or name.startswith("_"):
                raise ValueError(f"cannot serve method {name!r}: names must be public (no leading _)")
            fn = getattr(obj, name, None)
            if not callable(fn):
                raise ValueError(f"{type(obj).__name__} has no method {name!r} to serve")
            self._methods[name] = fn
        self._obj = obj
        self._host = host
        self._port = port
        self._token = token.encode() if token is not None else None
        self._max_frame_bytes = max_frame_bytes
        self._idle_timeout_s = float(idle_timeout_s)
        self._frame_timeout_s = float(frame_timeout_s)
        self._max_connections = max_connections
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closing = False

    @property
    def methods(self) -> tuple[str, ...]:
        """The served method names."""
        return tuple(sorted(self._methods))

    @property
    def pending_bytes(self) -> int:
        """Bytes held now by the requests being read or handled, across connections."""
        return self._pending_bytes

    def _budget(self) -> tuple[Any, Any]:
        """(reserve, release) for one connection's share of max_pending_bytes."""
        held = 0

        def reserve(nbytes: int) -> None:
            nonlocal held
            with self._lock:
                if self._pending_bytes + nbytes > self._max_pending_bytes:
                    raise ServerBusy(
                        f"the server is already holding {self._pending_bytes} bytes of requests; this one "
                        f"would pass its cap (max_pending_bytes={self._max_pending_bytes}); try again later")
                self._pending_bytes += nbytes
                held += nbytes

        def release() -> None:
            nonlocal held
            with self._lock:
                self._pending_bytes -= held
                held = 0

        return reserve, release

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on; valid after `start`."""
        if self._listener is None:
            raise RuntimeError("the server is not started")
        return tuple(self._listener.getsockname()[:2])

    def start(self) -> Server:
        """Binds, listens and starts accepting connections in a background thread. Returns self."""
        if self._listener is not None:
            raise RuntimeError("the server is already started")
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        self._listener = socket.create_server((self._host, self._port), family=family, backlog=128)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"rpc-accept-{self.address[1]}", daemon=True)
        self._accept_thread.start()
        logger.debug("rpc: serving %s on %s", type(self._obj).__name__, self.address)
        return self

    def close(self) -> None:
        """Stops accepting and closes every connection. Calls already running in the object finish in
        their (daemon) threads; their results are dropped."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            connections = list(self._connections)
        if self._listener is not None:
            # shutdown, not just close: close alone does not wake a thread blocked in accept().
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def __enter__(self) -> Server:
        return self if self._listener is not None else self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._closing:
                    return
                logger.warning("rpc: accept failed: %s", exc)
                threading.Event().wait(0.1)  # e.g. out of file descriptors: do not spin
                continue
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                full = len(self._connections) >= self._max_connections
                if not full:
                    self._connections.add(conn)
            if full:
                self._refuse_over_cap(conn, peer)
                continue
            _set_nodelay(conn)
            threading.Thread(target=self._serve_connection, args=(conn, peer),
                             name=f"rpc-conn-{peer}", daemon=True).start()

    def _refuse_over_cap(self, conn: socket.socket, peer: Any) -> None:
        """Tells a connection over the cap why, without blocking the accept loop on it, and closes it."""
        logger.warning("rpc: refusing connection from %s: already %d connections (max_connections=%d)",
                       peer, self._max_connections, self._max_connections)
        try:
            conn.settimeout(0.5)
            wire.send_message(conn, _error_response(None, TooManyConnections(
                f"the server at {self.address[0]}:{self.address[1]} already has {self._max_connections} "
                f"connections, its cap (max_connections={self._max_connections}); try again later")))
            # FIN after the error, and take what the client already sent, so that closing does not reset
            # the connection before the client has read why.
            conn.shutdown(socket.SHUT_WR)
            conn.setblocking(False)
            conn.recv(_HANDSHAKE_MAX_BYTES)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        authenticated = self._token is None
        first = True
        reserve, release = self._budget()
        try:
            while True:
                frame = message = None  # the previous request and its reply are done with
                release()
                limit = self._max_frame_bytes if authenticated else min(_HANDSHAKE_MAX_BYTES,
                                                                        self._max_frame_bytes)
                idle = self._idle_timeout_s if authenticated else min(
                    self._idle_timeout_s, self._frame_timeout_s, _HANDSHAKE_TIMEOUT_S)
                try:
                    frame = wire.read_frame(conn, limit, idle_timeout=idle,
                                            frame_timeout=self._frame_timeout_s, reserve=reserve)
                except (wire.FrameTooLarge, wire.FrameTimeout, ServerBusy) as exc:
                    release()
                    idle = isinstance(exc, wire.FrameTimeout) and exc.received is None
                    logger.log(logging.INFO if idle else logging.WARNING,
                               "rpc: closing connection from %s: %s", peer, exc)
                    conn.settimeout(min(self._frame_timeout_s, 5.0))
                    wire.send_message(conn, _error_response(None, exc))
                    return
                # A reply, like a request, must get through within the frame timeout: a client that
                # stops reading cannot hold the thread either.
                conn.settimeout(self._frame_timeout_s)
                try:
                    message = wire.decode(frame)
                except wire.WireError as exc:
                    if not authenticated:
                        self._refuse(conn, peer, "the first frame is not a valid handshake")
                        return
                    wire.send_message(conn, _error_response(None, exc))
                    continue
                if first and isinstance(message, dict) and "token" in message and "method" not in message:
                    first = False
                    if not self._token_matches(message["token"]):
                        self._refuse(conn, peer, "wrong token")
                        return
                    authenticated = True
                    wire.send_message(conn, {"ok": True, "methods": list(self.methods)})
                    continue
                first = False
                if not authenticated:
                    self._refuse(conn, peer, "missing token: the first frame must be {'token': ...}")
                    return
                self._send_response(conn, *self._handle(message))
        except wire.ConnectionClosed:
            pass
        except TimeoutError:  # FrameTimeout is handled above: this is a reply the client did not take
            logger.warning("rpc: closing connection from %s: a reply was not taken within the frame timeout "
                           "of %s s", peer, self._frame_timeout_s)
        except OSError as exc:  # ConnectionError, TimeoutError, a socket shut down by close()
            if not self._closing:
                logger.warning("rpc: connection from %s failed: %s", peer, exc)
        finally:
            release()
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _token_matches(self, token: Any) -> bool:
        if self._token is None:
            return True
        return isinstance(token, str) and hmac.compare_digest(token.encode(), self._token)

    def _refuse(self, conn: socket.socket, peer: Any, reason: str) -> None:
        logger.warning("rpc: refusing connection from %s: %s", peer, reason)
        wire.send_message(conn, _error_response(None, PermissionError(f"authentication failed: {reason}")))

    def _handle(self, message: Any) -> tuple[dict[str, Any], Any]:
        """Runs one request; returns (response, method name). Every failure becomes an error response."""
        if not isinstance(message, dict):
            return _error_response(None, wire.WireError(
                f"malformed request: expected a map with id, method, args, kwargs; "
                f"got {type(message).__name__}")), None
        req_id = message.get("id")
        method, args, kwargs = message.get("method"), message.get("args", []), message.get("kwargs", {})
        if not (isinstance(method, str) and isinstance(args, list) and isinstance(kwargs, dict)
                and all(isinstance(k, str) for k in kwargs)):
            return _error_response(req_id, wire.WireError(
                "malformed request: method must be a str, args a list and kwargs a map with str keys")
            ), method
        fn = self._methods.get(method)
        if fn is None:
            return _error_response(req_id, AttributeError(
                f"method {method!r} is not served by this {type(self._obj).__name__} server; "
                f"allowed: {', '.join(self.methods)}")), method
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # the object's errors belong to the caller
            logger.debug("rpc: %s raised %s: %s", method, type(exc).__name__, exc)
            return _error_response(req_id, exc), method
        return {"id": req_id, "ok": True, "result": result}, method

    @staticmethod
    def _send_response(conn: socket.socket, response: dict[str, Any], method: Any) -> None:
        try:
            parts = wire.encode_parts(response)
        except wire.WireError as exc:
            parts = wire.encode_parts(_error_response(response.get("id"), wire.WireError(
                f"the result of {method} is not wire-encodable: {exc}")))
        wire.write_frame(conn, parts)
