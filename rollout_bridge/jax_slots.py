"""The host half of the JAX engine's slot management: per-slot decode state, and which cache rows and
attention windows each decode call runs.

A decode call costs about (rows it runs) x (cache positions they attend over). Both are kept near the
work actually left:

- rows: a call runs only the active slots, padded to the next slot bucket (8, 12, 16, 24, ... max_slots),
  so the draining tail of a rollout round decodes a handful of rows instead of every slot;
- windows: the rows are ordered longest sequence first and split into groups of 4, each attending over
  the smallest window (`attention_windows`) its own sequences fit, so one long sequence no longer makes
  every short one read the long window.

Free slots may keep a finished turn's cache rows for the same request's next turn (`KeptTurns`): an
episode's next turn then computes only its new tokens.

Each slot bucket is one compiled decode program (the windows are traced indices into a static list of
window sizes), so `JaxEngine` can compile them all at start.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rollout_bridge import jax_decode


def attention_windows(smallest: int, max_len: int) -> tuple[int, ...]:
    """Decode attention window sizes: `smallest`, then steps of x1.5 and x4/3 (64, 96, 128, 192, 256,
    384, ...) below max_len, then max_len. Each window a group reads past its longest sequence is
    wasted; these steps keep that under a third, where powers of two waste up to half."""
    windows, w = [], smallest
    while w < max_len:
        windows.append(w)
        w = max(w + 1, w * 3 // 2 if len(windows) % 2 else w * 4 // 3)
    return (*windows, max_len)


def row_buckets(max_slots: int) -> list[int]:
    """Rows a decode call may run: 8, 12, 16, 24, 32, 48, ... (steps of x1.5 and x4/3, all multiples of
    4), then max_slots. Padding rows cost as much as active ones; powers of two alone pad a call by up
    to half (measured on the tool demo: 30% of decode rows were padding), these steps by under a third."""
    buckets, n = [], 8
    while n < max_slots:
        buckets.append(n)
        n = n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3
    return [*buckets, max_slots]


def num_groups(rows: int) -> int:
    """Window groups in a call of `rows` rows: groups of 4 rows (of 2 or 1 where 4 does not divide).

    Smaller groups fit each window closer to their sequences but cost a loop iteration each; groups of
    4 rows also keep the keys/values a group gathers in cache for its attention (measured on CPU,
    long-tailed and uniform lengths: faster than groups of 2, 8 or 16 rows)."""
    return rows // next(size for size in (4, 2, 1) if rows % size == 0)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The rows of one decode call.

    rows_b: int32 [n] cache slot of each row: the active slots, longest first, then free slots as
    padding (inactive, frozen); None runs every slot in slot order (a slot-sharded cache).
    window_g: int32 [G] index into the window list of the attention window of each of G equal
    consecutive groups of rows.
    """

    rows_b: np.ndarray | None
    window_g: np.ndarray


