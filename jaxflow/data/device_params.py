"""Policy weights handed to JAX engines in the trainer's own process without leaving the devices.

The parameter service carries each version as HF-named host tensors: what vLLM and other processes need,
but for a JAX engine in the same process it is a detour (device -> host -> HF layout -> host -> device).
`DeviceParamSource` keeps the newest published versions as arrays on device instead, and
`DeviceWeights.placed(shardings)` moves a version onto an engine's own mesh with `reshard`, one call per
pair of layouts (`jaxflow.data.reshard`): on accelerators device to device, never through the host, by a
compiled program (`reshard_program` returns it, for reading its memory and collectives); on CPU devices,
whose memory is the host's, by one `jax.device_put` of the tree, the faster route there.

Why the source copies at publish: the train step donates its state, so the arrays the trainer holds when
it publishes are invalidated by its next step, which may run before an engine gets to pull. `publish`
therefore makes an on-device copy, once per version, and straight onto each
registered target's shardings (`add_target`): an engine whose mesh differs from the trainer's then gets
its arrays in that one transfer, not in a copy followed by a reshard. Without targets the copy keeps
the trainer's shardings and the first `placed` for another layout reshards it. A placement is shared by
every engine that asks for those shardings, and engines never donate their weights (only their KV
cache), so nothing invalidates what an engine holds; a pulled `DeviceWeights` stays valid after its
version is evicted from the source, as long as someone holds it.

A rollout driver sees the parameter service's interface: `latest()`, `versions()` and `pull(version)`
-> (version, DeviceWeights), which `JaxEngine.update_weights` takes in place of HF tensors.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np

from jaxflow.data.param_service import UnknownVersionError
from jaxflow.data.reshard import ReshardProgram, check_shardings, device_leaves, reshard, reshard_program

__all__ = ["DeviceParamSource", "DeviceWeights", "ReshardProgram", "UnknownVersionError", "reshard",
           "reshard_program"]


def _check_version_number(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a version must be a non-negative int, got {version!r}")
    return int(version)


def _check_same_layout(params, reference, what: str) -> None:
    """Raises ValueError unless `params` has `reference`'s tree structure, shapes and dtypes."""
    if jax.tree.structure(params) != jax.tree.structure(reference):
        raise ValueError(f"{what} has tree structure {jax.tree.structure(params)}, expected "
                         f"{jax.tree.structure(reference)}")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), ref in zip(flat, jax.tree.leaves(reference)):
        if (tuple(leaf.shape), np.dtype(leaf.dtype)) != (tuple(ref.shape), np.dtype(ref.dtype)):
            raise ValueError(f"{what}: leaf {jax.tree_util.keystr(path)} is {np.dtype(leaf.dtype)}"
                             f"{list(leaf.shape)}, expected {np.dtype(ref.dtype)}{list(ref.shape)}")


def _shardings_key(shardings) -> tuple:
    """A hashable key of a pytree of shardings: equal for the same structure and equal shardings."""
    return (jax.tree.structure(shardings), tuple(check_shardings(shardings)))


class DeviceWeights:
    """One published version on device: `version` and `params` (the pytree as published, e.g. the
    trainer's nnx.State of Params), placed on one or more layouts. Read-only; share it freely."""

    def __init__(self, version: int, placements: dict[tuple, Any]):
        self.version = version
        self._placements = dict(placements)
        self._lock = threading.Lock()

    @property
    def params(self):
        """The version's arrays on the first layout it was placed on."""
        return next(iter(self._placements.values()))

    def placed(self, shardings):
        """The version's arrays on `shardings` (same pytree structure as `params`): the placement made at
        publish for that target if there is one (no transfer), else resharded now and kept for the next
        caller with the same shardings."""
        key = _shardings_key(shardings)
        with self._lock:
            found = self._placements.get(key)
        if found is not None:
            return found
        moved = reshard(self.params, shardings)
        with self._lock:
            return self._placements.setdefault(key, moved)

    def checked_placed(self, version: int, current, shardings, *, cast: bool, error: type[Exception]):
        """`placed(shardings)`, once this is `version` with `current`'s parameter tree, shapes and dtypes
        (a receiver's check before it swaps anything): else error(message naming the first mismatch).
        A dtype other than current's is cast on device when `cast` (new arrays on `shardings`), else
        refused."""
        source = f"device weights of version {self.version}"
        if self.version != version:
            raise error(f"{source} handed over as version {version}")
        got, want = jax.tree.structure(self.params), jax.tree.structure(current)
        if got != want:
            raise error(f"{source} have parameter tree {got}, this engine's model has {want}")
        needs_cast = False
        for (path, new), old in zip(jax.tree_util.tree_flatten_with_path(self.params)[0], jax.tree.leaves(current)):
            where = f"{source}: parameter {jax.tree_util.keystr(path)}"
            if tuple(new.shape) != tuple(old.shape):
                raise error(f"{where} has shape {tuple(new.shape)}, expected {tuple(old.shape)}")
            if new.dtype != old.dtype:
                if not cast:
                    raise error(f"{where} has dtype {new.dtype}, expected {old.dtype} (the serving dtype; "
                                f"casting was not asked for)")
                needs_cast = True
        if not needs_cast:
            return self.placed(shardings)
        # Cast and moved in one program, from the placement on those shardings if publish made one (the
        # cast then moves nothing), else from the first: cast on the source devices, fewer bytes move.
        with self._lock:
            source = self._placements.get(_shardings_key(shardings), self.params)
        return reshard(source, shardings, dtypes=jax.tree.map(lambda a: a.dtype, current))

    def layouts(self) -> int:
        """How many placements this version holds (one per distinct target layout asked for)."""
        with self._lock:
            return len(self._placements)

    def __repr__(self) -> str:
        return f"DeviceWeights(version={self.version}, layouts={self.layouts()})"


