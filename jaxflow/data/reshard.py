"""Moving a pytree of device arrays onto other shardings: one call per layout pair, by the route the
devices favour.

A policy version goes from the trainer's layout (e.g. fsdp over all devices) to an engine's (e.g. tensor
parallel, on the same devices, a subset of them, or other devices). `reshard_program` builds, once per
(tree, source shardings, target shardings, dtypes, route), the move, by one of two routes:

- **program** (accelerators): device to device, never through the host.
  1. one jitted program over the source devices re-lays the whole tree (casting it too if asked) into a
     *staging* layout: the target's partition spec on a mesh of the source devices. With as many source
     as target devices each target tile is then a shard on one source device (on that very device where
     the devices are the same, in order); with c times as many, each target tile is cut into c pieces,
     one per source device. Both layouts are written on one mesh that refines the two (`_refinement`), so
     that XLA lowers the change to all-gathers and all-to-alls; nothing goes through the host.
  2. one batched `jax.device_put` copies each shard or piece to the target device that needs it (nothing
     moves for one already in place), and where tiles were cut, one jitted program over the target devices
     joins the pieces.
- **put** (CPU devices): one `jax.device_put` of the whole tree onto the targets, after a cast where it
  narrows (widening casts run on the targets). Leaves whose target slices are not source shards go as
  host arrays that this module gathers from the shards in place (on CPU devices, views of their memory):
  `jax.device_put` would gather them itself, but keep that copy on the source array for as long as the
  source lives (a second version in memory until the trainer's next step frees its state).

Why the route follows the platform (`route="auto"`, the default; `route(...)` or `route=` pick one). On
accelerators `jax.device_put` goes through the host whenever a target slice is not a source shard (it
gathers the array and scatters it again: two PCIe crossings), while the program's collectives run on
NVLink or ICI and its copies are device to device. CPU "devices" share the host's memory: there
`jax.device_put`'s host route is a memcpy into host memory that the target devices then use as it is,
while XLA's CPU collectives are copies plus a rendezvous of every device's thread, and the runtime's
copies between CPU devices cost about as much again. benchmarks/weight_handoff.py times both routes on CPU
devices per layout pair a job makes (`handoff_vs_device_put`, `program_vs_device_put`).

Where every target slice is a source shard but the layout differs, `jax.device_put` hands over a source
shard that already lies on its target device as it is, even when told not to alias; the put route copies
those, so that nothing returned shares a buffer with the source (the trainer's next step donates it).

On the program route, step 1 needs the source's device count to be a multiple of the target's (the target
on the same devices, on a subset, or on as many other devices). Leaves of other pairs (a target on more
devices than the source, or on a count that does not divide it) are cut on the source devices and joined on
each target device, leaf by leaf (`_assembled`): correct, device to device, slower;
`ReshardProgram.leaves_leaf_by_leaf` counts them.

Memory (program route): step 1 holds, transiently on each source device, its share of the staged tree (one
target tile per leaf, or one piece of it); `ReshardProgram.compiled.memory_analysis()` gives it per device,
and `copy_bytes` what step 2 copies into each target device. Put route: the host arrays of the gathered
leaves, until the call returns.
"""


from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

__all__ = ["ROUTES", "ReshardProgram", "reshard", "reshard_program", "route"]

_COPIES = "_reshard_copies"  # the staging mesh's extra axis: copies of the target layout on the source devices


def device_leaves(params, what: str) -> list[tuple[str, jax.Array]]:
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


def check_shardings(shardings) -> list[jax.sharding.Sharding]:
    """The leaves of a pytree of shardings; ValueError naming the first leaf that is not a Sharding."""
    leaves = jax.tree.leaves(shardings)
    for leaf in leaves:
        if not isinstance(leaf, jax.sharding.Sharding):
            raise ValueError(f"target shardings must be a pytree of jax.sharding.Sharding, found a "
                             f"{type(leaf).__name__}")
    return leaves


