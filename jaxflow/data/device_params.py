"""Policy weights handed to JAX engines in the trainer's own process without leaving the devices.

The parameter service carries each version as HF-named host tensors: what vLLM and other processes need,
but for a JAX engine in the same process it is a detour (device -> host -> HF layout -> host -> device).
`DeviceParamSource` keeps the newest published versions as arrays on device instead, and
`DeviceWeights.placed(shardings)` moves a version onto an engine's own mesh with `reshard`: device to
device, never through the host (`jax.device_put` alone gathers an array on the host when the engine's
slices are not shards of the source; `reshard` cuts and joins them on the devices instead).

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
import jax.numpy as jnp
import numpy as np

from jaxflow.data.param_service import UnknownVersionError

__all__ = ["DeviceParamSource", "DeviceWeights", "UnknownVersionError", "reshard"]


def _check_version_number(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"a version must be a non-negative int, got {version!r}")
    return int(version)


def _device_leaves(params, what: str) -> list[tuple[str, jax.Array]]:
    """(path, array) of every leaf of `params`; raises ValueError naming a leaf that is not a live
    jax.Array (a host array would need a host transfer; a deleted one was donated)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if not isinstance(leaf, jax.Array):
            raise ValueError(f"{what}: leaf {name} is a {type(leaf).__name__}, not a jax.Array on device")
        if leaf.is_deleted():
            raise ValueError(f"{what}: leaf {name} was deleted (donated to a jitted call?)")
        out.append((name, leaf))
    return out


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
    leaves = jax.tree.leaves(shardings)
    for leaf in leaves:
        if not isinstance(leaf, jax.sharding.Sharding):
            raise ValueError(f"target shardings must be a pytree of jax.sharding.Sharding, found a "
                             f"{type(leaf).__name__}")
    return (jax.tree.structure(shardings), tuple(leaves))


def _slice_key(index, shape) -> tuple:
    return tuple(sl.indices(n) for sl, n in zip(index, shape))


def _holds_every_slice(x: jax.Array, target: jax.sharding.Sharding) -> bool:
    """Whether some shard of `x` already holds each slice that a device of `target` needs."""
    have = {_slice_key(i, x.shape) for i in x.sharding.devices_indices_map(x.shape).values()}
    return all(_slice_key(i, x.shape) in have for i in target.devices_indices_map(x.shape).values())


def _join(pieces: list[tuple[tuple[int, ...], jax.Array]], dim: int = 0) -> jax.Array:
    """The array tiled by `pieces` ((offset per dimension, block)), a regular grid."""
    if len(pieces) == 1:
        return pieces[0][1]
    offsets = sorted({offset[dim] for offset, _ in pieces})
    if len(offsets) == 1:
        return _join(pieces, dim + 1)
    rows = [_join([p for p in pieces if p[0][dim] == o], dim + 1) for o in offsets]
    return jnp.concatenate(rows, axis=dim)


# One call per source shard cuts all its blocks, one per target shard joins them: bounds and grid are
# static (eager indexing would send them from the host), and few calls keep dispatch overhead low.
_cut = jax.jit(lambda buffer, bounds: tuple(jax.lax.slice(buffer, lo, hi) for lo, hi in bounds),
               static_argnums=1)
_glue = jax.jit(lambda blocks, offsets: _join(list(zip(offsets, blocks))), static_argnums=1)


