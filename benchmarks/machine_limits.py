"""This machine's limits, measured where a benchmark runs (the CPU's equivalents of MFU's peak and of
decode's bandwidth bound): the FLOP/s of a large fp32 matrix multiply and the bytes/s of reading a large
array, each the median of a few jitted runs on the default device(s).

    .venv/bin/python benchmarks/machine_limits.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


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


def main() -> int:
    print(f"{jax.devices()[0].device_kind}: fp32 matmul peak {matmul_peak_flops() / 1e9:,.0f} GFLOP/s, "
          f"read bandwidth {read_bandwidth() / 1e9:,.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
