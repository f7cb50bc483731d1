"""How fast a new policy version reaches a JAX engine in the trainer's process, per layout.

For each (trainer mesh -> engine mesh) case, the median of N repeats (the routes in turn within each
repeat, so that they share the machine's load) of:

  device_put    the floor: a plain `jax.device_put` of the trainer's arrays onto the engine's shardings
                (copying: the engine must own its weights, since the train step donates the trainer's);
  hand-off      `DeviceParamSource.publish` + `JaxEngine.update_weights(DeviceWeights)`, the engine's
                layout registered as a target as the rl job does, on the route `reshard` picks for the
                devices (on CPU devices, `jax.device_put`'s; see jaxflow/data/reshard.py);
  program       the same hand-off on the route accelerators take (`reshard.route("program")`: a compiled
                program and device-to-device copies), timed on these devices;
  host trip     the old route: device -> HF-named numpy (`iter_hf_tensors`) -> `ParameterService`
                publish + pull -> `JaxEngine.update_weights(HF tensors)` -> device.

Each time runs until the engine's new arrays are ready. CPU "devices" stand for accelerators
(`--xla_force_host_platform_device_count=8`, set before jax is imported), so a copy between two of them
is a memcpy: the figures compare routes, not interconnects. Note that `jax.device_put` itself goes
through the host when the engine's slices are not shards of the source already (it gathers the array
and places it again: on CPU devices a memcpy into memory the devices then use as it is, on accelerators
two PCIe crossings); the program route runs `reshard_program`'s compiled program instead (collectives
among the devices, then device-to-device copies), whose all-to-alls on CPU devices are memcpys plus a
rendezvous of the 8 device threads.

    .venv/bin/python benchmarks/weight_handoff.py --json /tmp/weight_handoff.json     # ~100M params
    .venv/bin/python benchmarks/weight_handoff.py --quick

JSON: `inprocess_sync_vs_device_put` (floor time / hand-off time, the worst case over the layouts),
`program_route_vs_device_put` (floor time / program-route time, worst case), `host_roundtrip_vs_device_put`
(floor time / host-trip time, worst case), and every case's times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import results_meta

# name -> (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab), as in train_step.py
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 16, 512),
    "10m": (256, 768, 6, 4, 2, 64, 8192),
    "100m": (768, 2048, 12, 12, 4, 64, 32768),
}

# (name, trainer devices, trainer mesh (data, fsdp, tensor), engine devices, engine mesh): the layouts a
# job makes. The trainer's mesh is `sharding.make_mesh` over its devices; an engine's is the same call over
# the same devices (another split), a subset of them, or devices of its own.
CASES = [
    ("one device (as the rl job)", (0, 1), (1, 1, 1), (0, 1), (1, 1, 1)),
    ("8 fsdp -> same 8 fsdp", (0, 8), (1, 8, 1), (0, 8), (1, 8, 1)),
    ("8 fsdp -> 8 fsdp4 x tp2", (0, 8), (1, 8, 1), (0, 8), (1, 4, 2)),
    ("8 fsdp -> same 8 tp8", (0, 8), (1, 8, 1), (0, 8), (1, 1, 8)),
    ("2 data x 4 fsdp -> same 8 tp8", (0, 8), (2, 4, 1), (0, 8), (1, 1, 8)),
    ("8 fsdp -> 2 of them tp2 (subset)", (0, 8), (1, 8, 1), (4, 6), (1, 1, 2)),
    ("8 fsdp -> 1 of them (subset)", (0, 8), (1, 8, 1), (0, 1), (1, 1, 1)),
    ("4 fsdp -> other 4 tp4 (disjoint)", (0, 4), (1, 4, 1), (4, 8), (1, 1, 4)),
]


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100m", choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per route and case (median)")
    parser.add_argument("--platform", default="cpu", help="JAX platform (cases needing more devices than "
                                                          "there are are skipped)")
    parser.add_argument("--quick", action="store_true", help="a ~10M model, 9 repeats")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeats = ("10m" if args.size == "100m" else args.size), 9
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def _median_times(fns: dict, repeats: int, fresh) -> dict:
    """name -> median seconds of `fns[name](fresh())`, the routes taken in turn within each repeat so that all
    see the same load on a shared machine (a route's repeats back to back would each see other minutes).
    Each call gets arrays of its own from `fresh()` (made untimed), as each version is new arrays in a job:
    `jax.device_put` keeps a host copy on an array it gathered, which a later call on the same array reuses."""
    import jax
    for fn in fns.values():
        fn(fresh())  # warm-up: compiles, pre-faults buffers
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            arrays = jax.block_until_ready(fresh())
            t0 = time.perf_counter()
            fn(arrays)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_case(case, model, repeats: int) -> dict:
    import jax
    from flax import nnx

    from jaxflow import sharding
    from jaxflow.data.device_params import DeviceParamSource, reshard
    from jaxflow.data.param_service import ParameterService
    from jaxflow.data.reshard import route
    from jaxflow.models import hf_io
    from rollout_bridge.jax_engine import JaxEngine

    name, (t0, t1), (td, tf, tt), (e0, e1), (ed, ef, et) = case
    devices = jax.devices()
    trainer_mesh = sharding.make_mesh(td, tf, tt, devices=devices[t0:t1])
    engine_mesh = sharding.make_mesh(ed, ef, et, devices=devices[e0:e1])
    graphdef, params = nnx.split(model)
    trainer_shardings = sharding.state_shardings(params, trainer_mesh)
    trainer_params = reshard(params, trainer_shardings, copy=True)
    engine = JaxEngine(nnx.merge(graphdef, trainer_params), mesh=engine_mesh, max_slots=8, max_len=64,
                       prefill_buckets=(64,), warmup=False)
    source = DeviceParamSource()
    source.add_target(engine.param_shardings)
    service = ParameterService(keep=2)
    version = [0]

    def fresh():  # what a train step returns: new arrays on the trainer's layout
        return reshard(trainer_params, trainer_shardings, copy=True)

    def floor(trainer_params):
        jax.block_until_ready(jax.device_put(trainer_params, engine.param_shardings, may_alias=False))

    def handoff(trainer_params):
        version[0] += 1
        source.publish(version[0], trainer_params)
        engine.update_weights(*source.pull(version[0]))
        jax.block_until_ready(engine._params)

    def handoff_program(trainer_params):
        with route("program"):
            handoff(trainer_params)

    def host_trip(trainer_params):
        version[0] += 1
        service.publish(version[0], hf_io.iter_hf_tensors(nnx.merge(graphdef, trainer_params)))
        engine.update_weights(*service.pull(version[0]))
        jax.block_until_ready(engine._params)

    try:
        out = {"case": name, "trainer_devices": t1 - t0, "engine_devices": e1 - e0,
               **_median_times({"device_put_s": floor, "handoff_s": handoff, "handoff_program_s": handoff_program,
                                "host_roundtrip_s": host_trip}, repeats, fresh)}
    finally:
        engine.close()
        source.close()
        service.close()
    out["handoff_vs_device_put"] = out["device_put_s"] / out["handoff_s"]
    out["program_vs_device_put"] = out["device_put_s"] / out["handoff_program_s"]
    out["host_roundtrip_vs_device_put"] = out["device_put_s"] / out["host_roundtrip_s"]
    return out


def main(argv=None) -> int:
    args = parse(argv)
    meta_started = results_meta.begin(argv)
    # Before jax is imported: its backend reads these once.
    flags = os.environ.get("XLA_FLAGS", "")
    if args.platform == "cpu" and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ["JAX_PLATFORMS"] = args.platform
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    from flax import nnx

    from jaxflow.models.config import ModelConfig
    from jaxflow.models.transformer import Transformer

    d, f, n_layers, h, g, k, v = SIZES[args.size]
    cfg = ModelConfig("Qwen3ForCausalLM", vocab_size=v, hidden_size=d, intermediate_size=f,
                      num_layers=n_layers, num_heads=h, num_kv_heads=g, head_dim=k, qk_norm=True,
                      tie_word_embeddings=True, dtype="float32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    n = jax.device_count()
    cases = [c for c in CASES if max(c[1][1], c[3][1]) <= n]
    mib = cfg.num_params() * 4 / 2**20
    print(f"model {args.size}: {cfg.num_params() / 1e6:.1f}M params, float32 ({mib:.0f} MiB); {n} x "
          f"{jax.devices()[0].device_kind}; median of {args.repeats}", flush=True)
    if len(cases) < len(CASES):
        print(f"  ({len(CASES) - len(cases)} cases need more than {n} devices: skipped)")
    results = []
    for case in cases:
        results.append(bench_case(case, model, args.repeats))
        print(f"  {case[0]} done", flush=True)

    print(f"\n{'trainer -> engine':<36}{'device_put':>12}{'hand-off':>12}{'program':>12}{'host trip':>12}"
          f"{'put/hand-off':>14}{'put/program':>13}{'put/host':>10}")
    for r in results:
        print(f"{r['case']:<36}{1e3 * r['device_put_s']:>10.1f}ms{1e3 * r['handoff_s']:>10.1f}ms"
              f"{1e3 * r['handoff_program_s']:>10.1f}ms{1e3 * r['host_roundtrip_s']:>10.1f}ms"
              f"{r['handoff_vs_device_put']:>13.2f}x{r['program_vs_device_put']:>12.2f}x"
              f"{r['host_roundtrip_vs_device_put']:>9.2f}x")
    figures = {
        "size": args.size, "params": cfg.num_params(), "dtype": "float32", "repeats": args.repeats,
        "device": jax.devices()[0].device_kind, "devices": n,
        "inprocess_sync_vs_device_put": min(r["device_put_s"] / r["handoff_s"] for r in results),
        "program_route_vs_device_put": min(r["device_put_s"] / r["handoff_program_s"] for r in results),
        "host_roundtrip_vs_device_put": min(r["device_put_s"] / r["host_roundtrip_s"] for r in results),
        "cases": results,
    }
    print(f"\nworst case: hand-off at {figures['inprocess_sync_vs_device_put']:.2f}x the device_put floor's "
          f"speed, host trip at {figures['host_roundtrip_vs_device_put']:.2f}x")
    if args.json:
        results_meta.write_json(args.json, figures, meta_started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
