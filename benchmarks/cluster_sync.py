"""How fast a published policy version reaches every engine on other Ray nodes, per transport.

A `ray.cluster_utils.Cluster` on this machine: a head node where this process (the trainer) publishes,
and one node per engine, each with its own raylet and object store, so an engine's pull really crosses
between nodes (over loopback). Per transport and engine count, the median of N repeats of: publish a new
version of an HF-named float32 state (the tensors of a real transformer) and tell every engine actor its
number; time until every engine holds it as numpy arrays ("host"), and in a separate pass until every
engine has it on its JAX device as well (`jax.device_put`, "device"). Transports:

  ray_object    Ray's object store, the whole state as one object: `ray.put` once, each engine `ray.get`s
                it (Ray copies the object into the engine node's store, then numpy views it, no copy).
  ray_tensors   `jaxflow.cluster.weights`: one object per tensor and a manifest of refs
                (`RayWeightPublisher.publish`, `pull` on the engine): what a sharded trainer would use.
                Tensors share objects up to 32 MiB; `ray_per_tensor` (not run by default) puts each alone.
  shm           the parameter service in shared memory, served over loopback RPC; each engine's
                `ParameterClient` attaches as a registered reader and keeps its mappings, and the service
                writes each version into a segment the engines released and still map (zero copy, no new
                mapping). Works only because these "nodes" share one host's /dev/shm: across real nodes
                the client cannot attach and streams instead.
  shm_push      the service's manifest travels with the notify call and the engine maps it at once
                (`attach_shared`): no RPC round trip, but a fresh mapping per version (a plain manifest's
                segment is never written again).
  stream        the same service, `ParameterClient(shared_memory=False)`: 8 MiB `read` chunks over TCP.

Each publish follows `--gap-s` idle seconds (default 1 s: the trainer's step between versions, during
which the parameter service pre-faults its next shared-memory buffer; with back-to-back publishes that
pre-fault races the publish). Per case the JSON also has the notify latency (publish done -> the last
engine's call arrived) and `device_aliases_host`: JAX on CPU maps 64-byte-aligned host memory instead of
copying it, even with `may_alias=False` (checked by buffer address), so there "device" costs no copy.

Then the same with one engine on the publisher's own node ("head"; `--no-same-node` skips it): where
Ray's `ray.get` maps the object from its node's store without moving a byte.

Every version differs from the last where the engines' checksum looks, so an engine that read a stale
or half-written version fails the run.

Beside them, a memory copy of the same bytes (`np.copyto` into warm memory, median of N) on this
machine; `cluster_sync_vs_memcpy` = memcpy time / the best transport's host time to all engines (the
worst engine count's, engines on other nodes only). Run:

    .venv/bin/python benchmarks/cluster_sync.py --json /tmp/cluster_sync.json      # 100M params, 2 and 4 engines
    .venv/bin/python benchmarks/cluster_sync.py --quick                            # 10M params, 2 engines

JSON: every figure per transport and engine count (median and all repeats), `vs_memcpy` per transport and
engine count, `best_transport`, `cluster_sync_vs_memcpy`, the load average before and after (the
figures are only as steady as the machine is idle). Needs `ray` (the cluster extra).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import results_meta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab), as in weight_handoff.py
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 16, 512),
    "10m": (256, 768, 6, 4, 2, 64, 8192),
    "100m": (768, 2048, 12, 12, 4, 64, 32768),
}
TRANSPORTS = ("ray_object", "ray_tensors", "ray_per_tensor", "shm", "shm_push", "stream")
DEFAULT_TRANSPORTS = ("ray_object", "ray_tensors", "shm", "shm_push", "stream")


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100m", choices=sorted(SIZES))
    parser.add_argument("--engines", default="2,4", help="engine counts, comma-separated (one node each)")
    parser.add_argument("--transports", default=",".join(DEFAULT_TRANSPORTS),
                        help=f"comma-separated, of {', '.join(TRANSPORTS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median)")
    parser.add_argument("--gap-s", type=float, default=1.0,
                        help="idle seconds before each publish (the trainer's step between versions)")
    parser.add_argument("--bucket-mib", type=int, default=None,
                        help="ray_tensors: MiB of tensors per object (default: the library's)")
    parser.add_argument("--no-same-node", dest="same_node", action="store_false",
                        help="skip the case of one engine on the publisher's own node")
    parser.add_argument("--node-store-gb", type=float, default=1.0, help="object store per engine node, GB")
    parser.add_argument("--quick", action="store_true", help="a ~10M model, 2 engines, 3 repeats")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.params = "10m" if args.params == "100m" else args.params
        args.engines, args.repeats = "2", 3
    try:
        args.engines = sorted({int(n) for n in args.engines.split(",")})
    except ValueError:
        parser.error(f"--engines must be comma-separated ints, got {args.engines!r}")
    if args.engines[0] < 1:
        parser.error(f"--engines must be >= 1, got {args.engines}")
    args.transports = [t for t in args.transports.split(",") if t]
    unknown = sorted(set(args.transports) - set(TRANSPORTS))
    if unknown:
        parser.error(f"unknown transports {unknown}; choose from {', '.join(TRANSPORTS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.gap_s < 0:
        parser.error(f"--gap-s must be >= 0, got {args.gap_s}")
    return args


def model_config(size: str):
    """The ModelConfig of a Qwen3-style float32 model of `size` (imports no JAX)."""
    from jaxflow.models.config import ModelConfig

    d, f, n_layers, h, g, k, v = SIZES[size]
    return ModelConfig("Qwen3ForCausalLM", vocab_size=v, hidden_size=d, intermediate_size=f, num_layers=n_layers,
                       num_heads=h, num_kv_heads=g, head_dim=k, qk_norm=True, tie_word_embeddings=True,
                       dtype="float32")


def hf_state(cfg) -> dict:
    """{HF name: float32 array} of a randomly initialised model of config `cfg`."""
    import numpy as np
    from flax import nnx

    from jaxflow.models import hf_io
    from jaxflow.models.transformer import Transformer

    return {name: np.array(a, np.float32)  # a writable copy: each version is marked (`run_case`)
            for name, a in hf_io.iter_hf_tensors(Transformer(cfg, rngs=nnx.Rngs(0)))}


def checksum(tensors) -> float:
    """A cheap fingerprint of a state (every 4099th element of each tensor): equal iff the pull was right,
    with overwhelming odds."""
    return float(sum(float(a.reshape(-1)[::4099].astype("float64").sum()) for a in tensors.values()))


def memcpy_s(tensors, repeats: int) -> float:
    import numpy as np

    dst = {k: np.empty_like(v) for k, v in tensors.items()}
    times = []
    for _ in range(repeats + 1):  # the first pass faults the destination in
        t0 = time.perf_counter()
        for k, v in tensors.items():
            np.copyto(dst[k], v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


class Engine:
    """An engine stand-in on its own node: pulls a version the way each transport does, keeps the newest
    one (host arrays, and device arrays when asked), and reports when it had them (time.time(), which
    every process on this machine reads alike)."""

    def __init__(self, service_address):
        import jax  # noqa: F401 - imported here, outside the timed calls

        from jaxflow.transport import rpc
        from jaxflow.transport.param_client import ParameterClient

        self._rpc = rpc.Client(tuple(service_address), timeout=120)
        self._clients = {"shm": ParameterClient(self._rpc), "stream": ParameterClient(self._rpc, shared_memory=False)}
        self.host = self.device = None

    def node_id(self) -> str:
        """The Ray node this engine runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def load(self, transport: str, handle, device: bool) -> tuple[float, float, float, float, bool]:
        """Pulls version `handle` (a version number, a manifest, or [object ref]); returns (time the call
        arrived, time the host arrays were held, time they were on the device (or the same), checksum,
        whether the device arrays alias the host arrays (JAX on CPU may map host memory, not copy it))."""
        arrived = time.time()
        import jax
        import ray

        from jaxflow.cluster.weights import pull
        from jaxflow.transport.param_client import attach_shared

        self.host = self.device = None  # the previous version goes first, as an engine short of memory would
        if transport == "shm_push":
            tensors = attach_shared(handle)  # the service's manifest came with the call: no RPC
        elif transport == "ray_object":
            tensors = ray.get(handle[0])
        elif transport in ("ray_tensors", "ray_per_tensor"):
            tensors = pull(handle)[1]
        else:
            tensors = self._clients[transport].pull(handle)[1]
        self.host, host_t = tensors, time.time()
        aliases = False
        if device:
            self.device = jax.block_until_ready(jax.device_put(tensors, may_alias=False))
            name = max(tensors, key=lambda k: tensors[k].nbytes)
            aliases = self.device[name].unsafe_buffer_pointer() == tensors[name].ctypes.data
        return arrived, host_t, time.time(), checksum(tensors), aliases


