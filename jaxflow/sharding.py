"""The device mesh and the one table that maps logical array axes to mesh axes.

Parameters are annotated with logical axis names (`embed`, `mlp`, `heads`, ...); the rules below decide
which mesh axis (`data`, `fsdp`, `expert`, `tensor`) each is split over. Every sharding in jaxflow is
derived here.

The `expert` axis splits a mixture-of-experts model's experts (`jaxflow.models.moe`); everything else
treats it as one more axis the batch's rows are split over, so a mesh without experts to split loses
nothing by having it (size 1 by default).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
# The mesh axes a batch's rows are split over.
BATCH_AXES = ("data", "fsdp", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "seq": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "lora_rank": None,
    "experts": "expert",
}


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, expert: int = 1) -> Mesh:
    """A (data, fsdp, expert, tensor) mesh over `devices` (default: all); one size may be -1 to take the
    rest.

    Axis types are Auto so that nnx modules and GSPMD propagate shardings without explicit annotations.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, expert, tensor]
    said = f"data={data} fsdp={fsdp} expert={expert} tensor={tensor}"
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {said}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices cannot be split into {said}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x expert={sizes[2]} x tensor={sizes[3]} needs "
                         f"{int(np.prod(sizes))} devices, {len(devices)} given")
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def rows_per_shard(mesh: Mesh) -> int:
    """How many parts a batch's rows are split into on `mesh` (the product of its batch axes)."""
    return int(np.prod([mesh.shape.get(a, 1) for a in BATCH_AXES]))


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: dict[str, str | tuple[str, ...] | None] | None = None) -> PartitionSpec:
    """The PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`.

    A mesh axis is used at most once per array (first dimension wins), and a dimension that its mesh
    axes do not divide evenly stays replicated: e.g. 2 kv heads on tensor=4 are copied, not padded.
    """
    rules = LOGICAL_RULES if rules is None else rules
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(logical_axes, shape):
        if name is not None and name not in rules:
            raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def named_sharding(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                   rules: dict[str, str | tuple[str, ...] | None] | None = None) -> NamedSharding:
    """`logical_to_spec` wrapped in a NamedSharding on `mesh`."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def state_shardings(state, mesh: Mesh, rules=None):
    """NamedShardings for an nnx State (concrete or abstract) whose Variables carry `logical_axes`.

    Variables without the annotation are replicated.
    """
    def one(var):
        value = var.get_value()
        axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
        return var.replace(value=named_sharding(axes, value.shape, mesh, rules))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def process_block(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> tuple[slice, ...]:
    """The block of a global array of `shape` that this process's devices hold under `sharding`.

    Raises ValueError if that part is not one contiguous block (a mesh whose devices are not grouped by
    process can scatter a process's rows): then no process could feed its part as one array.
    """
    shape = tuple(shape)
    indices = list(sharding.addressable_devices_indices_map(shape).values())
    block = []
    for dim, size in enumerate(shape):
        spans = sorted({idx[dim].indices(size)[:2] for idx in indices})
        covered = set().union(*(range(a, b) for a, b in spans))
        start, stop = spans[0][0], max(b for _, b in spans)
        if covered != set(range(start, stop)):
            raise ValueError(f"process {jax.process_index()} holds the non-contiguous spans {spans} of "
                             f"dimension {dim} under {sharding}; order the mesh's devices by process")
        block.append(slice(start, stop))
    return tuple(block)


def put_global(host, sharding: jax.sharding.Sharding) -> jax.Array:
    """`host`, the whole global array as every process sees it, as one jax.Array with `sharding`.

    On a mesh that spans processes each process feeds only its own block (`process_block`), through
    `jax.make_array_from_process_local_data`: no data crosses between processes (`jax.device_put` of a
    host array onto such a mesh would first check that every process passed the same value, gathering
    the whole array across processes on every call). On one process this is `jax.device_put`.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    host = np.asarray(host)
    return jax.make_array_from_process_local_data(sharding, host[process_block(sharding, host.shape)],
                                                  host.shape)
