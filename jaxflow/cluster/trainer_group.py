"""The RL job's trainer as N Ray actors forming one JAX mesh, driven from the job's process.

    group = TrainerGroup(spec, num_processes=2, tag=tag)   # spec: `TrainerGroup.spec(...)`
    version, extra = group.start()      # the processes join, build the trainer, restore the newest checkpoint
    metrics, staleness = group.train(consumed)              # every process the same buffer, its own rows
    group.publish(trajectories, board)  # mark v published, then every process puts its shards; one manifest
    group.checkpoint(None, extra)       # every process writes its shards of the state (orbax, multi-process)

Each actor (`TrainerActor`, Ray name `names.trainer(tag, i)`) is a fresh Ray worker process: it joins the
process group (`distributed.initialize`, process 0's actor picking the coordinator's address), lays
`distributed.global_mesh` over every process's devices, builds the usual `RLTrainer` (the same compiled
step as on one process) from the base model directory and restores the newest checkpoint of the run, if
any. One GPU each where the cluster has GPUs, one CPU otherwise (`cpu_devices` CPU devices each for CPU
hosts and tests).

Weights leave without a gather: every process converts the parameter shards it holds (replica 0 only)
to HF layout pieces (`hf_pieces`) and puts them into Ray's object store (`weights.put_shards`); the
driver merges the parts into one manifest (`weights.merge_manifests`) and commits it to the run's
`ManifestBoard`, where engines find it (`BoardSource`). A tensor whose shards do not map to blocks of
its HF layout is gathered and put whole by process 0.

A group cannot heal: when one process dies (or a call times out) every call raises `TrainerGroupFailed`
naming it, and the driver ends the group (`close`) and forms a new one in fresh processes, which
restores the newest checkpoint (`jaxflow.jobs.rl_cluster`).
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_collections
import numpy as np

from jaxflow.cluster import names, weights
from jaxflow.cluster.ray_actors import actor_options, jax_env, require_ray
from jaxflow.data.records import ConsumedBatch
from jaxflow.trainer import distributed

__all__ = ["TrainerActor", "TrainerGroup", "TrainerGroupFailed", "hf_pieces"]


class TrainerGroupFailed(distributed.ProcessGroupError):
    """A trainer process died or stopped answering: the group must be formed anew."""


def _flat_start(starts, lens, sizes) -> int | None:
    """Where a block (starts, lens) of an array of `sizes` begins in its row-major flattening, or None if
    the block is not one contiguous run there (a dim before the first split one has more than one index,
    or a dim after it is not whole)."""
    lead = next((i for i, n in enumerate(lens) if n != 1), len(lens) - 1)
    if any(lens[i] != sizes[i] for i in range(lead + 1, len(lens))):
        return None
    return int(np.ravel_multi_index(tuple(starts), tuple(sizes))) if sizes else 0


def _hf_block(row, starts, lens, shape) -> tuple[list[int], list[int]] | None:
    """(start, shape) in the HF tensor of the block (starts, lens) of a per-layer jaxflow array of `shape`,
    or None if it is not one block there."""
    if row.in_dims is not None:
        k = row.in_dims
        a, b = _flat_start(starts[:k], lens[:k], shape[:k]), _flat_start(starts[k:], lens[k:], shape[k:])
        if a is None or b is None:
            return None
        return [b, a], [math.prod(lens[k:]), math.prod(lens[:k])]
    r = row.hf_rank - 1
    rest = _flat_start(starts[r:], lens[r:], shape[r:])
    return None if rest is None else ([*starts[:r], rest], [*lens[:r], math.prod(lens[r:])])


def _blocks(array, stacked: bool) -> list[tuple[list[int], list[int]]] | None:
    """Every device's block of `array` as (starts, lens) per layer-free dims, or None if one of them is
    not a block of the HF layout (the same answer in every process: it reads the global sharding)."""
    out = []
    for index in array.sharding.devices_indices_map(array.shape).values():
        starts = [s.indices(n)[0] for s, n in zip(index, array.shape)]
        lens = [len(range(*s.indices(n))) for s, n in zip(index, array.shape)]
        out.append((starts[1:], lens[1:]) if stacked else (starts, lens))
    return out


def hf_pieces(model) -> Iterator[tuple[str, list[int], list[int], np.ndarray]]:
    """This process's part of the policy in HF layout: (HF name, whole HF shape, start, piece) for every
    parameter shard it holds as replica 0, ready for `weights.put_shards`. Parameters whose shards are not
    blocks of their HF tensors are gathered (a collective: every process must call this) and yielded
    whole by process 0."""
    import jax
    from jax.experimental import multihost_utils

    from jaxflow.models.hf_io import _param
    from jaxflow.models.names import tensor_maps

    cfg = model.config
    spec = model.layers.lora
    for row in tensor_maps(cfg, model.layers.names):
        array = _param(model, row.path)
        if spec is not None and row.path[0] == "layers" and row.path[-1] in spec.targets:
            array = _merged(array, getattr(model.layers, f"{row.path[-1]}_lora_a")[...],
                            getattr(model.layers, f"{row.path[-1]}_lora_b")[...], spec.scale)
        shape = tuple(array.shape[row.lead:])
        hf_shape = list(row.hf_shape(shape))
        # Expert rows (one HF tensor per layer and expert) are gathered whole rather than cut in blocks.
        ok = not row.experts and all(_hf_block(row, s, n, shape) is not None
                                     for s, n in _blocks(array, row.stacked))
        if not ok:  # gather this one; process 0 puts it whole
            whole = np.asarray(multihost_utils.process_allgather(array, tiled=True))
            if jax.process_index() == 0:
                for name, index in row.units():
                    yield name, hf_shape, [0] * len(hf_shape), np.ascontiguousarray(row.to_hf(whole[index]))
            continue
        for shard in array.addressable_shards:
            if shard.replica_id != 0:
                continue
            data = np.asarray(shard.data)
            starts = [s.indices(n)[0] for s, n in zip(shard.index, array.shape)]
            if row.stacked:
                for j in range(data.shape[0]):
                    start, piece_shape = _hf_block(row, starts[1:], list(data.shape[1:]), shape)
                    piece = row.to_hf(data[j]).reshape(piece_shape)
                    yield row.hf_name(row.layers[starts[0] + j]), hf_shape, start, np.ascontiguousarray(piece)
            else:
                start, piece_shape = _hf_block(row, starts, list(data.shape), shape)
                yield row.hf_name(), hf_shape, start, np.ascontiguousarray(row.to_hf(data).reshape(piece_shape))


def _merged(w, a, b, scale: float):
    """A LoRA target as the engines take it, W + scale * A B, computed where W's shards live (a jitted
    program on the global arrays: every process calls it) and laid out as W."""
    return _merge_program(scale, w.sharding)(w, a, b)


@functools.cache
def _merge_program(scale: float, out_sharding):
    """The jitted merge for one scale and output layout, made once per process: a fresh function per call
    would be traced and compiled again at every publish."""
    import jax
    import jax.numpy as jnp

    def merge(w, a, b):
        delta = jnp.matmul(a.reshape(a.shape[0], -1, a.shape[-1]).astype(jnp.float32),
                           b.reshape(b.shape[0], b.shape[1], -1).astype(jnp.float32))
        return (w.astype(jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)

    return jax.jit(merge, out_shardings=out_sharding)


def cache_every_process() -> None:
    """Lets this process write the programs it compiles to the persistent compilation cache, as process 0 does.

    JAX writes cache entries from process 0 only (so that processes do not contend for one entry on a
    shared filesystem), but a multi-process program's cache key holds the process's index: the entries of
    the other processes are never written, and they compile every program afresh in each group they form,
    so a re-formed group waits for process 1's full train-step compile while process 0 reads its own from
    the cache. Their keys differ from process 0's, so writing them contends for nothing. Call it after
    joining the group; without JAX's private cache writer (another JAX version) it changes nothing.
    """
    import jax
    try:
        from jax._src import compilation_cache, compiler
        original, put = compiler._cache_write, compilation_cache.put_executable_and_time
    except (ImportError, AttributeError):
        return
    if jax.process_index() == 0 or getattr(original, "every_process", False):
        return

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        # JAX's own conditions but the process's: no host callbacks, a compile worth keeping.
        if (host_callbacks or not compilation_cache.is_persistent_cache_enabled()
                or compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs):
            return
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs a compile, nothing more
            print(f"jaxflow: not caching {module_name} ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

    write.every_process = True
    compiler._cache_write = write


class TrainerActor:
    """The body of one trainer process's actor (see the module docstring)."""

    def address(self) -> str:
        """"ip:port" on this actor's node, with a port free there a moment ago: the group's coordinator."""
        return f"{require_ray().util.get_node_ip_address()}:{distributed.free_port()}"

    def start(self, address: str, num_processes: int, process_id: int, spec: dict[str, Any]) -> dict[str, Any]:
        """Joins the group, builds the trainer on the global mesh and restores the newest checkpoint of
        `spec["checkpoints"]` if there is one. {"version", "extra" (the checkpoint's, or None), "compile_s",
        "batch_shape", "damaged" (checkpoint steps passed over), "pid"}."""
        distributed.initialize(address, num_processes, process_id, timeout_s=spec["init_timeout_s"],
                               heartbeat_timeout_s=spec["heartbeat_timeout_s"])
        cache_every_process()
        from jaxflow.models import hf_io
        from jaxflow.models.lora import LoRASpec
        from jaxflow.trainer.checkpoint import Checkpointer
        from jaxflow.trainer.rl_trainer import RLTrainer

        mesh = distributed.global_mesh(fsdp=spec["fsdp"], tensor=spec["tensor"], expert=spec.get("expert", 1))
        # Adapters start from the same seed in every process (and as the single-process job's would).
        model = hf_io.load_model(spec["model_dir"], mesh=mesh, lora=LoRASpec.from_config(spec["trainer"].get("lora")),
                                 lora_seed=spec["lora_seed"], param_dtype=spec["trainer"].get("param_dtype", "float32"))
        self.trainer = RLTrainer(model, spec["trainer"], mesh, seq_len=spec["seq_len"],
                                 max_sequences=spec["max_sequences"],
                                 compute_dtype=spec["compute_dtype"])
        self.mesh, self.process_id = mesh, process_id
        self.ckpt = Checkpointer(spec["checkpoints"], max_to_keep=spec["max_to_keep"])
        self.validate_extra = spec.get("validate_extra")
        extra = self.restore_latest()[1] if self.ckpt.latest_step() is not None else None
        return {"version": self.trainer.version, "extra": extra, "compile_s": self.trainer.compile_s,
                "batch_shape": list(self.trainer.batch_shape), "damaged": list(self.ckpt.damaged),
                "pid": os.getpid(), "mesh": dict(mesh.shape), "trainable_params": self.trainer.trainable_params,
                "frozen_params": self.trainer.frozen_params}

    def restore_latest(self) -> tuple[int, dict, list[list]]:
        """Rolls the trainer back to the newest intact checkpoint; (its version, its extra, the damaged
        steps passed over as [step, why])."""
        from jaxflow.trainer.state import abstract_train_state
        state, extra = self.ckpt.restore(abstract_train_state(self.trainer.model(), self.trainer.tx, self.mesh),
                                         validate=self.validate_extra)
        self.trainer.state = state
        return self.trainer.version, extra, [list(d) for d in self.ckpt.damaged]

    def set_aside(self, steps: list[int]) -> list[str]:
        """Process 0 moves the damaged `steps` out of the step list (`Checkpointer.set_aside`) and returns
        where they went; the others re-read the step list (call them after process 0)."""
        if self.process_id == 0:
            return [str(self.ckpt.set_aside(step)) for step in steps]
        self.ckpt.reload()
        return []

    def train(self, consumed: ConsumedBatch) -> tuple[dict[str, float], dict[int, int], int]:
        """One update; (metrics, staleness histogram, train-step compiles so far)."""
        metrics, staleness = self.trainer.train(consumed)
        return metrics, staleness, self.trainer.compiles

    def put_weights(self) -> dict | None:
        """This process's part of the current version's manifest (None if it holds no replica-0 shard)."""
        pieces = list(hf_pieces(self.trainer.model()))
        return weights.put_shards(self.trainer.version, pieces) if pieces else None

    def params(self) -> dict[str, np.ndarray] | None:
        """Every parameter gathered to host, by path (a collective; process 0 returns it, the others None):
        for checks against a single-process run."""
        import jax
        gathered = distributed.gather_params(self.trainer.state.params)
        return gathered if jax.process_index() == 0 else None

    def save(self, extra: dict) -> bool:
        """Checkpoints the current version with `extra` (every process writes its shards)."""
        started = self.ckpt.save(self.trainer.version, self.trainer.state, extra, force=True)
        self.ckpt.wait_until_finished()
        return started

    def export(self, directory: str, tokenizer_dir: str, adapter_dir: str | None = None) -> str | None:
        """Gathers the policy (a collective) and, in process 0, writes it as an HF model to `directory`
        (LoRA merged) and, with LoRA and an `adapter_dir`, the adapters alone in PEFT's format there."""
        import jax
        from flax import nnx
        from jax.experimental import multihost_utils

        from jaxflow.models import hf_io
        model = self.trainer.model()
        graphdef, state = nnx.split(model)
        host = jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), state)
        if jax.process_index() != 0:
            return None
        local = nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, host))
        if local.layers.lora is not None and adapter_dir is not None:
            from jaxflow.models import lora
            lora.write_adapter(adapter_dir, local.layers.lora, lora.peft_tensors(local.layers),
                               base_model=str(pathlib.Path(tokenizer_dir).resolve()), overwrite=True)
        return str(hf_io.export_model(local, directory, tokenizer_dir=tokenizer_dir, overwrite=True))

    def close(self) -> None:
        import jax
        self.ckpt.close()
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()