def run_case(transport, engines, tensors, service, repeats: int, version: list[int], bucket_bytes: int,
             gap_s: float) -> dict:
    """Times `repeats` publishes of `tensors` to `engines` by `transport` (after one untimed warm-up),
    each after `gap_s` idle seconds."""
    import ray

    from jaxflow.cluster.weights import RayWeightPublisher

    publisher = RayWeightPublisher(keep=2, bucket_bytes=0 if transport == "ray_per_tensor" else bucket_bytes)
    kept_refs: list = []
    out = {"host_s": [], "device_s": [], "publish_s": [], "notify_s": []}
    aliased = []
    for r in range(repeats + 1):
        for device in (False, True):
            version[0] += 1
            # Each version differs where `checksum` looks, so an engine reading a stale one is caught
            # (the shared-memory service writes versions into segments readers keep mapped).
            for a in tensors.values():
                a.reshape(-1)[::4099] = version[0]
            want = checksum(tensors)
            time.sleep(gap_s)
            t0 = time.time()
            if transport == "ray_object":
                kept_refs = kept_refs[-1:] + [ray.put(tensors)]
                handle = [kept_refs[-1]]
            elif transport in ("ray_tensors", "ray_per_tensor"):
                handle = publisher.publish(version[0], tensors)
            elif transport == "shm_push":
                service.publish(version[0], tensors)
                handle = service.manifest(version[0])
            else:
                service.publish(version[0], tensors)
                handle = version[0]
            published = time.time()
            done = ray.get([e.load.remote(transport, handle, device) for e in engines])
            for *_, got, _ in done:
                if got != want:
                    raise AssertionError(f"{transport}: an engine's pulled state differs from the published one")
            if r == 0:
                continue
            if device:
                out["device_s"].append(max(d for _, _, d, _, _ in done) - t0)
                aliased += [a for *_, a in done]
            else:
                out["host_s"].append(max(h for _, h, _, _, _ in done) - t0)
                out["publish_s"].append(published - t0)
                out["notify_s"].append(max(a for a, *_ in done) - published)
    return {**{k + "_median": statistics.median(v) for k, v in out.items()}, "repeats": out,
            "device_aliases_host": all(aliased)}