class DeviceParamSource:
    """The newest `keep` published versions as `DeviceWeights`. Thread-safe; see the module docstring.

    keep: versions kept (older ones are dropped; DeviceWeights already pulled stay valid).
    targets: shardings pytrees that publish places each version on (more with `add_target`).
    """

    def __init__(self, keep: int = 1, targets=()):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.keep = keep
        self._lock = threading.Lock()
        self._versions: dict[int, DeviceWeights] = {}  # in increasing version order
        self._targets: dict[tuple, Any] = {}
        self._reference = None  # shapes and dtypes every version must match, set by the first publish
        self._closed = False
        for target in targets:
            self.add_target(target)

    def add_target(self, shardings) -> None:
        """Places every later version on `shardings` too, at publish (e.g. a JaxEngine's
        `param_shardings`). Adding a layout already registered does nothing."""
        key = _shardings_key(shardings)
        with self._lock:
            self._check_open()
            if self._reference is not None:
                self._check_target(shardings)
            self._targets.setdefault(key, shardings)

    def publish(self, version: int, params) -> DeviceWeights:
        """Copies `params` (a pytree of jax.Arrays; not donated, not kept) on device onto every target
        layout (the arrays' own layout when there is none) and makes it the latest version.

        Raises ValueError, changing nothing, for a version not newer than the latest, a leaf that is not
        a live device array, or shapes/dtypes/structure other than the first version's.
        """
        version = _check_version_number(version)
        device_leaves(params, f"params of version {version}")
        with self._lock:
            self._check_open()
            latest = next(reversed(self._versions), None)
            if latest is not None and version <= latest:
                raise ValueError(f"version {version} is not newer than the latest published version "
                                 f"{latest}")
            reference = self._reference
            targets = dict(self._targets)
        if reference is not None:
            _check_same_layout(params, reference, f"params of version {version}")
        else:
            for shardings in targets.values():
                if jax.tree.structure(shardings) != jax.tree.structure(params):
                    raise ValueError(f"params of version {version} have tree structure "
                                     f"{jax.tree.structure(params)}, a registered target "
                                     f"{jax.tree.structure(shardings)}")
        if not targets:
            own = jax.tree.map(lambda a: a.sharding, params)
            targets = {_shardings_key(own): own}
        # Copies, never aliases: the trainer's next (donating) step must leave these intact.
        placements = {key: reshard(params, shardings, copy=True) for key, shardings in targets.items()}
        weights = DeviceWeights(version, placements)
        with self._lock:
            self._check_open()
            latest = next(reversed(self._versions), None)
            if latest is not None and version <= latest:  # another publisher got there meanwhile
                raise ValueError(f"version {version} is not newer than the latest published version "
                                 f"{latest}")
            if self._reference is None:
                self._reference = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
            self._versions[version] = weights
            while len(self._versions) > self.keep:
                del self._versions[next(iter(self._versions))]
        return weights

    def latest(self) -> int | None:
        """The newest published version, or None before the first publish."""
        with self._lock:
            self._check_open()
            return next(reversed(self._versions), None)

    def versions(self) -> list[int]:
        """The versions still kept, oldest first."""
        with self._lock:
            self._check_open()
            return list(self._versions)

    def get(self, version: int | None = None) -> DeviceWeights:
        """The DeviceWeights of `version` (default the latest); UnknownVersionError if not kept."""
        with self._lock:
            self._check_open()
            if version is None:
                if not self._versions:
                    raise UnknownVersionError("no version has been published yet")
                version = next(reversed(self._versions))
            found = self._versions.get(version) if isinstance(version, (int, np.integer)) else None
            if found is None:
                raise UnknownVersionError(f"version {version!r} is not published; available: "
                                          f"{list(self._versions)}")
            return found

    def pull(self, version: int | None = None) -> tuple[int, DeviceWeights]:
        """(version, DeviceWeights) of `version` (default the latest), as `ParameterService.pull` returns
        (version, HF tensors): what a rollout driver hands to `engine.update_weights`."""
        weights = self.get(version)
        return weights.version, weights

    def close(self) -> None:
        """Drops every version and refuses further calls; DeviceWeights pulled earlier stay valid.
        Idempotent."""
        with self._lock:
            self._closed = True
            self._versions.clear()
            self._targets.clear()

    def __enter__(self) -> DeviceParamSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the device parameter source is closed")

    def _check_target(self, shardings) -> None:
        if jax.tree.structure(shardings) != jax.tree.structure(self._reference):
            raise ValueError(f"target shardings have tree structure {jax.tree.structure(shardings)}, "
                             f"the published params {jax.tree.structure(self._reference)}")
