"""The parameter service: published policy versions, as HF-named tensors, for rollout workers to pull.

The trainer publishes each policy version as the tensors `jaxflow.models.hf_io.iter_hf_tensors` yields
(HF name -> numpy array); rollout workers pull the newest version, or a given one, when their sync policy
says so. A version becomes visible (to `latest`, `versions`, `manifest`, `pull`, `read`) only when it is
committed, and a commit checks that every byte of every tensor has landed. Only the newest `keep`
committed versions are kept.

Publishing, one shot or streamed:

    service.publish(7, iter_hf_tensors(model))           # = begin + one put per tensor + commit
    service.begin(7, {"lm_head.weight": {"dtype": "bfloat16", "shape": [512, 64]}, ...})
    service.put(7, "lm_head.weight", chunk, offset)      # raw bytes at a byte offset, or a whole array
    service.commit(7)

Storage layout. Each version lives in one contiguous, page-aligned buffer holding its tensors in publish
order as raw C-order little-endian bytes, each at a 64-byte aligned offset (`manifest(v)["tensors"]`
lists dtype, shape, nbytes and offset). A published array is copied once, into that buffer, so the
trainer may reuse or donate its own buffers at once; `pull` returns read-only numpy views of the buffer
(no copy). A view keeps the buffer alive: arrays pulled before a version is evicted stay valid.

Where the buffer lives:
  * in process (default): private anonymous memory.
  * `shared_memory=True` (Linux): a named POSIX shared-memory segment per version
    (`multiprocessing.shared_memory.SharedMemory`, named `jxf<random>_<n>`). The manifest carries the
    segment's name, and `attach_shared(manifest)` maps it read-only in another process on the same host,
    again as zero-copy views. A segment is unlinked when its version is evicted (on a background
    thread: freeing the pages of a big segment takes tens of milliseconds) unless registered readers
    still read it or it is kept for reuse (below), and on `close()`, which waits for those threads.
    Unlinking only removes the name: processes that have the segment mapped keep a valid mapping until
    their last view of it is gone (POSIX semantics on Linux), and a new attach fails. Readers map the
    segment's file under /dev/shm directly rather than through SharedMemory, which before Python 3.13
    registers every attach with the reader's resource tracker: that tracker would unlink the service's
    segment when the reader exits and warn about a "leaked" segment. The creating service does register
    its segments, so the tracker cleans them up if the service dies unclosed.

Memory that was never touched costs a page fault per page on its first write, which makes copying into a
fresh buffer several times slower than `np.copyto` into warm memory; mapping a fresh segment costs a
reader as much again. So buffers are reused (`jaxflow.data.param_storage._Pool`): an evicted buffer that
nothing can read any more becomes the spare the next version is written into. In process that means no
pulled array views it; for a shared segment, also that every reader that was handed its name registered
(`attach`, which `ParameterClient.pull` uses) and has released it since. A reader that keeps its
mapping then reads the next versions through pages it already maps: a version reaches it without a
copy, a new mapping or a page fault. A name handed out by plain `manifest` (no reader to say when it
is done) is never written again. When no spare is ready, a thread pre-faults a fresh buffer after a
commit. The cost is memory: `keep` versions, one being published, one spare, one being pre-faulted,
and up to 4 evicted segments still read; `prefault=False` drops the pre-faulting.

Remote access: serve a ParameterService with `jaxflow.transport.rpc.Server(service, RPC_METHODS, ...)`;
`ParameterClient(rpc_client)` pulls from it (attaching the shared-memory segment when it can, streaming
`read` chunks otherwise) and can publish to it.

The buffers themselves (layout, shared-memory segments, pre-faulting, write coverage) are in
`jaxflow.data.param_storage`; this module decides what is kept, reused and unlinked.

Every rejected call raises before it changes anything, so a bad input never leaves a partial version
visible and the service keeps working. Two limits keep a careless or hostile publisher from blocking the
trainer: the bytes reserved by uncommitted versions are capped (`max_pending_bytes`, by default half of the
machine's physical memory), and a version number must be below 2**53 and, once a version is committed, at
most `max_version_jump` past the newest (so a publish of version 2**63 cannot make every later publish "not
newer").
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import weakref
from collections.abc import Iterable, Mapping
from multiprocessing import shared_memory as _shm
from typing import Any

import numpy as np

from jaxflow import machine
from jaxflow.data import checks
from jaxflow.data.param_storage import (
    _SHM_DIR,
    ALIGNMENT,
    DTYPES,
    _Buffer,
    _Coverage,
    _layout,
    _Pool,
    _Slot,
    _unlink_all,
    _views,
)
from jaxflow.data.timeouts import check_timeout

__all__ = ["ALIGNMENT", "DEFAULT_CHUNK_BYTES", "DTYPES", "RPC_METHODS", "ParameterService", "UnknownVersionError",
           "default_max_pending_bytes"]

# Bytes per `read` / `put` call of a ParameterClient: big enough that per-call overhead vanishes, small
# enough that one message never holds much memory.
DEFAULT_CHUNK_BYTES = 8 << 20

RPC_METHODS: tuple[str, ...] = ("begin", "put", "commit", "abort_publish", "latest", "versions",
                                "manifest", "attach", "release_reader", "read", "wait_for_version",
                                "poll_version")
"""The ParameterService methods to serve over RPC (what ParameterClient calls)."""


class UnknownVersionError(LookupError):
    """The asked-for version is not published: never committed (yet), or already evicted."""


MAX_VERSION = 2 ** 53 - 1  # exact in a float and in JSON


def default_max_pending_bytes() -> int:
    """The default cap on bytes reserved by versions being published: half of this machine's physical memory
    (`jaxflow.machine.physical_memory_bytes`), so a huge `begin` is refused before it can exhaust the host."""
    return max(1, machine.physical_memory_bytes() // 2)


def _check_version_number(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"a version must be a non-negative int below 2**53, got {version!r}")
    return int(version)


class _Version:
    """One version: its layout and buffer, and while it is being published, what has been written."""

    def __init__(self, number: int, slots: dict[str, _Slot], total: int):
        self.number = number
        self.slots = slots
        self.total = total
        self.buffer: _Buffer | None = None
        # Held while a chunk is copied in and while committing or aborting, so a commit never sees a
        # half-written chunk and an abort never frees a buffer under a copy.
        self.lock = threading.Lock()
        self.state = "open"  # -> "committed" | "aborted"
        self.covered = {name: _Coverage(slot.nbytes) for name, slot in slots.items()}


# --- the service --------------------------------------------------------------------------------------------

class ParameterService:
    """Holds the newest `keep` published versions of the policy's HF-named tensors. Thread-safe.

    keep: committed versions kept (older ones are evicted; arrays already pulled stay valid).
    shared_memory: store each version in a named shared-memory segment that other processes on this host
        can map (`attach_shared`); Linux only.
    prefault: keep a pre-faulted spare buffer so publishes copy into warm memory (see the module doc).
    max_pending_bytes: the most bytes all versions being published (begun, not committed) may reserve; None:
        half of this machine's physical memory (`default_max_pending_bytes`).
    max_version_jump: how far past the newest committed version a new version number may be.
    """

    def __init__(self, keep: int = 2, shared_memory: bool = False, prefault: bool = True, *,
                 max_pending_bytes: int | None = None, max_version_jump: int = 16):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if max_pending_bytes is None:
            max_pending_bytes = default_max_pending_bytes()
        for name, value in (("max_pending_bytes", max_pending_bytes), ("max_version_jump", max_version_jump)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_pending_bytes, self.max_version_jump = max_pending_bytes, max_version_jump
        if shared_memory and not os.path.isdir(_SHM_DIR):
            raise NotImplementedError(f"shared_memory=True needs POSIX shared memory under {_SHM_DIR} "
                                      f"(Linux)")
        self.keep = keep
        self.shared_memory = shared_memory
        self._prefault = prefault
        # Guards all the state below; notified on every commit and on close.
        self._lock = threading.Condition()
        self._committed: dict[int, _Version] = {}  # in increasing version order
        self._pending: dict[int, _Version] = {}
        self._latest: int | None = None
        self._closed = False
        # Random per service, so two services (or a stale segment of a dead one) never collide.
        self._prefix = f"jxf{secrets.token_hex(5)}_"
        self._names = itertools.count()
        # Segments not yet unlinked, by name. Plain dict operations are atomic under the GIL, so the
        # pre-fault thread and the finalizer may touch it without the lock.
        self._segments: dict[str, _shm.SharedMemory] = {}
        self._pool = _Pool(shared_memory, prefault, self._new_buffer)
        self._finalizer = weakref.finalize(self, _unlink_all, self._segments)

    # --- publishing ---

    def publish(self, version: int,
                tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]) -> None:
        """Publishes `version` in one call: begin, a put of every tensor, commit.

        tensors: name -> array, or (name, array) pairs such as `iter_hf_tensors(model)` yields (collected
        first: the layout needs every shape). Each array is copied once into the service's buffer; the
        caller may reuse it as soon as this returns. Nothing is visible unless everything succeeds.
        """
        version = _check_version_number(version)
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        arrays: dict[str, np.ndarray] = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError(f"version {version}: expected (name, array) pairs, got {item!r:.80}")
            name, value = item
            if name in arrays:
                raise ValueError(f"version {version}: tensor {name!r} is given twice")
            arrays[name] = np.asarray(value)
        self.begin(version, {name: {"dtype": a.dtype.name, "shape": list(a.shape)}
                             for name, a in arrays.items()})
        try:
            for name, arr in arrays.items():
                self.put(version, name, arr)
            self.commit(version)
        except BaseException:
            self.abort_publish(version)
            raise

    def begin(self, version: int, manifest: Mapping[str, Mapping[str, Any]]) -> None:
        """Starts publishing `version`: allocates its buffer for the tensors of `manifest`.

        manifest: name -> {"dtype": a name in DTYPES, "shape": list of ints}, in the order the tensors are
        laid out (other keys are ignored, so a manifest() entry works too). Raises ValueError when the
        version is not newer than the latest committed one, is already being published, or the manifest is
        malformed.
        """
        version = _check_version_number(version)
        slots, total = _layout(version, manifest)
        entry = _Version(version, slots, total)
        with entry.lock:  # puts to this version wait until its buffer exists
            with self._lock:
                self._check_open()
                self._check_newer(version)
                if version in self._pending:
                    raise ValueError(f"version {version} is already being published; commit it or "
                                     f"abort_publish it first")
                pending = sum(e.total for e in self._pending.values())
                if pending + total > self.max_pending_bytes:
                    raise ValueError(f"version {version} needs {total} bytes, but versions being published "
                                     f"already reserve {pending} of max_pending_bytes={self.max_pending_bytes}; "
                                     f"commit or abort_publish them first")
                self._pending[version] = entry
                spare, job = self._pool.take(total)
            try:
                entry.buffer = self._pool.fill(total, spare, job)
            except BaseException:
                entry.state = "aborted"
                with self._lock:
                    self._pending.pop(version, None)
                raise

    def put(self, version: int, name: str, data, offset: int = 0) -> None:
        """Writes into tensor `name` of the uncommitted `version`.

        data: the whole tensor as an array of the manifest's dtype and shape (any memory order; offset must
        be 0), or a chunk of its raw C-order little-endian bytes placed at byte `offset`: bytes, bytearray,
        memoryview, or a 1-D uint8 array (what the wire delivers). Chunks may come in any order and overlap.
        """
        entry = self._open_version(version, "put")
        with entry.lock:
            if entry.state != "open":
                raise ValueError(f"version {version} was aborted")
            slot = entry.slots.get(name) if isinstance(name, str) else None
            if slot is None:
                raise ValueError(f"version {version} has no tensor {name!r} in its manifest")
            where = f"version {version}: tensor {name!r}"
            if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
                raise ValueError(f"{where}: offset must be an int, got {offset!r}")
            offset = int(offset)
            whole = (isinstance(data, np.ndarray) and data.dtype.name == slot.dtype.name
                     and data.shape == slot.shape)
            if whole:
                if offset != 0:
                    raise ValueError(f"{where}: a whole array is written at offset 0, got offset {offset}")
                src, nbytes = data, slot.nbytes
            elif isinstance(data, np.ndarray) and not (data.dtype == np.uint8 and data.ndim == 1):
                raise ValueError(f"{where}: got an array of dtype {data.dtype.name} and shape "
                                 f"{list(data.shape)}, the manifest says {slot.dtype.name} "
                                 f"{list(slot.shape)} (raw byte chunks are bytes or 1-D uint8 arrays)")
            elif isinstance(data, np.ndarray):
                src, nbytes = data, data.size
            else:
                try:
                    src = np.frombuffer(data, np.uint8)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{where}: data must be an array or bytes-like, got "
                                     f"{type(data).__name__} ({exc})") from None
                nbytes = src.size
            if offset < 0 or offset + nbytes > slot.nbytes:
                raise ValueError(f"{where}: chunk [{offset}, {offset + nbytes}) is outside the tensor's "
                                 f"{slot.nbytes} bytes")
            dest = entry.buffer.array[slot.offset + offset:slot.offset + offset + nbytes]
            if whole:
                # One copy, straight from the caller's array (strided or byte-swapped ones included).
                np.copyto(dest.view(slot.dtype).reshape(slot.shape), src, casting="equiv")
            else:
                np.copyto(dest, src)
            entry.covered[name].add(offset, offset + nbytes)

    def commit(self, version: int) -> None:
        """Makes `version` visible, after checking every byte of every tensor was written.

        Incomplete: ValueError naming the tensors and missing bytes; the version stays pending (put the
        rest and commit again, or abort_publish it). Not newer than a version committed meanwhile:
        ValueError, and the version is dropped. Evicts the oldest versions beyond `keep`.
        """
        entry = self._open_version(version, "commit")
        with entry.lock:
            if entry.state != "open":
                raise ValueError(f"version {version} was aborted")
            incomplete = [(name, cov) for name, cov in entry.covered.items() if cov.missing()]
            if incomplete:
                name, cov = incomplete[0]
                gap = cov.first_gap()
                more = f"; {len(incomplete) - 1} more tensor(s) are incomplete" if len(incomplete) > 1 else ""
                raise ValueError(f"cannot commit version {version}: tensor {name!r} is missing "
                                 f"{cov.missing()} of its {cov.nbytes} bytes (first gap: bytes "
                                 f"[{gap[0]}, {gap[1]})){more}")
            with self._lock:
                self._check_open()
                latest = self._latest
                stale = latest is not None and version <= latest
                self._pending.pop(version, None)
                if stale:
                    entry.state = "aborted"
                    self._pool.recycle(entry.buffer)
                else:
                    entry.state = "committed"
                    entry.covered = {}
                    self._committed[version] = entry
                    self._latest = version
                    self._evict()
                    self._pool.after_commit(entry.total)
                    self._lock.notify_all()
            if stale:
                raise ValueError(f"version {version} is not newer than the latest published version "
                                 f"{latest} (committed while it was being written); it was dropped")

    def abort_publish(self, version: int) -> bool:
        """Drops the uncommitted `version`. Returns whether there was one to drop."""
        with self._lock:
            entry = self._pending.get(version)
        if entry is None:
            return False
        with entry.lock:
            if entry.state != "open":
                return False
            entry.state = "aborted"
            with self._lock:
                self._pending.pop(version, None)
                if entry.buffer is not None:
                    # No view of an uncommitted buffer was ever handed out, so it is safe to reuse.
                    self._pool.recycle(entry.buffer)
        return True

    # --- reading ---

    def latest(self) -> int | None:
        """The newest committed version, or None before the first commit."""
        with self._lock:
            self._check_open()
            return self._latest

    def versions(self) -> list[int]:
        """The committed versions still kept, oldest first."""
        with self._lock:
            self._check_open()
            return list(self._committed)

    def manifest(self, version: int | None = None) -> dict[str, Any]:
        """A description of a committed version (default the latest), made of msgpack-friendly values.

        {"version": int, "total_bytes": int (the buffer's used size), "alignment": 64,
         "segment": shared-memory segment name, or None when the service is not in shared-memory mode,
         "tensors": {name: {"dtype": str, "shape": [int], "nbytes": int, "offset": int (in the buffer)}}}
        """
        with self._lock:
            entry = self._get(version)
            self._pool.expose(entry.buffer)
            return self._manifest(entry)

    def attach(self, reader: str, version: int | None = None, release: list[str] | tuple[str, ...] = ()
               ) -> dict[str, Any]:
        """`manifest(version)` for a reader in another process that maps the shared segment and says when
        it stops reading: the service may then write a later version into the same segment, which the
        reader keeps mapped (no new mapping, its page tables already filled: see `_Pool`).

        reader: an id unique to the reading process (`ParameterClient` makes one). Its hold on the
        version's segment lasts until it names the segment in `release` (here or in `release_reader`).
        release: segment names this reader no longer reads (unknown ones are ignored), released first.
        The manifest gains "live": the names of the segments the service still has (kept, being written,
        spare or still read), which it may write into again: a reader may unmap any other. Without shared memory,
        the same as `manifest` (no segment, no hold).
        """
        checks.check_str("reader", reader, empty_ok=False)
        release = self._check_names(release)
        with self._lock:
            self._pool.release(reader, release)
            entry = self._get(version)
            self._pool.hold(reader, entry.buffer)
            live = [e.buffer.name for e in [*self._committed.values(), *self._pending.values()]
                    if e.buffer is not None and e.buffer.name is not None]
            return {**self._manifest(entry), "live": live + self._pool.live()}

    def release_reader(self, reader: str, names: list[str] | tuple[str, ...] | None = None) -> int:
        """`reader` reads none of the segments `names` (None: of any segment it holds) any more; returns
        how many of its holds were dropped. Call when a reading process closes."""
        checks.check_str("reader", reader, empty_ok=False)
        names = None if names is None else self._check_names(names)
        with self._lock:
            held = self._pool.readers(reader)
            names = held if names is None else [n for n in names if n in held]
            self._pool.release(reader, names)
            return len(names)

    @staticmethod
    def _check_names(names: Any) -> list[str]:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"release must be a list of segment names (str), got {names!r:.200}")
        return list(names)

    def _manifest(self, entry: _Version) -> dict[str, Any]:
        return {
                "version": entry.number,
                "total_bytes": entry.total,
                "alignment": ALIGNMENT,
                "segment": entry.buffer.name,
                "tensors": {name: {"dtype": s.dtype.name, "shape": list(s.shape), "nbytes": s.nbytes,
                                   "offset": s.offset} for name, s in entry.slots.items()},
        }

    def pull(self, version: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """(version, {name: read-only array}) of a committed version (default the latest), without copying.

        The arrays view the service's buffer and stay valid after the version is evicted. Raises
        UnknownVersionError if the version is not (or no longer) published.
        """
        with self._lock:  # views are made under the lock, so eviction sees them when it checks for reuse
            entry = self._get(version)
            return entry.number, _views(entry.buffer.array, entry.slots)

    def read(self, version: int, name: str | None, offset: int, size: int) -> np.ndarray:
        """Bytes [offset, offset + size) of tensor `name` of a committed version, as a read-only 1-D uint8
        array viewing the service's buffer (what a remote client streams; the wire sends it without a copy).

        name None reads the version's whole buffer instead ([0, manifest["total_bytes"]), tensors at their
        manifest offsets), so a client can fetch many small tensors in one call.
        """
        with self._lock:
            entry = self._get(version)
            if name is None:
                limit, base, what = entry.total, 0, f"version {version}'s buffer"
            else:
                slot = entry.slots.get(name) if isinstance(name, str) else None
                if slot is None:
                    raise ValueError(f"version {version} has no tensor {name!r}")
                limit, base, what = slot.nbytes, slot.offset, f"version {version}: tensor {name!r}"
            if (isinstance(offset, bool) or isinstance(size, bool)
                    or not isinstance(offset, (int, np.integer)) or not isinstance(size, (int, np.integer))
                    or offset < 0 or size < 0 or offset + size > limit):
                raise ValueError(f"{what}: cannot read {size!r} bytes at offset {offset!r} of {limit}")
            view = entry.buffer.array[base + offset:base + offset + size]
            view.flags.writeable = False
            return view

    def wait_for_version(self, min_version: int, timeout: float | None = None) -> int:
        """Blocks until a version >= `min_version` is committed and returns the latest version.

        timeout: seconds (None: forever). Raises TimeoutError when it passes first.
        """
        got = self.poll_version(min_version, timeout)
        if got is None:
            raise TimeoutError(f"no version >= {min_version} was published within {timeout} s "
                               f"(latest: {self.latest()})")
        return got

    def poll_version(self, min_version: int, timeout: float | None = None) -> int | None:
        """wait_for_version that returns None on timeout instead of raising: the form a remote client
        calls, in slices shorter than its RPC deadline."""
        timeout = check_timeout(timeout)
        with self._lock:
            self._lock.wait_for(lambda: self._closed or (self._latest is not None
                                                          and self._latest >= min_version), timeout)
            self._check_open()
            return self._latest if self._latest is not None and self._latest >= min_version else None

    # --- lifetime ---

    def close(self) -> None:
        """Drops every version (unlinking shared-memory segments) and refuses further calls.

        Arrays pulled earlier stay valid. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending.values())
            buffers = [e.buffer for e in self._committed.values()]
            self._pending.clear()
            self._committed.clear()
            self._lock.notify_all()
        held, releasing = self._pool.close()  # waits for a pre-fault in flight
        buffers += held
        for entry in pending:
            with entry.lock:  # waits for a put in flight
                entry.state = "aborted"
                buffers.append(entry.buffer)
        for buffer in buffers:
            if buffer is not None:
                buffer.release()
        for thread in releasing:
            thread.join()
        self._finalizer()

    def __enter__(self) -> ParameterService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals (the `_lock` holders are marked) ---

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the parameter service is closed")

    def _check_newer(self, version: int) -> None:
        if self._latest is not None and version <= self._latest:
            raise ValueError(f"version {version} is not newer than the latest published version "
                             f"{self._latest}")
        if self._latest is not None and version > self._latest + self.max_version_jump:
            raise ValueError(f"version {version} jumps more than max_version_jump={self.max_version_jump} "
                             f"past the latest published version {self._latest}")

    def _get(self, version: int | None) -> _Version:
        """The committed entry of `version` (default latest). Holds `_lock`."""
        self._check_open()
        if version is None:
            if self._latest is None:
                raise UnknownVersionError("no version has been published yet")
            version = self._latest
        entry = self._committed.get(version) if isinstance(version, (int, np.integer)) else None
        if entry is None:
            pending = " (it is being published but not committed yet)" if version in self._pending else ""
            raise UnknownVersionError(f"version {version!r} is not published{pending}; available: "
                                      f"{list(self._committed)}")
        return entry

    def _open_version(self, version: int, action: str) -> _Version:
        with self._lock:
            self._check_open()
            entry = self._pending.get(version)
            if entry is None:
                if version in self._committed:
                    raise ValueError(f"cannot {action} version {version}: it is already committed")
                raise ValueError(f"cannot {action} version {version}: it is not being published "
                                 f"(call begin first)")
            return entry

    def _new_buffer(self, size: int) -> _Buffer:
        if not self.shared_memory:
            return _Buffer(size)
        return _Buffer(size, f"{self._prefix}{next(self._names)}", self._segments)

    def _evict(self) -> None:
        """Drops the oldest committed versions beyond `keep`, handing their buffers to the pool (reused,
        retired while registered readers hold them, or released). Holds `_lock`."""
        dropped = []
        while len(self._committed) > self.keep:
            dropped.append(self._committed.pop(next(iter(self._committed))).buffer)
        self._pool.evict(dropped)
