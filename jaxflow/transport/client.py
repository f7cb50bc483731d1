"""The client side of `jaxflow.transport.rpc`: `Client` stands in for an object that a
`jaxflow.transport.rpc.Server` serves, over a pool of connections.

It lives apart from the server only to keep each module short; import it from either module.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
from typing import Any

from jaxflow.data.timeouts import check_timeout
from jaxflow.transport import wire
from jaxflow.transport.errors import exception_from_payload

__all__ = ["Client"]


def _set_nodelay(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # Request/response traffic of small frames: Nagle plus delayed ACKs would add ~40 ms per call.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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
