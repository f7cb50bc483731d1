"""What the rl job's checkpoints carry besides the TrainState, and the check a resume runs on it.

A checkpoint of the rl job holds, next to the TrainState's arrays (weights, optimizer state, step counters),
an extra dict of two pieces:

  trajectories    the trajectory service's snapshot: every group, its samples and rewards, the buffers'
                  slots, the counters, and the prompt iterator's position (`source`)
  base_accuracy   the held-out accuracy of the base model (None until measured), a float in [0, 1]

`ExtraCheck` is the `validate` a resume hands to `Checkpointer.restore`: the checkpoint's checksums have
already shown that the pieces are as saved; this shows that they are usable by this run (the snapshot
passes the trajectory service's own validator for this service's group size, batch, slots and eta, and is
at the checkpoint's step). A step that fails it is damaged like one with bad bytes: named, passed over,
and the step before it restored. It is a plain dataclass so that it travels to the trainer processes of a
cluster run (`jaxflow.cluster.trainer_group`), which restore the checkpoint themselves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxflow.data.records import RouteSpec
from jaxflow.data.service_snapshot import parse_snapshot
from jaxflow.data.trajectory_service import FIELDS, GroupState, TrajectoryService

# The extra's pieces: key -> what messages call it.
PIECES = {"trajectories": "trajectory snapshot", "base_accuracy": "base-model accuracy"}


@dataclasses.dataclass(frozen=True)
class ExtraCheck:
    """Checks an rl checkpoint's extra against the trajectory service it will be restored into.

    group_size, batch_groups, reserve_groups, eta: the service's (a snapshot of another shape cannot be
    restored into it). route_spec: the routing its model records (None: a dense model), which the
    snapshot's samples' routes must fit.
    """

    group_size: int
    batch_groups: int
    reserve_groups: int
    eta: int
    route_spec: RouteSpec | None = None

    @classmethod
    def for_service(cls, service: TrajectoryService) -> ExtraCheck:
        """The check for restoring into `service`."""
        return cls(group_size=service.group_size, batch_groups=service.batch_groups,
                   reserve_groups=service.reserve_groups, eta=service.eta, route_spec=service.route_spec)

    def __call__(self, step: int, extra: dict[str, Any]) -> None:
        """Raises ValueError naming the piece and what is wrong with it, or returns None: `extra` (of
        checkpoint `step`) can be restored as a whole."""
        for key, name in PIECES.items():
            if key not in extra:
                raise ValueError(f"its {name} ({key!r}) is missing")
        accuracy = extra["base_accuracy"]
        if accuracy is not None and not (isinstance(accuracy, int | float) and not isinstance(accuracy, bool)
                                         and math.isfinite(accuracy) and 0.0 <= accuracy <= 1.0):
            raise ValueError(f"its {PIECES['base_accuracy']} ('base_accuracy') is {accuracy!r}, not None or a "
                             f"number in [0, 1]")
        snap = extra["trajectories"]
        try:
            parse_snapshot(snap, group_fields=FIELDS, states={s.value: s for s in GroupState}, n=self.group_size,
                           batch_groups=self.batch_groups, reserve_groups=self.reserve_groups, eta=self.eta,
                           route_spec=self.route_spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"its {PIECES['trajectories']} ('trajectories') is invalid: {e}") from e
        # The snapshot is taken with the checkpoint of the version the trainer holds, whose buffer comes next.
        if snap["v_train"] != step:
            raise ValueError(f"its {PIECES['trajectories']} ('trajectories') is at train version "
                             f"{snap['v_train']}, the checkpoint's step is {step}")
