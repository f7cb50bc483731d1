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
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxflow.trainer.state import TrainState

_STATE, _EXTRA = "state", "extra"


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
        for an extra that JSON cannot encode, before anything is written.
        """
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"checkpoint extra must be a dict, got {type(extra).__name__}")
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint extra for step {step} in {self.directory} is not "
                            f"JSON-serialisable: {e}") from e
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(_nest(_flatten(state))),
                                     _EXTRA: ocp.args.JsonSave(dict(extra))})
        return self._manager.save(int(step), args=args, force=force)

    def latest_step(self) -> int | None:
        """The newest saved step (including one whose write is still in flight), or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All kept steps, ascending."""
        return sorted(self._manager.all_steps())

    def restore(self, target: TrainState, step: int | None = None) -> tuple[TrainState, dict]:
        """Reads checkpoint `step` (default: the latest) into the structure and shardings of `target`.

        target: a TrainState of ShapeDtypeStructs with shardings (`abstract_train_state` on the mesh to
        restore onto) or of arrays; the result has its pytree structure, Variable metadata, dtypes and
        shardings. Returns (state, extra). Raises FileNotFoundError if there is no such checkpoint and
        ValueError if the saved arrays do not match the target's names or shapes.
        """
        self._manager.wait_until_finished()  # A step still being written is not readable yet.
        self._manager.reload()  # Another process may have written or pruned steps since.
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                                    f"available steps: {steps}")
        wanted = _flatten(target)
        self._check_matches(step, wanted)
        restored = self._manager.restore(step, args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardRestore(_nest(wanted)), _EXTRA: ocp.args.JsonRestore()}))
        arrays = _flatten(restored[_STATE])
        state = jax.tree.unflatten(jax.tree.structure(target), [arrays[name] for name in wanted])
        return state, dict(restored[_EXTRA] or {})

    def _check_matches(self, step: int, wanted: dict[str, Any]) -> None:
        """Compares target names/shapes against the saved metadata, so that a wrong model size fails
        with the parameter's name before any array is read (orbax's own error names neither)."""
        saved = _flatten(self._manager.item_metadata(step)[_STATE])
        where = f"checkpoint step {step} in {self.directory}"
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
