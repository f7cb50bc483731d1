"""Policy versions through Ray's object store: tensors (or shards of them) as objects, a manifest of refs.

In cluster mode the weights travel the way everything else does on Ray (one transport per deployment):

    publisher = RayWeightPublisher(keep=2)                # in the trainer process (the objects' owner)
    manifest = publisher.publish(7, hf_tensors)           # ray.put of the tensors; keeps the newest `keep`
    version, tensors = pull(publisher.manifest())         # on an engine: {HF name: read-only array}

A manifest is a plain dict, cheap to send to an engine actor (it carries refs, not bytes):

    {"version": 7, "tensors": {name: {"dtype": "float32", "shape": [..],
                                      "shards": [{"start": [..], "shape": [..], "ref": ObjectRef,
                                                  "item": None or i}, ...]}}}

Small pieces share an object (a list of arrays, `item` says which), up to `bucket_bytes` each: Ray's
cost per object is well above a small tensor's copy time.

A sharded trainer gathers nothing on one host: each of its processes calls `put_shards` with the pieces
it holds (in HF layout, with where each piece starts in the whole tensor; a replicated piece is put by
one process only), sends its part to one process, and that one `merge_manifests` the parts and
`commit`s the result. `pull` then assembles each tensor from its shards on the engine. A tensor of one
shard is not copied: on the node that holds the object, `ray.get` returns a read-only numpy view of the
object store (zero copy); an engine on another node first receives the object into its own node's store.

Lifetime: Ray frees an object once no process holds a ref to it. The publisher holds the manifests of
the newest `keep` committed versions and drops older ones; an engine that still holds an evicted
manifest keeps those objects alive until it drops it, as arrays pulled from the parameter service stay
valid. The objects live as long as their owner, the process that `put` them: if it dies, `pull` raises
UnknownVersionError naming the version.

Ray is imported inside the functions that need it (the `cluster` extra).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxflow.data.param_service import DTYPES, UnknownVersionError

__all__ = ["DEFAULT_BUCKET_BYTES", "PUBLISHER_METHODS", "ManifestSource", "RayWeightPublisher", "UnknownVersionError",
           "merge_manifests", "pull", "put_shards"]


# Pieces share an object up to this many bytes (see put_shards): Ray's cost per object is far above a
# small tensor's copy time (an object per tensor took 1.1 to 2.1 times as long to reach every engine in
# benchmarks/cluster_sync.py), and 32 MiB is still a small part of a model.
DEFAULT_BUCKET_BYTES = 32 << 20


def _check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a version must be a non-negative int, got {version!r}")
    return int(version)


def _shape(value: Any, where: str) -> list[int]:
    if (not isinstance(value, (list, tuple))
            or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in value)):
        raise ValueError(f"{where}: expected a list of non-negative ints, got {value!r}")
    return [int(d) for d in value]


def _check_bucket_bytes(bucket_bytes: Any) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise ValueError(f"bucket_bytes must be an int >= 0, got {bucket_bytes!r}")
    return bucket_bytes


def put_shards(version: int, shards: Iterable[tuple[str, Sequence[int], Sequence[int], np.ndarray]], *,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
    """Puts the shards into Ray's object store; returns this process's part of the version's manifest.

    shards: (HF name, the whole tensor's shape, where this piece starts in it, the piece as a host array
    in HF layout). A whole tensor is the shard (name, arr.shape, [0] * arr.ndim, arr). Everything is
    checked (dtypes, ranks, bounds, a name given twice at one start) before the first put.
    bucket_bytes: consecutive pieces share one object (a list of arrays) up to this many bytes, which
        saves Ray's per-object cost on the many small tensors of a model; a bigger piece is an object of
        its own, and 0 puts every piece alone.
    """
    version = _check_version(version)
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    checked: list[tuple[str, list[int], list[int], np.ndarray]] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for item in shards:
        if not (isinstance(item, tuple) and len(item) == 4 and isinstance(item[0], str) and item[0]):
            raise ValueError(f"version {version}: expected (name, shape, start, array) shards, got {item!r:.80}")
        name, shape, start, arr = item
        where = f"version {version}: tensor {name!r}"
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in DTYPES:
            raise ValueError(f"{where} has dtype {arr.dtype.name}; supported: {', '.join(DTYPES)}")
        shape, start = _shape(shape, f"{where}: shape"), _shape(start, f"{where}: start")
        if not len(shape) == len(start) == arr.ndim:
            raise ValueError(f"{where}: shape {shape}, start {start} and a piece of rank {arr.ndim} disagree")
        if any(s + n > d for s, n, d in zip(start, arr.shape, shape)):
            raise ValueError(f"{where}: a piece of shape {list(arr.shape)} at {start} overruns shape {shape}")
        if (name, tuple(start)) in seen:
            raise ValueError(f"{where}: two pieces start at {start}")
        seen.add((name, tuple(start)))
        checked.append((name, shape, start, arr))
    if not checked:
        raise ValueError(f"version {version}: no tensors to put")
    import ray

    tensors: dict[str, dict] = {}
    for name, shape, _, arr in checked:
        entry = tensors.setdefault(name, {"dtype": arr.dtype.name, "shape": shape, "shards": []})
        if entry["dtype"] != arr.dtype.name or entry["shape"] != shape:
            raise ValueError(f"version {version}: tensor {name!r} has pieces of {entry['dtype']} {entry['shape']} "
                             f"and of {arr.dtype.name} {shape}")
    bucket: list[tuple[str, list[int], np.ndarray]] = []

    def flush() -> None:
        # A lone piece is put as itself, a bucket as a list; "item" says where a piece is in its object.
        ref = ray.put(bucket[0][2] if len(bucket) == 1 else [arr for _, _, arr in bucket])
        for i, (name, start, arr) in enumerate(bucket):
            tensors[name]["shards"].append({"start": start, "shape": list(arr.shape), "ref": ref,
                                            "item": None if len(bucket) == 1 else i})
        bucket.clear()

    for name, _, start, arr in checked:
        if bucket and sum(a.nbytes for _, _, a in bucket) + arr.nbytes > bucket_bytes:
            flush()
        bucket.append((name, start, arr))
    flush()
    return {"version": version, "tensors": tensors}


def merge_manifests(parts: Sequence[Mapping[str, Any]]) -> dict:
    """One version's manifest from the parts each trainer process `put_shards`; raises ValueError when
    the parts disagree (version, dtype, shape), pieces overlap, or a tensor is not covered exactly."""
    if not parts:
        raise ValueError("no manifest parts to merge")
    version = parts[0]["version"]
    tensors: dict[str, dict] = {}
    for part in parts:
        if part["version"] != version:
            raise ValueError(f"manifest parts of versions {version} and {part['version']} cannot be merged")
        for name, entry in part["tensors"].items():
            into = tensors.setdefault(name, {"dtype": entry["dtype"], "shape": list(entry["shape"]), "shards": []})
            if (into["dtype"], into["shape"]) != (entry["dtype"], list(entry["shape"])):
                raise ValueError(f"version {version}: tensor {name!r} is {into['dtype']} {into['shape']} in one "
                                 f"part and {entry['dtype']} {list(entry['shape'])} in another")
            into["shards"].extend(entry["shards"])
    for name, entry in tensors.items():
        _check_cover(f"version {version}: tensor {name!r}", entry)
    return {"version": version, "tensors": tensors}


def _check_cover(where: str, entry: Mapping[str, Any]) -> None:
    boxes = [(s["start"], s["shape"]) for s in entry["shards"]]
    for i, (a0, an) in enumerate(boxes):
        for b0, bn in boxes[:i]:
            if all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(a0, an, b0, bn)):
                raise ValueError(f"{where}: the pieces at {b0} and {a0} overlap")
    covered = sum(math.prod(n) for _, n in boxes)
    if covered != math.prod(entry["shape"]):
        raise ValueError(f"{where}: its pieces cover {covered} of {math.prod(entry['shape'])} elements")


def pull(manifest: Mapping[str, Any], timeout: float | None = None) -> tuple[int, dict[str, np.ndarray]]:
    """(version, {HF name: read-only array}) of a manifest, fetched from Ray's object store in one `ray.get`.

    A one-shard tensor is the object itself (zero copy where the object is local); a sharded one is
    assembled into a new array. Raises UnknownVersionError when an object is gone (its owner died),
    ValueError when an object does not match the manifest, TimeoutError after `timeout` seconds.
    """
    import ray

    version = manifest["version"]
    entries = list(manifest["tensors"].items())
    refs = list({s["ref"]: None for _, e in entries for s in e["shards"]})
    try:
        objects = dict(zip(refs, ray.get(refs, timeout=timeout)))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"version {version}: its tensors did not arrive within {timeout} s") from None
    except ray.exceptions.ObjectLostError as exc:
        raise UnknownVersionError(f"version {version}: a tensor's object is gone ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0]})") from None
    out = {}
    for name, entry in entries:
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        pieces = [(s, objects[s["ref"]] if s.get("item") is None else objects[s["ref"]][s["item"]])
                  for s in entry["shards"]]
        for s, arr in pieces:
            if not isinstance(arr, np.ndarray) or arr.dtype != dtype or list(arr.shape) != s["shape"]:
                raise ValueError(f"version {version}: tensor {name!r}: a piece at {s['start']} is "
                                 f"{getattr(arr, 'dtype', type(arr).__name__)} {getattr(arr, 'shape', '')}, "
                                 f"the manifest says {dtype.name} {s['shape']}")
        if len(pieces) == 1 and tuple(pieces[0][1].shape) == shape:
            whole = pieces[0][1]
        else:
            whole = np.empty(shape, dtype)
            for s, arr in pieces:
                whole[tuple(slice(b, b + n) for b, n in zip(s["start"], arr.shape))] = arr
        whole.flags.writeable = False
        out[name] = whole
    return version, out


class RayWeightPublisher:
    """Keeps the manifests (and so the objects) of the newest `keep` committed versions. Thread-safe.

    bucket_bytes: how many bytes of tensors `publish` puts into one object at most (see put_shards).

    Run it in the trainer process that puts the objects, or as a Ray actor (`ray.remote(RayWeightPublisher)`)
    that engines ask for the newest manifest: refs committed to it keep their objects alive there.
    """

    def __init__(self, keep: int = 2, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.keep = keep
        self.bucket_bytes = _check_bucket_bytes(bucket_bytes)
        self._lock = threading.Lock()
        self._manifests: dict[int, dict] = {}  # in increasing version order

    def publish(self, version: int, tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]) -> dict:
        """Puts every whole tensor (name -> host array, or (name, array) pairs) and commits the version;
        returns its manifest."""
        version = _check_version(version)
        with self._lock:
            self._check_newer(version)
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"version {version}: expected (name, array) pairs, got {item!r:.80}")
        manifest = put_shards(version, [(name, np.shape(a), [0] * np.ndim(a), np.asarray(a)) for name, a in items],
                              bucket_bytes=self.bucket_bytes)
        self.commit(manifest)
        return manifest

    def commit(self, manifest: Mapping[str, Any]) -> None:
        """Makes a (merged) manifest the newest version and evicts versions beyond `keep`."""
        version = _check_version(manifest.get("version") if isinstance(manifest, Mapping) else None)
        if not isinstance(manifest.get("tensors"), Mapping) or not manifest["tensors"]:
            raise ValueError(f"version {version}: the manifest has no tensors")
        with self._lock:
            self._check_newer(version)
            self._manifests[version] = dict(manifest)
            while len(self._manifests) > self.keep:
                del self._manifests[next(iter(self._manifests))]

    def manifest(self, version: int | None = None) -> dict:
        """The manifest of `version` (default the newest); UnknownVersionError if never committed or evicted."""
        with self._lock:
            if version is None and self._manifests:
                version = next(reversed(self._manifests))
            if version not in self._manifests:
                raise UnknownVersionError(f"version {version} is not published (kept: {list(self._manifests)})")
            return self._manifests[version]

    def latest(self) -> int | None:
        """The newest committed version, or None."""
        with self._lock:
            return next(reversed(self._manifests), None)

    def versions(self) -> list[int]:
        """The kept versions, oldest first."""
        with self._lock:
            return list(self._manifests)

    def _check_newer(self, version: int) -> None:
        """Holds `_lock`."""
        latest = next(reversed(self._manifests), None)
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest published version {latest}")

    def reset(self) -> None:
        """Forgets every version (a run rolled back to a checkpoint publishes an older version next)."""
        with self._lock:
            self._manifests.clear()


# What a publisher hosted in a service actor serves (`ray_actors.build(RayWeightPublisher, ...)`).
PUBLISHER_METHODS = ("commit", "manifest", "latest", "versions", "reset")


class ManifestSource:
    """A rollout engine's weight source (the coordinator's `latest()` / `pull(version)`) over a publisher
    (or its proxy): `pull` fetches the version's objects and returns its HF-named tensors."""

    def __init__(self, publisher: Any, timeout: float | None = 300.0):
        self.publisher, self.timeout = publisher, timeout

    def latest(self) -> int | None:
        return self.publisher.latest()

    def pull(self, version: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        return pull(self.publisher.manifest(version), timeout=self.timeout)
