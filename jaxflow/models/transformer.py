"""Decoder-only transformer in flax.nnx covering the Llama, Qwen2, Qwen3 and Qwen3-MoE layouts.

Layer parameters are stacked along a leading `layers` axis and the forward pass scans over them, so
compile time does not grow with depth. Every parameter carries logical axis names; `jaxflow.sharding`
maps them onto the mesh. In a mixture-of-experts model (`jaxflow.models.moe`) the router and experts are
stacked over the sparse layers only and a dense MLP over the dense ones; the layers run as one scan per
run of consecutive layers of one kind (`scan_layers`).

Shapes: B batch, T query length, S key length, D hidden, H query heads, G kv heads, R = H // G,
K head_dim, F mlp width, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.models import lora as lora_lib
from jaxflow.models import moe, precision
from jaxflow.models.config import ModelConfig
from jaxflow.models.lora import LoRASpec
from jaxflow.models.names import DENSE_MLP_NAMES, MOE_NAMES

# Large negative instead of -inf: a query with no visible key (a padding row) gets a uniform softmax
# instead of NaN, and its output is never used.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies, [K/2] float32, computed as transformers does (float32 throughout)."""
    k = cfg.head_dim
    exponent = np.arange(0, k, 2, dtype=np.int64).astype(np.float32) / np.float32(k)
    inv_freq = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    rope = cfg.rope
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / np.float32(rope["factor"])
    elif kind == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def apply_rope(x_btnk: jax.Array, positions_bt: jax.Array, inv_freq_k: jax.Array) -> jax.Array:
    """Rotates the two halves of each head (HF's rotate_half convention), in float32."""
    angles = positions_bt.astype(jnp.float32)[..., None] * inv_freq_k  # [B, T, K/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x = x_btnk.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x_btnk.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, normalised in float32 and cast back before the scale (as HF does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale * normed.astype(x.dtype)


def attention_mask(segment_ids_bt: jax.Array, kv_segment_ids_bs: jax.Array | None = None,
                   q_offset: int | jax.Array = 0, context_ids_bt: jax.Array | None = None) -> jax.Array:
    """[B, 1, 1, T, S] bool: causal, same segment, and neither side padding (segment id 0).

    `q_offset` is the absolute index of the first query among the keys (non-zero when decoding).
    `context_ids_bt`: per query, the segment id of a shared prompt it also sees (0: none), as the
    trainer's batch lays a GRPO group's prompt out once for several completions
    (`jaxflow.trainer.batch.make_batch(share_prompts=True)`).
    """
    kv = segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs
    t, s = segment_ids_bt.shape[1], kv.shape[1]
    causal = (jnp.arange(t)[:, None] + q_offset) >= jnp.arange(s)[None, :]
    same = segment_ids_bt[:, :, None] == kv[:, None, :]
    if context_ids_bt is not None:
        same = same | (context_ids_bt[:, :, None] == kv[:, None, :])
    real = (segment_ids_bt[:, :, None] != 0) & (kv[:, None, :] != 0)
    return (causal[None] & same & real)[:, None, None]


# Rows of more than ATTENTION_QUERY_BLOCK queries are attended that many queries at a time: the scores exist
# [B, G, R, block, S] at once instead of [B, G, R, T, S] (for one 4,096-token row of Qwen3-0.6B, 67 MB
# instead of 1.07 GB in float32). The packed trainer's parts of a row count as rows here: parts of 512 in
# blocks of 256 took 6% less of the Qwen3-0.6B step's temp at 4 rows of 4,096 a device than whole.
ATTENTION_QUERY_BLOCK = 256


