"""Where the time of one train step and of one engine decode chunk goes, by JAX's profiler.

Runs a few warm train steps (the packed layout of `train_step.py`) and one rollout round of the JAX engine
(the long-tail workload of `engines.py`) under `jax.profiler.trace`, then reads the trace back and prints,
for each program, its wall time per call, how much of that time the CPU threads spent inside XLA's ops
(the rest is dispatch, host work and waiting), and the ops that took it: each op's time with the nested
ops of loops and conditionals counted once (in the innermost op), by the JAX operation and source line
that XLA's metadata gives for it.

    .venv/bin/python benchmarks/profile_step.py --json /tmp/profile.json
    .venv/bin/python benchmarks/profile_step.py --quick

The traces stay under --trace-dir: `perfetto_trace.json.gz` opens at ui.perfetto.dev, the `.xplane.pb`
in TensorBoard's profile plugin. The JSON carries, per program, calls, wall_ms_per_call, op_ms_per_call,
op_busy_frac (the wall time during which at least one thread ran an op) and the top ops.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import ml_collections
import numpy as np
import results_meta
from engines import MODELS, workload
from flax import nnx
from train_step import SIZES, long_tail_trajectories, model_config

from jaxflow import sharding
from jaxflow.models.tiny import write_tiny_model
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.batch import make_batch
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, make_optimizer
from rollout_bridge.engine import Request

_DUMP = ""  # where XLA dumps the optimised HLO (`dump_hlo`)


def dump_hlo() -> None:
    """Makes XLA dump the optimised HLO of the profiled programs, which maps the trace's op names to the
    JAX operations and source lines they came from. XLA reads its flags when the backend starts: call
    before anything touches a device."""
    global _DUMP
    _DUMP = tempfile.mkdtemp(prefix="jaxflow-hlo-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit__lambda|jit_decode|jit_prefill|jit_extend").strip()


# Ops that only run other ops (loops, conditionals, calls): their time is their children's.
_CONTAINERS = ("while", "cond", "conditional", "call")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")


def _frames(lines: list[str]) -> dict[int, str]:
    """stack frame id -> "file:line function" from the tables at the top of an HLO dump (JAX keeps only
    the frames of user code, so a frame is a line of ours, of flax's or of optax's)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and line.strip():
            key, _, value = line.partition(" ")
            current[int(key)] = value.strip('"')
        elif current is not None:
            current = None
        if line.startswith(("ENTRY", "%", "fused_computation")):
            break
    out = {}
    for frame, value in tables.get("StackFrames", {}).items():
        loc = dict(re.findall(r"(\w+)=(\d+)", tables["FileLocations"].get(
            int(re.search(r"file_location_id=(\d+)", value).group(1)), "")))
        path = tables["FileNames"].get(int(loc.get("file_name_id", 0)), "?")
        for root in ("/jaxflow/", "/rollout_bridge/", "site-packages/"):
            if root in path:
                path = (root.strip("/") + "/" if root != "site-packages/" else "") + path.split(root, 1)[-1]
                break
        func = tables["FunctionNames"].get(int(loc.get("function_name_id", 0)), "?").rsplit(".", 1)[-1]
        out[frame] = f"{path}:{loc.get('line', '?')} {func}"
    return out