def _assembled(x: jax.Array, target: jax.sharding.Sharding) -> jax.Array:
    """`x` on `target`, each target shard built on its device from the blocks of the source shards that
    overlap it: cut on the source device, copied device to device, joined on the target device. Only the
    bytes a target device needs reach it, and the array is never whole anywhere unless the target holds
    it whole."""
    shape = x.shape
    sources: dict[tuple, list[jax.Array]] = {}
    for shard in x.addressable_shards:  # replicas share a key
        sources.setdefault(_slice_key(shard.index, shape), []).append(shard.data)
    cuts: dict[int, tuple[jax.Array, list]] = {}  # id(source buffer) -> (buffer, [(lo, hi)])
    plan = []  # per target device: (device, [(offset in its shard, source buffer id, cut number)])
    for device, index in target.addressable_devices_indices_map(shape).items():
        want = _slice_key(index, shape)
        pieces = []
        for have, buffers in sources.items():
            overlap = [(max(h[0], w[0]), min(h[1], w[1])) for h, w in zip(have, want)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            buffer = next((b for b in buffers if b.devices() == {device}), buffers[0])
            bounds = cuts.setdefault(id(buffer), (buffer, []))[1]
            bound = (tuple(lo - h[0] for (lo, _), h in zip(overlap, have)),
                     tuple(hi - h[0] for (_, hi), h in zip(overlap, have)))
            if bound not in bounds:  # a block that several target devices need is cut once
                bounds.append(bound)
            offset = tuple(lo - w[0] for (lo, _), w in zip(overlap, want))
            pieces.append((offset, id(buffer), bounds.index(bound)))
        plan.append((device, pieces))
    blocks = {key: _cut(buffer, tuple(bounds)) for key, (buffer, bounds) in cuts.items()}
    wanted = [(blocks[key][n], device) for device, pieces in plan for _, key, n in pieces]
    moved = iter(jax.device_put([b for b, _ in wanted], [d for _, d in wanted]))
    shards = []
    for _device, pieces in plan:
        here = [next(moved) for _ in pieces]
        shards.append(here[0] if len(here) == 1 else _glue(tuple(here), tuple(o for o, _, _ in pieces)))
    return jax.make_array_from_single_device_arrays(shape, target, shards)


def _buffers(x: jax.Array) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def _reshard_leaf(x: jax.Array, target: jax.sharding.Sharding, copy: bool) -> jax.Array:
    if x.sharding.is_equivalent_to(target, x.ndim):
        return jax.device_put(x, target, may_alias=False if copy else None)
    # `jax.device_put` moves shards device to device only when each slice the target needs is a shard
    # already (or the source is one device, sliced in place); otherwise it goes through the host (it
    # gathers the whole array there and scatters it again). So those are cut and joined on devices.
    if x.size and len(x.sharding.device_set) > 1 and not _holds_every_slice(x, target):
        y = _assembled(x, target)
    else:
        y = jax.device_put(x, target)
    if copy and _buffers(y) & _buffers(x):  # shards already in place were reused
        y = jax.device_put(y, target, may_alias=False)
    return y


def reshard(params, target_shardings, *, copy: bool = False):
    """`params` (a pytree of jax.Arrays) moved onto `target_shardings` (the same pytree structure, e.g.
    `sharding.state_shardings(params, engine_mesh)`), device to device.

    Where the target's slices are shards already (or the source is one device), each is copied to its
    device by `jax.device_put`; otherwise each target shard is cut from the overlapping source shards
    on their devices, copied, and joined on its device (`jax.device_put` alone would gather the array
    on the host and scatter it again). Arrays
    already laid out as asked are returned as is (same buffers) unless `copy`; with `copy` nothing in
    the result shares a buffer with `params`. Nothing is donated: the inputs stay valid. Transfers from
    the host are refused (transfer guard), so a path through the host fails loudly.
    """
    _device_leaves(params, "reshard")
    if jax.tree.structure(target_shardings) != jax.tree.structure(params):
        raise ValueError(f"target shardings have tree structure {jax.tree.structure(target_shardings)}, "
                         f"the params {jax.tree.structure(params)}")
    _shardings_key(target_shardings)
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        return jax.tree.map(lambda x, t: _reshard_leaf(x, t, copy), params, target_shardings)


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
        params = self.placed(shardings)
        if needs_cast:  # relabelled with the receiver's shardings, so that none of its programs recompiles
            params = jax.device_put(jax.tree.map(lambda a, old: a.astype(old.dtype), params, current), shardings)
        return params

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
        _device_leaves(params, f"params of version {version}")
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