# ----- the fallback: cut on the source devices, join on each target device, leaf by leaf -----

def _slice_key(index, shape) -> tuple:
    return tuple(sl.indices(n) for sl, n in zip(index, shape))


def _slices_held(shape, source: jax.sharding.Sharding, target: jax.sharding.Sharding) -> bool:
    """Whether some shard of an array laid out by `source` holds each slice that a device of `target` needs."""
    have = {_slice_key(i, shape) for i in source.devices_indices_map(shape).values()}
    return all(_slice_key(i, shape) in have for i in target.devices_indices_map(shape).values())


def _on_host(x: jax.Array) -> np.ndarray:
    """`x` gathered into one new host array, read from its shards in place (CPU devices: views of their
    memory); nothing is kept on `x`."""
    out = np.empty(x.shape, x.dtype)
    done = set()
    for shard in x.addressable_shards:
        key = _slice_key(shard.index, x.shape)
        if key not in done:  # replicas: one of them
            done.add(key)
            out[shard.index] = np.asarray(shard.data)
    return out


def _holds_every_slice(x: jax.Array, target: jax.sharding.Sharding) -> bool:
    """Whether some shard of `x` already holds each slice that a device of `target` needs."""
    return _slices_held(x.shape, x.sharding, target)


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


_cast = jax.jit(lambda a, dtype: a.astype(dtype), static_argnums=1)  # keeps the input's sharding
_cast_all = jax.jit(lambda xs, dtypes: [a.astype(d) for a, d in zip(xs, dtypes)], static_argnums=1)


def _cast_leaves(leaves: list, dtypes: list) -> list:
    """Each leaf cast to its dtype where it lies: one call per device set the leaves span."""
    out: list[Any] = [None] * len(leaves)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    for at in groups.values():
        for i, y in zip(at, _cast_all([leaves[i] for i in at], tuple(np.dtype(dtypes[i]) for i in at))):
            out[i] = y
    return out


def _leaf_by_leaf(x: jax.Array, target: jax.sharding.Sharding, dtype) -> jax.Array:
    """`x` as `dtype` on `target`, a new array (the fallback for leaves the program cannot stage)."""
    if x.dtype != dtype:  # cast where the bytes are, so that fewer of them move
        x = _cast(x, dtype)
    # `jax.device_put` moves shards device to device only when each slice the target needs is a shard
    # already (or the source is one device, sliced in place); otherwise it goes through the host.
    if x.size and len(x.sharding.device_set) > 1 and not _holds_every_slice(x, target):
        y = _assembled(x, target)
    else:
        y = jax.device_put(x, target)
    if _buffers(y) & _buffers(x):  # shards already in place were reused
        y = jax.device_put(y, target, may_alias=False)
    return y


# ----- the program -----

def _as_named(target: jax.sharding.Sharding) -> NamedSharding | None:
    if isinstance(target, NamedSharding):
        return target
    if isinstance(target, SingleDeviceSharding):
        device = next(iter(target.device_set))
        return NamedSharding(Mesh(np.array([device], dtype=object), (_COPIES + "_one",),
                                  axis_types=(AxisType.Auto,)), PartitionSpec())
    return None


def _device_order(s: jax.sharding.Sharding) -> tuple | None:
    """The device list a jitted program over arrays of sharding `s` runs on, in order (None: not known)."""
    if isinstance(s, NamedSharding):
        return tuple(s.mesh.devices.flat)
    if isinstance(s, SingleDeviceSharding):
        return tuple(s.device_set)
    return None


