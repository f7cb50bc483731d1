"""The storage under the parameter service: where each version's tensors live, and how.

A version is one contiguous, page-aligned buffer holding its tensors as raw C-order little-endian bytes,
each at an `ALIGNMENT`-byte offset (`_layout`). The buffer is private anonymous memory or a named POSIX
shared-memory segment (`_Buffer`); readers in other processes map the segment through /dev/shm
(`_map_segment`) and view it without a copy (`_views`). `_SpareJob` pre-faults the next buffer on a
thread, `_Pool` decides when a buffer may be written again (who may still read it), and `_Coverage`
tracks which bytes of a tensor a streamed publish has written.
`jaxflow.data.param_service` explains the policy (what is kept, reused and unlinked, and when).
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import sys
import threading
from collections.abc import Mapping
from multiprocessing import shared_memory as _shm
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

# Byte alignment of every tensor in a version's buffer: a cache line, and enough for any SIMD load.
ALIGNMENT = 64

DTYPES: dict[str, np.dtype] = {
    np.dtype(t).name: np.dtype(t)
    for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
              ml_dtypes.float8_e5m2, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32,
              np.uint16, np.uint8, np.bool_)
}
"""The dtype names a published tensor may have."""

_SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE

# The raw bytes in buffers and on the wire are little-endian; numpy views them with native dtypes.
assert sys.byteorder == "little", "jaxflow.data.param_storage assumes a little-endian host"


# --- layout -------------------------------------------------------------------------------------------------

class _Slot(NamedTuple):
    """Where one tensor lives in its version's buffer."""
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _layout(version: int, manifest: Any) -> tuple[dict[str, _Slot], int]:
    """Validates a begin() manifest and places its tensors: ({name: slot}, total bytes)."""
    if not isinstance(manifest, Mapping) or not manifest:
        raise ValueError(f"version {version}: the manifest must be a non-empty dict of "
                         f"name -> {{'dtype': str, 'shape': list[int]}}, got {type(manifest).__name__}"
                         f"{'' if manifest else ' (empty)'}")
    slots: dict[str, _Slot] = {}
    offset = 0
    for name, entry in manifest.items():
        where = f"version {version}: tensor {name!r}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"version {version}: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(entry, Mapping) or "dtype" not in entry or "shape" not in entry:
            raise ValueError(f"{where}: the manifest entry must have 'dtype' and 'shape', got {entry!r}")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise ValueError(f"{where} has dtype {entry['dtype']!r}; supported: {', '.join(DTYPES)}")
        shape = entry["shape"]
        if (not isinstance(shape, (list, tuple))
                or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise ValueError(f"{where} has shape {shape!r}; expected a list of non-negative ints")
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        slots[name] = _Slot(dtype, shape, offset, nbytes)
        offset = _align(offset + nbytes)
    return slots, offset


def _views(buffer: np.ndarray, slots: Mapping[str, _Slot]) -> dict[str, np.ndarray]:
    """Read-only arrays over `buffer` (uint8) at the slots' offsets: no copy."""
    out = {}
    for name, slot in slots.items():
        arr = buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).reshape(slot.shape)
        arr.flags.writeable = False
        out[name] = arr
    return out


def _slots_of(manifest: Mapping[str, Any]) -> dict[str, _Slot]:
    """The slots of a manifest() dict (what a reader in another process gets)."""
    return {name: _Slot(DTYPES[t["dtype"]], tuple(t["shape"]), t["offset"], t["nbytes"])
            for name, t in manifest["tensors"].items()}


def _native(arr: np.ndarray) -> np.ndarray:
    """`arr` with native byte order (its raw bytes are then the wire's little-endian ones)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


# --- buffers ------------------------------------------------------------------------------------------------

class _Buffer:
    """One version's storage: `size` writable bytes of page-aligned memory, `array` (uint8) over it.

    Private anonymous memory, or (`name` given) a new shared-memory segment recorded in `registry` until
    it is unlinked. The memory is never unmapped explicitly: it goes when the last numpy view of it does,
    so views handed out stay valid whatever the service does later.
    """

    def __init__(self, size: int, name: str | None = None, registry: dict | None = None):
        self.size = max(size, ALIGNMENT)  # mmap refuses 0 bytes
        self.name = name
        self._segment = None
        if name is None:
            # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which Linux backs with
            # (slower to fault) shmem.
            mapping = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            # SharedMemory creates the segment (O_EXCL) and registers it with the resource tracker, which
            # unlinks it should this process die without closing the service. Its own mapping is dropped at
            # once in favour of a plain mmap whose lifetime follows the numpy views: SharedMemory.close()
            # raises while views of its buffer exist, and its __del__ would try.
            segment = _shm.SharedMemory(name=name, create=True, size=self.size)
            segment.close()
            registry[name] = segment
            self._segment, self._registry = segment, registry
            try:
                mapping = _map_segment(name, self.size, writable=True)
            except BaseException:
                self.release()
                raise
        self.array = np.frombuffer(mapping, np.uint8)

    def unreferenced(self) -> bool:
        """Whether no view of this buffer exists outside this object (so it may be overwritten).

        Every numpy view of `array`, and every view of such a view, holds a reference to `array` (numpy
        collapses view chains onto it), so a refcount of 2 (this object's + the call's) means none.
        """
        return sys.getrefcount(self.array) <= 2

    def release(self) -> None:
        """Unlinks the segment's name (a no-op for private memory). Existing mappings stay valid."""
        if self._segment is not None:
            segment, self._segment = self._segment, None
            self._registry.pop(segment.name, None)
            try:
                segment.unlink()
            except FileNotFoundError:
                pass