class TrainerGroup:
    """The driver's handle on N `TrainerActor`s: the methods the RL job's train loop calls on a trainer
    (`version`, `train`, `publish`, `publish_weights`, `checkpoint`), each run in every process.

    spec: `TrainerGroup.spec(...)`. tag: the run's name tag (`names.run_tag`). generation: how many
    groups this run formed before (names the actors). cpu_devices: CPU devices per process (CPU hosts and
    tests). resources: custom node resources each actor needs. timeout_s: the longest a call may take
    (a step, a checkpoint) before the group counts as failed.
    """

    def __init__(self, spec: dict[str, Any], *, num_processes: int, tag: str, generation: int = 0,
                 cpu_devices: int | None = None, resources: dict[str, float] | None = None,
                 timeout_s: float = 600.0):
        ray = require_ray()
        self.spec, self.num_processes, self.timeout_s = spec, num_processes, timeout_s
        options = actor_options(resources, jax_env(cpu_devices))
        remote = ray.remote(TrainerActor)
        self.names = [names.trainer(tag, i, generation) for i in range(num_processes)]
        self.actors = [remote.options(name=n, **options).remote() for n in self.names]
        self.version: int | None = None
        self.started: list[dict] = []
        self.compiles, self.compile_s = 0, 0.0  # the train step's, in process 0

    @staticmethod
    def spec(model_dir: str, trainer: ml_collections.ConfigDict, *, seq_len: int, max_sequences: int,
             checkpoints: str, max_to_keep: int, fsdp: int = -1, tensor: int = 1, expert: int = 1,
             init_timeout_s: float = 120.0,
             heartbeat_timeout_s: int = 60, lora_seed: int = 0, compute_dtype: str = "float32",
             validate_extra: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
        """What every trainer process is built from (LoRA: `trainer.lora`, adapters drawn from `lora_seed`;
        master weights in `trainer.param_dtype`, the update computing in `compute_dtype`).
        validate_extra: the checkpoint extra's check (`Checkpointer.restore`'s `validate`; picklable), run by
        every process on the same extra, so that all pass over the same damaged steps."""
        return {"model_dir": str(model_dir), "trainer": trainer, "seq_len": seq_len, "max_sequences": max_sequences,
                "lora_seed": lora_seed, "compute_dtype": compute_dtype, "validate_extra": validate_extra,
                "checkpoints": str(checkpoints), "max_to_keep": max_to_keep, "fsdp": fsdp, "tensor": tensor,
                "expert": expert,
                "init_timeout_s": init_timeout_s, "heartbeat_timeout_s": heartbeat_timeout_s}

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`method(*args)` in every process; their results by process id (see `_wait`)."""
        return self._wait([getattr(a, method).remote(*args) for a in self.actors], method, timeout_s)

    def start(self) -> tuple[int, dict | None]:
        """Forms the group (see `TrainerActor.start`); (the version it holds, the restored checkpoint's extra)."""
        ray = require_ray()
        try:
            address = ray.get(self.actors[0].address.remote(), timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise TrainerGroupFailed(f"trainer process 0 ({self.names[0]}) did not start: {type(e).__name__}") \
                from None
        refs_args = [(address, self.num_processes, i, self.spec) for i in range(self.num_processes)]
        ray_refs = [a.start.remote(*args) for a, args in zip(self.actors, refs_args)]
        self.started = self._wait(ray_refs, "start", None)
        self.version = self.started[0]["version"]
        self.compiles, self.compile_s = 1, self.started[0]["compile_s"]
        self._set_aside(self.started[0]["damaged"])
        return self.version, self.started[0]["extra"]

    def _set_aside(self, damaged: list) -> None:
        """Damaged checkpoint steps the restore passed over: reported, kept for inspection as
        damaged-<step>, out of the way of the steps redone now (as the single-process job does)."""
        if not damaged:
            return
        steps = [int(step) for step, _ in damaged]
        moved = self._wait([self.actors[0].set_aside.remote(steps)], "set_aside", self.timeout_s)[0]
        # Then the others re-read the step list (a done ref stands in for process 0: ids stay by process).
        self._wait([require_ray().put([])] + [a.set_aside.remote(steps) for a in self.actors[1:]],
                   "set_aside", self.timeout_s)
        for (_, why), where in zip(damaged, moved):
            print(f"jaxflow: {why}; kept as {where}, not used", file=sys.stderr, flush=True)

    def _wait(self, refs: list[Any], method: str, timeout_s: float | None) -> list[Any]:
        """The results of `refs` (one per process) by process id. The first process to fail (dead,
        raised, or silent past `timeout_s`, default the group's) raises TrainerGroupFailed naming it."""
        ray = require_ray()
        timeout_s = timeout_s or self.timeout_s
        index = {ref: i for i, ref in enumerate(refs)}
        out: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                late = sorted(index[r] for r in pending)
                raise TrainerGroupFailed(f"trainer process(es) {late} ({self.names[late[0]]}) did not finish "
                                         f"{method} within {timeout_s:g} s")
            i = index[done[0]]
            try:
                out[i] = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None) or e
                raise TrainerGroupFailed(f"trainer process {i} ({self.names[i]}) failed in {method}: "
                                         f"{type(cause).__name__}: {str(cause)[:2000]}") from None
            except ray.exceptions.RayError as e:
                raise TrainerGroupFailed(f"trainer process {i} ({self.names[i]}) died during {method}: "
                                         f"{type(e).__name__}") from None
        return [out[i] for i in range(len(refs))]

    def train(self, consumed: ConsumedBatch) -> tuple[dict[str, float], dict[int, int]]:
        """One update on every process (the buffer sent once, through the object store)."""
        ref = require_ray().put(consumed)
        metrics, staleness, self.compiles = self._all("train", ref)[0]
        self.compile_s = metrics.get("compile_s", self.compile_s)
        self.version += 1
        return metrics, staleness

    def publish(self, trajectories, board) -> int:
        """Marks the current version published in the trajectory service, then publishes its weights."""
        trajectories.mark_published(self.version)
        return self.publish_weights(board)

    def publish_weights(self, board) -> int:
        """Every process puts its shards; the merged manifest is committed to `board`."""
        parts = [p for p in self._all("put_weights") if p is not None]
        board.commit(weights.merge_manifests(parts))
        return self.version

    def checkpoint(self, ckpt, extra: dict) -> None:
        """Every process saves its shards of the current version with `extra` (`ckpt` is the driver's,
        unused: the processes write the run's checkpoint directory themselves)."""
        self._all("save", extra)

    def restore_latest(self) -> tuple[int, dict]:
        """Rolls every process back to the newest checkpoint; (version, extra)."""
        self.version, extra, damaged = self._all("restore_latest")[0]
        self._set_aside(damaged)
        return self.version, extra

    def export(self, directory: str, tokenizer_dir: str, adapter_dir: str | None = None) -> None:
        """The merged HF model to `directory`; with LoRA the adapters (PEFT's format) to `adapter_dir`."""
        self._all("export", str(directory), str(tokenizer_dir), None if adapter_dir is None else str(adapter_dir))

    @property
    def trainable_params(self) -> int:
        return self.started[0]["trainable_params"]

    def params(self) -> dict[str, np.ndarray]:
        """The current parameters gathered to host, by path (see `TrainerActor.params`)."""
        return self._all("params")[0]

    def close(self, graceful: bool = True) -> None:
        """Ends the group: leaves the process group cleanly when `graceful` and every process answers,
        then kills the actors either way."""
        ray = require_ray()
        if graceful:
            try:
                self._all("close", timeout_s=60)
            except TrainerGroupFailed:
                pass
        for a in self.actors:
            ray.kill(a)
        # A re-formed group reuses no name (see names.trainer), so nothing waits for the names to free.