class SlotTable:
    """Per-slot decode state ([max_slots] numpy arrays, the fields of `jax_decode.SlotState`) and the
    choice of rows and windows per decode call.

    windows: the attention window sizes (ascending, the last one max_len). select_rows: run only active
    rows (False for a cache sharded over slots, where gathering rows would move cache rows between
    devices at every step; every call then runs all slots with one window).
    """

    def __init__(self, max_slots: int, max_stop_ids: int, windows: tuple[int, ...], select_rows: bool):
        b = max_slots
        self.windows = windows
        self.arrays: dict[str, np.ndarray] = dict(
            tokens_b=np.zeros(b, np.int32), lengths_b=np.zeros(b, np.int32), active_b=np.zeros(b, bool),
            generated_b=np.zeros(b, np.int32), max_tokens_b=np.zeros(b, np.int32),
            temperature_b=np.zeros(b, np.float32), top_k_b=np.zeros(b, np.int32),
            top_p_b=np.ones(b, np.float32), seeds_b=np.zeros(b, np.uint32),
            stop_ids_bn=np.full((b, max_stop_ids), -1, np.int32), finish_b=np.zeros(b, np.int32))
        self.buckets = row_buckets(b) if select_rows else [b]
        # The buckets whose decode program is compiled (the engine may compile the others in the
        # background, `jax_warmup`): a call runs in the smallest ready bucket that holds its rows.
        self.ready = set(self.buckets)
        self._select_rows = select_rows

    def fill(self, slot: int, sequence: list[int], generated: int, max_tokens: int, temperature: float,
             top_k: int, top_p: float, seed: int, stop_ids: tuple[int, ...]) -> None:
        """Starts `slot` on `sequence` (prompt + tokens so far; its last token is the pending input)."""
        a = self.arrays
        a["tokens_b"][slot], a["lengths_b"][slot] = sequence[-1], len(sequence) - 1
        a["active_b"][slot], a["generated_b"][slot] = True, generated
        a["max_tokens_b"][slot], a["temperature_b"][slot] = max_tokens, temperature
        a["top_k_b"][slot], a["top_p_b"][slot] = top_k, top_p
        a["seeds_b"][slot] = seed % 2**32
        a["stop_ids_bn"][slot] = -1
        a["stop_ids_bn"][slot, :len(stop_ids)] = stop_ids

    def free(self, slot: int) -> None:
        # Neutral sampling params on empty slots keep the top-k/top-p sort off when nobody needs it.
        a = self.arrays
        a["active_b"][slot], a["temperature_b"][slot] = False, 0.0
        a["top_k_b"][slot], a["top_p_b"][slot] = 0, 1.0

    def used_positions(self) -> int:
        """Cache positions held by active sequences (their pending token included)."""
        active = self.arrays["active_b"]
        return int((self.arrays["lengths_b"][active] + 1).sum())

    def _window(self, longest: int) -> int:
        """Index of the smallest window that holds `longest` positions (the largest when none does)."""
        return min(int(np.searchsorted(self.windows, longest)), len(self.windows) - 1)

    def plan(self, num_steps: int) -> DecodePlan:
        """Rows and windows for a call of up to `num_steps` steps over the active slots (at least one)."""
        a = self.arrays
        active = np.flatnonzero(a["active_b"])
        reach_a = a["lengths_b"][active] + num_steps  # positions each sequence may reach in the call
        if not self._select_rows:
            return DecodePlan(None, np.array([self._window(int(reach_a.max()))], np.int32))
        order = np.argsort(-reach_a, kind="stable")
        active, reach_a = active[order], reach_a[order]
        n = next(b for b in self.buckets if b >= len(active) and b in self.ready)
        padding = np.flatnonzero(~a["active_b"])[:n - len(active)]
        # Rows are longest first, so a group's first row is its longest; all-padding groups get the
        # smallest window.
        starts = range(0, n, n // num_groups(n))
        window_g = np.array([self._window(int(reach_a[s])) if s < len(active) else 0 for s in starts],
                            np.int32)
        return DecodePlan(np.concatenate([active, padding]).astype(np.int32), window_g)

    def idle_plans(self) -> list[DecodePlan]:
        """A plan of every shape `plan` can return, over free slots only (all slots must be free): for
        compiling every decode program up front."""
        if not self._select_rows:
            return [DecodePlan(None, np.zeros(1, np.int32))]
        return [DecodePlan(np.arange(n, dtype=np.int32), np.zeros(num_groups(n), np.int32))
                for n in self.buckets]

    def state(self, plan: DecodePlan) -> jax_decode.SlotState:
        """The decode state of the plan's rows."""
        if plan.rows_b is None:
            return jax_decode.SlotState(**self.arrays)
        return jax_decode.SlotState(**{k: v[plan.rows_b] for k, v in self.arrays.items()})

    def update(self, plan: DecodePlan, state: jax_decode.SlotState) -> None:
        """Takes back the plan's rows' state after the call (numpy arrays)."""
        rows = slice(None) if plan.rows_b is None else plan.rows_b
        for k, v in state._asdict().items():
            self.arrays[k][rows] = v

    def slots(self, plan: DecodePlan) -> np.ndarray:
        """The slot of each row of the plan."""
        return np.arange(len(self.arrays["active_b"])) if plan.rows_b is None else plan.rows_b


class KeptTurns:
    """Cache rows of finished turns kept for the same request's next turn (`JaxEngine(reuse_turns=)`):
    request id -> (slot, the tokens whose keys/values the slot holds), least recently kept first."""

    def __init__(self):
        self._by_id: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._slots: set[int] = set()

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def keep(self, request_id: str, slot: int, cached: list[int], length: int) -> None:
        """Keeps `slot`, holding `cached` (checked against the slot's cached `length`)."""
        if len(cached) == length:
            self._by_id[request_id] = (slot, tuple(cached))
            self._slots.add(slot)

    def take(self, request_id: str, sequence: list[int]) -> tuple[int | None, int]:
        """(The slot `request_id` kept, or None; how many leading positions of `sequence` it already
        holds: all its kept tokens when `sequence` extends them by at least its pending last token, else 0)."""
        kept = self._by_id.pop(request_id, None)
        if kept is None:
            return None, 0
        slot, cached = kept
        self._slots.discard(slot)
        n = len(cached)
        return slot, n if n < len(sequence) and tuple(sequence[:n]) == cached else 0

    def drop(self, request_id: str) -> None:
        """Forgets the turn `request_id` kept, if any (its slot is free again)."""
        kept = self._by_id.pop(request_id, None)
        if kept is not None:
            self._slots.discard(kept[0])

    def evict(self) -> int:
        """Frees the least recently kept slot and returns it."""
        request_id = next(iter(self._by_id))
        slot, _ = self._by_id.pop(request_id)
        self._slots.discard(slot)
        return slot

    def clear(self) -> None:
        self._by_id.clear()
        self._slots.clear()
