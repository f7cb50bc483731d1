"""Validation of a trajectory-service snapshot, in full, before `restore` touches anything.

A snapshot comes back from a checkpoint (JSON), possibly edited or damaged. `parse_snapshot` checks every
field (types, ranges, the group states, samples and rewards, the slots each buffer holds) and returns the
parsed pieces; it raises ValueError (or TypeError) naming the bad field, prefixed with "snapshot", so a
bad snapshot leaves the running service exactly as it was.

A sample is saved as a dict of its fields (`snapshot_samples`). Its routes (`Sample.routes`, a mixture-of-
experts model's) are saved only when it has some, compactly: {"dtype", "shape", "data": base64 of the
array's C-order little-endian bytes}, restored to the same dtype, shape and values. A sample saved without
them (a dense model's, or a snapshot from before routes existed) is restored with routes None. Its
sequence_starts (`Sample.sequence_starts`) are saved only when it has some; a sample saved without them (one
training sequence, or a snapshot from before they existed) is restored with []. Its teacher_logprobs
(`Sample.teacher_logprobs`) are saved only when it has some; a sample saved without them is restored with None.
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import math
from typing import Any

import numpy as np

from jaxflow.data import checks
from jaxflow.data.records import RouteSpec, Sample
from jaxflow.data.service_groups import own_samples

_TOP = ("v_train", "published", "next_id", "counts", "groups", "source")
_SAMPLE_FIELDS = ("tokens", "logprobs", "versions", "finish_reason")
_OPTIONAL_SAMPLE_FIELDS = ("env_spans", "reward", "routes", "sequence_starts", "teacher_logprobs")
# The dtypes saved routes may have: the signed ints `route_dtype` picks (and int64, numpy's default).
_ROUTE_DTYPES = {np.dtype(t).name: np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)}


def encode_routes(routes: np.ndarray) -> dict[str, Any]:
    """`routes` as JSON: {"dtype": name, "shape": [...], "data": base64 of its little-endian C-order bytes}."""
    arr = np.ascontiguousarray(routes, dtype=routes.dtype.newbyteorder("<"))
    return {"dtype": routes.dtype.name, "shape": list(routes.shape), "data": base64.b64encode(arr.tobytes()).decode()}


def decode_routes(d: Any, where: str) -> np.ndarray:
    """The array `encode_routes` saved (a new, writable one); ValueError naming `where` if `d` is not one."""
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data"}:
        raise ValueError(f"snapshot {where}: routes must be None or a dict of dtype, shape and data, got {d!r:.200}")
    dtype = _ROUTE_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise ValueError(f"snapshot {where}: routes dtype {d['dtype']!r:.80} is not one of {', '.join(_ROUTE_DTYPES)}")
    shape = d["shape"]
    if not isinstance(shape, list) or len(shape) != 3 or not all(checks.is_int(x) and x >= 0 for x in shape):
        raise ValueError(f"snapshot {where}: routes shape {shape!r:.80} must be 3 ints >= 0 (tokens, sparse layers, "
                         f"top-k)")
    try:
        raw = base64.b64decode(d["data"], validate=True) if isinstance(d["data"], str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise ValueError(f"snapshot {where}: routes data must be a base64 str")
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"snapshot {where}: routes data holds {len(raw)} bytes, but shape {shape} of {dtype.name} "
                         f"needs {math.prod(shape) * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def snapshot_samples(samples: list[Sample] | None) -> list[dict[str, Any]] | None:
    """`samples` as JSON-serialisable dicts (copies: the service's own live on), routes `encode_routes`d
    and left out when None, sequence_starts left out when [] (as saved before they existed), teacher_logprobs
    left out when None."""
    if samples is None:
        return None
    out = []
    for s in samples:
        d = dataclasses.asdict(dataclasses.replace(s, routes=None))
        del d["routes"]
        if s.routes is not None:
            d["routes"] = encode_routes(s.routes)
        if not d["sequence_starts"]:
            del d["sequence_starts"]
        if d["teacher_logprobs"] is None:
            del d["teacher_logprobs"]
        out.append(d)
    return out


def _sample(d: Any, where: str) -> Sample:
    if isinstance(d, Sample):
        return d
    required, optional = set(_SAMPLE_FIELDS), set(_OPTIONAL_SAMPLE_FIELDS)
    if not isinstance(d, dict) or not required <= set(d) <= required | optional:
        raise ValueError(f"snapshot {where}: a sample must be a dict of tokens, logprobs, versions, finish_reason "
                         f"(and env_spans, reward, routes, sequence_starts, teacher_logprobs), got {d!r:.200}")
    # Snapshots from before multi-turn episodes have no env_spans ([]), from before routes no routes (None),
    # samples of one training sequence (and snapshots from before there could be more) no sequence_starts ([]).
    if d.get("routes") is not None:
        d = {**d, "routes": decode_routes(d["routes"], where)}
    return Sample(**d)


def parse_snapshot(snap: Any, *, group_fields: tuple[str, ...], states: dict[str, Any], n: int,
                   batch_groups: int, reserve_groups: int, eta: int,
                   route_spec: RouteSpec | None = None) -> dict[str, Any]:
    """The snapshot's parts, checked: {"v_train", "published", "next_id", "counts", "groups": [field
    dicts with parsed states and Samples], "source": dict}. route_spec: the routing of the service's model
    (None: a dense model, whose samples have no routes); routes are returned in its dtype."""
    if not isinstance(snap, dict) or set(snap) != set(_TOP):
        keys = sorted(snap) if isinstance(snap, dict) else type(snap).__name__
        raise ValueError(f"snapshot must be a dict with keys {', '.join(_TOP)}; got {keys}")
    try:
        v_train = checks.check_int("snapshot v_train", snap["v_train"], 0)
        published = checks.check_int("snapshot published", snap["published"], 0, v_train)
        next_id = checks.check_int("snapshot next_id", snap["next_id"], 0)
    except TypeError as e:
        raise ValueError(str(e)) from None
    counts = snap["counts"]
    if not isinstance(counts, dict) or not all(isinstance(k, str) and checks.is_int(v) and v >= 0
                                               for k, v in counts.items()):
        raise ValueError(f"snapshot counts must map names to ints >= 0, got {counts!r:.200}")
    source = snap["source"]
    if not isinstance(source, dict) or not checks.is_int(source.get("index")) or source["index"] < 0:
        raise ValueError(f"snapshot source must be {{'index': int >= 0}}, got {source!r:.200}")
    if not isinstance(snap["groups"], list):
        raise ValueError("snapshot groups must be a list")
    groups, seen = [], set()
    slots: collections.Counter[int] = collections.Counter()
    for i, d in enumerate(snap["groups"]):
        where = f"groups[{i}]"
        if not isinstance(d, dict) or set(d) != set(group_fields):
            raise ValueError(f"snapshot {where} must have the fields {', '.join(group_fields)}, got "
                             f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        d = dict(d)
        gid = d["group_id"]
        if not checks.is_int(gid) or not 0 <= gid < next_id or gid in seen:
            raise ValueError(f"snapshot {where}.group_id={gid!r} must be a unique int in [0, next_id={next_id})")
        seen.add(gid)
        where = f"group {gid}"
        if d["state"] not in states:
            raise ValueError(f"snapshot {where}: state {d['state']!r} is not one of {', '.join(states)}")
        d["state"] = states[d["state"]]
        state = d["state"].value
        if not isinstance(d["prompt"], list) or not d["prompt"] or not all(
                checks.is_int(t) and t >= 0 for t in d["prompt"]):
            raise ValueError(f"snapshot {where}: prompt must be a non-empty list of token ids")
        if not isinstance(d["meta"], dict):
            raise ValueError(f"snapshot {where}: meta must be a dict")
        if d["n"] != n:
            raise ValueError(f"snapshot {where}: n={d['n']!r}, but this service has group_size {n}")
        for f in ("v_start", "attempt"):
            if not checks.is_int(d[f]) or d[f] < 0:
                raise ValueError(f"snapshot {where}: {f}={d[f]!r} must be an int >= 0")
        if d["v_start"] > published:
            raise ValueError(f"snapshot {where}: v_start={d['v_start']} is above published={published}")
        if d["worker"] is not None and not isinstance(d["worker"], str):
            raise ValueError(f"snapshot {where}: worker must be None or a str")
        if not checks.is_number(d["since"]):
            raise ValueError(f"snapshot {where}: since must be a number")
        if state not in ("requeued", "running", "finished", "occupied", "failed"):
            raise ValueError(f"snapshot {where}: a {state} group cannot be in a snapshot")
        if state == "failed":  # kept for the record: it holds nothing
            if d["reserved"] != -1 or d["step"] is not None:
                raise ValueError(f"snapshot {where}: a failed group holds no slot (reserved=-1, step=None)")
            if isinstance(d["samples"], list):  # never dispatched again: read back as they were saved
                d["samples"] = [_sample(s, f"{where} sample {i}") for i, s in enumerate(d["samples"])]
            groups.append(d)
            continue
        holds = d["reserved"] if state != "occupied" else d["step"]
        lo, hi = max(v_train, d["v_start"]), d["v_start"] + eta
        if not checks.is_int(holds) or not lo <= holds <= hi:
            field = "step" if state == "occupied" else "reserved"
            raise ValueError(f"snapshot {where}: {field}={holds!r} must be a buffer in [{lo}, {hi}]")
        if state == "occupied" and d["reserved"] != -1:
            raise ValueError(f"snapshot {where}: an occupied group holds no reservation (reserved=-1)")
        if state != "occupied" and d["step"] is not None:
            raise ValueError(f"snapshot {where}: only occupied groups have a step")
        slots[holds] += 1
        if d["samples"] is not None:
            if not isinstance(d["samples"], list):
                raise ValueError(f"snapshot {where}: samples must be a list or None")
            d["samples"] = [_sample(s, f"{where} sample {i}") for i, s in enumerate(d["samples"])]
            try:
                checks.check_samples(gid, n, d["samples"], "snapshot", d["v_start"], published,
                                     finished=state in ("finished", "occupied"), route_spec=route_spec)
            except (TypeError, ValueError) as e:
                raise ValueError(f"snapshot {e}") from None
            d["samples"] = own_samples(d["samples"], route_spec)
        elif state in ("finished", "occupied"):
            raise ValueError(f"snapshot {where}: a {state} group needs its samples")
        if state == "occupied":
            try:
                checks.check_rewards(gid, n, d["rewards"])
            except ValueError as e:
                raise ValueError(f"snapshot {e}") from None
        elif d["rewards"] is not None:
            raise ValueError(f"snapshot {where}: only occupied groups have rewards")
        groups.append(d)
    for step, k in slots.items():
        if k > reserve_groups:
            raise ValueError(f"snapshot: buffer {step} holds {k} groups, more than its {reserve_groups} slots")
    return {"v_train": v_train, "published": published, "next_id": next_id, "counts": dict(counts),
            "groups": groups, "source": dict(source)}
