"""Checkpoints of the trainer: the sharded TrainState plus other components' JSON state, via orbax.

One checkpoint step is one orbax step directory holding two items, written together and made visible by
one atomic rename when both are complete:

  <directory>/<step>/state   the TrainState's arrays, as a nested dict named by pytree path
                             (`params/layers/q_proj`, `opt_state/0/mu/embed`, `step`, ...)
  <directory>/<step>/extra   a JSON dict owned by other components (data iterator, trajectory service)

The TrainState is stored as a plain nested dict rather than handed to orbax as is: its nnx Variables carry
metadata (logical axes, ...) that is code, not data. On restore the exact pytree (Variable types and
metadata included) comes from the caller's target, usually `train_state.abstract_train_state` on the
mesh to restore onto; orbax reads each array straight into the target's sharding, so a checkpoint
written on one mesh shape can be read onto another.

A step is valid only as a whole. Every step carries a sha256 per array (of its host bytes, dtype and shape)
and one per piece of the extra (each top-level key: the trajectory service's snapshot, the data iterator's
position in it, ...; of its canonical JSON), both in the extra JSON under reserved keys, because orbax
itself does not notice every damage: random bytes written into a data chunk can decompress to wrong weights
with no error, and an edited JSON value is still valid JSON. `restore` verifies them, then hands the extra to
the caller's `validate(step, extra)` (the job's check of what each piece must hold, e.g. the trajectory
service's snapshot validator), all before the caller changes anything. A damaged step (unreadable metadata,
truncated or missing data, a checksum that does not match, a missing piece, a piece `validate` refuses) is
reported by name (a warning in the log naming the step, the piece and the reason) and the previous step is
tried; `damaged` and `restored_step` say what happened, and `set_aside` moves a damaged step out of the step
list without deleting it. Only when no step is intact does `restore` raise `CheckpointDamaged`, naming the
directory and every step's damage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxflow.trainer.state import TrainState

_STATE, _EXTRA = "state", "extra"
# The extra key holding {array name: sha256 hex}; refused in a caller's extra, removed from what restore returns.
_CHECKSUMS = "_jaxflow_checksums"
# The extra key holding {extra piece (top-level key): sha256 hex of its canonical JSON}; reserved likewise.
_EXTRA_CHECKSUMS = "_jaxflow_extra_checksums"
_RESERVED = (_CHECKSUMS, _EXTRA_CHECKSUMS)

log = logging.getLogger(__name__)


class CheckpointDamaged(RuntimeError):
    """A checkpoint step cannot be restored as saved; the message names the directory, step and damage."""


def _digest(value) -> str:
    """sha256 of an array's dtype, shape and C-order host bytes: the same for any sharding of it. An
    array spread over processes (a multi-process trainer) cannot be read to host here: it gets the
    `_spread_digest` of its words instead, computed where it lives, marked "w32:"."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return _spread_digest(value)
    host = np.asarray(value)
    h = hashlib.sha256(f"{host.dtype.str}{host.shape}".encode())
    h.update(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _json_digest(value) -> str:
    """sha256 of `value`'s canonical JSON (sorted keys, no spaces): the same before saving and after reading,
    since `save` digests the JSON round trip of the extra (int keys become strings, tuples lists)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _brief(error: BaseException) -> str:
    """An exception as one short line (TensorStore errors run to pages of spec)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _key_name(entry) -> str:
    """One pytree path entry (dict key, attribute, sequence index) as a string."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _flatten(tree) -> dict[str, Any]:
    """Leaves keyed by their '/'-joined pytree path, in pytree leaf order.

    An nnx Variable is named by its own path (not `.../value`), so that the stored `params` has the
    layout of `nnx.State.to_pure_dict()`.
    """
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    items, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)
    return {"/".join(_key_name(k) for k in path): leaf.get_value() if is_var(leaf) else leaf
            for path, leaf in items}


def _nest(flat: Mapping[str, Any]) -> dict:
    """{'a/b': x} -> {'a': {'b': x}}: the plain tree orbax stores."""
    root: dict = {}
    for name, leaf in flat.items():
        *parents, last = name.split("/")
        node = root
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return root


def _words(x: jax.Array) -> jax.Array:
    """The array's bytes as a flat uint32 vector (narrower items widened, 8-byte ones split in two)."""
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)


