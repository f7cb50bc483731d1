"""What a compiled XLA program does per device, read from its optimised HLO text (`compiled.as_text()`).

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count; jaxflow's train step
scans over layers and micro-batches, so most of its work is in loop bodies. This module walks the
program's computations instead, multiplying each loop body by its known trip count (XLA records it on the
`while` as `known_trip_count`), and for a `conditional` takes its costliest branch (the plan is for the
worst case: `split_attention`'s uncut branch, a micro-batch that has tokens).

Per device, for the whole program:

- `matmul_flops`: 2 x (output elements) x (contracted size) over every `dot`: the work a tensor core or
  MXU does. Elementwise work is left out (it is not what the peak FLOP/s figures measure).
- `bytes_accessed`: for each instruction outside fusions, the bytes of its operands and its result (a
  fused kernel reads its inputs and writes its output once); an operand a fusion only reads through a
  `dynamic-slice` counts as the slice, and a `dynamic-update-slice` or `scatter` in place as the update. XLA's CPU
  backend fuses less than the GPU and TPU ones, so this is an upper bound for them.
- `collectives`: per kind (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), how
  many run, the bytes of their operands, and the bytes each device sends over the links with ring
  algorithms on groups of n devices: all-gather S(n-1) for a shard of S bytes, all-reduce 2S(n-1)/n,
  reduce-scatter and all-to-all S(n-1)/n, collective-permute S.

`loops_without_trip_count` counts while loops whose trip count XLA does not know (a decode loop that stops
when every row is done): their bodies count once.
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
               "s4": 0.5, "u4": 0.5, "token": 0}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that move no data of their own (their callees' instructions are counted).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency"}
# Ops that write into their first operand in place, and which operand holds the update.
_UPDATE_OPERAND = {"dynamic-update-slice": 1, "scatter": 2}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    type_str: str
    opcode: str
    operands: list[str]
    attrs: str

    @property
    def bytes(self) -> float:
        return type_bytes(self.type_str)

    @property
    def dims(self) -> list[int]:
        m = _ARRAY.search(self.type_str)
        return [int(d) for d in m.group(2).split(",") if d] if m else []


def type_bytes(type_str: str) -> float:
    """Bytes of an HLO type (a tuple's elements summed); unknown element types count 0."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_str):
        total += DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """`text` split at commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        type_str, rest = rest[:end], rest[end:].lstrip()
    else:
        type_str, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1)
    operands = [p.split()[-1].lstrip("%") for p in _split_top(rest[op.end():end - 1])]
    return Instr(name, type_str, op.group(1), operands, rest[end:])


def parse_module(text: str) -> tuple[dict[str, dict[str, Instr]], str]:
    """(computations: name -> {instruction name -> Instr} in order, entry computation name)."""
    comps: dict[str, dict[str, Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "->" in line:
                current = m.group(2)
                comps[current] = {}
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            comps[current][instr.name] = instr
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def _callees(attrs: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
    if m:
        return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
    m = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def group_size(attrs: str, num_partitions: int) -> int:
    """Devices per replica group of a collective, from any of the forms XLA prints."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = {k.strip().strip("'"): int(v) for k, v in (p.split("=") for p in m.group(1).split(","))}
        axes = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
        return math.prod(sizes.get(a, 1) for a in axes) if axes else num_partitions
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len(m.group(1).split(","))
    return num_partitions


def _wire_bytes(kind: str, operand_bytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-gather": operand_bytes * (n - 1),
            "all-reduce": 2 * operand_bytes * (n - 1) / n,
            "collective-permute": operand_bytes}.get(kind, operand_bytes * (n - 1) / n)


@dataclasses.dataclass
class Costs:
    matmul_flops: float = 0.0
    bytes_accessed: float = 0.0
    collectives: dict = dataclasses.field(default_factory=dict)
    loops_without_trip_count: int = 0

    def add(self, other: Costs, times: float = 1.0) -> None:
        self.matmul_flops += times * other.matmul_flops
        self.bytes_accessed += times * other.bytes_accessed
        self.loops_without_trip_count += other.loops_without_trip_count
        for kind, c in other.collectives.items():
            mine = self.collectives.setdefault(kind, {"count": 0, "operand_bytes": 0.0, "wire_bytes": 0.0})
            for key in mine:
                mine[key] += times * c[key]

    def as_dict(self) -> dict:
        return {"matmul_flops": self.matmul_flops, "bytes_accessed": self.bytes_accessed,
                "collectives": {k: self.collectives[k] for k in COLLECTIVES if k in self.collectives},
                "collective_wire_bytes": sum(c["wire_bytes"] for c in self.collectives.values()),
                "loops_without_trip_count": self.loops_without_trip_count}


class _Walker:
    def __init__(self, text: str):
        self.comps, self.entry = parse_module(text)
        m = re.search(r"num_partitions=(\d+)", text)
        self.partitions = int(m.group(1)) if m else 1
        self.memo: dict[tuple[str, bool], Costs] = {}

    def _fusion_bytes(self, comp: dict[str, Instr], instr: Instr, fused_name: str) -> float:
        """Operand and result bytes of a fusion, an operand it only reads through dynamic-slices counted
        as those slices, a result that updates an operand in place counted as the update."""
        fused = self.comps.get(fused_name, {})
        params = {i.name: int(re.search(r"\d+", i.operands[0] if i.operands else "0").group())
                  for i in fused.values() if i.opcode == "parameter"}
        users: dict[str, list[Instr]] = {}
        for i in fused.values():
            for o in i.operands:
                users.setdefault(o, []).append(i)
        root = list(fused.values())[-1] if fused else None
        in_place = None
        if root is not None and root.opcode in _UPDATE_OPERAND and root.operands[0] in params:
            in_place = params[root.operands[0]]
        total = 0.0
        for pname, index in params.items():
            if index >= len(instr.operands):
                continue
            src = comp.get(instr.operands[index])
            full = src.bytes if src is not None else 0.0
            uses = users.get(pname, [])
            if index == in_place:
                continue
            if uses and all(u.opcode == "dynamic-slice" for u in uses):
                total += sum(u.bytes for u in uses)
            else:
                total += full
        if in_place is not None:
            update = fused.get(root.operands[_UPDATE_OPERAND[root.opcode]])
            total += 2 * (update.bytes if update is not None else 0.0)
        else:
            total += instr.bytes
        return total

    def costs(self, name: str, fused: bool = False) -> Costs:
        key = (name, fused)
        if key in self.memo:
            return self.memo[key]
        comp = self.comps.get(name, {})
        out = Costs()
        for instr in comp.values():
            op = instr.opcode
            kind = op.removesuffix("-start")
            if op == "dot":
                lhs = comp.get(instr.operands[0])
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
                contracted = 1
                if lhs is not None and m:
                    dims = lhs.dims
                    contracted = math.prod(dims[int(d)] for d in m.group(1).split(",") if d)
                out.matmul_flops += 2 * math.prod(instr.dims) * contracted
            elif kind in COLLECTIVES and not op.endswith("-done"):
                operand_bytes = sum(comp[o].bytes for o in instr.operands if o in comp)
                n = group_size(instr.attrs, self.partitions)
                c = out.collectives.setdefault(kind, {"count": 0, "operand_bytes": 0.0, "wire_bytes": 0.0})
                c["count"] += 1
                c["operand_bytes"] += operand_bytes
                c["wire_bytes"] += _wire_bytes(kind, operand_bytes, n)
            if op == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', instr.attrs)
                if not m:
                    out.loops_without_trip_count += 1
                trips = int(m.group(1)) if m else 1
                for callee in _callees(instr.attrs, "body") + _callees(instr.attrs, "condition"):
                    out.add(self.costs(callee, fused), trips)
            elif op == "conditional":
                branches = (_callees(instr.attrs, "branch_computations")
                            or _callees(instr.attrs, "true_computation") + _callees(instr.attrs, "false_computation"))
                if branches:
                    costs = [self.costs(b, fused) for b in branches]
                    out.add(max(costs, key=lambda c: (c.matmul_flops, c.bytes_accessed)))
            elif op == "fusion":
                for callee in _callees(instr.attrs, "calls"):
                    out.add(self.costs(callee, fused=True))
                    if not fused:
                        out.bytes_accessed += self._fusion_bytes(comp, instr, callee)
            elif op in ("call", "async-start", "custom-call"):
                for callee in _callees(instr.attrs, "calls") + _callees(instr.attrs, "to_apply"):
                    out.add(self.costs(callee, fused))
            if not fused and op not in _NO_TRAFFIC and op != "fusion" and not op.endswith("-done"):
                if op == "dynamic-slice":
                    out.bytes_accessed += 2 * instr.bytes
                elif op in _UPDATE_OPERAND and len(instr.operands) > _UPDATE_OPERAND[op]:
                    update = comp.get(instr.operands[_UPDATE_OPERAND[op]])
                    out.bytes_accessed += 2 * (update.bytes if update is not None else 0.0)
                else:
                    out.bytes_accessed += instr.bytes + sum(comp[o].bytes for o in instr.operands if o in comp)
        self.memo[key] = out
        return out


def program_costs(hlo_text: str) -> dict:
    """Per-device matmul FLOPs, bytes accessed and collective traffic of a compiled SPMD program, loops
    counted by their trip counts (see the module docstring). `hlo_text`: `compiled.as_text()`."""
    walker = _Walker(hlo_text)
    return walker.costs(walker.entry).as_dict()
