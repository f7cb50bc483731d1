"""Serve an object from its own Python process: `serve_in_subprocess` and `stop_subprocess`.

The child process builds the object from an importable factory, serves it with a `jaxflow.transport.rpc.Server` and
reports its address back; a `jaxflow.transport.rpc.Client` then reaches it like any other server. Server processes
stop when asked, when the parent interpreter exits, and when the parent dies.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util  # registers its exit handler before ours: see _stop_children
import os
import signal
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from jaxflow import refs
from jaxflow.data.timeouts import check_timeout
from jaxflow.refs import RefError
from jaxflow.transport import rpc, wire
from jaxflow.transport.errors import error_payload, exception_from_payload, register_remote_error
from jaxflow.transport.rpc import Server, check_bind

logger = logging.getLogger(__name__)

_children: weakref.WeakSet = weakref.WeakSet()


# A factory reference that names nothing usable fails in the child; the parent re-raises it as itself.
register_remote_error(RefError)


def _subprocess_main(factory: str, kwargs_message: bytes, methods: list[str], token: str | None,
                     host: str, limits: dict[str, Any], report) -> None:
    """The server process: builds the object, serves it, reports its address, waits for SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    try:
        obj = refs.resolve(factory, what="factory")(**wire.decode(kwargs_message))
        server = Server(obj, methods, host=host, token=token, **limits).start()
    except BaseException as exc:
        report.send_bytes(wire.encode({"ok": False, "error": error_payload(exc)}))
        report.close()
        raise SystemExit(1) from exc
    report.send_bytes(wire.encode({"ok": True, "address": list(server.address)}))
    report.close()
    try:
        # Also stop when the parent is gone, so a crashed trainer leaves no orphan servers.
        while not stop.wait(0.5) and os.getppid() == parent:
            pass
    finally:
        server.close()
        close = getattr(obj, "close", None)
        if callable(close):
            close()


def serve_in_subprocess(factory: str, kwargs: dict[str, Any], methods: Iterable[str], *,
                        token: str | None = None, host: str = "127.0.0.1", start_timeout: float = 60,
                        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                        idle_timeout_s: float = rpc.DEFAULT_IDLE_TIMEOUT_S,
                        frame_timeout_s: float = rpc.DEFAULT_FRAME_TIMEOUT_S,
                        max_connections: int = rpc.DEFAULT_MAX_CONNECTIONS,
                        max_pending_bytes: int = rpc.DEFAULT_MAX_PENDING_BYTES,
                        ) -> tuple[multiprocessing.process.BaseProcess, tuple[str, int]]:
    """Serves `factory(**kwargs)` from a new Python process ("spawn", so no state is inherited).

    factory: "package.module:callable", importable in the child (one that names nothing usable raises
    `jaxflow.refs.RefError`). kwargs: wire-encodable, passed encoded.
    Returns (process, (host, port)) once the server listens. If the factory or the server fails, raises
    that error (mapped like a remote call's) with the child's traceback in `remote_traceback`; if the child
    reports nothing within `start_timeout` seconds, TimeoutError. max_frame_bytes, idle_timeout_s,
    frame_timeout_s, max_connections and max_pending_bytes are the server's limits (see `jaxflow.transport.rpc.Server`);
    they and start_timeout are checked before the process starts. Stop it with `stop_subprocess`, which
    closes the server and then calls the object's `close()` if it has one. Processes still running at
    interpreter exit are stopped, and a server whose parent died stops by itself.

    As with any "spawn" multiprocessing, a script calling this must guard its main code with
    `if __name__ == "__main__":`.
    """
    if isinstance(methods, str):
        raise TypeError("methods must be an iterable of method names, not a string")
    check_bind(host, token)
    limits = {"max_frame_bytes": max_frame_bytes, "idle_timeout_s": idle_timeout_s,
              "frame_timeout_s": frame_timeout_s, "max_connections": max_connections,
              "max_pending_bytes": max_pending_bytes}
    rpc.check_limits(**limits)
    if check_timeout(start_timeout, "start_timeout") is None:
        raise ValueError("start_timeout must be a finite number of seconds >= 0, got None")
    kwargs_message = wire.encode(dict(kwargs))
    ctx = multiprocessing.get_context("spawn")
    # duplex=False is a pipe, not a socket; the child's report is read as raw bytes and decoded by wire.
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_subprocess_main, name=f"jaxflow-rpc:{factory}",
        args=(factory, kwargs_message, list(methods), token, host, limits, writer))
    process.start()
    writer.close()  # the child holds the only write end now, so its death reads as EOF
    try:
        if not reader.poll(start_timeout):
            stop_subprocess(process)
            raise TimeoutError(f"the server for {factory} did not start within {start_timeout} s")
        try:
            report = wire.decode(reader.recv_bytes(1 << 20))
        except EOFError:
            process.join(5)
            raise RuntimeError(f"the server process for {factory} exited with code {process.exitcode} "
                               f"before reporting its address") from None
    finally:
        reader.close()
    if not isinstance(report, dict) or not report.get("ok"):
        process.join(5)
        stop_subprocess(process)
        exc = exception_from_payload(report.get("error"))
        exc.add_note(f"raised while starting the server process for {factory}")
        raise exc
    _children.add(process)
    host_port = report["address"]
    return process, (host_port[0], int(host_port[1]))


def stop_subprocess(process: multiprocessing.process.BaseProcess, timeout: float = 10) -> int | None:
    """Stops a process from `serve_in_subprocess` (SIGTERM, then SIGKILL after `timeout` s); returns its
    exit code."""
    if process.is_alive():
        process.terminate()
        process.join(timeout)
        if process.is_alive():
            logger.warning("rpc: server process %s ignored SIGTERM; killing it", process.name)
            process.kill()
            process.join(timeout)
    else:
        process.join(0)
    _children.discard(process)
    return process.exitcode


@atexit.register
def _stop_children() -> None:
    # atexit runs handlers last-registered first, and multiprocessing.util (imported above) registered its
    # own already; so this runs before that one, which would otherwise wait forever for the server
    # processes (not daemons: a daemon process may not start processes of its own).
    for process in list(_children):
        stop_subprocess(process)
