"""Throughput of the data service: protocol operations and weight sync, side by side.

Group ops: every group passes three protocol transitions (Reserve at dispatch, Occupy at finish with
rewards, Consume); the benchmark drives full train steps (dispatch one group per call, finish one group
per call with its samples, one consume per batch) and reports transitions per second, embedded and
through a loopback server.

Weight sync: publish + pull of a state of N parameters (fp32) through the parameter service, embedded
and through shared memory to another process, against a plain memory copy of the same bytes.

    .venv/bin/python benchmarks/data_service.py --json /tmp/data_service.json
    .venv/bin/python benchmarks/data_service.py --quick

The JSON carries group_ops_per_s_embedded, group_ops_per_s_loopback and weight_sync_vs_memcpy.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import numpy as np
import results_meta

from jaxflow.data.param_service import RPC_METHODS, ParameterService
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.transport import rpc
from jaxflow.transport.param_client import ParameterClient

TRAJECTORY_METHODS = ["dispatch", "finish", "consume", "mark_published", "stats"]


def _service(steps: int, batch: int, group_size: int) -> TrajectoryService:
    records = [{"prompt": [1 + i % 100] * 16, "meta": {"answer": i}} for i in range(steps * batch)]
    return TrajectoryService(PromptSource(records, shuffle=False), batch_groups=batch,
                             group_size=group_size, eta=1)


def drive_groups(svc, steps: int, batch: int, group_size: int, tokens: int) -> dict:
    """Runs `steps` train steps through `svc` (embedded object or RPC client)."""
    t0 = time.perf_counter()
    for v in range(steps):
        tasks = []
        while len(tasks) < batch:
            got = svc.dispatch("bench", v, 1)
            if not got:
                break
            tasks.extend(got)
        for t in tasks:
            samples = [Sample(tokens=[5] * tokens, logprobs=[-1.0] * tokens, versions=[v] * tokens,
                              finish_reason="stop") for _ in range(group_size)]
            svc.finish(t.group_id, "bench", samples, rewards=[1.0] * group_size)
        consumed = svc.consume(v, timeout=30)
        assert len(consumed.groups) == batch, (v, len(consumed.groups))
        svc.mark_published(v + 1)
    elapsed = time.perf_counter() - t0
    transitions = 3 * steps * batch
    calls = steps * (2 * batch + 2)
    return {"group_ops_per_s": transitions / elapsed, "calls_per_s": calls / elapsed, "seconds": elapsed}


def bench_groups(steps: int, batch: int, group_size: int, tokens: int) -> dict:
    embedded = drive_groups(_service(steps, batch, group_size), steps, batch, group_size, tokens)
    with rpc.Server(_service(steps, batch, group_size), TRAJECTORY_METHODS).start() as server:
        with rpc.Client(server.address) as client:
            loopback = drive_groups(client, steps, batch, group_size, tokens)
    return {"embedded": embedded, "loopback": loopback}


def _tensors(num_params: int, per_tensor: int = 2_000_000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out, left, i = {}, num_params, 0
    while left > 0:
        n = min(per_tensor, left)
        out[f"model.layers.{i}.weight"] = rng.standard_normal(n, dtype=np.float32)
        left, i = left - n, i + 1
    return out


def _memcpy_s(tensors: dict[str, np.ndarray], repeats: int) -> float:
    dst = {k: np.empty_like(v) for k, v in tensors.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in tensors.items():
            np.copyto(dst[k], v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pull_in_child(address, version, conn):
    """Child process: pull `version` through shared memory and report the pull time and a checksum."""
    with rpc.Client(tuple(address)) as client:
        params = ParameterClient(client)
        t0 = time.perf_counter()
        _, tensors = params.pull(version)
        checksum = float(sum(float(v[:: max(1, v.size // 64)].sum()) for v in tensors.values()))
        conn.send((time.perf_counter() - t0, checksum))


def bench_weights(num_params: int, repeats: int, gap: float) -> dict:
    tensors = _tensors(num_params)
    nbytes = sum(v.nbytes for v in tensors.values())
    memcpy = _memcpy_s(tensors, repeats)

    # As in training: one publish per train step (`gap` seconds apart), the engine drops a pulled
    # version once loaded, and the first publish (cold pages) is a warm-up that is not timed.
    service = ParameterService(keep=2)
    times = []
    for r in range(repeats + 1):
        time.sleep(gap)
        t0 = time.perf_counter()
        service.publish(r, tensors)
        _, pulled = service.pull(r)
        times.append(time.perf_counter() - t0)
        del pulled
    service.close()
    embedded = statistics.median(times[1:])

    shared = ParameterService(keep=2, shared_memory=True)
    ctx = multiprocessing.get_context("spawn")
    shm_times = []
    with rpc.Server(shared, RPC_METHODS).start() as server:
        for r in range(repeats + 1):
            time.sleep(gap)
            t0 = time.perf_counter()
            shared.publish(r, tensors)
            publish_s = time.perf_counter() - t0
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pull_in_child, args=(server.address, r, child))
            proc.start()
            pull_s, checksum = parent.recv()
            proc.join()
            expected = float(sum(float(v[:: max(1, v.size // 64)].sum()) for v in tensors.values()))
            assert abs(checksum - expected) <= 1e-3 * max(1.0, abs(expected)), "shm pull corrupted data"
            shm_times.append(publish_s + pull_s)
    shared.close()
    shm = statistics.median(shm_times[1:])
    return {"bytes": nbytes, "memcpy_s": memcpy, "embedded_s": embedded, "shm_s": shm,
            "embedded_vs_memcpy": memcpy / embedded, "shm_vs_memcpy": memcpy / shm}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="train steps driven through the service")
    parser.add_argument("--batch", type=int, default=64, help="groups per train step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per sample")
    parser.add_argument("--params", type=float, default=100e6, help="parameters in the weight-sync state")
    parser.add_argument("--repeats", type=int, default=5, help="timed publishes (after one warm-up)")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between publishes (a train step)")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    if args.quick:
        args.steps, args.repeats = 15, 3

    groups = bench_groups(args.steps, args.batch, args.group_size, args.tokens)
    weights = bench_weights(int(args.params), args.repeats, args.gap)

    print(f"group ops ({args.steps} steps x {args.batch} groups x {args.group_size} samples x "
          f"{args.tokens} tokens; 3 transitions per group)")
    print(f"{'placement':<12}{'group ops/s':>14}{'calls/s':>12}")
    for name, r in groups.items():
        print(f"{name:<12}{r['group_ops_per_s']:>14,.0f}{r['calls_per_s']:>12,.0f}")
    gb = weights["bytes"] / 1e9
    print(f"\nweight sync: {args.params / 1e6:.0f}M fp32 parameters ({gb:.2f} GB), median of {args.repeats} "
          f"publishes {args.gap}s apart after a warm-up")
    print(f"{'path':<28}{'seconds':>10}{'GB/s':>8}{'vs memcpy':>11}")
    rows = [("memcpy (np.copyto)", weights["memcpy_s"], 1.0),
            ("publish+pull embedded", weights["embedded_s"], weights["embedded_vs_memcpy"]),
            ("publish+pull shm, 2 procs", weights["shm_s"], weights["shm_vs_memcpy"])]
    for name, s, ratio in rows:
        print(f"{name:<28}{s:>10.3f}{gb / s:>8.2f}{ratio:>10.2f}x")
    if args.json:
        results_meta.write_json(args.json, {
            "group_ops_per_s_embedded": groups["embedded"]["group_ops_per_s"],
            "group_ops_per_s_loopback": groups["loopback"]["group_ops_per_s"],
            "weight_sync_vs_memcpy": min(weights["embedded_vs_memcpy"], weights["shm_vs_memcpy"]),
            "groups": groups, "weights": weights, "args": vars(args)}, meta_started)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
