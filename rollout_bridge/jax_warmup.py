"""Compiling a JAX engine's programs ahead of use, off the engine's critical path.

A decode program exists per slot bucket (`jax_slots.row_buckets`): nine for 128 slots. On a warm
persistent compilation cache each still costs about 0.8 s (tracing and lowering in Python, then loading
the executable; measured on two cores with the tiny model): compiling them all at construction made
building the RL job's first engine take 9.4 s (2.0-2.1 s now). The engine compiles its largest bucket
(and the prefill programs) before it serves, and `BackgroundCompiles` does the rest on a thread of its
own: until a bucket is ready, a decode call runs in the smallest ready bucket that holds its rows
(more padding rows, never a compile in the loop).
The extend programs of multi-turn episodes (`JaxEngine(reuse_turns=True)`) compile there too.

Background compiles take one process-wide lock, one at a time: engines of the same shapes in one
process (an evaluator beside the rollout engines) then share each program (jit's caches) instead of
tracing it twice at once. What an engine compiles before it serves takes no lock: the first engine of
those shapes compiled it before starting its background work, so a later engine finds it in the cache
rather than waiting behind the other's background compiles.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence

log = logging.getLogger(__name__)

COMPILE_LOCK = threading.Lock()
# Keys of the jobs compiled in this process (held by jit's caches): an engine of the same shapes as an
# earlier one finds its programs here and marks them ready without lowering them again.
COMPILED: set[Hashable] = set()


class BackgroundCompiles:
    """Runs `jobs` ((key, thunk returning a `jax.stages.Lowered`) pairs), compiling each, in order on a
    daemon thread, one at a time under `COMPILE_LOCK`, and calls `on_ready(key)` after each (at once for
    a key already in `COMPILED`: the key must name the program, shapes included). A job that
    raises is logged and skipped (its key never becomes ready; callers keep their fallback). `close`
    stops after the job in progress."""

    def __init__(self, jobs: Sequence[tuple[Hashable, Callable[[], object]]],
                 on_ready: Callable[[Hashable], None], name: str = "jax-warmup"):
        self._jobs, self._on_ready = list(jobs), on_ready
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for key, lower in self._jobs:
                held = False
                while key not in COMPILED and not held:  # waits out another engine's compile, or `close`
                    held = COMPILE_LOCK.acquire(timeout=0.05)
                    if not held and self._stop.is_set():
                        return
                if key in COMPILED:  # compiled by an engine of the same shapes
                    if held:
                        COMPILE_LOCK.release()
                    self._on_ready(key)
                    continue
                try:
                    if self._stop.is_set():
                        return
                    lower().compile()
                    COMPILED.add(key)
                except Exception as e:  # noqa: BLE001 - the engine keeps serving in its ready shapes
                    log.warning("background compile of %r failed (%s: %s); calls keep to the shapes already "
                                "compiled", key[:2] if isinstance(key, tuple) else key, type(e).__name__, e)
                    continue
                finally:
                    COMPILE_LOCK.release()
                self._on_ready(key)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until every job ran (or `close` stopped them); False on timeout."""
        return self._done.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
