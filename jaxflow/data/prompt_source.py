"""Prompts for the trajectory service, read through a grain pipeline whose position is checkpointable."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain


class PromptSource:
    """Yields {"prompt": list[int], "meta": dict} records, shuffled per epoch by grain.

    records: token-id prompts with task metadata (e.g. the answer a reward function checks).
    num_epochs: None repeats forever. The position is saved with `get_state` and restored with
    `set_state`, so a resumed run continues with the next unseen prompt.
    """

    def __init__(self, records: Sequence[dict[str, Any]], *, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = 1):
        for i, r in enumerate(records):
            prompt = r.get("prompt") if isinstance(r, dict) else None
            if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
                raise ValueError(f"prompt record {i} has no valid 'prompt' (a non-empty list of token ids)")
        dataset = grain.MapDataset.source(list(records))
        if shuffle:
            dataset = dataset.shuffle(seed=seed)
        # Random access by position: O(1) per record, and the position is the whole checkpoint state.
        self._dataset = dataset.repeat(num_epochs)
        self._length = len(self._dataset)
        self._index = 0

    @property
    def exhausted(self) -> bool:
        """True once every record of every epoch has been handed out."""
        return self._index >= self._length

    def next(self) -> dict[str, Any] | None:
        """The next record, or None once every epoch has been read."""
        if self.exhausted:
            return None
        record = self._dataset[self._index]
        self._index += 1
        return {"prompt": list(record["prompt"]), "meta": dict(record.get("meta", {}))}

    def get_state(self) -> dict[str, Any]:
        """The position of the next record to hand out (JSON-serialisable)."""
        return {"index": self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        self._index = int(state["index"])
