"""What LoRA saves: weight-sync bytes and latency, and the optimizer's state, against full fine-tuning.

    .venv/bin/python benchmarks/lora.py [--size 125m] [--rank 8] [--quick] [--json PATH]

For a model of `--size` (train_step.py's table; 125m is 110M parameters), side by side, full fine-tuning
and LoRA adapters of `--rank` on all seven projections (alpha 2 x rank):

  trained params, opt-state bytes   what the optimizer holds (AdamW: two moments per trained parameter)
  sync bytes                        one version as the engines receive it: the HF weights, or the adapters
  host sync ms                      the trainer producing that version as host tensors (HF-named, or
                                    PEFT-named adapters) + a JAX engine checking, placing and swapping them in
  device sync ms                    the in-process route: `DeviceParamSource.publish` (copy on device) +
                                    the engine's `update_weights` of that version (no host round trip)

Medians of `--repeats` versions (a JAX engine with no requests in flight, so nothing is recomputed).
The JSON carries `sync_bytes_ratio` and `opt_state_bytes_ratio` (LoRA / full) and the latency ratios.
--quick: the 10m model, 3 repeats.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import results_meta
from flax import nnx
from train_step import SIZES, model_config

from jaxflow import sharding
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.models import lora as lora_lib
from jaxflow.models.hf_io import iter_hf_tensors
from jaxflow.models.lora import LoRASpec
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.state import create_train_state
from jaxflow.trainer.step import make_optimizer
from rollout_bridge.jax_engine import JaxEngine


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def measure(cfg, spec: LoRASpec | None, repeats: int) -> dict:
    import ml_collections
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    model = Transformer(cfg, rngs=nnx.Rngs(0), lora=spec)
    tx = make_optimizer(ml_collections.ConfigDict(dict(lr=1e-4, warmup_steps=0, schedule="constant", total_steps=10,
                                                       b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
                                                       max_grad_norm=1.0)))
    state = create_train_state(model, tx, mesh)
    engine = JaxEngine(model, max_slots=2, max_len=64, decode_chunk=4, prefill_buckets=(32, 64), mesh=mesh)
    source = DeviceParamSource()
    source.add_target(engine.param_shardings)

    def host_tensors():
        return lora_lib.peft_tensors(model.layers) if spec is not None else dict(iter_hf_tensors(model))

    host_ms, device_ms, sync_bytes = [], [], 0
    try:
        for v in range(1, repeats + 1):
            start = time.perf_counter()
            tensors = host_tensors()
            engine.update_weights(2 * v - 1, tensors)
            host_ms.append(1e3 * (time.perf_counter() - start))
            sync_bytes = sum(x.nbytes for x in tensors.values())
            del tensors
            start = time.perf_counter()
            source.publish(2 * v, state.params)
            engine.update_weights(*source.pull())
            device_ms.append(1e3 * (time.perf_counter() - start))
    finally:
        engine.close()
        source.close()
    return {"trained_params": sum(x.size for x in jax.tree.leaves(state.params)),
            "opt_state_bytes": nbytes(state.opt_state), "sync_bytes": sync_bytes,
            "host_sync_ms": statistics.median(host_ms), "device_sync_ms": statistics.median(device_ms)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="125m", choices=sorted(SIZES))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the 10m model, 3 repeats (well under 5 minutes)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    if args.quick:
        args.size, args.repeats = "10m", 3
    if args.rank < 1 or args.repeats < 1:
        parser.error("--rank and --repeats must be >= 1")
    cfg = model_config(args.size, "float32")
    spec = LoRASpec(rank=args.rank, alpha=2.0 * args.rank)
    print(f"model {args.size}: {cfg.num_params() / 1e6:.1f}M params, float32; LoRA rank {args.rank} on "
          f"{', '.join(spec.targets)}; median of {args.repeats} versions", flush=True)
    rows = {"full": measure(cfg, None, args.repeats), "lora": measure(cfg, spec, args.repeats)}
    print(f"{'':6} {'trained params':>15} {'opt state MB':>13} {'sync MB':>9} {'host sync ms':>13} "
          f"{'device sync ms':>15}")
    for name, r in rows.items():
        print(f"{name:6} {r['trained_params']:>15,} {r['opt_state_bytes'] / 2**20:>13.1f} "
              f"{r['sync_bytes'] / 2**20:>9.2f} {r['host_sync_ms']:>13.1f} {r['device_sync_ms']:>15.1f}")
    full, adapters = rows["full"], rows["lora"]
    ratios = {"sync_bytes_ratio": adapters["sync_bytes"] / full["sync_bytes"],
              "opt_state_bytes_ratio": adapters["opt_state_bytes"] / full["opt_state_bytes"],
              "host_sync_ms_ratio": adapters["host_sync_ms"] / full["host_sync_ms"],
              "device_sync_ms_ratio": adapters["device_sync_ms"] / full["device_sync_ms"]}
    print("lora / full: " + ", ".join(f"{k.removesuffix('_ratio')} {v:.4f}" for k, v in ratios.items()))
    if args.json:
        results_meta.write_json(args.json, {"size": args.size, "params": cfg.num_params(), "rank": args.rank,
                                            "repeats": args.repeats, **rows, **ratios}, meta_started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