def hlo_sources(module_re: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (JAX operation, source line) from the optimised HLO that XLA dumped for the
    modules whose name matches `module_re` (a later dump of a module overrides an earlier one)."""
    out: dict[str, tuple[str, str]] = {}
    for path in sorted(glob.glob(os.path.join(_DUMP, "*after_optimizations.txt"))) if _DUMP else []:
        module = os.path.basename(path).split(".")[1]
        if not re.search(module_re, module):
            continue
        with open(path) as f:
            lines = f.read().splitlines()
        frames = _frames(lines)
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]*)"', m.group(2))
            frame = re.search(r"stack_frame_id=(\d+)", m.group(2))
            out[m.group(1)] = (op.group(1).rsplit("/", 1)[-1] if op else "",
                               frames.get(int(frame.group(1)), "") if frame else "")
    return out


def read_trace(trace_dir: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}: the profiler wrote no trace")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarise(events: list[dict], module_re: str, top: int) -> dict:
    """Op time of the XLA modules matching `module_re`, per call (one execution: one run id): each op's
    own time (nested ops subtracted), the call's wall time (its first op's start to its last op's end) and
    the fraction of it during which some thread ran one of its ops."""
    ops = [e for e in events
           if e.get("ph") == "X" and re.search(module_re, (e.get("args") or {}).get("hlo_module", ""))]
    spans: dict[str, list[float]] = {}
    for e in ops:
        span = spans.setdefault(e["args"].get("run_id", ""), [e["ts"], e["ts"] + e["dur"]])
        span[0], span[1] = min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])
    calls = max(len(spans), 1)
    wall_s = sum(end - start for start, end in spans.values()) / 1e6 or 1e-9
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    own: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    leaf_intervals = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[float, str]] = []  # (end, name) of the ops this one may be nested in
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]:
                stack.pop()
            if stack:  # a nested op's time is its own, not its parent's
                own[stack[-1][1]] -= e["dur"]
            own[e["name"]] += e["dur"]
            count[e["name"]] += 1
            stack.append((e["ts"] + e["dur"], e["name"]))
            if e["name"].split(".")[0] not in _CONTAINERS:
                leaf_intervals.append((e["ts"], e["ts"] + e["dur"]))
    busy, last_end = 0.0, -1.0
    for start, end in sorted(leaf_intervals):
        if end > last_end:
            busy += end - max(start, last_end)
            last_end = end
    sources = hlo_sources(module_re)
    rows = []
    for name, us in sorted(own.items(), key=lambda kv: -kv[1]):
        if name.split(".")[0] in _CONTAINERS:
            continue
        op, src = sources.get(name, ("", ""))
        rows.append({"op": name, "calls_per_call": count[name] / calls, "ms_per_call": us / calls / 1e3,
                     "frac_of_wall": us / 1e6 / wall_s, "jax_op": op, "source": src})
    op_ms = sum(r["ms_per_call"] for r in rows)
    kinds: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        kinds[r["jax_op"] or "?"] += r["ms_per_call"]
    return {"calls": calls, "wall_ms_per_call": 1e3 * wall_s / calls, "op_ms_per_call": op_ms,
            "op_busy_frac": busy / 1e6 / wall_s, "top_ops": rows[:top],
            "by_jax_op": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def print_summary(title: str, s: dict, top: int) -> None:
    print(f"\n{title}: {s['calls']} calls, {s['wall_ms_per_call']:.2f} ms wall a call; ops on the CPU threads "
          f"{s['op_ms_per_call']:.2f} ms a call (summed over threads); some op running "
          f"{100 * s['op_busy_frac']:.0f}% of the wall time")
    print(f"  {'op':<40}{'n':>5}{'ms':>9}{'% wall':>8}  {'jax op':<22}source")
    for r in s["top_ops"][:top]:
        print(f"  {r['op'][:39]:<40}{r['calls_per_call']:>5.0f}{r['ms_per_call']:>9.2f}"
              f"{100 * r['frac_of_wall']:>7.1f}%  {r['jax_op'][:21]:<22}{r['source']}")
    kinds = list(s["by_jax_op"].items())[:8]
    total = s["op_ms_per_call"] or 1.0
    print("  by JAX operation: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in kinds))


def profile_train_step(args, trace_dir: str) -> dict:
    cfg = model_config(args.size, "float32")
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    trajs = long_tail_trajectories(args.sequences, args.seq_len, cfg.vocab_size)
    total = sum(len(t.prompt) + len(t.completion) for t in trajs)
    rows = -(-int(1.2 * total / args.seq_len) // args.micro_batches) * args.micro_batches
    batch, _ = make_batch(trajs, num_rows=rows, seq_len=args.seq_len, micro_batches=args.micro_batches, pack=True)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tx = make_optimizer(ml_collections.ConfigDict(dict(
        lr=1e-5, warmup_steps=0, schedule="constant", total_steps=1, b1=0.9, b2=0.95, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0)))
    state = create_train_state(model, tx, mesh)
    step = TrainStep(nnx.graphdef(model), tx, StepConfig(), mesh, train_state_shardings(state.params, tx, mesh))

    def run(n):
        nonlocal state
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        return times

    run(2)  # compile and warm up
    plain = statistics.median(run(args.steps))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        traced = statistics.median(run(args.steps))
    s = summarise(read_trace(trace_dir), r"^jit__lambda$", args.top)
    s.update(step_s=plain, step_s_traced=traced, tokens=total,
             shape=list(np.shape(batch.tokens)), model=args.size)
    return s


def profile_decode(args, trace_dir: str) -> dict:
    from rollout_bridge.jax_engine import JaxEngine

    model_dir = os.path.join(tempfile.mkdtemp(prefix="jaxflow-profile-"), "model")
    write_tiny_model(model_dir, **MODELS["tiny"])
    requests = workload(args.requests, 64, args.max_tokens, long_tail=True)
    engine = JaxEngine(model_dir, max_slots=args.slots, max_len=args.max_tokens + 64)
    engine.warmed()  # every decode bucket compiled before the timed rounds
    try:
        def round_(tag):
            t0 = time.perf_counter()
            out = engine.generate([Request(f"{q.request_id}-{tag}", q.prompt, q.params) for q in requests])
            return time.perf_counter() - t0, sum(len(c.sample.tokens) for c in out)

        round_("warm")
        plain_s, tokens = round_("plain")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            traced_s, _ = round_("traced")
    finally:
        engine.close()
    events = read_trace(trace_dir)
    # One call of the decode program = one chunk of decode_chunk steps over the active rows.
    s = summarise(events, r"^jit_decode$", args.top)
    prefill = summarise(events, r"^jit_(prefill|extend)$", 3)
    s.update(round_s=plain_s, round_s_traced=traced_s, tokens=tokens, tokens_per_s=tokens / plain_s,
             decode_frac_of_round=s["calls"] * s["wall_ms_per_call"] / 1e3 / traced_s,
             prefill_frac_of_round=prefill["calls"] * prefill["wall_ms_per_call"] / 1e3 / traced_s,
             decode_chunk=engine.decode_chunk, slots=args.slots)
    return s


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES), help="the train step's model")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sequences", type=int, default=256, help="trajectories in the train batch")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="profiled train steps")
    parser.add_argument("--requests", type=int, default=256, help="requests in the profiled rollout round")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--top", type=int, default=12, help="ops listed per program")
    parser.add_argument("--trace-dir", default=None, help="where the traces go (default: a new temp dir)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and requests: a minute or two")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    dump_hlo()
    if args.quick:
        args.steps, args.sequences, args.requests, args.max_tokens = 3, 128, 128, 128
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="jaxflow-trace-")

    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; traces under {trace_root}", flush=True)
    train = profile_train_step(args, os.path.join(trace_root, "train_step"))
    print_summary(f"train step (model {train['model']}, batch {train['shape']}, {train['tokens']} tokens; "
                  f"{1e3 * train['step_s']:.1f} ms a step untraced)", train, args.top)
    decode = profile_decode(args, os.path.join(trace_root, "decode"))
    print_summary(f"decode chunk ({decode['decode_chunk']} steps, {decode['slots']} slots; a round of "
                  f"{args.requests} requests: {decode['round_s']:.2f} s untraced, {decode['tokens_per_s']:,.0f} "
                  f"tokens/s traced: {100 * decode['decode_frac_of_round']:.0f}% of it in decode calls, "
                  f"{100 * decode['prefill_frac_of_round']:.0f}% in prefill calls)", decode, args.top)
    if args.json:
        results_meta.write_json(args.json, {"device": jax.devices()[0].device_kind, "train_step": train,
                                            "decode": decode, "trace_dir": trace_root, "args": vars(args)},
                                meta_started)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