def main(argv=None) -> int:
    args = parse(argv)
    meta_started = results_meta.begin(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Inherited by the cluster's nodes and so by the engine actors: they import jaxflow from this tree.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, ROOT)
    import ray
    from ray.cluster_utils import Cluster

    from jaxflow.cluster.weights import DEFAULT_BUCKET_BYTES
    from jaxflow.data.param_service import RPC_METHODS, ParameterService
    from jaxflow.transport import rpc

    # The cluster's processes start before this one imports JAX (forking a multithreaded JAX warns).
    cfg = model_config(args.params)
    load_before = os.getloadavg()
    bucket_bytes = DEFAULT_BUCKET_BYTES if args.bucket_mib is None else args.bucket_mib << 20
    store = int(args.node_store_gb * 1e9)
    head_store = max(store, int(3.5 * 4 * cfg.num_params()))  # two kept versions and one being put
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": head_store, "include_dashboard": False, "resources": {"publisher": 1}})
    for i in range(max(args.engines)):
        cluster.add_node(num_cpus=1, object_store_memory=store, resources={f"engine_{i}": 1})
    service = server = None
    results = []
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        service = ParameterService(keep=2, shared_memory=True, max_version_jump=1 << 20)  # one counter for all
        server = rpc.Server(service, RPC_METHODS).start()
        tensors = hf_state(cfg)
        nbytes = sum(a.nbytes for a in tensors.values())
        n_params = nbytes // 4
        memcpy = memcpy_s(tensors, max(args.repeats, 5))
        print(f"state {args.params}: {n_params / 1e6:.1f}M params, float32, {len(tensors)} tensors "
              f"({nbytes / 2**20:.0f} MiB); memcpy {1e3 * memcpy:.1f} ms ({nbytes / memcpy / 1e9:.1f} GB/s); "
              f"median of {args.repeats}; {os.cpu_count()} CPUs", flush=True)
        actor = ray.remote(Engine)
        engines = [actor.options(num_cpus=0, resources={f"engine_{i}": 0.01}).remote(list(server.address))
                   for i in range(max(args.engines))]
        local = actor.options(num_cpus=0, resources={"publisher": 0.01}).remote(list(server.address))
        nodes = ray.get([e.node_id.remote() for e in [local, *engines]])
        assert len(set(nodes)) == len(engines) + 1, "two engines landed on one node"
        version = [0]
        cases = [(engines[:n], n, False) for n in args.engines] + ([([local], 1, True)] if args.same_node else [])
        for group, n, same_node in cases:
            for transport in args.transports:
                row = run_case(transport, group, tensors, service, args.repeats, version, bucket_bytes, args.gap_s)
                row.update(transport=transport, engines=n, same_node=same_node,
                           vs_memcpy=memcpy / row["host_s_median"], device_vs_memcpy=memcpy / row["device_s_median"])
                results.append(row)
                print(f"  {n} engines{' (same node)' if same_node else ''}, {transport}: "
                      f"{1e3 * row['host_s_median']:.0f} ms", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if server is not None:
            server.close()
        if service is not None:
            service.close()

    print(f"\n{'engines':<12}{'transport':<13}{'publish':>10}{'notify':>10}{'host':>10}{'device':>10}"
          f"{'GB/s/engine':>13}{'memcpy/host':>13}  device aliases host")
    for r in results:
        print(f"{str(r['engines']) + (' (head)' if r['same_node'] else ''):<12}{r['transport']:<13}"
              f"{1e3 * r['publish_s_median']:>8.0f}ms{1e3 * r['notify_s_median']:>8.0f}ms"
              f"{1e3 * r['host_s_median']:>8.0f}ms{1e3 * r['device_s_median']:>8.0f}ms"
              f"{nbytes / r['host_s_median'] / 1e9:>13.2f}{r['vs_memcpy']:>12.2f}x  {r['device_aliases_host']}")
    # The transport whose worst engine count is fastest, engines on other nodes only.
    worst = {t: min(r["vs_memcpy"] for r in results if r["transport"] == t and not r["same_node"])
             for t in args.transports}
    best = max(worst, key=worst.get)
    figures = {
        "params": args.params, "num_params": int(n_params), "bytes": nbytes, "tensors": len(tensors),
        "dtype": "float32", "repeats": args.repeats, "gap_s": args.gap_s, "bucket_bytes": bucket_bytes,
        "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "engine_counts": args.engines,
        "memcpy_s": memcpy, "best_transport": best, "cluster_sync_vs_memcpy": worst[best],
        "vs_memcpy_worst_per_transport": worst, "cases": results,
    }
    print(f"\nmemcpy {1e3 * memcpy:.1f} ms; best transport {best}: cluster_sync_vs_memcpy = {worst[best]:.2f} "
          f"(its worst engine count)")
    if args.json:
        results_meta.write_json(args.json, figures, meta_started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
