"""`wait_until`: the one way the tests wait for something another thread or process does.

A test that sleeps a fixed time and then checks is slow where the machine is fast and flaky where it is
slow; one that polls is neither. The timeout is a safety net against a hang, never a speed requirement.
"""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, what: str | Callable[[], str],
               interval: float = 0.01) -> T:
    """Calls `predicate` every `interval` seconds until it returns a true value, and returns that value.

    Fails (AssertionError) after `timeout` seconds, naming `what` (a text, or a function giving one, called
    only then: a description of the state at that moment) and the last value `predicate` returned. An
    exception `predicate` raises propagates at once: a test that waits for a call to fail wraps the wait in
    `pytest.raises`.
    """
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {described}; last value seen: {last!r}")
        time.sleep(interval)