def _map_segment(name: str, size: int, writable: bool) -> mmap.mmap:
    """Maps the shared-memory segment `name` through /dev/shm, without SharedMemory.

    Python before 3.13 registers every SharedMemory it opens with the resource tracker, which then
    unlinks the segment (and warns of a leak) when the opening process exits, even though that process
    only attached. Opening the file directly keeps readers out of the tracker altogether.
    """
    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"shared-memory segment {name!r} has {actual} bytes, the manifest needs {size}")
        if writable:
            return mmap.mmap(fd, size)
        # A reader maps everything now, in one call, rather than faulting page by page as it reads.
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                         prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _touch(array: np.ndarray) -> None:
    """Write-faults every page of `array` (numpy releases the GIL for this, so it runs beside Python)."""
    array[::_PAGE] = 0


def _unlink_all(registry: dict) -> None:
    """Unlinks every segment still in `registry` (the service's finalizer: at exit or garbage collection)."""
    for segment in list(registry.values()):
        try:
            segment.unlink()
        except FileNotFoundError:
            pass
    registry.clear()


class _SpareJob:
    """A buffer being allocated and pre-faulted on a background thread."""

    def __init__(self, make, size: int):
        self._make = make
        self.size = size
        self._buffer: _Buffer | None = None
        self._done = threading.Event()
        # A daemon: a pending pre-fault must not hold up interpreter exit (the finalizer unlinks segments).
        threading.Thread(target=self._run, name="param-service-prefault", daemon=True).start()

    def _run(self) -> None:
        try:
            buffer = self._make()
            _touch(buffer.array)
            self._buffer = buffer
        except Exception:  # noqa: BLE001 - best effort: begin() then allocates the usual way
            pass
        finally:
            self._done.set()

    def result(self) -> _Buffer | None:
        """Waits for the buffer; None when making it failed (e.g. /dev/shm full)."""
        self._done.wait()
        return self._buffer


def _spare_fits(size: int, total: int) -> bool:
    # A spare much bigger than needed is not worth pinning for a small version.
    return total <= size <= 2 * max(total, ALIGNMENT)


# --- the pool of buffers ------------------------------------------------------------------------------------