def _staging(shape, source: jax.sharding.Sharding, target: jax.sharding.Sharding, sources: tuple):
    """How step 1 lays out one leaf over the device list `sources`: (staging sharding, split), or None when
    the target spans a device count that does not divide the source's.

    With as many source devices as target devices, the staging sharding is the target's spec on the
    source devices (the target itself when those are its devices, in order); split is None.
    With c times as many, each target tile is cut into c pieces along one dimension, one piece per source
    device (split = (dimension, c)): nothing is held twice, and step 2 joins the pieces on the target
    devices. A leaf too small to cut (no dimension divides) takes c copies of the target layout instead.
    """
    named = _as_named(target)
    if named is None or len(sources) % named.mesh.size:
        return None
    if tuple(named.mesh.devices.flat) == sources:
        return named, None
    c, grid, names = len(sources) // named.mesh.size, named.mesh.devices.shape, named.mesh.axis_names
    mesh = Mesh(np.array(sources, dtype=object).reshape(*grid, c), (*names, _COPIES),
                axis_types=(AxisType.Auto,) * (len(names) + 1))
    if c == 1:
        return NamedSharding(mesh, named.spec), None
    tile = named.shard_shape(tuple(shape))
    entries = list(named.spec) + [None] * (len(shape) - len(named.spec))
    # The pieces along a dimension the source splits (the partitioner then keeps that split where it is),
    # else one the target splits, else the first that divides.
    by_source = [whole != part for whole, part in zip(shape, source.shard_shape(tuple(shape)))]
    for dim in sorted(range(len(shape)), key=lambda d: (not by_source[d], entries[d] is None)):
        if tile[dim] % c == 0 and tile[dim] >= c:
            entry = entries[dim]
            names_at = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            entries[dim] = (*names_at, _COPIES)
            return NamedSharding(mesh, PartitionSpec(*entries)), (dim, c)
    return NamedSharding(mesh, named.spec), None


