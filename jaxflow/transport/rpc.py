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
import itertools
import logging
import math
import select
import socket
import threading
from collections.abc import Iterable
from typing import Any

from jaxflow.data.timeouts import check_timeout
from jaxflow.transport import wire
from jaxflow.transport.errors import (
    RemoteError,
    TooManyConnections,
    error_payload,
    exception_from_payload,
    register_remote_error,
)

__all__ = ["Client", "RemoteError", "Server", "TooManyConnections", "check_bind", "check_limits",
           "is_loopback", "register_remote_error"]

logger = logging.getLogger(__name__)

# The handshake is tiny; before a connection has authenticated it may not make the server buffer more.
_HANDSHAKE_MAX_BYTES = 1 << 16

# Server limits. A client's pooled connection that the server closed while idle is noticed and replaced
# by the client before its next call, so the idle timeout costs a reconnect, never a call.
DEFAULT_IDLE_TIMEOUT_S = 300.0
DEFAULT_FRAME_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 512
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
    numbers of seconds > 0, `max_connections` and `max_frame_bytes` ints >= 1."""
    for name, value in limits.items():
        if name.endswith("_timeout_s"):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        elif name in ("max_connections", "max_frame_bytes"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        else:
            raise TypeError(f"unknown server limit {name!r}")


def _set_nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Request/response traffic of small frames: Nagle plus delayed ACKs would add ~40 ms per call.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _error_response(req_id: Any, exc: BaseException) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "error": error_payload(exc)}


class Server:
    """Serves the methods named in `methods` of `obj` to `Client`s, one thread per connection.

    host/port: where to listen (port 0 picks a free one; see `address`). token: a shared secret every
    connection must present first; required for any non-loopback host. max_frame_bytes: the largest
    request accepted; a larger one gets an error and its connection is closed (a request's buffer grows
    only as its bytes arrive).

    Limits against slow, silent and greedy clients, each logged when it closes a connection:
    idle_timeout_s: a connection that starts no request for this long after its last reply is closed
    (a client reconnects by itself). frame_timeout_s: a request must arrive whole within this many
    seconds of its first byte, and a connection with a token must send its handshake within this long
    (at most 10 s) of connecting; else it is closed. max_connections: connections beyond this many are refused with an
    error frame naming the cap (the client raises TooManyConnections). A call running in the served
    object is not limited by these: a blocking call's duration is its own `timeout` argument's business.
    """

    def __init__(self, obj: Any, methods: Iterable[str], *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        if isinstance(methods, str):
            raise TypeError("methods must be an iterable of method names, not a string")
        check_bind(host, token)
        check_limits(max_frame_bytes=max_frame_bytes, idle_timeout_s=idle_timeout_s,
                     frame_timeout_s=frame_timeout_s, max_connections=max_connections)
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
        try:
            while True:
                limit = self._max_frame_bytes if authenticated else min(_HANDSHAKE_MAX_BYTES,
                                                                        self._max_frame_bytes)
                idle = self._idle_timeout_s if authenticated else min(
                    self._idle_timeout_s, self._frame_timeout_s, _HANDSHAKE_TIMEOUT_S)
                try:
                    frame = wire.read_frame(conn, limit, idle_timeout=idle, frame_timeout=self._frame_timeout_s)
                except (wire.FrameTooLarge, wire.FrameTimeout) as exc:
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


class Client:
    """Calls a `Server`'s methods; stands in for the served object.

    `client.name(*args, **kwargs)` calls `name` remotely for every served method (learned at connection);
    the client's own attributes (`call`, `close`, `methods`, `address`) take precedence, so reach a served
    method with one of those names through `call`. Remote exceptions are re-raised as the same type with
    the same message when it is a common builtin (ValueError, KeyError, TypeError, TimeoutError, ...) or
    registered with `register_remote_error`; an unknown type becomes its nearest known base class, or
    `RemoteError`. Each raised exception carries `remote_type` and `remote_traceback`.

    Thread-safe through a pool of connections: a call takes an idle connection or opens a new one, so a
    call blocked in the server (a trainer's `consume`) never delays another thread's call. At most
    `max_idle` idle connections are kept. timeout: seconds for connecting and for each call (None: no
    limit), so it must exceed the longest blocking call made through this client.

    Calls are not retried: after a ConnectionError or a timeout the remote call may or may not have run.
    The one exception is a pooled connection the server closed for idleness just as a call took it: the
    server's notice proves the request was never read, and the call is sent again on a new connection.
    """

    def __init__(self, address: tuple[str, int] | list | str, *, token: str | None = None,
                 timeout: float | None = None, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 max_idle: int = 4):
        self._address = _parse_address(address)
        if timeout is not None and (check_timeout(timeout, "timeout") is None or timeout <= 0):
            raise ValueError(f"timeout must be a finite number of seconds > 0 or None, got {timeout!r}")
        for name, value, low in (("max_frame_bytes", max_frame_bytes, 1), ("max_idle", max_idle, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self._token = token
        self._timeout = timeout
        self._max_frame_bytes = max_frame_bytes
        self._max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._methods: frozenset[str] = frozenset()
        self._release(self._connect())

    @property
    def address(self) -> tuple[str, int]:
        """The server's (host, port)."""
        return self._address

    @property
    def methods(self) -> frozenset[str]:
        """The methods the server serves."""
        return self._methods

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls `method(*args, **kwargs)` on the served object and returns its result."""
        req_id = next(self._ids)
        parts = wire.encode_parts({"id": req_id, "method": method, "args": list(args), "kwargs": kwargs})
        while True:
            conn, reused = self._acquire()
            response = self._exchange(conn, parts, req_id)
            if reused and _closed_while_idle(response):
                # The server closed this pooled connection for idleness before reading the request (its
                # error frame says so), so the request never ran: send it on a fresh connection.
                continue
            break
        if response.get("ok"):
            return response.get("result")
        raise exception_from_payload(response.get("error"))

    def _exchange(self, conn: socket.socket, parts: list, req_id: int) -> dict[str, Any]:
        """Sends one request on `conn` and returns the response; keeps `conn` for reuse or closes it."""
        try:
            try:
                wire.write_frame(conn, parts)
            except OSError:
                # The server may have refused the request (an oversized frame) and closed the connection
                # while we were still sending: its error explains more than a broken pipe.
                response = self._pending_response(conn)
                if response is None:
                    raise
            else:
                response = wire.recv_message(conn, self._max_frame_bytes)
        except BaseException:
            conn.close()
            raise
        if not isinstance(response, dict) or response.get("id") not in (req_id, None):
            conn.close()
            raise ConnectionError(f"rpc: unexpected response to request {req_id} from {self._address}")
        if response.get("id") is None:
            conn.close()  # an error about the connection itself: the server has closed it
        else:
            self._release(conn)
        return response

    def close(self) -> None:
        """Closes idle connections; connections in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not ordinary attributes.
        if name.startswith("_") or name not in self.__dict__.get("_methods", ()):
            raise AttributeError(f"{name!r} is not served by {self.__dict__.get('_address')}; served: "
                                 f"{', '.join(sorted(self.__dict__.get('_methods', ())))}")
        def method(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"Calls {name} on the server at {self._address}."
        self.__dict__[name] = method
        return method

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | self._methods)

    def __repr__(self) -> str:
        return f"Client({self._address!r}, methods={sorted(self._methods)})"

    def _connect(self) -> socket.socket:
        conn = socket.create_connection(self._address, timeout=self._timeout)
        try:
            conn.settimeout(self._timeout)
            _set_nodelay(conn)
            wire.send_message(conn, {"token": self._token})
            reply = wire.recv_message(conn, self._max_frame_bytes)
            if not (isinstance(reply, dict) and reply.get("ok") and isinstance(reply.get("methods"), list)):
                if isinstance(reply, dict) and "error" in reply:
                    raise exception_from_payload(reply["error"])
                raise ConnectionError(f"rpc: unexpected handshake reply from {self._address}")
        except BaseException:
            conn.close()
            raise
        self._methods = frozenset(reply["methods"])
        return conn

    def _acquire(self) -> tuple[socket.socket, bool]:
        """(a connection, whether it was reused from the pool)."""
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the client is closed")
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if not _looks_closed(conn):
                return conn, True
            conn.close()

    def _release(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _pending_response(self, conn: socket.socket) -> Any | None:
        try:
            conn.settimeout(1.0)
            return wire.recv_message(conn, self._max_frame_bytes)
        except (OSError, wire.WireError):
            return None


def _parse_address(address: Any) -> tuple[str, int]:
    """(host, port) from a (host, port) pair or a "host:port" string; ValueError naming the address."""
    try:
        if isinstance(address, str):
            host, sep, port = address.rpartition(":")
            if not sep or not host:
                raise ValueError("no host:port")
            address = (host.strip("[]"), port)
        host, port = address
        port = int(port)
        if not isinstance(host, str) or not host or not 0 < port < 65536:
            raise ValueError("host must be a non-empty str and port in 1..65535")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid server address {address!r}: expected (host, port) or 'host:port' "
                         f"({exc})") from None
    return host, port


def _closed_while_idle(response: dict[str, Any]) -> bool:
    """Whether `response` is a server's notice that it closed the connection for idleness, sent only when
    no byte of a next request had arrived."""
    error = response.get("error")
    return (response.get("id") is None and not response.get("ok") and isinstance(error, dict)
            and str(error.get("type", "")).endswith("FrameTimeout")
            and isinstance(error.get("attrs"), dict) and error["attrs"].get("received", 0) is None)


def _looks_closed(conn: socket.socket) -> bool:
    """Whether an idle connection was closed by the server (readable while idle means EOF or junk)."""
    try:
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
