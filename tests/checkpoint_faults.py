"""Damage injected into a saved checkpoint step's extra (the job state saved beside the arrays), for the
checkpoint tests and for soaks that resume from damaged checkpoints.

    damage_extra(workdir / "checkpoints" / "3", "wrong-value")                # an edit on disk
    damage_extra(workdir / "checkpoints" / "3", "missing-key", resign=True)   # saved wrong, checksum right

Without `resign` the change is caught by the checksum of that piece; with it the step looks as if it had
been saved with that content, so only the restore's `validate` (the job's check, `jaxflow.jobs.resume`)
can refuse it. Either way the restore names the step and the piece, and falls back to the step before.
"""

import json
import pathlib

from jaxflow.trainer import checkpoint

HOW = ("wrong-value", "missing-key", "missing-piece")


def extra_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The JSON file holding a step's extra (orbax's JSON item)."""
    return pathlib.Path(step_dir) / "extra" / "metadata"


def damage_extra(step_dir: pathlib.Path, how: str, piece: str = "trajectories", *, resign: bool = False) -> str:
    """Changes `piece` of the extra of the checkpoint step in `step_dir`; returns what was changed.

    how: "wrong-value" (a trajectory snapshot's `v_train` one higher, any other piece replaced by a string),
    "missing-key" (the snapshot's `counts` removed, or the first key of another dict piece), or
    "missing-piece" (the piece removed). resign: also rewrite the piece's checksum to match.
    """
    path = extra_file(step_dir)
    extra = json.loads(path.read_text())
    value = extra.get(piece)
    if how == "wrong-value":
        if isinstance(value, dict) and "v_train" in value:
            value["v_train"] += 1
            what = f"{piece}.v_train = {value['v_train']}"
        else:
            extra[piece] = "wrong"
            what = f"{piece} = 'wrong'"
    elif how == "missing-key":
        key = "counts" if isinstance(value, dict) and "counts" in value else next(iter(value))
        del value[key]
        what = f"{piece}.{key} removed"
    elif how == "missing-piece":
        del extra[piece]
        what = f"{piece} removed"
    else:
        raise ValueError(f"how={how!r} is not one of {HOW}")
    sums = extra.get(checkpoint._EXTRA_CHECKSUMS)
    if resign and sums is not None:
        if piece in extra:
            sums[piece] = checkpoint._json_digest(extra[piece])
        else:
            sums.pop(piece, None)
    path.write_text(json.dumps(extra))
    return what