def _refinement(meshes) -> tuple[Mesh, dict] | None:
    """One mesh over the common device order of `meshes` whose axes refine all of theirs, and per mesh a map
    axis name -> the refined axes it spans (major to minor); None when their axis sizes do not nest.

    Shardings written on different meshes of the same devices are only devices to the partitioner, and it
    replicates an array to re-tile it; written on one mesh, a change of layout is a change of axes, which it
    lowers to all-to-all and slices."""
    cuts = {1}
    for mesh in meshes:
        cuts.update(int(c) for c in np.cumprod(mesh.devices.shape))
    chain = sorted(cuts)
    if any(b % a for a, b in zip(chain, chain[1:])):
        return None
    sizes = [b // a for a, b in zip(chain, chain[1:])]
    names = tuple(f"{_COPIES}_{t}" for t in range(len(sizes)))
    refined = Mesh(np.array(meshes[0].devices.flat, dtype=object).reshape(sizes or [1]), names or (_COPIES,),
                   axis_types=(AxisType.Auto,) * max(len(names), 1))
    spans = {}
    for mesh in meshes:
        lo, axes = 1, {}
        for name, size in zip(mesh.axis_names, mesh.devices.shape):
            hi = lo * size
            axes[name] = tuple(n for n, a, b in zip(names, chain, chain[1:]) if a >= lo and b <= hi)
            lo = hi
        spans[mesh] = axes
    return refined, spans


def _on(refined: Mesh, axes: dict, sharding: NamedSharding) -> NamedSharding:
    """`sharding` written on the refined mesh (the same device of each slice)."""
    spec = []
    for entry in sharding.spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = tuple(r for name in names for r in axes[name])
        spec.append(None if not parts else parts[0] if len(parts) == 1 else parts)
    return NamedSharding(refined, PartitionSpec(*spec))


def _gathered(source: NamedSharding, staged: NamedSharding) -> NamedSharding | None:
    """`source` less the mesh axes that `staged` does not use (both on one mesh), or None if that is
    `source` itself: the partitioner lowers source -> this -> staged as an all-gather then all-to-alls
    and slices, where it would replicate the whole array for the change in one go."""
    used = {name for entry in staged.spec if entry is not None
            for name in ((entry,) if isinstance(entry, str) else entry)}
    spec, dropped = [], False
    for entry in source.spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(n for n in names if n in used)
        dropped = dropped or len(kept) < len(names)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return NamedSharding(source.mesh, PartitionSpec(*spec)) if dropped else None


def _pick_shards(shape, staged: NamedSharding, target: NamedSharding) -> tuple[list, NamedSharding]:
    """(the staged shards' devices to take, one per position of `target`'s mesh in order, and the sharding
    those shards form: `target`'s spec on a mesh of them): the device itself where it holds its slice."""
    has: dict[tuple, list] = {}
    for device, index in staged.devices_indices_map(shape).items():
        has.setdefault(_slice_key(index, shape), []).append(device)
    positions = list(target.mesh.devices.flat)
    wants = target.devices_indices_map(shape)
    chosen: list[Any] = [None] * len(positions)
    for p, device in enumerate(positions):  # first every device that holds its own slice
        holders = has[_slice_key(wants[device], shape)]
        if device in holders:
            chosen[p] = device
            holders.remove(device)
    for p, device in enumerate(positions):
        if chosen[p] is None:
            chosen[p] = has[_slice_key(wants[device], shape)].pop(0)
    mesh = Mesh(np.array(chosen, dtype=object).reshape(target.mesh.devices.shape), target.mesh.axis_names,
                axis_types=(AxisType.Auto,) * len(target.mesh.axis_names))
    return chosen, NamedSharding(mesh, target.spec)


class ReshardProgram:
    """The move of one pytree layout onto another by one route (see the module docstring); built and cached
    by `reshard_program`. Call it with arrays of the abstract params' shapes, dtypes and shardings.

    route: "program" (device to device: steps 1 and 2) or "put" (one batched `jax.device_put`).
    compiled: the `jax.stages.Compiled` step 1 (None when no leaf can be staged, and on the put route): its
      `memory_analysis()` gives per-device argument, output and temp bytes, its `as_text()` the collectives.
    join_compiled: the program over the target devices that joins cut tiles (None when none is cut).
    copy_bytes: bytes that step 2 copies between devices, per target device (a dict device -> bytes; empty
      on the put route).
    leaves_leaf_by_leaf: how many leaves take the leaf-by-leaf fallback instead.
    """

    def __init__(self, treedef, sources: list, targets: list, dtypes: list, donate: bool, route: str = "program"):
        self.treedef, self.targets, self.dtypes, self.donate, self.route = treedef, targets, dtypes, donate, route
        self.shapes = [tuple(s.shape) for s in sources]
        self._source_shardings = [s.sharding for s in sources]
        self.compiled = None  # step 1
        self.join_compiled = None  # the pieces joined on the target devices
        self.copy_bytes: dict[Any, int] = {}
        self.leaves_leaf_by_leaf = 0
        if route == "put":
            # Cast before the move where that narrows (fewer bytes move), after it where it widens.
            self._narrowed = [i for i, (s, d) in enumerate(zip(sources, dtypes))
                              if d != np.dtype(s.dtype) and d.itemsize <= np.dtype(s.dtype).itemsize]
            self._widened = [i for i, (s, d) in enumerate(zip(sources, dtypes))
                             if d != np.dtype(s.dtype) and d.itemsize > np.dtype(s.dtype).itemsize]
            # Leaves whose target slices are not source shards: gathered here (see the module docstring).
            self._via_host = [i for i, (s, t) in enumerate(zip(sources, targets)) if len(s.sharding.device_set) > 1
                              and not _slices_held(self.shapes[i], s.sharding, t)]
            # Leaves jax.device_put may hand over a source buffer of (see `_put`): laid out otherwise, with
            # every target slice a source shard.
            self._may_share = [i for i, (s, t) in enumerate(zip(sources, targets)) if i not in self._via_host
                               and not s.sharding.is_equivalent_to(t, len(self.shapes[i]))]
            return
        self._build_program(sources, targets, dtypes, donate)

    def _build_program(self, sources: list, targets: list, dtypes: list, donate: bool) -> None:
        """Plans and compiles steps 1 and 2 (the program route)."""
        device_lists = {_device_order(s.sharding) for s in sources}  # one program needs one device list
        plans = [None] * len(sources)
        if len(device_lists) == 1 and None not in device_lists:
            devices = next(iter(device_lists))
            plans = [_staging(shape, s.sharding, t, devices) for shape, s, t in zip(self.shapes, sources, targets)]
        # Leaves cut into pieces are joined by one program over the target devices: those of the first.
        split_devices = next((_device_order(targets[i]) for i, p in enumerate(plans) if p and p[1]), None)
        for i, plan in enumerate(plans):
            if plan and plan[1] and _device_order(targets[i]) != split_devices:
                plans[i] = None
        self._program = [i for i, p in enumerate(plans) if p is not None]
        self._fallback = [i for i, p in enumerate(plans) if p is None]
        self.leaves_leaf_by_leaf = len(self._fallback)
        self._whole: dict[int, tuple[list, NamedSharding]] = {}  # leaf -> (devices to take, their sharding)
        self._pieces: dict[int, list[tuple[list, NamedSharding]]] = {}  # leaf -> per piece, the same
        self._splits: dict[int, tuple[int, int]] = {}  # leaf -> (dimension cut, pieces)
        for i in self._program:
            named, (staged, split) = _as_named(targets[i]), plans[i]
            tile = named.shard_shape(self.shapes[i])
            nbytes = int(np.prod(tile)) * np.dtype(dtypes[i]).itemsize
            if split is None:
                self._whole[i] = _pick_shards(self.shapes[i], staged, named)
                held = [(self._whole[i][0], nbytes)]
            else:
                self._splits[i] = split
                c, grid = split[1], named.mesh.devices.shape
                at = np.array(staged.mesh.devices.flat, dtype=object).reshape(-1, c)  # [tile, piece] -> device
                self._pieces[i] = [
                    (list(at[:, j]), NamedSharding(Mesh(at[:, j].reshape(grid), named.mesh.axis_names,
                                                        axis_types=named.mesh.axis_types), named.spec))
                    for j in range(c)]
                held = [(taken, nbytes // c) for taken, _ in self._pieces[i]]
            for taken, size in held:
                for device, wanted in zip(taken, named.mesh.devices.flat):
                    if device != wanted:
                        self.copy_bytes[wanted] = self.copy_bytes.get(wanted, 0) + size
        self._inputs: list | None = None  # the sources written on the refined mesh, where there is one
        # Leaves whose pieces are the source's own shards skip step 1: the join makes their new buffers.
        direct = {i for i in self._splits if dtypes[i] == np.dtype(sources[i].dtype)
                  and plans[i][0].is_equivalent_to(self._source_shardings[i], len(self.shapes[i]))}
        self._staged = [i for i in self._program if i not in direct]
        self._final = {i for i in self._staged if plans[i][0] == targets[i]}  # step 1 makes the target's shards
        if self._pieces:
            self._compile_join(targets, dtypes)
        if not self._staged:
            return
        ins = [_as_named(self._source_shardings[i]) for i in self._staged]
        outs = [plans[i][0] for i in self._staged]
        moves = any(not self._source_shardings[i].is_equivalent_to(o, len(self.shapes[i]))
                    for i, o in zip(self._staged, outs))
        refined = None if None in ins or not moves else _refinement(list({s.mesh: None for s in ins + outs}))
        gathered = [None] * len(ins)
        if refined is not None:
            mesh, spans = refined
            ins = [_on(mesh, spans[s.mesh], s) for s in ins]
            outs = [_on(mesh, spans[s.mesh], s) for s in outs]
            gathered = [_gathered(a, b) for a, b in zip(ins, outs)]
            self._inputs = ins
        else:
            ins = [self._source_shardings[i] for i in self._staged]
        out_dtypes = [dtypes[i] for i in self._staged]

        def move(leaves):
            out = []
            for a, dtype, middle in zip(leaves, out_dtypes, gathered):
                narrower = np.dtype(dtype).itemsize <= a.dtype.itemsize
                a = a.astype(dtype) if narrower else a  # cast where fewer bytes then move
                if middle is not None:
                    a = jax.lax.with_sharding_constraint(a, middle)
                # `copy`: a fresh buffer even where the layout is already the staging one.
                out.append(jnp.copy(a if narrower else a.astype(dtype)))
            return out

        abstract = [jax.ShapeDtypeStruct(self.shapes[i], sources[i].dtype, sharding=s)
                    for i, s in zip(self._staged, ins)]
        self.compiled = jax.jit(move, out_shardings=outs,
                                donate_argnums=(0,) if donate else ()).lower(abstract).compile()

    def _compile_join(self, targets: list, dtypes: list) -> None:
        """The program over the target devices that stacks each cut leaf's pieces back into its tiles."""
        joined = list(self._pieces)
        splits = [(*self._splits[i], _as_named(targets[i]).shard_shape(self.shapes[i])) for i in joined]
        shapes = [self.shapes[i] for i in joined]

        def join(pieces):
            out = []
            for parts, shape, (dim, c, tile) in zip(pieces, shapes, splits):
                grid = (*shape[:dim], shape[dim] // tile[dim], tile[dim] // c, *shape[dim + 1:])
                out.append(jnp.stack([p.reshape(grid) for p in parts], axis=dim + 1).reshape(shape))
            return out

        abstract = [[jax.ShapeDtypeStruct(self._piece_shape(i), dtypes[i], sharding=_as_named(targets[i]))
                     for _ in self._pieces[i]] for i in joined]
        self.join_compiled = jax.jit(join, out_shardings=[targets[i] for i in joined]).lower(abstract).compile()

    def _piece_shape(self, i: int) -> tuple:
        (dim, c), shape = self._splits[i], self.shapes[i]
        return (*shape[:dim], shape[dim] // c, *shape[dim + 1:])

    def __call__(self, params):
        """`params` on the target shardings (in the target dtypes), new arrays; with `donate`, the staged
        leaves' inputs are invalidated (on the put route, every input)."""
        leaves = self.treedef.flatten_up_to(params)
        if self.route == "put":
            return self.treedef.unflatten(self._put(leaves))
        out: list[Any] = [None] * len(leaves)
        if self._program:
            staged = {i: leaves[i] for i in self._program}
            if self.compiled is not None:
                inputs = [leaves[i] for i in self._staged]
                if self._inputs is not None:  # the same shards under the refined mesh's names: no transfer
                    inputs = jax.device_put(inputs, self._inputs)
                staged.update(zip(self._staged, self.compiled(inputs)))
            relabelled, targets, at = [], [], []
            for i, y in staged.items():
                if i in self._final:  # the target's own shards, under another name or already its own
                    relabelled.append(y)
                    targets.append(self.targets[i])
                    at.append(i)
                    continue
                by_device = {shard.device: shard.data for shard in y.addressable_shards}
                parts = [self._whole[i]] if i in self._whole else self._pieces[i]
                shape = self.shapes[i] if i in self._whole else self._piece_shape(i)
                for taken, sharding in parts:
                    relabelled.append(jax.make_array_from_single_device_arrays(
                        shape, sharding, [by_device[d] for d in taken]))
                    targets.append(self.targets[i] if i in self._whole else _as_named(self.targets[i]))
                    at.append(i)
            # One call for every leaf: shards already in place stay, the others are copied device to device.
            moved: dict[int, list] = {}
            for i, y in zip(at, jax.device_put(relabelled, targets)):
                moved.setdefault(i, []).append(y)
            for i in self._whole:
                out[i] = moved[i][0]
            if self.join_compiled is not None:
                for i, y in zip(self._pieces, self.join_compiled([moved[i] for i in self._pieces])):
                    out[i] = y
        for i in self._fallback:
            out[i] = _leaf_by_leaf(leaves[i], self.targets[i], self.dtypes[i])
        return self.treedef.unflatten(out)

    def _put(self, leaves: list) -> list:
        """The put route: narrowing casts where the bytes are, one `jax.device_put` of every leaf, widening
        casts on the targets."""
        moving = list(leaves)
        for i, y in zip(self._narrowed, _cast_leaves([leaves[i] for i in self._narrowed],
                                                     [self.dtypes[i] for i in self._narrowed])):
            moving[i] = y
        fresh = set(self._narrowed)  # a cast made these: the move may keep their buffers
        for i in self._via_host:
            moving[i] = _on_host(moving[i])
            fresh.add(i)
        out = jax.device_put(moving, self.targets, may_alias=[i in fresh for i in range(len(moving))])
        # Where a target shard is a source shard already on its device, jax.device_put hands that buffer
        # over even when told not to alias (it picks up such shards as they are).
        shared = [i for i in self._may_share if i not in fresh and _buffers(out[i]) & _buffers(leaves[i])]
        if shared:
            for i, y in zip(shared, jax.device_put([out[i] for i in shared], [self.targets[i] for i in shared],
                                                   may_alias=False)):
                out[i] = y
        if self._widened:  # the cast's output sharding is an equivalent one: relabelled, not moved
            cast = _cast_leaves([out[i] for i in self._widened], [self.dtypes[i] for i in self._widened])
            for i, y in zip(self._widened, jax.device_put(cast, [self.targets[i] for i in self._widened],
                                                           may_alias=True)):
                out[i] = y
        if self.donate:  # the program route's contract: the inputs are the callee's now
            for x in leaves:
                x.delete()
        return out


ROUTES = ("auto", "program", "put")
_ROUTE: contextvars.ContextVar[str] = contextvars.ContextVar("reshard_route", default="auto")


@contextlib.contextmanager
def route(name: str):
    """Within the block, `reshard` and `reshard_program` calls that name no route take `name` (one of
    `ROUTES`); e.g. `route("program")` runs the accelerator route on CPU devices, to test or time it."""
    _check_route(name)
    token = _ROUTE.set(name)
    try:
        yield
    finally:
        _ROUTE.reset(token)


def _check_route(name) -> None:
    if name not in ROUTES:
        raise ValueError(f"reshard route must be one of {ROUTES}, got {name!r}")


def _resolved_route(name: str | None, sources: list, targets: list) -> str:
    """"program" or "put" for this pair: `name`, else the one `route` set, else by the devices' platform
    (the module docstring says why)."""
    name = _ROUTE.get() if name is None else name
    _check_route(name)
    if name != "auto":
        return name
    devices = set().union(*(s.sharding.device_set for s in sources), *(t.device_set for t in targets))
    return "put" if all(d.platform == "cpu" for d in devices) else "program"


_PROGRAMS: dict[tuple, ReshardProgram] = {}
_PROGRAMS_LOCK = threading.Lock()
_MAX_PROGRAMS = 64  # layout pairs kept compiled; a job has a handful


def reshard_program(abstract_params, target_shardings, *, dtypes=None, donate: bool = False,
                    route: str | None = None) -> ReshardProgram:
    """The move (compiled once) of arrays laid out as `abstract_params` onto `target_shardings`.

    abstract_params: a pytree of `jax.ShapeDtypeStruct`s with their `sharding` set (or of jax.Arrays):
      the source layout. No array is allocated to build the program.
    target_shardings: the same pytree structure of `jax.sharding.Sharding`s, e.g.
      `sharding.state_shardings(params, engine_mesh)` or a JaxEngine's `param_shardings`.
    dtypes: None (keep each leaf's dtype) or the same pytree structure of dtypes to cast to on the way
      (cast on the source devices, before anything moves).
    donate: let the program reuse the source's buffers (they are invalidated by the call).
    route: one of `ROUTES`; None takes the one `route(...)` set (default "auto": "put" when every device
      is a CPU device, else "program"; see the module docstring).

    Compiled once per (structure, shapes, dtypes, source shardings, targets, donate, route) and cached.
    Raises ValueError for structures that differ, a leaf without a sharding, or an unknown route.
    """
    flat, treedef = jax.tree.flatten(abstract_params)
    targets = check_shardings(target_shardings)
    if jax.tree.structure(target_shardings) != treedef:
        raise ValueError(f"target shardings have tree structure {jax.tree.structure(target_shardings)}, "
                         f"the params {treedef}")
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        if not isinstance(getattr(leaf, "sharding", None), jax.sharding.Sharding):
            raise ValueError(f"reshard_program: leaf {jax.tree_util.keystr(path)} has no sharding (a "
                             f"jax.ShapeDtypeStruct needs sharding=...)")
    if dtypes is None:
        out_dtypes = [np.dtype(a.dtype) for a in flat]
    else:
        out_dtypes = [np.dtype(d) for d in treedef.flatten_up_to(dtypes)]
    chosen = _resolved_route(route, flat, targets)
    key = (treedef, tuple((tuple(a.shape), np.dtype(a.dtype), a.sharding) for a in flat), tuple(targets),
           tuple(out_dtypes), bool(donate), chosen)
    with _PROGRAMS_LOCK:
        found = _PROGRAMS.get(key)
    if found is not None:
        return found
    program = ReshardProgram(treedef, flat, targets, out_dtypes, bool(donate), chosen)
    with _PROGRAMS_LOCK:
        while len(_PROGRAMS) >= _MAX_PROGRAMS:
            del _PROGRAMS[next(iter(_PROGRAMS))]
        return _PROGRAMS.setdefault(key, program)


def reshard(params, target_shardings, *, copy: bool = False, dtypes=None, route: str | None = None):
    """`params` (a pytree of jax.Arrays) moved onto `target_shardings` (the same pytree structure, e.g.
    `sharding.state_shardings(params, engine_mesh)`) by `reshard_program`, in one call for the tree.

    Arrays already laid out as asked (and of the asked dtype) are returned as is (same buffers) unless
    `copy`; with `copy` nothing in the result shares a buffer with `params`. Nothing is donated: the
    inputs stay valid. On the program route (accelerators) transfers from the host are refused (transfer
    guard), so a path through the host fails loudly; the put route (CPU devices, whose memory is the
    host's) is `jax.device_put`'s own. dtypes, route: as for `reshard_program`.
    """
    device_leaves(params, "reshard")
    if jax.tree.structure(target_shardings) != jax.tree.structure(params):
        raise ValueError(f"target shardings have tree structure {jax.tree.structure(target_shardings)}, "
                         f"the params {jax.tree.structure(params)}")
    targets = check_shardings(target_shardings)
    leaves, treedef = jax.tree.flatten(params)
    want = [np.dtype(a.dtype) for a in leaves] if dtypes is None else \
        [np.dtype(d) for d in treedef.flatten_up_to(dtypes)]
    out = list(leaves)
    move = []
    for i, (x, t, d) in enumerate(zip(leaves, targets, want)):
        if copy or x.dtype != d or not x.sharding.is_equivalent_to(t, x.ndim):
            move.append(i)
        elif x.sharding != t:  # the same shards under the target's name: no transfer
            out[i] = jax.device_put(x, t)
    if move:
        sub = [leaves[i] for i in move]
        program = reshard_program(sub, [targets[i] for i in move], dtypes=[want[i] for i in move], route=route)
        # The put route leaves the caller's guard as it is.
        guard = jax.transfer_guard_host_to_device("disallow_explicit") if program.route == "program" \
            else contextlib.nullcontext()
        with guard:
            moved = program(sub)
        for i, y in zip(move, moved):
            out[i] = y
    return treedef.unflatten(out)
