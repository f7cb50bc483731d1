"""This machine's limits, measured where a benchmark runs (the CPU's equivalents of MFU's peak and of
decode's bandwidth bound): the FLOP/s of a large fp32 matrix multiply and the bytes/s of reading a large
array, each the median of a few jitted runs on the default device(s).

    .venv/bin/python benchmarks/machine_limits.py [--quick] [--json PATH]

--quick uses a smaller matrix and array (seconds); --json writes both figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import results_meta


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n @ n x n fp32 matmul (2 n^3 FLOPs)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    return 2 * n**3 / _median_seconds(jax.jit(lambda x: x @ x), a, repeats=repeats)


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of summing an fp32 array of `mib` MiB (far larger than any cache): each byte read once."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    return x.nbytes / _median_seconds(jax.jit(jnp.sum), x, repeats=repeats)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 1024 x 1024 matmul and a 128 MiB array")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    meta_started = results_meta.begin(argv)
    n, mib = (1024, 128) if args.quick else (2048, 512)
    flops, bandwidth = matmul_peak_flops(n), read_bandwidth(mib)
    print(f"{jax.devices()[0].device_kind}: fp32 matmul peak {flops / 1e9:,.0f} GFLOP/s, "
          f"read bandwidth {bandwidth / 1e9:,.1f} GB/s")
    if args.json:
        results_meta.write_json(args.json, {"device": jax.devices()[0].device_kind, "matmul_n": n,
                                            "matmul_peak_flops": flops, "read_mib": mib,
                                            "read_bandwidth_bytes_per_s": bandwidth}, meta_started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