class _Pool:
    """Where the service's version buffers come from and go to. Not thread-safe: the service's lock
    guards every call except `fill` (which may wait on a pre-fault thread).

    A buffer is reused only when nothing can read it any more: no numpy view of it remains in this
    process (`_Buffer.unreferenced`) and, for a shared segment, every other process that was handed its
    name registered as a reader (`hold`) and has `release`d it since. A segment whose name went out
    without a reader (`expose`: a plain manifest) is never reused, only unlinked when evicted. So readers
    that register keep their mapping across versions (the service writes the next version into pages
    they already map), and readers that do not are never written under.

    State: `spare` (one warm free buffer), `job` (a spare being pre-faulted), `retired` (evicted
    buffers that registered readers still hold, at most `max_retired`: beyond that the oldest is
    unlinked, which leaves existing mappings valid), `holders` (segment name -> reader ids),
    `exposed` (names handed out without a reader).
    """

    def __init__(self, shared: bool, prefault: bool, new_buffer, max_retired: int = 4):
        self.shared, self.prefault, self.new_buffer, self.max_retired = shared, prefault, new_buffer, max_retired
        self.spare: _Buffer | None = None
        self.job: _SpareJob | None = None
        self.retired: dict[str, _Buffer] = {}
        self.holders: dict[str, set[str]] = {}
        self.exposed: set[str] = set()
        self.releasing: list[threading.Thread] = []  # threads unlinking segments
        self.closed = False

    # -- readers --

    def expose(self, buffer: _Buffer) -> None:
        if buffer.name is not None:
            self.exposed.add(buffer.name)

    def hold(self, reader: str, buffer: _Buffer) -> None:
        if buffer.name is not None:
            self.holders.setdefault(buffer.name, set()).add(reader)

    def release(self, reader: str, names) -> None:
        """`reader` reads none of the segments `names` any more (unknown names are ignored); a retired
        buffer nobody reads becomes the spare, or is unlinked if there is one."""
        freed = []
        for name in names:
            held = self.holders.get(name)
            if held is None:
                continue
            held.discard(reader)
            if not held:
                del self.holders[name]
            buffer = self.retired.get(name)
            if buffer is not None and self._reusable(buffer):
                del self.retired[name]
                freed.append(buffer)
        self._drop([b for b in freed if not self._keep_as_spare(b)])

    def readers(self, reader: str) -> list[str]:
        return [name for name, held in self.holders.items() if reader in held]

    def live(self) -> list[str]:
        """The names of the free and retired segments (the service adds its versions')."""
        return list(self.retired) + [b.name for b in (self.spare,) if b is not None and b.name]

    # -- buffers --

    def _reusable(self, buffer: _Buffer) -> bool:
        if not buffer.unreferenced():
            return False
        return buffer.name is None or (buffer.name not in self.exposed and not self.holders.get(buffer.name))

    def _keep_as_spare(self, buffer: _Buffer) -> bool:
        if self.spare is None and not self.closed:
            self.spare = buffer
            return True
        return False

    def take(self, total: int) -> tuple[_Buffer | None, _SpareJob | None]:
        """The spare if it suits a version of `total` bytes, else the job making one (whatever its size:
        `fill` releases a misfit)."""
        spare, self.spare = self.spare, None
        if spare is not None:
            if _spare_fits(spare.size, total):
                return spare, None
            self._drop([spare])
        job, self.job = self.job, None
        return None, job

    def fill(self, total: int, spare: _Buffer | None, job: _SpareJob | None) -> _Buffer:
        """A buffer for `total` bytes: the spare, the job's (waiting for it), or a new one."""
        if spare is not None:
            return spare
        if job is not None:
            buffer = job.result()
            if buffer is not None and _spare_fits(buffer.size, total):
                return buffer
            if buffer is not None:
                buffer.release()  # made for a different model size: rare enough to just drop
        return self.new_buffer(total)

    def recycle(self, buffer: _Buffer) -> None:
        """Keeps `buffer`, known to have no outside views, as the spare if there is none."""
        if not self._keep_as_spare(buffer):
            buffer.release()

    def evict(self, buffers: list[_Buffer]) -> None:
        """Buffers of evicted versions: reused, kept while registered readers hold them, or dropped."""
        dropped = []
        for buffer in buffers:
            if self._reusable(buffer) and self._keep_as_spare(buffer):
                continue
            if buffer.name is not None and self.holders.get(buffer.name) and buffer.name not in self.exposed:
                self.retired[buffer.name] = buffer
            else:
                dropped.append(buffer)
        while len(self.retired) > self.max_retired:  # readers that never release (gone): stop waiting
            name = next(iter(self.retired))
            self.holders.pop(name, None)
            dropped.append(self.retired.pop(name))
        for buffer in dropped:
            if buffer.name is not None:
                self.exposed.discard(buffer.name)
                self.holders.pop(buffer.name, None)
        self._drop(dropped)

    def after_commit(self, size: int) -> None:
        """Prepares a warm spare for the next version (about `size` bytes) unless one is there or being
        made (a retired buffer that readers release in time becomes the spare first)."""
        if not self.prefault or self.spare is not None or self.job is not None:
            return
        self.job = _SpareJob(lambda: self.new_buffer(size), max(size, ALIGNMENT))

    def _drop(self, buffers: list[_Buffer]) -> None:
        """Releases `buffers` on a thread that `close` joins.

        Unlinking a segment that no process maps any more frees its pages there and then, which takes
        about as long as writing them (~60 ms/GB): too long for a commit to wait on. Private memory goes
        with its last reference: there is nothing to do.
        """
        buffers = [b for b in buffers if b.name is not None]
        if not buffers:
            return

        def release() -> None:
            for buffer in buffers:
                buffer.release()

        thread = threading.Thread(target=release, name="param-service-release", daemon=True)
        self.releasing = [t for t in self.releasing if t.is_alive()] + [thread]
        thread.start()

    def close(self) -> tuple[list[_Buffer], list[threading.Thread]]:
        """Stops reusing; (the buffers it held, to release; the threads unlinking, to join)."""
        self.closed = True
        buffers = [self.spare, *self.retired.values()]
        if self.job is not None:
            buffers.append(self.job.result())
        self.spare, self.job, self.retired = None, None, {}
        return [b for b in buffers if b is not None], self.releasing


# --- coverage -----------------------------------------------------------------------------------------------

class _Coverage:
    """The byte ranges of one tensor written so far: sorted, disjoint, merged [start, end) intervals."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if start >= end:
            return
        # Intervals overlapping or touching [start, end) are i..j-1; replace them by their union.
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def missing(self) -> int:
        return self.nbytes - sum(e - s for s, e in zip(self.starts, self.ends))

    def first_gap(self) -> tuple[int, int]:
        start = 0
        for s, e in zip(self.starts, self.ends):
            if s > start:
                return start, s
            start = e
        return start, self.nbytes
