"""The object the RPC tests serve: a toy with a method for each kind of call and failure, and the factories
`serve_in_subprocess` imports by reference ("toy_service:make_toy") in its child process."""

import threading
import time

from jaxflow.data.records import Sample
from jaxflow.transport import rpc

METHODS = ["add", "echo", "fail", "fail_custom", "open_missing", "slow", "hold", "samples", "unencodable"]

ERRORS = {cls.__name__: cls for cls in (ValueError, KeyError, TypeError, TimeoutError, RuntimeError,
                                         IndexError, FileNotFoundError, PermissionError, LookupError)}


class ToyError(ValueError):
    """Unregistered: crosses the wire as its nearest known base, ValueError."""


class WeirdError(Exception):
    """Unregistered and not under a known type: crosses the wire as RemoteError."""


@rpc.register_remote_error
class StaleGroupError(RuntimeError):
    """Registered, with an __init__ that takes other parameters than its args."""

    def __init__(self, group_id: int, lag: int):
        super().__init__(f"group {group_id} is {lag} versions stale")
        self.group_id = group_id
        self.lag = lag


class Toy:
    """The object under test; `scale` shows that factory kwargs arrive."""

    def __init__(self, scale: int = 1):
        self.scale = scale
        self.closed = False
        self.holding = threading.Event()  # set once a call of hold() is running
        self.release = threading.Event()  # ends every call of hold()

    def add(self, a, b=0):
        return (a + b) * self.scale

    def echo(self, *args, **kwargs):
        return {"args": args, "kwargs": kwargs}

    def fail(self, kind: str, message: str):
        raise ERRORS[kind](message)

    def fail_custom(self, kind: str):
        if kind == "toy":
            raise ToyError("bad toy")
        if kind == "stale":
            raise StaleGroupError(7, 5)
        raise WeirdError("something odd")

    def open_missing(self, path: str):
        with open(path):
            pass

    def slow(self, seconds: float):
        time.sleep(seconds)
        return seconds

    def hold(self, timeout_s: float = 60.0):
        """Runs until `release` is set (at most timeout_s): a call a test knows to be in flight."""
        self.holding.set()
        return self.release.wait(timeout_s)

    def samples(self, n: int):
        return [Sample([i], [-0.5], [0], "stop") for i in range(n)]

    def unencodable(self):
        return object()

    def hidden(self):
        return "not served"

    def close(self):
        self.closed = True


def make_toy(scale: int) -> Toy:
    """The factory serve_in_subprocess imports in the child."""
    return Toy(scale)


def make_failing(scale: int) -> Toy:
    raise ValueError(f"bad config: scale={scale} is not allowed")
