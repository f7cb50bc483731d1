"""Reading (and publishing to) a ParameterService from another process.

`attach_shared` maps a shared-memory version on this host with zero copies; `ParameterClient` wraps an
RPC client of a served ParameterService and pulls by attaching when it can, streaming chunks otherwise.
The storage layout (one aligned buffer per version, tensors at the manifest's offsets) is the
service's, so the helpers that read it are shared with `jaxflow.data.param_service`.
"""

from __future__ import annotations

import gc
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxflow.data.param_service import DEFAULT_CHUNK_BYTES
from jaxflow.data.param_storage import (
    ALIGNMENT,
    _Buffer,
    _map_segment,
    _native,
    _slots_of,
    _views,
)
from jaxflow.data.timeouts import check_timeout

# Held segments still viewed that make it worth a garbage collection before a pull (see `_unread`): a
# collection costs up to tens of ms in a big process, mapping a fresh segment ~1.3 memcpy of its bytes.
_COLLECT_FOR_BYTES = 64 << 20


def attach_shared(manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Maps the shared-memory segment of a `manifest()` from a shared-memory ParameterService on this host
    and returns {name: read-only array} viewing it (no copy).

    The mapping lives as long as the arrays do, even after the service evicts the version. Does not touch
    Python's resource tracker, so the segment is neither unlinked nor reported as leaked when this process
    exits. Raises FileNotFoundError when the segment does not exist here (another host or container, or the
    version was evicted), ValueError when the manifest has no segment.
    """
    name = manifest.get("segment")
    if not name:
        raise ValueError(f"version {manifest.get('version')} is not in shared memory (the service was "
                         f"created without shared_memory=True)")
    if "/" in name or name.startswith("."):
        raise ValueError(f"invalid shared-memory segment name {name!r}")
    mapping = _map_segment(name, max(manifest["total_bytes"], ALIGNMENT), writable=False)
    return _views(np.frombuffer(mapping, np.uint8), _slots_of(manifest))


class ParameterClient:
    """A ParameterService seen through an RPC client (anything with `call(method, *args)`).

    Pulls by attaching the version's shared-memory segment when the service uses shared memory and the
    segment is reachable from this process; otherwise streams the version with `read` in `chunk_bytes`
    pieces into one buffer. Also publishes, for a trainer in another process.

    Attaching registers this client as a reader of the segment (`ParameterService.attach`) and keeps
    the mapping: once no array pulled from a segment is left in this process, the next `pull` releases
    it, and the service may write a later version into that same segment, which this client then reads
    through the mapping it already has (no new mapping, no page faults). `close` releases every segment.

    shared_memory: whether to try attaching at all (False: always stream).
    reader: this client's id on the service (default: host, pid and a random suffix).
    """

    def __init__(self, rpc_client, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shared_memory: bool = True,
                 reader: str | None = None):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._rpc = rpc_client
        self.chunk_bytes = chunk_bytes
        self._try_shared = shared_memory
        self.reader = reader or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._held: set[str] = set()  # segments the service counts this client as reading
        self._maps: dict[str, np.ndarray] = {}  # segment name -> uint8 array over this process's mapping

    def latest(self) -> int | None:
        """The service's newest committed version, or None."""
        return self._rpc.call("latest")

    def versions(self) -> list[int]:
        """The service's committed versions, oldest first."""
        return list(self._rpc.call("versions"))

    def manifest(self, version: int | None = None) -> dict[str, Any]:
        """The service's manifest of `version` (default the latest); see ParameterService.manifest."""
        return self._rpc.call("manifest", version)

    def wait_for_version(self, min_version: int, timeout: float | None = None, *,
                         poll_s: float = 5.0) -> int:
        """Blocks until the service has a version >= `min_version`; returns its latest version.

        Waits on the server in calls of at most `poll_s` seconds, so no single call outlives an RPC
        deadline. Raises TimeoutError after `timeout` seconds (None: never).
        """
        timeout = check_timeout(timeout)
        if check_timeout(poll_s, "poll_s") is None or poll_s <= 0:
            raise ValueError(f"poll_s must be a finite number of seconds > 0, got {poll_s!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            got = self._rpc.call("poll_version", min_version, max(left, 0.0))
            if got is not None:
                return got
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no version >= {min_version} was published within {timeout} s")

    def pull(self, version: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """(version, {name: read-only array}) of `version` (default the latest).

        Zero-copy through shared memory when possible, else one streamed copy. When pulling the latest
        version and the service evicts it mid-stream, starts over with the new latest (up to 3 times).
        """
        for attempt in range(3):
            if self._try_shared:
                manifest = self._attach_call(version)
                if manifest.get("segment"):
                    try:
                        return manifest["version"], self._map(manifest)
                    except FileNotFoundError:
                        pass  # not reachable from here (another host or IPC namespace): stream it
            else:
                manifest = self._rpc.call("manifest", version)
            try:
                return manifest["version"], self._stream(manifest)
            except Exception:
                if version is not None or attempt == 2 or manifest["version"] in self.versions():
                    raise

    def _unread(self) -> list[str]:
        """Held segments of which no pulled array is left in this process (or that were never mapped).

        Arrays handed to JAX may be kept alive only by reference cycles (JAX on CPU aliases host memory,
        and a dropped device array can sit in a cycle until the garbage collector runs), so when a big
        segment still looks read, the collector runs, youngest generation first, before it is kept.
        """
        def read(name: str) -> bool:
            # 2 references: the dict's and getrefcount's argument; any view pulled from it adds one.
            return name in self._maps and sys.getrefcount(self._maps[name]) > 2

        for generation in (0, 1, 2):
            still = [n for n in self._held if read(n)]
            if sum(self._maps[n].size for n in still) < _COLLECT_FOR_BYTES:
                break
            gc.collect(generation)
        return [n for n in self._held if not read(n)]

    def _attach_call(self, version: int | None) -> dict[str, Any]:
        unread = self._unread()
        manifest = self._rpc.call("attach", self.reader, version, unread)
        self._held.difference_update(unread)
        if manifest.get("segment"):
            self._held.add(manifest["segment"])
        keep = set(manifest.get("live", ())) | self._held
        for name in [n for n in self._maps if n not in keep]:
            del self._maps[name]  # the service will not write into it again: unmapped with its last view
        return manifest

    def _map(self, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
        name, size = manifest["segment"], max(manifest["total_bytes"], ALIGNMENT)
        if "/" in name or name.startswith("."):
            raise ValueError(f"invalid shared-memory segment name {name!r}")
        mapped = self._maps.get(name)
        if mapped is None or mapped.size < size:
            mapped = self._maps[name] = np.frombuffer(_map_segment(name, size, writable=False), np.uint8)
        return _views(mapped, _slots_of(manifest))

    def close(self) -> None:
        """Releases every segment this client reads (arrays already pulled stay valid), so that the
        service may reuse them. Best effort: a service that is gone is ignored."""
        held, self._held = list(self._held), set()
        self._maps.clear()
        if held:
            try:
                self._rpc.call("release_reader", self.reader, held)
            except Exception:  # noqa: BLE001 - nothing to release on a service that is gone
                pass

    def _stream(self, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
        total = manifest["total_bytes"]
        buffer = _Buffer(total).array
        for offset in range(0, total, self.chunk_bytes):
            size = min(self.chunk_bytes, total - offset)
            chunk = np.frombuffer(self._rpc.call("read", manifest["version"], None, offset, size), np.uint8)
            if chunk.size != size:
                raise ValueError(f"version {manifest['version']}: read {size} bytes at offset {offset} "
                                 f"returned {chunk.size}")
            buffer[offset:offset + size] = chunk
        return _views(buffer, _slots_of(manifest))

    def publish(self, version: int,
                tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]], *,
                chunk_bytes: int | None = None) -> None:
        """Publishes `version` on the service: begin, each tensor's bytes in `chunk_bytes` puts, commit.

        On any failure the version is aborted on the service (nothing becomes visible) and the error raised.
        """
        chunk = chunk_bytes or self.chunk_bytes
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        arrays = [(name, _native(np.asarray(value))) for name, value in items]
        self._rpc.call("begin", version, {name: {"dtype": a.dtype.name, "shape": list(a.shape)}
                                          for name, a in arrays})
        try:
            for name, arr in arrays:
                # A 1-D uint8 view: the wire sends it as raw bytes without a copy, whatever the dtype.
                raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                for offset in range(0, raw.size, chunk):
                    self._rpc.call("put", version, name, raw[offset:offset + chunk], offset)
            self._rpc.call("commit", version)
        except BaseException:
            try:
                self._rpc.call("abort_publish", version)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise
