"""What runs a reward function: resolving its reference, checking its result, and the worker process.

A reward function is named by reference, "module:function" (e.g. "jaxflow.tasks:reward"), and called as
`fn(response: str, meta: dict) -> float`; its result counts if it is a finite real number. `worker_main` is
the loop of one `RewardPool` worker process (a spawn target: it must stay importable by this module path).
"""

from __future__ import annotations

import math
import multiprocessing.connection
import numbers
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from jaxflow import refs
from jaxflow.rewards.reaper import MARKER_ENV

__all__ = ["check_result", "error_text", "resolve", "score_inline", "worker_main"]

# The longest error text a worker sends or the pool logs for one failure.
MAX_ERROR_CHARS = 500

# How messages name a reward function's reference.
WHAT = "reward function reference"


def resolve(fn_ref: str) -> Callable[[str, dict], Any]:
    """The function a "module:function" reference names (the function may be a dotted attribute path).

    Raises:
      jaxflow.refs.RefError (a ValueError): `fn_ref` is not of that form, its module does not import (the
        message says what it raised or that it exited), or it names no function taking (response, meta):
        a builtin such as `builtins:eval`, a class or a function of another signature is refused.
      jaxflow.refs.ImportHung (a RefError): the module did not finish importing within the time limit.
    """
    return refs.resolve(fn_ref, what=WHAT, expect="function", arity=2)


def check_result(value: Any) -> float | None:
    """`value` as a float if it is a finite real number (bool, int, float, numpy scalar), else None."""
    if not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return value if math.isfinite(value) else None


def score_inline(fn_ref: str, response: str, meta: dict) -> float:
    """Calls the reward function in this process, for tests and debugging: its exception propagates, and
    ValueError is raised if `fn_ref` names no function or the result is not a finite real number."""
    value = resolve(fn_ref)(response, meta)
    checked = check_result(value)
    if checked is None:
        raise ValueError(f"reward function {fn_ref} returned {value!r:.100}, not a finite real number")
    return checked


def error_text(e: BaseException) -> str:
    """The exception as "TypeName: message", cut to a length a log line or a pipe message can carry."""
    return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def worker_main(conn: multiprocessing.connection.Connection, preload: Sequence[str],
                memory_limit_mb: int | None, marker: str = "") -> None:
    """A reward worker: reports ready, then runs [job id, fn_ref, responses, meta, index of the first] jobs
    until told to stop. Each call's answer is sent as it ends, [job id, index, status, payload]: ("ok",
    float), ("invalid", repr of the result) or ("raised", error text); a call that had to import its
    function first sends [job id, "loaded", None] once the import is done. An empty message, or the parent
    closing its end of the pipe, stops the worker.
    """
    # Ctrl-C goes to the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A group of its own, so that killing a hung call also kills any processes the reward function started.
    os.setpgid(0, 0)
    if marker:  # inherited by what reward functions execute: the pool finds them by it, setsid or not
        os.environ[MARKER_ENV] = marker
    if memory_limit_mb is not None:
        import resource
        limit = memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    functions: dict[str, Callable] = {}
    try:
        for fn_ref in preload:
            functions[fn_ref] = resolve(fn_ref)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops the pool with it
        conn.send_bytes(msgpack.packb(["start_failed", f"preloading {fn_ref}: {error_text(e)}"]))
        return
    conn.send_bytes(msgpack.packb(["ready", os.getpid()]))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        job_id, fn_ref, responses, meta, first = msgpack.unpackb(message, raw=False, strict_map_key=False)
        for index, response in enumerate(responses, first):
            try:
                fn = functions.get(fn_ref)
                if fn is None:
                    fn = functions[fn_ref] = resolve(fn_ref)
                    # The import is done: from here on the parent holds the call to timeout_s.
                    conn.send_bytes(msgpack.packb([job_id, "loaded", None]))
                value = fn(response, meta)
                checked = check_result(value)
                answer = ["ok", checked] if checked is not None else ["invalid", repr(value)[:200]]
            # BaseException: a reward function calling sys.exit() or raising KeyboardInterrupt failed one
            # sample; the worker itself is fine.
            except BaseException as e:  # noqa: BLE001
                answer = ["raised", error_text(e)]
            try:
                conn.send_bytes(msgpack.packb([job_id, index, *answer]))
            except (EOFError, OSError):
                return
