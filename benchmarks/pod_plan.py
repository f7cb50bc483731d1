"""Sizes a run on a pod before it has one: compiles jaxflow's real programs for a real architecture on N fake
CPU devices and reports, per device, what they hold, compute and move.

    .venv/bin/python benchmarks/pod_plan.py --model qwen3-8b --mesh data=1,fsdp=64,tensor=1 --seq 8192 --rows 64
    .venv/bin/python benchmarks/pod_plan.py --model qwen3-0.6b --mesh fsdp=8 --seq 4096 --rows 8 --compare-unchunked
    .venv/bin/python benchmarks/pod_plan.py --sweep --json benchmarks/results/pod_plan.json
    .venv/bin/python benchmarks/pod_plan.py --sweep --quick

Nothing is allocated: the state is `abstract_train_state` (ShapeDtypeStructs with their shardings) and every
program is `jax.jit(...).lower(abstract arguments).compile()`, with `--xla_force_host_platform_device_count=N`
(N = the mesh's size) set before JAX starts. Programs:

- train_step: `TrainStep`'s update (forward, loss, backward, AdamW) for a batch of [micro_batches, rows, seq],
  rows split over data x fsdp, the state donated; float32 master parameters and AdamW moments, the forward
  and backward in the compute dtype where the step can (`StepConfig.compute_dtype`), each block
  rematerialised (`--remat`, default on) and log-probs in chunks (`StepConfig.logprob_chunk`).
- prefill and decode: the JAX engine's (`rollout_bridge.jax_decode`) on the engine's mesh (default
  tensor = min(8, N), data = the rest: a tensor-parallel replica per 8 devices), parameters in the compute
  dtype, a KV cache of `--engine-slots` x seq positions; prefill of one full-length row per replica (what a
  weight swap recomputes), decode of one token for every slot.
- reshard: a version from the trainer's layout (the state's parameter shardings) to the engine's
  (`sharding.state_shardings` on the engine mesh, as `JaxEngine` places its parameters), cast to the
  engine's dtype: `jax.jit(lambda p: p, out_shardings=engine_shardings)`.

For each: the compiled memory analysis (argument, output, aliased, temp, generated code bytes), matmul FLOPs,
bytes accessed and collective bytes by kind from the optimised HLO (`hlo_stats`, loops counted by their
trip counts), and XLA's own `cost_analysis()` (which counts a loop body once).

Analytic count, per device, from the shardings (each leaf's shard shape x its dtype):
  parameters P_dev (float32 master), gradients = P_dev (the step accumulates them in the parameters' dtype),
  AdamW state = 2 P_dev in float32 (+ scalars), batch = fields x [M, rows/(data*fsdp), T] x 4 bytes.
  The donated state is both argument and output, so the compiled argument + output - aliased bytes compare
  with parameters + optimizer state + batch (`state_bytes_vs_analytic`); gradients live in temp.
Activations per micro-batch, with n = rows/(data*fsdp) x T tokens per device, c = compute-dtype bytes,
tp = tensor, D hidden, F mlp, H heads, G kv heads, K head_dim, V vocab, L layers, C logprob chunk:
  saved per layer and token, without remat: c (4D + (3H + 3G)K/tp + 3F/tp) — the block input, both norm
    outputs (the projections' inputs), q and k before and after their norm and rope, v, the attention output,
    gate, up and their product (`split_attention` keeps q, k, v, not its probabilities);
  with remat: c D (the block input only);
  live block: while one block's backward runs, its saved set (without remat's saving) and its attention
    scores and probabilities, rows x H/tp x Q x T x (4 + c) bytes (the uncut branch; Q = T, or the query
    block of `transformer.attention`, ATTENTION_QUERY_BLOCK, on longer rows);
  LM head: 3 x 4 bytes x rows x min(C, T) x V/tp (float32 logits, their gradient, the probabilities behind
    the entropy; vocab-parallel over fsdp too, the same bytes: rows of the fsdp group x V/(fsdp tp)), live
    before any block's backward starts, so never together with a live block.
  analytic_activation_bytes = L n (saved per layer and token) + max(live block, LM head).
temp bytes (XLA's buffer assignment) hold more than activations: the gradient accumulator (P_dev), the
optimizer's updates and new moments before the skip-if-not-finite select, fsdp all-gathered weights of a
block, and CPU-backend copies (bfloat16 matmuls upcast to float32); and less where XLA frees a buffer
early or fuses it away (the scores and probabilities of attention need not both exist).
`temp_vs_analytic` divides temp by gradients + activations.

Roofline, per accelerator (ACCELERATORS, published figures): max(FLOPs / peak, bytes / HBM bandwidth) +
collective wire bytes / interconnect bandwidth (no overlap assumed: an upper bound for a well-overlapped
step, a lower bound for the compute, which on a real chip is never at peak). Verdict: fits when
argument + output - aliased + temp <= the device's memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclasses.dataclass(frozen=True)
class Accelerator:
    memory_bytes: float
    peak_bf16_flops: float  # dense
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per chip, within the scale-up domain, as published (all links)
    domain: int  # chips one scale-up interconnect joins
    scale_out_bytes_per_s: float | None  # per chip beyond the domain


# Published figures (decimal GB). H100: "NVIDIA H100 Tensor Core GPU" datasheet, SXM5 column (bf16 dense = half
# the sparse 1,979 TFLOPS; HBM3 3.35 TB/s; NVLink 900 GB/s) and the "NVIDIA DGX H100" datasheet (8 GPUs per
# NVLink domain, 8 x 400 Gb/s ConnectX-7: 50 GB/s per GPU between nodes). TPU v5p and v5e: Google Cloud's
# "TPU v5p" and "TPU v5e" system architecture pages (bf16 459 / 197 TFLOPS; HBM 95 GB at 2,765 GB/s / 16 GB at
# 819 GB/s; ICI 4,800 / 1,600 Gbps per chip; pods of 8,960 / 256 chips).
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(80e9, 989e12, 3.35e12, 900e9, 8, 50e9),
    "tpu_v5p": Accelerator(95e9, 459e12, 2.765e12, 600e9, 8960, None),
    "tpu_v5e": Accelerator(16e9, 197e12, 819e9, 200e9, 256, None),
}

# The sweep for the docs: model x devices at seq 8192, fsdp over every device, one row per device per
# micro-batch (rows = N). `--quick` keeps one case, qwen3-0.6b on 64 devices (a few minutes here).
SWEEP_MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
SWEEP_DEVICES = (8, 64, 256)
QUICK_SWEEP = (("qwen3-0.6b", 64),)
SWEEP_SEQ = 8192
# The case whose figures are the result file's top-level keys.
HEADLINE_CASE = ("qwen3-8b", 64)
# The log-prob chunking study of the full sweep: Qwen3-0.6B at 4,096 tokens on fsdp=8, the step with
# chunked log-probs against the one with whole [rows, T, V] logits, at 1 and 4 rows a device (model, devices,
# seq, rows). The logits grow with the rows; the parameters' share of temp does not.
CHUNKING_CASES = (("qwen3-0.6b", 8, 4096, 8), ("qwen3-0.6b", 8, 4096, 32))
# A small model for tests and smoke runs (train_step.py's "tiny" shape).
TINY = dict(architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True)


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,fsdp=4,tensor=1" (any subset; missing axes are 1) -> {"data": 2, "fsdp": 4, "expert": 1,
    "tensor": 1}. `expert` splits a mixture of experts' experts (and the batch's rows, like data and fsdp)."""
    mesh = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in mesh or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS in data, fsdp, expert, tensor "
                             f"and SIZE >= 1")
        mesh[name] = int(value)
    return mesh


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-8b", help="a preset (jaxflow/models/presets.py) or 'tiny'")
    parser.add_argument("--mesh", default="fsdp=64", help="the trainer's mesh: data=..,fsdp=..,expert=..,tensor=..")
    parser.add_argument("--engine-mesh", default=None,
                        help="the JAX engine's mesh on the same devices (default tensor=min(8, N), data=the rest)")
    parser.add_argument("--seq", type=int, default=8192, help="sequence length of the batch and the engine cache")
    parser.add_argument("--rows", type=int, default=None, help="rows per micro-batch (default: one per data x fsdp "
                                                               "shard)")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                        help="rematerialise each block in the backward pass (default on)")
    parser.add_argument("--logprob-chunk", type=int, default=None,
                        help="positions per log-prob chunk (default: the step's default; 0 = unchunked)")
    parser.add_argument("--compare-unchunked", action="store_true",
                        help="also compile the step with logprob_chunk=0 and report logprob_temp_ratio")
    parser.add_argument("--engine-slots", type=int, default=None,
                        help="KV cache slots of the engine (default 32 per engine replica)")
    parser.add_argument("--skip-engine", action="store_true", help="plan the train step only")
    parser.add_argument("--sweep", action="store_true",
                        help=f"{', '.join(SWEEP_MODELS)} x {SWEEP_DEVICES} devices at seq {SWEEP_SEQ}, "
                             "each in a process of its own")
    parser.add_argument("--cases", default=None,
                        help="with --sweep: MODEL:DEVICES,... to run, in this order (default: all of the sweep)")
    parser.add_argument("--resume", action="store_true",
                        help="with --sweep --json: keep the cases the file already holds and run the others")
    parser.add_argument("--quick", action="store_true",
                        help="with --sweep: qwen3-0.6b on 64 devices only; alone: qwen3-0.6b on 8 "
                             "devices at seq 2048")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def _check_args(args, parser) -> dict[str, int]:
    try:
        mesh = parse_mesh(args.mesh)
        if args.engine_mesh:
            parse_mesh(args.engine_mesh)
    except ValueError as e:
        parser.error(str(e))
    for name in ("seq", "micro_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.cases and not all(re.fullmatch(r"[\w.\-]+:\d+", c.strip()) for c in args.cases.split(",") if c.strip()):
        parser.error(f"--cases {args.cases!r}: expected MODEL:DEVICES,... (e.g. qwen3-8b:64,qwen3-32b:256)")
    if args.rows is not None and args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    return mesh


def _set_device_count(n: int) -> None:
    """Makes the CPU backend show n devices: XLA reads XLA_FLAGS when JAX first starts a backend."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


# ---------------------------------------------------------------------------------------------------------------
# Everything below runs with JAX started on N devices.


def _model_config(name: str):
    from jaxflow.models import presets
    from jaxflow.models.config import ModelConfig
    if name == "tiny":
        return ModelConfig(**TINY)
    return presets.preset(name)


def _shard_bytes(x) -> int:
    """Bytes one device holds of abstract array x (its sharding's shard shape; the largest shard)."""
    import numpy as np
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def _tree_shard_bytes(tree) -> int:
    import jax
    return sum(_shard_bytes(x) for x in jax.tree.leaves(tree))


def _memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")
    out = {k.removesuffix("_size_in_bytes") + "_bytes": int(getattr(ma, k)) for k in keys}
    out["peak_bytes"] = int(getattr(ma, "peak_memory_in_bytes", 0))
    out["needed_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def _xla_cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


def program_report(compiled, compile_s: float) -> dict:
    """Memory, costs and collectives of one compiled program, per device."""
    import hlo_stats
    return {"compile_s": round(compile_s, 2), "memory": _memory(compiled), **hlo_stats.program_costs(
        compiled.as_text()), "xla_cost_analysis_per_loop_trip": _xla_cost(compiled)}


def roofline(program: dict, devices: int) -> dict:
    """Estimated seconds of one program on each accelerator, and whether it fits (see the module docstring)."""
    out = {}
    for name, acc in ACCELERATORS.items():
        link = acc.link_bytes_per_s if devices <= acc.domain or acc.scale_out_bytes_per_s is None \
            else acc.scale_out_bytes_per_s
        compute_s = program["matmul_flops"] / acc.peak_bf16_flops
        memory_s = program["bytes_accessed"] / acc.hbm_bytes_per_s
        comm_s = program["collective_wire_bytes"] / link
        need = program["memory"]["needed_bytes"]
        out[name] = {"compute_s": compute_s, "memory_s": memory_s, "collective_s": comm_s,
                     "time_s": max(compute_s, memory_s) + comm_s, "fits": need <= acc.memory_bytes,
                     "short_by_gb": max(0.0, (need - acc.memory_bytes) / 1e9)}
    return out


def _step_config(args, chunk):
    """The StepConfig the plan compiles, with the fields this tree's StepConfig has; notes for the rest."""
    from jaxflow.trainer.step import StepConfig
    fields = {f.name: f for f in dataclasses.fields(StepConfig)}
    kwargs, notes = {"remat": args.remat}, []
    if "compute_dtype" in fields:
        kwargs["compute_dtype"] = args.compute_dtype
    elif args.compute_dtype != "float32":
        notes.append(f"compute dtype {args.compute_dtype} is not available in this tree (StepConfig has no "
                     "compute_dtype): the step was planned computing in float32")
    if "logprob_chunk" in fields:
        if chunk is not None:
            kwargs["logprob_chunk"] = chunk
    elif chunk not in (None, 0):
        notes.append("log-prob chunking is not available in this tree (StepConfig has no logprob_chunk): the step "
                     "was planned with full [rows, T, V] logits")
    cfg = StepConfig(**kwargs)
    return cfg, notes


def compile_train_step(model_cfg, mesh, args, rows: int, chunk):
    """(compiled program, compile seconds, abstract state, abstract batch bytes per device, StepConfig, notes)."""
    import ml_collections
    import numpy as np
    from flax import nnx

    from jaxflow.models import hf_io
    from jaxflow.trainer.batch import FIELD_DTYPES
    from jaxflow.trainer.state import abstract_train_state, train_state_shardings
    from jaxflow.trainer.step import TrainStep, make_optimizer

    model = hf_io.abstract_model(model_cfg, param_dtype="float32")
    tx = make_optimizer(ml_collections.ConfigDict(dict(
        lr=1e-6, warmup_steps=1, schedule="constant", total_steps=1, b1=0.9, b2=0.999, eps=1e-8,
        weight_decay=0.01, max_grad_norm=1.0)))
    state = abstract_train_state(model, tx, mesh)
    cfg, notes = _step_config(args, chunk)
    step = TrainStep(nnx.graphdef(model), tx, cfg, mesh, train_state_shardings(state.params, tx, mesh))
    shape = (args.micro_batches, rows, args.seq)
    compile_s = step.compile(state, shape)
    shard_rows = step.batch_sharding.shard_shape(shape)
    batch_bytes = sum(int(np.prod(shard_rows)) * np.dtype(d).itemsize for d in FIELD_DTYPES.values())
    return step.compiled(shape), compile_s, state, batch_bytes, cfg, notes


def analytic(model_cfg, mesh, state, batch_bytes: int, rows: int, args, step_cfg) -> dict:
    """The per-device analytic count (module docstring): state from the shardings, activations by formula."""
    import jax
    import numpy as np

    from jaxflow import sharding
    from jaxflow.models import transformer
    params = _tree_shard_bytes(state.params)
    opt = _tree_shard_bytes(state.opt_state)
    counters = _tree_shard_bytes((state.step, state.version, state.skipped))
    tp = mesh.shape["tensor"]
    shards = sharding.rows_per_shard(mesh)
    rows_dev = max(1, rows // shards)
    t = args.seq
    tokens = rows_dev * t
    compute = getattr(step_cfg, "compute_dtype", "float32")
    c = np.dtype(jax.numpy.dtype(compute)).itemsize
    d, f, h, g, k, v, n_layers = (model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_heads,
                                  model_cfg.num_kv_heads, model_cfg.head_dim, model_cfg.vocab_size,
                                  model_cfg.num_layers)
    if model_cfg.num_experts:  # a token's k experts: each keeps its gate, up and product, and the token's copy
        f = model_cfg.num_experts_per_tok * (model_cfg.moe_intermediate_size + d * tp / 3)
    no_remat = c * (4 * d + (3 * h + 3 * g) * k / tp + 3 * f / tp)
    saved = c * d if args.remat else no_remat
    queries = min(t, transformer.ATTENTION_QUERY_BLOCK)
    attention = rows_dev * (h / tp) * queries * t * (4 + c)
    chunk = getattr(step_cfg, "logprob_chunk", 0) or t
    lm_head = 3 * 4 * rows_dev * min(chunk, t) * v / tp
    # The LM head runs after every block's forward and before any block's backward: its buffers and a
    # block's are never live together, so the peak holds the larger of the two.
    activations = n_layers * tokens * saved + max(tokens * no_remat + attention, lm_head)
    return {"params_bytes": params, "grads_bytes": params, "opt_state_bytes": opt + counters,
            "batch_bytes": batch_bytes, "state_and_batch_bytes": params + opt + counters + batch_bytes,
            "activation_bytes": activations, "activation_terms": {
                "saved_per_layer_and_token": saved, "layers_x_tokens": n_layers * tokens,
                "live_block_bytes": tokens * no_remat, "attention_scores_bytes": attention,
                "lm_head_bytes": lm_head},
            "tokens_per_device": tokens, "params": model_cfg.num_params(),
            "train_flops_analytic": train_flops(model_cfg, tokens, t, tp, args.remat)}


def train_flops(model_cfg, tokens: int, t: int, tp: int, remat: bool) -> float:
    """Matmul FLOPs of one device's update on `tokens` tokens of rows of t: 2 x (the blocks' weights) a token
    for each pass over them (forward, two for the backward, one more with remat), 2 V D a token for each of
    the LM head's three, and attention's 4 T H K a token and layer for each pass over it (those, and the
    recompute in `split_attention`'s backward), split over tensor."""
    passes = 4 if remat else 3
    head = model_cfg.vocab_size * model_cfg.hidden_size
    # The blocks' weights a token computes with (a mixture of experts' k experts, not all of them); an
    # untied embedding is a lookup, not a matmul.
    blocks = (model_cfg.num_params(active=True) - head * (1 if model_cfg.tie_word_embeddings else 2)
              - model_cfg.hidden_size)
    attention = 4 * t * model_cfg.num_heads * model_cfg.head_dim * model_cfg.num_layers * (passes + 1)
    return tokens * (2 * blocks * passes + 2 * head * 3 + attention) / tp


def _engine_mesh_shape(args, n: int) -> dict[str, int]:
    if args.engine_mesh:
        return parse_mesh(args.engine_mesh)
    tensor = min(8, n)
    return {"data": n // tensor, "fsdp": 1, "expert": 1, "tensor": tensor}


def compile_engine(model_cfg, engine_mesh, args, trainer_param_shardings, trainer_params):
    """Compiles the engine's prefill and decode and the trainer -> engine reshard; {name: report}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxflow import sharding
    from jaxflow.models import hf_io
    from rollout_bridge import jax_decode

    dtype = jnp.dtype(args.compute_dtype)
    model = hf_io.abstract_model(model_cfg, param_dtype=args.compute_dtype)
    graphdef, params = nnx.split(model)
    shardings = sharding.state_shardings(params, engine_mesh)
    spec = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    params = jax.tree.map(spec, params, shardings)
    replicas = engine_mesh.shape["data"] * engine_mesh.shape["fsdp"]
    slots = args.engine_slots or 32 * replicas
    cache_sharding = jax_decode.cache_sharding(model_cfg, slots, args.seq, engine_mesh)
    n, g, k = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim
    cache = jax_decode.KVCache(jax.ShapeDtypeStruct((n, slots, g, k, args.seq), dtype, sharding=cache_sharding.k_lbgks),
                               jax.ShapeDtypeStruct((n, slots, g, args.seq, k), dtype, sharding=cache_sharding.v_lbgsk))
    out = {}
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    start = time.perf_counter()
    compiled = jax_decode.prefill.lower(graphdef, params, cache, i32(replicas, args.seq), i32(replicas),
                                        i32(replicas, 1), out_sharding=cache_sharding).compile()
    out["prefill"] = program_report(compiled, time.perf_counter() - start)
    out["prefill"]["shape"] = {"rows": replicas, "tokens": args.seq, "slots": slots}
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    state = jax_decode.SlotState(tokens_b=i32(slots), lengths_b=i32(slots), active_b=jax.ShapeDtypeStruct(
        (slots,), jnp.bool_), generated_b=i32(slots), max_tokens_b=i32(slots), temperature_b=f32(slots),
        top_k_b=i32(slots), top_p_b=f32(slots), seeds_b=jax.ShapeDtypeStruct((slots,), jnp.uint32),
        stop_ids_bn=i32(slots, 4), finish_b=i32(slots))
    start = time.perf_counter()
    compiled = jax_decode.decode.lower(graphdef, params, cache, state, None, i32(1), num_steps=1,
                                       windows=(args.seq,), logprobs_mode="raw", out_sharding=cache_sharding).compile()
    out["decode"] = program_report(compiled, time.perf_counter() - start)
    out["decode"]["shape"] = {"rows": slots, "tokens_per_row": 1, "window": args.seq}

    # A version from the trainer's layout to the engine's, in the engine's dtype.
    source = jax.tree.map(spec, trainer_params, trainer_param_shardings)
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)  # noqa: E731
    start = time.perf_counter()
    compiled = jax.jit(cast, out_shardings=shardings).lower(source).compile()
    out["reshard"] = program_report(compiled, time.perf_counter() - start)
    out["reshard"]["engine_params_bytes"] = _tree_shard_bytes(params)
    out["reshard"]["version_bytes"] = int(sum(np.prod(x.shape) * dtype.itemsize for x in jax.tree.leaves(params)))
    return out


def plan(args, mesh_sizes: dict[str, int]) -> dict:
    """Compiles and measures every program of one case; returns its figures."""
    import jax

    from jaxflow import sharding
    from jaxflow.models import precision

    # The programs are compiled, never run: plan the accelerators' bfloat16 dots, not the CPU runtime's
    # upcast operands (`precision.float32_dot_operands`).
    precision.UPCAST_ON_CPU = False
    n = jax.device_count()
    mesh = sharding.make_mesh(mesh_sizes["data"], mesh_sizes["fsdp"], mesh_sizes["tensor"],
                              expert=mesh_sizes.get("expert", 1))
    model_cfg = _model_config(args.model)
    rows = args.rows or sharding.rows_per_shard(mesh)
    print(f"plan: {args.model} ({model_cfg.num_params() / 1e9:.3g}B parameters), mesh {mesh_text(mesh_sizes)} on "
          f"{n} devices, seq {args.seq}, {args.micro_batches} micro-batch(es) of {rows} rows, compute "
          f"{args.compute_dtype}, remat {args.remat}", flush=True)
    compiled, compile_s, state, batch_bytes, step_cfg, notes = compile_train_step(model_cfg, mesh, args, rows,
                                                                                 args.logprob_chunk)
    train = program_report(compiled, compile_s)
    del compiled
    print(f"  train step compiled in {compile_s:.1f}s", flush=True)
    counts = analytic(model_cfg, mesh, state, batch_bytes, rows, args, step_cfg)
    mem = train["memory"]
    compiled_state = mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
    result = {
        "model": args.model, "params": model_cfg.num_params(), "devices": n, "mesh": mesh_sizes, "seq": args.seq,
        "rows": rows, "micro_batches": args.micro_batches, "remat": args.remat,
        "compute_dtype": getattr(step_cfg, "compute_dtype", "float32"),
        "logprob_chunk": getattr(step_cfg, "logprob_chunk", None),
        "state_bytes_vs_analytic": compiled_state / counts["state_and_batch_bytes"],
        "temp_bytes": mem["temp_bytes"], "analytic_activation_bytes": counts["activation_bytes"],
        "temp_vs_analytic": mem["temp_bytes"] / (counts["grads_bytes"] + counts["activation_bytes"]),
        "needed_bytes": mem["needed_bytes"], "compile_s": round(compile_s, 2),
        "programs": {"train_step": train}, "analytic": counts, "notes": notes,
    }
    train["roofline"] = roofline(train, n)
    result["fits_h100"] = train["roofline"]["h100"]["fits"]
    if args.compare_unchunked:
        if result["logprob_chunk"] is None:
            result["logprob_temp_ratio"] = None
            notes.append("--compare-unchunked: StepConfig has no logprob_chunk in this tree; logprob_temp_ratio is "
                         "null")
        else:
            unchunked, s, *_ = compile_train_step(model_cfg, mesh, args, rows, 0)
            result["programs"]["train_step_unchunked"] = program_report(unchunked, s)
            result["logprob_temp_ratio"] = mem["temp_bytes"] / result["programs"]["train_step_unchunked"]["memory"][
                "temp_bytes"]
            print(f"  unchunked train step compiled in {s:.1f}s", flush=True)
    if not args.skip_engine:
        engine_sizes = _engine_mesh_shape(args, n)
        engine_mesh = sharding.make_mesh(engine_sizes["data"], engine_sizes["fsdp"], engine_sizes["tensor"],
                                         expert=engine_sizes.get("expert", 1))
        result["engine_mesh"] = engine_sizes
        param_shardings = jax.tree.map(lambda x: x.sharding, state.params)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.params)
        engine = compile_engine(model_cfg, engine_mesh, args, param_shardings, params)
        for name, report in engine.items():
            report["roofline"] = roofline(report, n)
            result["programs"][name] = report
        print(f"  engine programs compiled in {sum(r['compile_s'] for r in engine.values()):.1f}s", flush=True)
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return result


# ---------------------------------------------------------------------------------------------------------------
# Printing.

def _gb(x) -> str:
    return f"{x / 1e9:.3g}"


def print_case(r: dict) -> None:
    print(f"\n== {r['model']}: {r['devices']} devices, mesh {mesh_text(r['mesh'])}, seq {r['seq']}, "
          f"{r['micro_batches']} x {r['rows']} rows, compute {r['compute_dtype']}, remat {r['remat']}, "
          f"logprob_chunk {r['logprob_chunk']} ==")
    print("\nper device, GB:   argument   output   aliased     temp   needed | matmul TFLOP  GB accessed  "
          "collective GB (wire)  compile s")
    for name, p in r["programs"].items():
        m = p["memory"]
        coll = ", ".join(f"{k} {_gb(c['wire_bytes'])}" for k, c in p["collectives"].items()) or "none"
        print(f"  {name:<20}{_gb(m['argument_bytes']):>9}{_gb(m['output_bytes']):>9}{_gb(m['alias_bytes']):>10}"
              f"{_gb(m['temp_bytes']):>9}{_gb(m['needed_bytes']):>9} | {p['matmul_flops'] / 1e12:>12,.2f}"
              f"{_gb(p['bytes_accessed']):>13}  {coll}  ({p['compile_s']:.1f})")
    a = r["analytic"]
    print(f"\nanalytic, per device, GB: parameters {_gb(a['params_bytes'])}, gradients {_gb(a['grads_bytes'])}, "
          f"AdamW state {_gb(a['opt_state_bytes'])}, batch {_gb(a['batch_bytes'])}; activations "
          f"{_gb(a['activation_bytes'])} ({a['tokens_per_device']:,} tokens a device)")
    t = a["activation_terms"]
    print(f"  activations = layers x tokens ({a['activation_terms']['layers_x_tokens']:,}) x "
          f"{t['saved_per_layer_and_token']:.0f} B saved + max(live block {_gb(t['live_block_bytes'])} + "
          f"attention scores {_gb(t['attention_scores_bytes'])}, LM head {_gb(t['lm_head_bytes'])})")
    print(f"  state_bytes_vs_analytic = (argument + output - aliased) / (parameters + AdamW state + batch) = "
          f"{r['state_bytes_vs_analytic']:.3f}")
    print(f"  temp {_gb(r['temp_bytes'])} GB vs analytic gradients + activations "
          f"{_gb(a['grads_bytes'] + a['activation_bytes'])} GB: ratio {r['temp_vs_analytic']:.2f}. Above 1: temp "
          "also holds the optimizer's updates and new moments, fsdp-gathered weights of a block, and the CPU "
          "backend's float32 copies of bfloat16 operands; below 1: XLA frees or fuses away buffers the formula "
          "counts")
    train = r["programs"]["train_step"]
    print(f"  train step matmul FLOPs: {train['matmul_flops'] / 1e12:,.2f} T a device from the HLO, "
          f"{a['train_flops_analytic'] / 1e12:,.2f} T analytic ((6 or 8 with remat) N + attention, per token)")
    if r.get("logprob_temp_ratio") is not None:
        print(f"  log-prob chunking: temp chunked / unchunked = {r['logprob_temp_ratio']:.3f}")
    print("\nroofline (s) and verdict, per accelerator:")
    for name, acc in ACCELERATORS.items():
        row = []
        for prog in ("train_step", "prefill", "decode", "reshard"):
            if prog in r["programs"]:
                row.append(f"{prog} {r['programs'][prog]['roofline'][name]['time_s']:.4g}")
        rf = train["roofline"][name]
        verdict = "fits" if rf["fits"] else f"does NOT fit: short by {rf['short_by_gb']:.1f} GB"
        print(f"  {name:<8} ({acc.memory_bytes / 1e9:.0f} GB): {', '.join(row)}; train step {verdict}")
    for note in r["notes"]:
        print(f"  note: {note}")


# ---------------------------------------------------------------------------------------------------------------
# The sweep: one process per case (each needs its own device count).

def _case_argv(model: str, devices: int, args) -> list[str]:
    argv = ["--model", model, "--mesh", f"fsdp={devices}", "--seq", str(SWEEP_SEQ), "--rows", str(devices),
            "--compute-dtype", args.compute_dtype]
    if not args.remat:
        argv.append("--no-remat")
    return argv


def _run_case(argv: list[str], tmp: str, name: str) -> dict | None:
    """One case in a process of its own (each needs its own device count): its figures, or None."""
    path = pathlib.Path(tmp) / f"{name}.json"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--case-json", str(path)]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd)
    if proc.returncode != 0 or not path.exists():
        return None
    return json.loads(path.read_text())


def chunking_study(args, tmp: str) -> list[dict]:
    """CHUNKING_CASES: per case, the chunked and the unchunked step's temp bytes and their ratio."""
    out = []
    for model, devices, seq, rows in CHUNKING_CASES:
        argv = ["--model", model, "--mesh", f"fsdp={devices}", "--seq", str(seq), "--rows", str(rows),
                "--compute-dtype", args.compute_dtype, "--compare-unchunked", "--skip-engine"]
        r = _run_case(argv, tmp, f"chunking-{model}-{devices}-{rows}")
        row = {"model": model, "devices": devices, "seq": seq, "rows": rows, "rows_per_device": rows // devices}
        if r is None or r.get("logprob_temp_ratio") is None:
            out.append({**row, "error": "the case failed or has no unchunked step"})
            continue
        out.append({**row, "logprob_chunk": r["logprob_chunk"], "temp_bytes": r["temp_bytes"],
                    "unchunked_temp_bytes": r["programs"]["train_step_unchunked"]["memory"]["temp_bytes"],
                    "logprob_temp_ratio": r["logprob_temp_ratio"], "compile_s": r["compile_s"]})
    return out


def sweep(args, save=None) -> dict:
    """Runs the sweep's cases one process each, then (the full sweep only) the log-prob chunking study;
    `save(figures so far)` after each case (a long sweep cut short keeps the cases it finished)."""
    cases = QUICK_SWEEP if args.quick else [(m, n) for m in SWEEP_MODELS for n in SWEEP_DEVICES]
    cases = sorted(cases, key=lambda case: case != HEADLINE_CASE)  # the headline first
    if args.cases:
        cases = [(m, int(n)) for m, _, n in (c.strip().rpartition(":") for c in args.cases.split(",") if c.strip())]
    results = []
    if args.resume and args.json and pathlib.Path(args.json).exists():
        results = [r for r in json.loads(pathlib.Path(args.json).read_text()).get("sweep_cases", [])
                   if "error" not in r]
        done = {(r["model"], r["devices"]) for r in results}
        print(f"resuming: {len(results)} case(s) kept from {args.json}")
        cases = [c for c in cases if c not in done]
    chunking = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, devices in cases:
            r = _run_case(_case_argv(model, devices, args), tmp, f"{model}-{devices}")
            if r is None:
                results.append({"model": model, "devices": devices, "mesh": {"data": 1, "fsdp": devices, "tensor": 1},
                                "error": "the case's process failed"})
                continue
            results.append(r)
            if save is not None:
                save(_sweep_figures(results, chunking))
        if not (args.quick or args.cases):
            chunking = chunking_study(args, tmp)
    print_sweep(results, chunking)
    figures = _sweep_figures(results, chunking)
    if save is not None:
        save(figures)
    return figures


def print_sweep(results: list[dict], chunking: list[dict]) -> None:
    table = [_sweep_row(r) for r in results]
    print("\nsweep, seq 8192, fsdp over all devices, one row per device:")
    print(f"{'model':<12}{'devices':>8}{'state GB':>10}{'temp GB':>9}{'need GB':>9}{'H100':>8}{'v5p':>8}{'v5e':>8}"
          f"{'H100 s':>9}{'v5p s':>8}{'v5e s':>8}{'compile s':>11}")
    for row in table:
        if "error" in row:
            print(f"{row['model']:<12}{row['devices']:>8}  failed: {row['error']}")
            continue
        fit = {a: "fits" if row[f"fits_{a}"] else f"-{row[f'short_gb_{a}']:.0f}" for a in ACCELERATORS}
        print(f"{row['model']:<12}{row['devices']:>8}{row['state_gb']:>10.1f}{row['temp_gb']:>9.1f}"
              f"{row['needed_gb']:>9.1f}{fit['h100']:>8}{fit['tpu_v5p']:>8}{fit['tpu_v5e']:>8}"
              f"{row['step_s_h100']:>9.2f}{row['step_s_tpu_v5p']:>8.2f}{row['step_s_tpu_v5e']:>8.2f}"
              f"{row['compile_s']:>11.0f}")
    for c in chunking:
        head = f"log-prob chunking, {c['model']} on {c['devices']} devices, seq {c['seq']}, {c['rows_per_device']} " \
               "row(s) a device:"
        if "error" in c:
            print(f"{head} failed: {c['error']}")
            continue
        print(f"{head} temp {_gb(c['temp_bytes'])} GB chunked, {_gb(c['unchunked_temp_bytes'])} GB unchunked: "
              f"ratio {c['logprob_temp_ratio']:.3f}")


def _sweep_figures(results: list[dict], chunking: list[dict]) -> dict:
    """The result file of a sweep: the headline case's figures at the top level, every case's row and figures,
    and the chunking study."""
    head = next((r for r in results if (r["model"], r["devices"]) == HEADLINE_CASE and "error" not in r), None)
    out = dict(head) if head else {}
    out["headline_case"] = f"{HEADLINE_CASE[0]} on {HEADLINE_CASE[1]} devices" if head else None
    out["sweep"] = [_sweep_row(r) for r in results]
    out["sweep_cases"] = results
    out["logprob_chunking"] = chunking
    return out


def _sweep_row(r: dict) -> dict:
    if "error" in r:
        return {"model": r["model"], "devices": r["devices"], "error": r["error"]}
    train = r["programs"]["train_step"]
    m = train["memory"]
    row = {"model": r["model"], "devices": r["devices"], "mesh": mesh_text(r["mesh"]),
           "state_gb": (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"]) / 1e9,
           "temp_gb": m["temp_bytes"] / 1e9, "needed_gb": m["needed_bytes"] / 1e9,
           "state_bytes_vs_analytic": r["state_bytes_vs_analytic"], "compile_s": r["compile_s"],
           "compute": f"{r.get('compute_dtype')}, chunk {r.get('logprob_chunk') or 'none'}"}
    for name in ACCELERATORS:
        rf = train["roofline"][name]
        row[f"fits_{name}"] = rf["fits"]
        row[f"short_gb_{name}"] = rf["short_by_gb"]
        row[f"step_s_{name}"] = rf["time_s"]
        row[f"verdict_{name}"] = "fits" if rf["fits"] else f"short by {rf['short_by_gb']:.1f} GB"
    return row


def main(argv=None) -> int:
    parser = build_parser()
    parser.add_argument("--case-json", default=None, help=argparse.SUPPRESS)  # the sweep's per-case output
    args = parser.parse_args(argv)
    mesh = _check_args(args, parser)
    import results_meta
    started = results_meta.begin(argv)
    if args.sweep:
        save = (lambda figures: results_meta.write_json(args.json, figures, started)) if args.json else None
        out = sweep(args, save)
    else:
        if args.quick:
            args.model, args.seq = "qwen3-0.6b", 2048
            mesh = parse_mesh("fsdp=8")
        n = math.prod(mesh.values())
        _set_device_count(n)
        import jax
        if jax.device_count() != n:
            parser.error(f"JAX started with {jax.device_count()} devices, not {n}: run the planner in a fresh process")
        out = plan(args, mesh)
        print_case(out)
        if args.case_json:
            pathlib.Path(args.case_json).write_text(json.dumps(out, default=float))
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB (this process), "
          f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6:.2f} GB (largest case process)")
    if args.json:
        results_meta.write_json(args.json, out, started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    raise SystemExit(main())