def attention(q_btgrk, k_bsgk, v_bsgk, mask_b11ts) -> jax.Array:
    """Grouped-query attention with softmax in float32; returns [B, T, G, R, K].

    More than ATTENTION_QUERY_BLOCK queries are attended a block at a time, each block under
    `jax.checkpoint`, so neither pass holds the whole [T, S] scores or probabilities: the backward pass
    recomputes a block's instead of keeping them. Each query's softmax is over all its keys either way,
    so the result is the same as attending all queries at once."""
    b, t = q_btgrk.shape[:2]
    block = ATTENTION_QUERY_BLOCK
    if t <= block:
        return _attend(q_btgrk, k_bsgk, v_bsgk, mask_b11ts)
    n = -(-t // block)
    pad = n * block - t  # padded queries see no key; their output is sliced off below
    s = mask_b11ts.shape[-1]
    mask_bts = jnp.broadcast_to(mask_b11ts, (b, 1, 1, t, s))[:, 0, 0]
    q_nbcgrk = jnp.pad(q_btgrk, ((0, 0), (0, pad)) + ((0, 0),) * 3).reshape(
        b, n, block, *q_btgrk.shape[2:]).swapaxes(0, 1)
    mask_nbcs = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0))).reshape(b, n, block, s).swapaxes(0, 1)
    per_block = jax.checkpoint(lambda xs: _attend(xs[0], k_bsgk, v_bsgk, xs[1][:, None, None]))
    out = jax.lax.map(per_block, (q_nbcgrk, mask_nbcs))
    return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]


def _attend(q_btgrk, k_bsgk, v_bsgk, mask_b11ts) -> jax.Array:
    """`attention` for all of q's queries at once: scores [B, G, R, T, S]."""
    scale = 1.0 / math.sqrt(q_btgrk.shape[-1])
    q_btgrk, k_bsgk = precision.float32_dot_operands(q_btgrk, k_bsgk)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_btgrk, k_bsgk, preferred_element_type=jnp.float32)
    scores = jnp.where(mask_b11ts, scores * scale, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bsgk.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v_bsgk)


# Models with at most this many layers run them unrolled in `Transformer.hidden_states`.
UNROLL_LAYERS = 4

# Packed rows: how many equal parts the trainer's attention may cut a row into (`split_attention`), and
# the shortest part worth cutting to. Sixths give rows of 192 tokens parts of 32: the single-turn
# arithmetic task's sequences (median 29 tokens) then pack 41 rows a batch instead of 48 in quarters, and
# its update takes 9% less time.
ROW_SPLITS = (1, 2, 4, 6, 8)
MIN_SPLIT_LEN = 32


