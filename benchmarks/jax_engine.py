"""Decode throughput of jaxflow's JAX rollout engine on a long-tail length mix.

Writes a tiny HF model (Qwen3 layout, hidden 64 unless told otherwise), then for each slot count runs a
warm-up pass (compiles) and a timed pass, each of `--requests-per-slot` x slots requests: prompts of 16-64
tokens, completion lengths log-normal (median `--median`, capped by the context), sampled at
temperature 1 so that lengths come from max_tokens alone. Prints generated tokens/s over the whole pass
(admission, prefill and the draining tail included), the engine's own decode rate while requests
still queue (every slot busy), and the mean slot occupancy.

    .venv/bin/python benchmarks/jax_engine.py --slots 32 64 --json /tmp/jax_engine.json
    .venv/bin/python benchmarks/jax_engine.py --quick
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import jax
import numpy as np
import results_meta

from jaxflow.models.config import from_hf_config, read_hf_config
from jaxflow.models.tiny import write_tiny_model
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.jax_engine import JaxEngine


def long_tail_requests(n: int, max_len: int, median: int, vocab: int, seed: int) -> list[Request]:
    """Prompts of 16-64 tokens; completions log-normal around `median`, at least 4, within the context."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, vocab, int(rng.integers(16, 65))).tolist()
        max_tokens = int(np.clip(rng.lognormal(np.log(median), 0.9), 4, max_len - 1 - len(prompt)))
        out.append(Request(f"b{seed}-{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                  seed=i)))
    return out


def bench(directory, slots: int, args) -> dict:
    engine = JaxEngine(directory, max_slots=slots, max_len=args.max_len, decode_chunk=args.decode_chunk)
    engine.warmed()  # every decode bucket compiled (the smaller ones in the background)
    vocab = engine.config.vocab_size
    try:
        # The engine compiles its decode programs before this; the warm-up pass (the timed workload
        # with other lengths) compiles the prefill programs of the longer (batch, length) buckets.
        t0 = time.perf_counter()
        engine.generate(long_tail_requests(args.requests_per_slot * slots, args.max_len, args.median,
                                           vocab, seed=1))
        warmup_s = time.perf_counter() - t0
        requests = long_tail_requests(args.requests_per_slot * slots, args.max_len, args.median, vocab,
                                      seed=2)
        occupancy = []
        for r in requests:
            engine.submit(r)
        t0 = time.perf_counter()
        done, full_rates = 0, []
        while done < len(requests):
            done += len(engine.poll(timeout=0.05))
            load = engine.load()
            occupancy.append(load.running / slots)
            # The engine's recent rate while requests still queue, i.e. with every slot busy (after the
            # first seconds, so that its averaging window holds only full-batch decoding).
            if load.waiting and time.perf_counter() - t0 > 2.0:
                full_rates.append(load.tokens_per_s)
        wall_s = time.perf_counter() - t0
    finally:
        engine.close()
    generated = sum(r.params.max_tokens for r in requests)
    return {"slots": slots, "requests": len(requests), "generated_tokens": generated,
            "wall_s": wall_s, "tokens_per_s": generated / wall_s,
            "full_batch_tokens_per_s": float(np.mean(full_rates)) if full_rates else None,
            "mean_occupancy": float(np.mean(occupancy)), "warmup_s": warmup_s}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--median", type=int, default=128, help="median completion length")
    parser.add_argument("--decode-chunk", type=int, default=16)
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="short context and completions: seconds")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    if args.quick:
        args.max_len, args.median, args.requests_per_slot = 256, 32, 2

    with tempfile.TemporaryDirectory() as tmp:
        directory = write_tiny_model(pathlib.Path(tmp) / "model", architecture="Qwen3ForCausalLM",
                                     hidden_size=args.hidden, intermediate_size=2 * args.hidden)
        device = jax.devices()[0]
        cfg = from_hf_config(read_hf_config(directory))
        print(f"tiny Qwen3: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads / "
              f"{cfg.num_kv_heads} kv heads x {cfg.head_dim}, vocab {cfg.vocab_size}; on "
              f"{device.device_kind}; max_len {args.max_len}, decode_chunk {args.decode_chunk}, median "
              f"completion {args.median}", flush=True)
        results = [bench(directory, slots, args) for slots in args.slots]
    print(f"\n{'slots':>6}{'requests':>10}{'tokens':>9}{'wall (s)':>10}{'tokens/s':>11}{'full batch':>12}"
          f"{'occupancy':>11}")
    for r in results:
        full = f"{r['full_batch_tokens_per_s']:,.0f}" if r["full_batch_tokens_per_s"] else "n/a"
        print(f"{r['slots']:>6}{r['requests']:>10}{r['generated_tokens']:>9}{r['wall_s']:>10.2f}"
              f"{r['tokens_per_s']:>11,.0f}{full:>12}{100 * r['mean_occupancy']:>10.0f}%")
    if args.json:
        results_meta.write_json(args.json, {"device": jax.devices()[0].device_kind, "max_len": args.max_len,
                                            "decode_chunk": args.decode_chunk, "results": results}, meta_started)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
