"""Throughput of the jitted PPO update for a model size given on the command line.

Runs the same synthetic long-tail batch through several layouts side by side (padded rows, packed rows,
packed + remat) and prints one table: median step time, tokens/s (non-padding tokens processed) and
model-FLOPs utilisation: on a GPU/TPU against the chip's listed peak, on a CPU against the peak of a large
fp32 matrix multiply measured in the same run (`machine_limits.py`).

    .venv/bin/python benchmarks/train_step.py --size 10m --json /tmp/train_step.json
    .venv/bin/python benchmarks/train_step.py --quick

The JSON carries tokens_per_s, step_time_s, mfu (null without an accelerator) and cpu_mfu (null on an
accelerator) of the packed layout, the measured matmul peak, plus every variant and its ratio to the first
one run (`ratio_vs_padded`: the padded baseline unless `--variants` leaves it out; at 100m
`--variants packed` skips the padded step's minutes).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import ml_collections
import numpy as np
import results_meta
from flax import nnx
from machine_limits import matmul_peak_flops

from jaxflow import sharding
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.batch import Trajectory, make_batch
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import LOGPROB_CHUNK, StepConfig, TrainStep, make_optimizer

# name -> (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 16, 512),
    "10m": (256, 768, 6, 4, 2, 64, 8192),
    "50m": (512, 1536, 8, 8, 4, 64, 16384),
    "100m": (768, 2048, 12, 12, 4, 64, 32768),  # 100.7M parameters
    "125m": (768, 2048, 12, 12, 4, 64, 32768),  # the same model, its older name
    "500m": (1024, 3072, 24, 16, 8, 64, 65536),
    "1b": (2048, 5632, 16, 16, 8, 128, 65536),
}

# Dense bf16 peak FLOP/s per chip, by substrings of jax's device_kind.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "TPU v4": 275e12,
              "TPU v5 lite": 197e12, "TPU v5p": 459e12, "TPU v6": 918e12}


def peak_flops(device) -> float | None:
    """Per-chip peak FLOP/s of an accelerator, or None (CPU, or a chip not in the table)."""
    if device.platform == "cpu":
        return None
    return next((v for k, v in PEAK_FLOPS.items() if k in device.device_kind), None)


def model_config(size: str, dtype: str) -> ModelConfig:
    d, f, n_layers, h, g, k, v = SIZES[size]
    return ModelConfig("Qwen3ForCausalLM", vocab_size=v, hidden_size=d, intermediate_size=f,
                       num_layers=n_layers, num_heads=h, num_kv_heads=g, head_dim=k, qk_norm=True,
                       tie_word_embeddings=True, dtype=dtype)


def long_tail_trajectories(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    """Prompts of 16-64 tokens and log-normal completion lengths (median ~ seq_len/6, capped)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(16, 64))
        c = int(np.clip(rng.lognormal(np.log(seq_len / 6), 0.8), 4, seq_len - p))
        out.append(Trajectory(prompt=rng.integers(0, vocab, p).tolist(),
                              completion=rng.integers(0, vocab, c).tolist(),
                              behav_logp=(-np.log(vocab) + 0.1 * rng.normal(size=c)).tolist(),
                              versions=[0] * c, reward=float(rng.integers(0, 2)), group_id=i // 8))
    return out


def train_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """6·N for the matmuls (forward + backward) plus attention's 12·L·T·H·K."""
    return 6 * cfg.num_params() + 12 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim


def bench_variant(cfg, mesh, batch, remat: bool, steps: int, logprob_chunk: int = LOGPROB_CHUNK,
                  compute_dtype: str = "float32") -> dict:
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
    tx = make_optimizer(ml_collections.ConfigDict(dict(
        lr=1e-5, warmup_steps=0, schedule="constant", total_steps=1, b1=0.9, b2=0.95, eps=1e-8,
        weight_decay=0.0, max_grad_norm=1.0)))
    state = create_train_state(model, tx, mesh)
    step = TrainStep(nnx.graphdef(model), tx, StepConfig(remat=remat, logprob_chunk=logprob_chunk,
                                                         compute_dtype=compute_dtype), mesh,
                     train_state_shardings(state.params, tx, mesh))
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps):
        batch = batch.replace(versions=np.where(batch.loss_mask > 0, i + 1, -1).astype(np.int32))
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    tokens = int((np.asarray(batch.segment_ids) > 0).sum())
    return {"first_step_s": compile_s, "step_time_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "rows": int(np.prod(batch.tokens.shape[:2])),
            "seq_len": int(batch.tokens.shape[-1])}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m", choices=sorted(SIZES))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=32, help="trajectories per batch")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default bfloat16 on GPU/TPU, else float32)")
    parser.add_argument("--logprob-chunk", type=int, default=LOGPROB_CHUNK,
                        help="positions per chunk of the LM head (trainer.logprob_chunk; 0: the whole sequence)")
    parser.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="what the update computes in (model.compute_dtype)")
    parser.add_argument("--variants", default="padded,packed,packed+remat",
                        help="comma-separated subset of padded, packed, packed+remat (a big model's padded "
                             "step takes minutes)")
    parser.add_argument("--quick", action="store_true", help="tiny model, short sequences: done in seconds")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    if args.quick:
        args.size, args.seq_len, args.sequences, args.steps = "tiny", 128, 32, 3

    device = jax.devices()[0]
    dtype = args.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
    cfg = model_config(args.size, dtype)
    mesh = sharding.make_mesh()
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    trajs = long_tail_trajectories(args.sequences, args.seq_len, cfg.vocab_size)
    padded_rows = -(-args.sequences // (shards * args.micro_batches)) * shards * args.micro_batches
    padded, _ = make_batch(trajs, num_rows=padded_rows, seq_len=args.seq_len,
                           micro_batches=args.micro_batches)
    total = sum(len(t.prompt) + len(t.completion) for t in trajs)
    packed_rows = padded_rows
    for rows in range(shards * args.micro_batches, padded_rows + 1, shards * args.micro_batches):
        if rows * args.seq_len >= 1.15 * total:  # first-fit needs a little slack
            packed_rows = rows
            break
    packed, _ = make_batch(trajs, num_rows=packed_rows, seq_len=args.seq_len,
                           micro_batches=args.micro_batches, pack=True)

    print(f"model {args.size}: {cfg.num_params() / 1e6:.1f}M params, {dtype}; mesh {dict(mesh.shape)} on "
          f"{jax.device_count()} x {device.device_kind}; {args.sequences} sequences, {total} tokens, "
          f"seq_len {args.seq_len}", flush=True)
    variants = {"padded": (padded, False), "packed": (packed, False), "packed+remat": (packed, True)}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(variants))
    if unknown or not chosen:
        parser.error(f"--variants {args.variants!r}: choose from {', '.join(variants)} (got {unknown or 'none'})")
    variants = {name: v for name, v in variants.items() if name in chosen}
    results = {}
    peak = peak_flops(device)
    cpu_peak = matmul_peak_flops() if device.platform == "cpu" else None
    for name, (batch, remat) in variants.items():
        r = bench_variant(cfg, mesh, batch, remat, args.steps, args.logprob_chunk, args.compute_dtype)
        flops = train_flops_per_token(cfg, args.seq_len) * r["tokens"] / r["step_time_s"]
        r["mfu"] = flops / (peak * jax.device_count()) if peak else None
        r["cpu_mfu"] = flops / cpu_peak if cpu_peak else None
        r["flops_per_s"] = flops
        results[name] = r
        print(f"  {name} done (first step {r['first_step_s']:.1f}s)", flush=True)

    base = results[next(iter(results))]["tokens_per_s"]
    if cpu_peak:
        print(f"\nMFU against this CPU's fp32 matmul peak, measured now: {cpu_peak / 1e9:,.0f} GFLOP/s")
    first = "vs " + next(iter(results))
    print(f"\n{'variant':<14}{'rows x len':>12}{'step (ms)':>11}{'tokens/s':>12}{first:>13}{'MFU':>8}")
    for name, r in results.items():
        r["ratio_vs_padded"] = r["tokens_per_s"] / base
        mfu = r["mfu"] if r["mfu"] is not None else r["cpu_mfu"]
        mfu = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
        print(f"{name:<14}{r['rows']:>5} x {r['seq_len']:<5}{1e3 * r['step_time_s']:>10.1f}"
              f"{r['tokens_per_s']:>12,.0f}{r['ratio_vs_padded']:>12.2f}x{mfu:>8}")
    if args.json:
        main_r = results.get("packed") or next(iter(results.values()))
        results_meta.write_json(args.json, {
            "size": args.size, "params": cfg.num_params(), "dtype": dtype,
            "logprob_chunk": args.logprob_chunk, "compute_dtype": args.compute_dtype,
            "device": device.device_kind, "devices": jax.device_count(),
            "tokens_per_s": main_r["tokens_per_s"], "step_time_s": main_r["step_time_s"],
            "mfu": main_r["mfu"], "cpu_mfu": main_r["cpu_mfu"], "cpu_matmul_peak_flops": cpu_peak,
            "variants": results}, meta_started)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