def row_splits(t: int) -> tuple[int, ...]:
    """The ways `split_attention` may cut rows of t tokens: n equal parts of at least MIN_SPLIT_LEN."""
    return tuple(n for n in ROW_SPLITS if t % n == 0 and (n == 1 or t // n >= MIN_SPLIT_LEN))


def attention_units(segment_ids_bt: jax.Array, context_ids_bt: jax.Array) -> jax.Array:
    """[B, T] int32: the id of the set of tokens each token attends within: its shared prompt's segment
    (`context_ids_bt` > 0) or else its own. A shared prompt and the completions that see it are one unit."""
    return jnp.where(context_ids_bt > 0, context_ids_bt, segment_ids_bt)


def split_index(units_bt: jax.Array, splits: tuple[int, ...]) -> jax.Array:
    """Index into `splits` of the most parts every row of the batch can be cut into without cutting an
    attention unit (`attention_units`; a cut at position c is clean when c starts a unit or is padding).
    int32 scalar."""
    t = units_bt.shape[1]
    previous = jnp.pad(units_bt[:, :-1], ((0, 0), (1, 0)))
    clean_t = jnp.all((units_bt == 0) | (units_bt != previous), axis=0)
    # The most parts among the clean cuts (n = 1 always is): where one n divides the next, the clean
    # ones are a prefix of `splits`; 4 and 6 parts of 192 tokens are not, and either may be the one.
    parts = jnp.asarray([n * jnp.all(clean_t[::t // n]) for n in splits], jnp.int32)
    return jnp.argmax(parts).astype(jnp.int32)


def _attention_in_parts(n: int, q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt) -> jax.Array:
    """`attention` with each row cut into n equal parts that attend within themselves."""
    b, t = q_btgrk.shape[:2]

    def cut(x):
        return x.reshape(b * n, t // n, *x.shape[2:])

    mask = attention_mask(cut(segment_ids_bt), context_ids_bt=cut(context_ids_bt))
    out = attention(cut(q_btgrk), cut(k_bsgk), cut(v_bsgk), mask)
    return out.reshape(q_btgrk.shape)


def split_attention(q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt=None) -> jax.Array:
    """`attention` over packed rows, each cut into the most equal parts that no attention unit straddles:
    a token only sees its own segment (and its shared prompt's, `context_ids_bt`; default none), so
    attending within parts of T/n tokens computes the same output for n times less work. The batch
    packer (`jaxflow.trainer.batch`) keeps short sequences inside such parts; the cut is chosen on
    device for the whole batch (one branch of a switch runs).

    The backward pass recomputes the attention of the chosen cut instead of keeping its probabilities
    (a switch's own gradient would keep every branch's, the uncut [B, G, R, T, T] among them)."""
    if context_ids_bt is None:
        context_ids_bt = jnp.zeros_like(segment_ids_bt)
    return _split_attention(q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt)


def _switch_index(q_btgrk, segment_ids_bt, context_ids_bt):
    splits = row_splits(q_btgrk.shape[1])
    return splits, split_index(attention_units(segment_ids_bt, context_ids_bt), splits)


@jax.custom_vjp
def _split_attention(q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt) -> jax.Array:
    splits, index = _switch_index(q_btgrk, segment_ids_bt, context_ids_bt)
    branches = [functools.partial(_attention_in_parts, n) for n in splits]
    return jax.lax.switch(index, branches, q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt)


def _split_attention_fwd(q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt):
    residuals = (q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt)
    return _split_attention(*residuals), residuals


def _split_attention_bwd(residuals, d_out):
    q_btgrk, k_bsgk, v_bsgk, segment_ids_bt, context_ids_bt = residuals
    splits, index = _switch_index(q_btgrk, segment_ids_bt, context_ids_bt)

    def backward(n):
        def run(q, k, v, d):
            attend = lambda q, k, v: _attention_in_parts(n, q, k, v, segment_ids_bt, context_ids_bt)  # noqa: E731
            return jax.vjp(attend, q, k, v)[1](d)
        return run

    grads = jax.lax.switch(index, [backward(n) for n in splits], q_btgrk, k_bsgk, v_bsgk, d_out)
    return (*grads, None, None)


_split_attention.defvjp(_split_attention_fwd, _split_attention_bwd)


# Layer parameter name -> (logical axes without the leading `layers` axis, shape, init kind). The order
# here is the order of `DecoderLayers` attributes; the model's config decides which optional ones exist.
def _layer_param_specs(cfg: ModelConfig):
    d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    specs = {
        "input_norm": (("embed",), (d,), "ones"),
        "q_proj": (("embed", "heads", "head_dim"), (d, h, k), "normal"),
        "k_proj": (("embed", "kv_heads", "head_dim"), (d, g, k), "normal"),
        "v_proj": (("embed", "kv_heads", "head_dim"), (d, g, k), "normal"),
        "o_proj": (("heads", "head_dim", "embed"), (h, k, d), "normal"),
        "post_attn_norm": (("embed",), (d,), "ones"),
        "gate_proj": (("embed", "mlp"), (d, f), "normal"),
        "up_proj": (("embed", "mlp"), (d, f), "normal"),
        "down_proj": (("mlp", "embed"), (f, d), "normal"),
    }
    if cfg.qkv_bias:
        specs.update(q_bias=(("heads", "head_dim"), (h, k), "zeros"),
                     k_bias=(("kv_heads", "head_dim"), (g, k), "zeros"),
                     v_bias=(("kv_heads", "head_dim"), (g, k), "zeros"))
    if cfg.o_bias:
        specs["o_bias"] = (("embed",), (d,), "zeros")
    if cfg.qk_norm:
        specs.update(q_norm=(("head_dim",), (k,), "ones"), k_norm=(("head_dim",), (k,), "ones"))
    if cfg.mlp_bias:
        specs.update(gate_bias=(("mlp",), (f,), "zeros"), up_bias=(("mlp",), (f,), "zeros"),
                     down_bias=(("embed",), (d,), "zeros"))
    if cfg.num_experts:
        e, fm = cfg.num_experts, cfg.moe_intermediate_size
        specs.update(router=(("embed", None), (d, e), "normal"),
                     expert_gate=(("experts", "embed", "mlp"), (e, d, fm), "normal"),
                     expert_up=(("experts", "embed", "mlp"), (e, d, fm), "normal"),
                     expert_down=(("experts", "mlp", "embed"), (e, fm, d), "normal"))
        if not cfg.dense_layers:
            specs = {name: spec for name, spec in specs.items() if name not in DENSE_MLP_NAMES}
    return specs


def stack_size(cfg: ModelConfig, name: str) -> int:
    """How many layers' worth the stack of layer parameter `name` (or of its LoRA adapters) holds."""
    base = name.removesuffix("_lora_a").removesuffix("_lora_b")
    if cfg.num_experts and base in MOE_NAMES:
        return len(cfg.sparse_layers)
    if cfg.num_experts and base in DENSE_MLP_NAMES:
        return len(cfg.dense_layers)
    return cfg.num_layers


def layer_runs(cfg: ModelConfig) -> list[tuple[int, int, bool]]:
    """The layers as (start, stop, sparse) runs of consecutive layers of one kind; one run when dense."""
    sparse = set(cfg.sparse_layers)
    runs: list[tuple[int, int, bool]] = []
    for i in range(cfg.num_layers):
        if runs and runs[-1][2] == (i in sparse):
            runs[-1] = (runs[-1][0], i + 1, runs[-1][2])
        else:
            runs.append((i, i + 1, i in sparse))
    return runs


def _rows(tree, start: int, n: int):
    """Entries start .. start + n - 1 of every [L, ...] array of `tree`."""
    return jax.tree.map(lambda a: a[start:start + n], tree)


def scan_layers(cfg: ModelConfig, stacked: dict[str, jax.Array], body, carry, *, layer_xs=None,
                sparse_xs=None, unroll: int = 1, all_ys: bool = False):
    """Runs `body(carry, p, layer_x, sparse_x) -> (carry, y)` over the layers in order, a `lax.scan`
    per run of one kind (`layer_runs`), p one layer's parameters (its dense MLP's or its router's and
    experts', as the layer has). layer_xs: a pytree of [L, ...] arrays, sliced per layer; sparse_xs:
    [L_sparse, ...] arrays, given to sparse layers only (None to dense ones). unroll: at most this many
    layers of a run per loop step. Returns (carry, the sparse layers' ys stacked [L_sparse, ...], or None
    when the model has none)."""
    ys = []
    at = {True: 0, False: 0}  # the next layer's index in the sparse and the dense stacks
    for start, stop, sparse in layer_runs(cfg):
        n = stop - start
        own = at[sparse]
        at[sparse] += n
        p = {}
        for name, value in stacked.items():
            base = name.removesuffix("_lora_a").removesuffix("_lora_b")
            if cfg.num_experts and base in (DENSE_MLP_NAMES if sparse else MOE_NAMES):
                continue
            lo = own if cfg.num_experts and base in DENSE_MLP_NAMES + MOE_NAMES else start
            p[name] = value if (lo, lo + n) == (0, value.shape[0]) else value[lo:lo + n]
        xs = (p, None if layer_xs is None else _rows(layer_xs, start, n),
              _rows(sparse_xs, own, n) if sparse and sparse_xs is not None else None)
        carry, y = jax.lax.scan(lambda c, x: body(c, *x), carry, xs, unroll=max(1, min(unroll, n)))
        if sparse or all_ys:
            ys.append(y)
    if not ys:
        return carry, None
    return carry, ys[0] if len(ys) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *ys)


def _init(kind, key, shape, std, dtype):
    if kind == "ones":
        return jnp.ones(shape, dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class DecoderLayers(nnx.Module):
    """All decoder blocks, each parameter stacked over a leading [L] axis; with `lora`, the adapters of
    its targets too (`jaxflow.models.lora`: `<target>_lora_a` [L, in..., r] and `<target>_lora_b`
    [L, r, out...], `nnx.LoRAParam`s; A random, B zero, so the adapted model starts as the base)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, lora: LoRASpec | None = None):
        specs = _layer_param_specs(cfg)
        self.names = tuple(specs)
        for name, (axes, shape, kind) in specs.items():
            value = _init(kind, rngs.params(), (stack_size(cfg, name), *shape), cfg.initializer_range,
                          param_dtype)
            setattr(self, name, nnx.Param(value, logical_axes=("layers", *axes)))
        self.lora = None
        if lora is not None:
            lora_lib.attach(self, lora, rngs.params())

    def stacked(self) -> dict[str, jax.Array]:
        """The layer parameters as a dict of [L, ...] arrays, the `xs` of the layer scan. Adapters come as
        `<target>_lora_a` and `<target>_lora_b`, B already scaled by alpha / r."""
        out = {name: getattr(self, name)[...] for name in self.names}
        for target in (self.lora.targets if self.lora else ()):
            out[f"{target}_lora_a"] = getattr(self, f"{target}_lora_a")[...]
            out[f"{target}_lora_b"] = getattr(self, f"{target}_lora_b")[...] * self.lora.scale
        return out


def _project(p: dict[str, jax.Array], name: str, equation: str, x: jax.Array) -> jax.Array:
    """x through the projection `name` (its einsum `equation`), plus its adapter's x A B where it has one.

    `equation` is "bt<in>,<in><out>->bt<out>": computed as one [b*t, in] x [in, out] matmul. A 3-D
    einsum gives the same numbers, but XLA's CPU backend then computes each weight's gradient through a
    transposed copy of the activations' gradient, which cost as much as the matmuls on small models.
    """
    w = p[name]
    ins = len(equation.split(",")[0]) - 2  # x's feature dims, which are w's leading dims
    y = (x.reshape(-1, math.prod(x.shape[2:])) @ w.reshape(math.prod(w.shape[:ins]), -1)).reshape(
        *x.shape[:2], *w.shape[ins:])
    a = p.get(f"{name}_lora_a")
    if a is None:
        return y
    b = p[f"{name}_lora_b"]
    k = a.ndim - 1  # the kernel's input dims
    xa = jnp.einsum("...i,ir->...r", x.reshape(*x.shape[:x.ndim - k], -1), a.reshape(-1, a.shape[-1]))
    return y + jnp.einsum("...r,ro->...o", xa, b.reshape(b.shape[0], -1)).reshape(y.shape).astype(y.dtype)


def decoder_layer(cfg: ModelConfig, p: dict[str, jax.Array], x_btd: jax.Array, positions_bt,
                  inv_freq_k, mask_b11ts, attend=None, *, routes_btk=None, valid_bt=None):
    """One pre-norm decoder block on the per-layer params `p`; a mixture of experts in place of the MLP
    when p holds a router (`jaxflow.models.moe.moe_mlp`, replaying `routes_btk` when given; valid_bt:
    the real tokens its router statistics count, default all).

    attend says how the block attends. None: the chunk attends within itself under `mask_b11ts`
    ([B, 1, 1, T, T]; prefill) and its own (k_btgk, v_btgk) are returned. Otherwise a function
    `attend(q_btgrk, k_btgk, v_btgk) -> (out_btgrk, extra)` (`mask_b11ts` is unused), returned with the
    block's output in place of the keys/values: the rollout engine's stores them in its cache, attends
    over it and returns the updated cache as `extra` (the cache layout and the attention kernel stay the
    caller's business, so the engine can update a buffer in place and read it in the order its hardware
    likes while this body stays the one the trainer runs); the trainer's attends within packed rows
    (`split_attention`).
    Returns (x_btd, (k_btgk, v_btgk) or extra, the router's `moe.RouterStats` or None).
    """
    b, t, _ = x_btd.shape
    g, r = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    h = rms_norm(x_btd, p["input_norm"], cfg.rms_norm_eps)
    q = _project(p, "q_proj", "btd,dhk->bthk", h)
    k = _project(p, "k_proj", "btd,dgk->btgk", h)
    v = _project(p, "v_proj", "btd,dgk->btgk", h)
    if cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions_bt, inv_freq_k)
    k = apply_rope(k, positions_bt, inv_freq_k)
    q = q.reshape(b, t, g, r, -1)
    if attend is None:
        out, kv_out = attention(q, k, v, mask_b11ts), (k, v)
    else:
        out, kv_out = attend(q, k, v)
    out = out.reshape(b, t, g * r, -1)
    attn = _project(p, "o_proj", "bthk,hkd->btd", out)
    if cfg.o_bias:
        attn = attn + p["o_bias"]
    x_btd = x_btd + attn

    h = rms_norm(x_btd, p["post_attn_norm"], cfg.rms_norm_eps)
    if "router" in p:
        out, stats = moe.moe_mlp(cfg, p, h, routes_btk, valid_bt)
        return x_btd + out, kv_out, stats
    gate = _project(p, "gate_proj", "btd,df->btf", h)
    up = _project(p, "up_proj", "btd,df->btf", h)
    if cfg.mlp_bias:
        gate, up = gate + p["gate_bias"], up + p["up_bias"]
    down = _project(p, "down_proj", "btf,fd->btd", jax.nn.silu(gate) * up)
    if cfg.mlp_bias:
        down = down + p["down_bias"]
    return x_btd + down, kv_out, None


class Transformer(nnx.Module):
    """Token embedding, L stacked decoder blocks, final RMSNorm and LM head (tied or not); with `lora`,
    LoRA adapters on the blocks' target projections (`jaxflow.models.lora`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=None, lora: LoRASpec | None = None):
        dtype = jnp.dtype(param_dtype or cfg.dtype)
        self.config = cfg
        self.embed = nnx.Param(_init("normal", rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                     cfg.initializer_range, dtype), logical_axes=("vocab", "embed"))
        self.layers = DecoderLayers(cfg, rngs=rngs, param_dtype=dtype, lora=lora)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype), logical_axes=("embed",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init("normal", rngs.params(), (cfg.hidden_size, cfg.vocab_size),
                                           cfg.initializer_range, dtype),
                                     logical_axes=("embed", "vocab"))

    def hidden_states(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None,
                      segment_ids_bt: jax.Array | None = None, context_ids_bt: jax.Array | None = None, *,
                      remat: bool = False, routes_btlk: jax.Array | None = None, with_router: bool = False):
        """Final-norm hidden states [B, T, D].

        tokens_bt: int32 token ids. positions_bt: rotary positions (default 0..T-1; for left padding
        pass `positions_from_mask`). segment_ids_bt: int32, 0 marks padding, equal non-zero ids attend
        to each other (packing; rows whose segments allow it attend in parts, `split_attention`);
        default all ones. context_ids_bt: per token, the segment id of a shared prompt it also attends
        to (0 or None: none). remat recomputes each block in the backward pass.
        routes_btlk: a mixture-of-experts model's recorded experts to replay, [B, T, L_sparse, k]
        (-1: the token routes itself; `jaxflow.models.moe`). with_router: return (h, stats), stats the
        sparse layers' `moe.RouterStats` stacked [L_sparse, ...] over the real tokens (None if dense).
        """
        cfg = self.config
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones(tokens_bt.shape, jnp.int32)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        if routes_btlk is not None and not cfg.num_experts:
            raise ValueError(f"routes to replay given to a dense model ({cfg.architecture} has no experts)")
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
        x = rows_sharded(jnp.take(self.embed[...], tokens_bt, axis=0))
        valid_bt = segment_ids_bt != 0

        def attend(q, k, v):
            return split_attention(q, k, v, segment_ids_bt, context_ids_bt), None

        def body(x, p, _, routes_btk):
            x, _, stats = decoder_layer(cfg, p, x, positions_bt, inv_freq, None, attend, routes_btk=routes_btk,
                                        valid_bt=valid_bt)
            return rows_sharded(x), stats

        if remat:
            body = jax.checkpoint(body)
        # A shallow model's layers are unrolled: the loop would slice each layer's weights out of the stack
        # and stack each layer's saved activations for the backward pass, copies that took 8% of the
        # 2-layer tiny model's train step. Deeper models keep the loop, whose compile time does not grow.
        unroll = cfg.num_layers if cfg.num_layers <= UNROLL_LAYERS else 1
        routes = None if routes_btlk is None else jnp.moveaxis(routes_btlk, 2, 0)
        x, stats = scan_layers(cfg, self.layers.stacked(), body, x, sparse_xs=routes, unroll=unroll)
        h = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return (h, stats) if with_router else h

    def head_weight(self) -> tuple[jax.Array, tuple[str | None, ...]]:
        """The LM head's weight and its logical axes: the embedding [V, D] when tied, else lm_head [D, V]."""
        if self.config.tie_word_embeddings:
            return self.embed[...], ("vocab", None)
        return self.lm_head[...], (None, "vocab")

    def logits(self, h_btd: jax.Array, weight: jax.Array | None = None) -> jax.Array:
        """LM-head logits [B, T, V] in float32 from hidden states; `weight`: the head's weight as
        `head_weight` gives it, when the caller has already laid it out (default: the module's own).

        One [B*T, D] x [D, V] matmul, as in `_project`, so the weight's gradient is one matmul too
        (measured: 0.97x the tiny model's train step against a 3-D einsum)."""
        h_nd = h_btd.reshape(-1, h_btd.shape[-1])
        w = self.head_weight()[0] if weight is None else weight
        if self.config.tie_word_embeddings:
            out = jnp.einsum("nd,vd->nv", h_nd, w, preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("nd,dv->nv", h_nd, w, preferred_element_type=jnp.float32)
        return out.reshape(*h_btd.shape[:-1], out.shape[-1])

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, context_ids_bt=None, *, remat=False):
        """Logits [B, T, V] float32; arguments as in `hidden_states`."""
        return self.logits(self.hidden_states(tokens_bt, positions_bt, segment_ids_bt, context_ids_bt,
                                              remat=remat))


# Mesh axes a batch's rows are split over (jaxflow.sharding's "batch" rule).
ROW_AXES = moe.ROW_AXES


def rows_sharded(x_b: jax.Array) -> jax.Array:
    """x_b [B, ...] constrained to rows split over the data, fsdp and expert axes of the mesh set around the trace
    (`jax.set_mesh`; without one, x_b as it is), the rest of each row whole on its device.

    Without it, GSPMD may follow the fsdp-sharded weights instead: the embedding gather and the blocks'
    matmuls then come out split over the hidden dimension with every row on every device, and each
    projection ends in an all-reduce of the whole batch's activations (measured on Qwen3-8B at 64
    devices: 40x the temp memory of the rows-split step)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_b
    axes = tuple(a for a in ROW_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x_b.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x_b
    spec = jax.sharding.PartitionSpec(axes, *([None] * (x_b.ndim - 1)))
    return jax.lax.with_sharding_constraint(x_b, spec)


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
    """Rotary positions for left-padded rows: 0 at each row's first real token, 0 on padding."""
    mask = mask_bt.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0) * mask
