"""How exceptions cross the RPC wire: raised in the served object, re-raised by the `jaxflow.transport.rpc.Client`.

`error_payload` turns an exception into the map an error response carries ({"type", "message", "args",
"mro", "attrs", "traceback"}); `exception_from_payload` rebuilds it on the client. Common builtin types and
those passed to `register_remote_error` come back as themselves; an unknown type becomes its nearest known
base class, or `RemoteError`.
"""

from __future__ import annotations

import traceback
from typing import Any

from jaxflow.data.param_service import UnknownVersionError
from jaxflow.data.service_errors import ConsumeSuperseded, SampleRefused
from jaxflow.transport import wire

_TRACEBACK_CHARS = 8000

# Builtin exceptions re-raised on the client as themselves. ConnectionError is left out on purpose: on the
# client it means the transport failed, and a remote one must not be mistaken for that.
_BUILTIN_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (ValueError, KeyError, TypeError, TimeoutError, RuntimeError, IndexError, FileNotFoundError,
                PermissionError, LookupError, AttributeError, NotImplementedError, AssertionError)
}
_REGISTERED_ERRORS: dict[str, type[BaseException]] = {}


class RemoteError(RuntimeError):
    """An exception raised by the served object whose type the client does not know.

    remote_type: the remote exception's type ("module.QualName"). remote_message: its message.
    remote_traceback: the server-side traceback, as text.
    """

    def __init__(self, remote_type: str, message: str):
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message


class TooManyConnections(ConnectionError):
    """A server refused a connection because it already holds as many as its `max_connections` allows.
    Nothing was called; trying again after other connections close may succeed."""


class ServerBusy(ConnectionError):
    """A server refused a request because the requests it is already reading hold as many bytes as its
    `max_pending_bytes` allows. The request was not run, and the server closed the connection."""


def _type_name(cls: type) -> str:
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def register_remote_error(cls: type[BaseException]) -> type[BaseException]:
    """Lets the client re-raise exceptions of type `cls` as `cls` (usable as a decorator).

    The exception is rebuilt without calling `__init__`: its `args` and wire-encodable attributes are
    copied from the remote one, so `str()` and attributes match. Both ends must import the class.
    """
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        raise TypeError(f"register_remote_error: {cls!r} is not an exception class")
    _REGISTERED_ERRORS[_type_name(cls)] = cls
    return cls


register_remote_error(wire.WireError)
register_remote_error(wire.FrameTooLarge)
register_remote_error(wire.FrameTimeout)
register_remote_error(TooManyConnections)
register_remote_error(ServerBusy)
# The services never import the transport: it registers their errors.
register_remote_error(UnknownVersionError)
register_remote_error(SampleRefused)
register_remote_error(ConsumeSuperseded)


def _is_encodable(value: Any) -> bool:
    try:
        wire.encode_parts(value)
    except wire.WireError:
        return False
    return True


def error_payload(exc: BaseException) -> dict[str, Any]:
    """An exception as the wire carries it."""
    cls = type(exc)
    args = list(exc.args)
    if isinstance(exc, KeyError) and len(args) == 1 and isinstance(args[0], str):
        message = args[0]  # str(KeyError) quotes its argument; the message is the text itself
    else:
        message = str(exc)
    if not _is_encodable(args):
        args = [message]
    attrs = {k: v for k, v in vars(exc).items() if not k.startswith("__") and _is_encodable(v)}
    if isinstance(exc, OSError):
        attrs.update({k: getattr(exc, k) for k in ("filename", "filename2")
                      if getattr(exc, k) is not None and _is_encodable(getattr(exc, k))})
    return {
        "type": _type_name(cls),
        "message": message,
        "args": args,
        "mro": [_type_name(c) for c in cls.__mro__ if issubclass(c, BaseException)],
        "attrs": attrs,
        "traceback": "".join(traceback.format_exception(exc))[-_TRACEBACK_CHARS:],
    }


def _known_error(name: Any) -> type[BaseException] | None:
    if not isinstance(name, str):
        return None
    return _BUILTIN_ERRORS.get(name) or _REGISTERED_ERRORS.get(name)


def exception_from_payload(error: Any) -> BaseException:
    """Rebuilds the exception described by an error payload, by the rules in the `jaxflow.transport.rpc.Client`
    docstring."""
    if not isinstance(error, dict):
        return RemoteError("unknown", f"malformed error payload {error!r}")
    remote_type = str(error.get("type", "unknown"))
    message = str(error.get("message", ""))
    args = error.get("args") if isinstance(error.get("args"), list) else [message]
    attrs = error.get("attrs") if isinstance(error.get("attrs"), dict) else {}
    cls = _known_error(remote_type)
    exc: BaseException
    if cls is not None and cls.__module__ == "builtins":
        try:
            exc = cls(*args)
        except Exception:
            exc = cls(message)
    elif cls is not None:
        # Not cls(*args): a subclass's __init__ often takes other parameters than the args it passes up.
        try:
            exc = cls.__new__(cls, *args)
        except Exception:
            exc = cls.__new__(cls)
        exc.args = tuple(args)
    else:
        # An unknown subclass of a known type (a service's ValueError subclass): raise the nearest known
        # base so `except ValueError` works as it does against the embedded object.
        mro = error.get("mro") if isinstance(error.get("mro"), list) else []
        base = next((b for b in map(_known_error, mro[1:]) if b is not None), None)
        exc = base(f"{remote_type}: {message}") if base is not None else RemoteError(remote_type, message)
        attrs = {}
    for key, value in attrs.items():
        try:
            setattr(exc, str(key), value)
        except (AttributeError, TypeError):
            pass
    exc.remote_type = remote_type
    exc.remote_traceback = str(error.get("traceback", ""))
    return exc