@jax.jit
def _word_sums(x: jax.Array) -> jax.Array:
    # Two position-weighted sums mod 2**32 (exact integer arithmetic: the same for every sharding and
    # every reduction order), catching a changed word and two swapped ones.
    w = _words(x)
    i = jnp.arange(w.shape[0], dtype=jnp.uint32)
    return jnp.stack([jnp.sum(w * (i * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32),
                      jnp.sum((w ^ (w >> 15)) * (i * jnp.uint32(40503) + jnp.uint32(97)), dtype=jnp.uint32)])


def _spread_digest(value: jax.Array) -> str:
    """The checksum of an array spread over processes, computed on its devices; every process gets it."""
    from jax.experimental import multihost_utils
    sums = _word_sums(value)
    sums = np.asarray(sums.addressable_data(0) if sums.sharding.is_fully_replicated
                      else multihost_utils.process_allgather(sums, tiled=True))
    return f"w32:{value.dtype.str}{tuple(value.shape)}:{int(sums[0]):08x}{int(sums[1]):08x}"


def _matches(saved: str, value) -> bool:
    """Whether `value` has the digest `saved`, of whichever kind was saved."""
    if isinstance(saved, str) and saved.startswith("w32:"):
        return saved == (_spread_digest(value) if isinstance(value, jax.Array)
                         else _spread_digest(jnp.asarray(value)))
    return saved == _digest(value)


class Checkpointer:
    """Saves and restores (TrainState, extra) by step in `directory`, keeping the newest `max_to_keep`.

    Saves are asynchronous: `save` returns once the arrays are copied to host memory (so the caller may
    donate or overwrite the state right away) and the files are written in the background. A step
    becomes visible to `latest_step`/`restore` in a fresh process only once it is complete; a crash
    mid-save leaves the previous checkpoints untouched. Also a context manager (closing waits for
    pending writes).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
                 save_interval_steps: int = 1):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                               save_interval_steps=save_interval_steps, create=True)
        # Naming the handlers lets a fresh process read metadata (for the shape check) before any save.
        self.damaged: list[tuple[int, str]] = []  # (step, why) passed over by the last restore
        self.restored_step: int | None = None  # the step the last restore read
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                           _EXTRA: ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: TrainState, extra: dict | None = None, *,
             force: bool = False) -> bool:
        """Starts writing `state` and `extra` as checkpoint `step`; returns whether a save started.

        Without `force`, a step off the `save_interval_steps` grid or not after the latest saved step is
        skipped (False); the first save into an empty directory always happens (orbax's policy), and
        `force` onto an existing step raises orbax's StepAlreadyExistsError (a ValueError) rather than
        overwrite it. extra: JSON-serialisable dict, saved atomically with the state. Raises TypeError
        for an extra that JSON cannot encode and ValueError for one using the reserved checksum key, before
        anything is written. The checksums are computed here, from a host copy of each array (one pass over
        the state's bytes; an array spread over processes is summed where it lives, see `_digest`).
        """
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"checkpoint extra must be a dict, got {type(extra).__name__}")
        reserved = [k for k in _RESERVED if k in extra]
        if reserved:
            raise ValueError(f"checkpoint extra key {reserved[0]!r} is reserved for the checksums")
        try:
            pieces = json.loads(json.dumps(extra))  # what a restore will read back
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint extra for step {step} in {self.directory} is not "
                            f"JSON-serialisable: {e}") from e
        if not force and not self._manager.should_save(int(step)):
            return False
        flat = _flatten(state)
        extra = {**extra, _CHECKSUMS: {name: _digest(value) for name, value in flat.items()},
                 _EXTRA_CHECKSUMS: {key: _json_digest(value) for key, value in pieces.items()}}
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(_nest(flat)),
                                     _EXTRA: ocp.args.JsonSave(extra)})
        return self._manager.save(int(step), args=args, force=force)

    def latest_step(self) -> int | None:
        """The newest saved step (including one whose write is still in flight), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All kept steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(self, target: TrainState, step: int | None = None, *,
                validate: Callable[[int, dict], None] | None = None) -> tuple[TrainState, dict]:
        """Reads checkpoint `step` (default: the newest intact one) into the structure and shardings of
        `target`, verifying every array and every piece of the extra against the checksum saved with it.

        target: a TrainState of ShapeDtypeStructs with shardings (`abstract_train_state` on the mesh to
        restore onto) or of arrays; the result has its pytree structure, Variable metadata, dtypes and
        shardings. validate(step, extra): the caller's check of the verified extra, run before this returns
        (so before the caller changes anything); a ValueError, TypeError or KeyError from it makes the step
        damaged, its message (which should name the piece) the reason. Returns (state, extra). Without
        `step`, a damaged step is logged by name and the one
        before it is tried; afterwards `restored_step` is the step read and `damaged` lists
        (step, why) for each damaged step passed over. Raises FileNotFoundError if there is no such
        checkpoint, ValueError if the saved arrays do not match the target's names or shapes, and
        CheckpointDamaged if the named step (or, without `step`, every step) is damaged.
        """
        self._manager.wait_until_finished()  # A step still being written is not readable yet.
        self._manager.reload()  # Another process may have written or pruned steps since.
        steps = self.all_steps()
        self.damaged, self.restored_step = [], None
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step is not None and int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available steps: {steps}")
        wanted = _flatten(target)
        for candidate in ([int(step)] if step is not None else steps[::-1]):
            try:
                arrays, extra = self._restore_step(candidate, wanted, validate)
            except CheckpointDamaged as e:
                self.damaged.append((candidate, str(e)))
                log.warning("%s", e)
                continue
            if self.damaged:
                log.warning("checkpoint: restored step %d instead of damaged step(s) %s in %s", candidate,
                            [s for s, _ in self.damaged], self.directory)
            self.restored_step = candidate
            return jax.tree.unflatten(jax.tree.structure(target), [arrays[n] for n in wanted]), extra
        if step is not None:
            raise CheckpointDamaged(self.damaged[0][1])
        raise CheckpointDamaged(
            f"no intact checkpoint in {self.directory}: " + "; ".join(why for _, why in self.damaged)
            + ". Nothing was restored; move the damaged steps aside (or use another workdir) to start afresh")

    def _restore_step(self, step: int, wanted: dict[str, Any],
                      validate: Callable[[int, dict], None] | None) -> tuple[dict[str, Any], dict]:
        """The verified arrays (by name, cast to the target's dtypes) and extra of one step."""
        where = f"checkpoint step {step} in {self.directory}"
        try:
            saved = _flatten(self._manager.item_metadata(step)[_STATE])
        except Exception as e:  # noqa: BLE001 -- whatever orbax raises on unreadable metadata is damage
            raise CheckpointDamaged(f"{where} is damaged: its metadata cannot be read ({_brief(e)})") from e
        self._check_matches(where, saved, wanted)
        # Read each array in its saved dtype (its checksum is of those bytes), cast to the target's after.
        read = {name: want if saved[name].dtype == want.dtype else
                jax.ShapeDtypeStruct(want.shape, saved[name].dtype, sharding=getattr(want, "sharding", None))
                for name, want in wanted.items()}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore(_nest(read)), _EXTRA: ocp.args.JsonRestore()}))
            arrays = _flatten(restored[_STATE])
            extra = dict(restored[_EXTRA] or {})
        except Exception as e:  # noqa: BLE001 -- truncated, missing or undecodable data is damage
            raise CheckpointDamaged(f"{where} is damaged: reading it failed ({_brief(e)})") from e
        sums = extra.pop(_CHECKSUMS, None)
        if sums is None:
            log.warning("%s has no checksums (saved by an older jaxflow): restored unverified", where)
        else:
            bad = [name for name in wanted if not isinstance(sums, Mapping)
                   or not _matches(sums.get(name), arrays[name])]
            if bad:
                raise CheckpointDamaged(f"{where} is damaged: {len(bad)} array(s) differ from the checksums "
                                        f"saved with them: {bad[:5]}")
        self._check_extra(where, extra, extra.pop(_EXTRA_CHECKSUMS, None))
        if validate is not None:
            try:
                validate(step, extra)
            except (ValueError, TypeError, KeyError) as e:
                why = e.args[0] if isinstance(e, KeyError) and e.args else e  # (a KeyError's str() is quoted)
                raise CheckpointDamaged(f"{where} is damaged: {why}") from e
        arrays = {name: arrays[name] if arrays[name].dtype == want.dtype else arrays[name].astype(want.dtype)
                  for name, want in wanted.items()}
        return arrays, extra

    @staticmethod
    def _check_extra(where: str, extra: dict, sums: Any) -> None:
        """Compares each piece of the extra with the checksum saved with it; raises CheckpointDamaged naming
        the first piece that is missing, changed or not saved with the step."""
        if sums is None:  # saved before the extra had checksums: the arrays' warning (if any) covers it
            return
        if not isinstance(sums, Mapping):
            raise CheckpointDamaged(f"{where} is damaged: the checksums of its extra are not a dict")
        for key in sorted(sums):
            if key not in extra:
                raise CheckpointDamaged(f"{where} is damaged: its extra piece {key!r} is missing")
            if sums[key] != _json_digest(extra[key]):
                raise CheckpointDamaged(f"{where} is damaged: its extra piece {key!r} differs from the checksum "
                                        f"saved with it")
        unknown = sorted(set(extra) - set(sums))
        if unknown:
            raise CheckpointDamaged(f"{where} is damaged: its extra has piece(s) {unknown} not saved with it")

    def _check_matches(self, where: str, saved: dict[str, Any], wanted: dict[str, Any]) -> None:
        """Compares target names/shapes against the saved metadata, so that a wrong model size fails
        with the parameter's name before any array is read (orbax's own error names neither)."""
        for name, want in wanted.items():
            if name not in saved:
                raise ValueError(f"{where} has no array {name!r} that the restore target expects")
            if tuple(saved[name].shape) != tuple(want.shape):
                raise ValueError(f"{where}: {name!r} was saved with shape {tuple(saved[name].shape)}, "
                                 f"the restore target expects {tuple(want.shape)}")
        unexpected = sorted(set(saved) - set(wanted))
        if unexpected:
            raise ValueError(f"{where} has array(s) {unexpected[:5]} that the restore target lacks "
                             f"(a different model or optimizer?)")

    def set_aside(self, step: int) -> pathlib.Path:
        """Renames step `step`'s directory to `damaged-<step>[-n]` (kept, no longer a step), so that the
        run can save that step number again; returns the new path."""
        self._manager.wait_until_finished()
        source = self.directory / str(int(step))
        if not source.is_dir():
            raise FileNotFoundError(f"no checkpoint directory for step {step} in {self.directory}")
        dest, n = self.directory / f"damaged-{int(step)}", 0
        while dest.exists():
            n += 1
            dest = self.directory / f"damaged-{int(step)}-{n}"
        source.rename(dest)
        self._manager.reload()
        return dest

    def reload(self) -> None:
        """Reads the step list from disk again (after another process set a step aside)."""
        self._manager.reload()

    def wait_until_finished(self) -> None:
        """Blocks until every started save is fully written (and old steps pruned)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
