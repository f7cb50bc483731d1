"""The jitted half of the JAX rollout engine: KV cache, prefill, chunked decode and per-slot sampling.

Everything here has fixed shapes so that a running engine compiles a handful of programs once: the
cache holds `num_slots` sequences of up to `max_len` positions; one decode call runs `num_steps` steps
for a fixed number of rows (cache slots named by the caller), attending over windows picked at run time
from a static list; and prefill lengths come from a few buckets. The layer math is
`jaxflow.models.transformer.decoder_layer`, the same function the trainer's forward pass scans.

A slot's sequence is prompt + generated tokens. The cache holds keys/values of all but its last token;
that last token is the slot's pending input, fed by the next decode step, which writes its keys/values
and samples the following token. So prefill needs no LM head, and sampling lives in one place.

Routing (a mixture-of-experts model, `ModelConfig.num_experts`): each program also returns the experts
each sparse layer's router chose at the positions it computed (`route_dtype` ints, the layout of
`jaxflow.data.records.Sample.routes`), so the engine can record them for routing replay: decode
[B, C, L_sparse, k] (-1 where nothing was generated), prefill and extend [P, T, L_sparse, k]. A dense
model's programs return None in their place and compute exactly what they did without it.

Shapes: L layers, B slots (in the cache) or rows (of a decode call), S cache positions (max_len, or the
attention window), G kv heads, R query heads per kv head, K head_dim, D hidden, V vocab, C decode steps
per call, P sequences per prefill call, T prefill bucket length, N stop ids per slot.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.data.records import route_dtype
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import (
    MASK_VALUE,
    attention,
    attention_mask,
    decoder_layer,
    rms_norm,
    rope_inv_freq,
    scan_layers,
)

# SlotState.finish_b codes.
RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
LOGPROBS_MODES = ("raw", "processed")


class KVCache(NamedTuple):
    """Keys and values of every layer and slot, in the param dtype: k_lbgks [L, B, G, K, S] and v_lbgsk
    [L, B, G, S, K]. Also used for their shardings (`cache_sharding`).

    Heads before positions, so that each (slot, head) owns one contiguous block; keys with positions
    last, values with positions before head_dim. Decode attention then reduces both products over a
    non-minor axis of its block (scores over K, outputs over S), which XLA's CPU backend vectorises
    along the contiguous axis: measured 0.58x the time of batched dot products over [S, K] key blocks
    on the tiny model's shapes, where each (slot, head) is a separate small matrix product.
    """

    k_lbgks: jax.Array
    v_lbgsk: jax.Array


class SlotState(NamedTuple):
    """Per-slot decode state, all [B] (stop ids [B, N]); the host owns it between decode calls.

    tokens_b: the pending input token (the sequence's last token, not yet in the cache).
    lengths_b: positions already in the cache, i.e. the pending token's position.
    active_b: the slot holds a sequence still generating. generated_b: tokens generated so far, a
    resumed prefix included; it also indexes the per-token PRNG key. max_tokens_b: the request's limit on
    generated_b. temperature_b (0 = greedy), top_k_b (0 = off), top_p_b (1 = off): sampling filters.
    seeds_b: uint32 per-request seed. stop_ids_bn: stop token ids, -1 pads. finish_b: RUNNING, or why the
    slot stopped in the last call (FINISH_STOP, FINISH_LENGTH).
    """

    tokens_b: jax.Array
    lengths_b: jax.Array
    active_b: jax.Array
    generated_b: jax.Array
    max_tokens_b: jax.Array
    temperature_b: jax.Array
    top_k_b: jax.Array
    top_p_b: jax.Array
    seeds_b: jax.Array
    stop_ids_bn: jax.Array
    finish_b: jax.Array


K_AXES = ("layers", "batch", "kv_heads", "head_dim", "seq")
V_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")


def _routes(cfg: ModelConfig, topk_l: jax.Array | None) -> jax.Array | None:
    """The sparse layers' top-k [L_sparse, ..., k] (int32, from `scan_layers`) as [..., L_sparse, k] in the
    route dtype; None for a dense model."""
    if topk_l is None:
        return None
    return jnp.moveaxis(topk_l, 0, -2).astype(route_dtype(cfg.num_experts))


def cache_sharding(cfg: ModelConfig, num_slots: int, max_len: int, mesh: jax.sharding.Mesh,
                   rules=None) -> KVCache:
    """The keys' and values' shardings: slots over the batch axes (data, fsdp), kv heads over tensor,
    each only where it divides."""
    n, b, g, s, k = cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim
    return KVCache(sharding.named_sharding(K_AXES, (n, b, g, k, s), mesh, rules),
                   sharding.named_sharding(V_AXES, (n, b, g, s, k), mesh, rules))


def init_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype, out_sharding: KVCache) -> KVCache:
    """A zeroed cache, created directly in its sharding."""
    n, b, g, s, k = cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim
    return KVCache(jax.jit(lambda: jnp.zeros((n, b, g, k, s), dtype), out_shardings=out_sharding.k_lbgks)(),
                   jax.jit(lambda: jnp.zeros((n, b, g, s, k), dtype), out_shardings=out_sharding.v_lbgsk)())


@functools.partial(jax.jit, static_argnames=("graphdef", "out_sharding"), donate_argnames=("cache",))
def prefill(graphdef, params: nnx.State, cache: KVCache, tokens_pt: jax.Array, lengths_p: jax.Array,
            slots_pr: jax.Array, *, out_sharding) -> tuple[KVCache, jax.Array | None]:
    """Computes keys/values of tokens_pt[p, :lengths_p[p]] once and stores them, positions 0..T-1, in
    each of the slots slots_pr[p, :] (the tail past lengths_p[p] holds junk that decode overwrites before
    it is ever visible). Sequences that share their context (the G samples of a GRPO group share their
    prompt) are computed once and written to all their slots in the same scatter.

    tokens_pt: int32, right-padded. slots_pr: int32 [P, R]; a slot >= B marks an unused destination
    (a padding row has none), which is dropped. Returns (the updated cache (the input cache is donated),
    the routes [P, T, L_sparse, k] of a mixture-of-experts model, else None).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.config
    t = tokens_pt.shape[1]
    segment_ids_pt = (jnp.arange(t)[None, :] < lengths_p[:, None]).astype(jnp.int32)
    positions_pt = jnp.broadcast_to(jnp.arange(t), tokens_pt.shape)
    mask = attention_mask(segment_ids_pt)
    inv_freq = jnp.asarray(rope_inv_freq(cfg))

    def body(x_ptd, p, _, __):
        x_ptd, kv, stats = decoder_layer(cfg, p, x_ptd, positions_pt, inv_freq, mask)
        if not cfg.num_experts:
            return x_ptd, kv
        # Every layer's ys have one structure (all_ys): a dense layer's routes are a placeholder, dropped.
        k = cfg.num_experts_per_tok
        return x_ptd, (kv, jnp.zeros((*tokens_pt.shape, k), jnp.int32) if stats is None else stats.topk_btk)

    x_ptd = jnp.take(model.embed[...], tokens_pt, axis=0)
    _, ys = scan_layers(cfg, model.layers.stacked(), body, x_ptd, all_ys=True)
    (k_lptgk, v_lptgk), routes = (ys, None) if not cfg.num_experts else (
        ys[0], _routes(cfg, ys[1][np.asarray(cfg.sparse_layers)]))
    fanout = slots_pr.shape[1]
    slots_q = slots_pr.reshape(-1)  # destination q = p * R + r takes row p
    k_lqgkt = jnp.repeat(jnp.transpose(k_lptgk, (0, 1, 3, 4, 2)), fanout, axis=1)
    v_lqgtk = jnp.repeat(jnp.swapaxes(v_lptgk, 2, 3), fanout, axis=1)
    k = cache.k_lbgks.at[:, slots_q, :, :, :t].set(k_lqgkt.astype(cache.k_lbgks.dtype), mode="drop")
    v = cache.v_lbgsk.at[:, slots_q, :, :t].set(v_lqgtk.astype(cache.v_lbgsk.dtype), mode="drop")
    return jax.lax.with_sharding_constraint(KVCache(k, v), out_sharding), routes


@functools.partial(jax.jit, static_argnames=("graphdef", "out_sharding"), donate_argnames=("cache",))
def extend(graphdef, params: nnx.State, cache: KVCache, tokens_pt: jax.Array, starts_p: jax.Array,
           slots_p: jax.Array, *, out_sharding) -> tuple[KVCache, jax.Array | None]:
    """Appends tokens_pt[p] to the sequence whose keys/values slot slots_p[p] already holds at positions
    0..starts_p[p]-1: computes the new tokens' keys/values at positions starts_p[p].. (attending over the
    slot's cached positions and causally among themselves) and stores them there. An episode's next turn
    costs its new tokens (the environment's answer) instead of a prefill of its whole context.

    tokens_pt: int32, right-padded (padding tokens write junk past the sequence, which decode overwrites
    before it is ever visible; positions past the cache are dropped). slots_p: int32; a slot >= B marks a
    padding row, dropped. Returns (the updated cache (the input cache is donated), the routes
    [P, T, L_sparse, k] of the new tokens of a mixture-of-experts model, else None).
    """
    model = nnx.merge(graphdef, params)
    cfg = model.config
    max_len = cache.v_lbgsk.shape[3]
    positions_pt = starts_p[:, None] + jnp.arange(tokens_pt.shape[1])[None, :]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    # Row p's query at position i sees cached and new positions <= i (of its own slot).
    visible_pts = jnp.arange(max_len)[None, None, :] <= positions_pt[:, :, None]
    rows_p = jnp.minimum(slots_p, cache.v_lbgsk.shape[1] - 1)  # padding rows read some slot, write nowhere

    def body(carry, p, layer, _):
        x_ptd, k_lbgks, v_lbgsk = carry

        def attend(q_ptgrk, k_ptgk, v_ptgk):
            k = k_lbgks.at[layer, slots_p[:, None], :, :, positions_pt].set(k_ptgk.astype(k_lbgks.dtype),
                                                                            mode="drop")
            v = v_lbgsk.at[layer, slots_p[:, None], :, positions_pt].set(v_ptgk.astype(v_lbgsk.dtype),
                                                                         mode="drop")
            keys = jnp.transpose(k[layer, rows_p], (0, 3, 1, 2))  # [P, S, G, K]
            values = jnp.swapaxes(v[layer, rows_p], 1, 2)
            return attention(q_ptgrk, keys, values, visible_pts[:, None, None]), (k, v)

        x_ptd, (k_lbgks, v_lbgsk), stats = decoder_layer(cfg, p, x_ptd, positions_pt, inv_freq, None, attend)
        return (x_ptd, k_lbgks, v_lbgsk), None if stats is None else stats.topk_btk

    x_ptd = jnp.take(model.embed[...], tokens_pt, axis=0)
    (_, k, v), topk = scan_layers(cfg, model.layers.stacked(), body, (x_ptd, cache.k_lbgks, cache.v_lbgsk),
                                  layer_xs=jnp.arange(cfg.num_layers))
    return jax.lax.with_sharding_constraint(KVCache(k, v), out_sharding), _routes(cfg, topk)


def _cached_attention(q_bgrk: jax.Array, keys_bgks: jax.Array, values_bgsk: jax.Array,
                      visible_bs: jax.Array) -> jax.Array:
    """One query token per slot against its cached keys/values; returns [B, G, R, K].

    The same math as `transformer.attention` (float32 scores and softmax, probabilities cast to the
    value dtype), written as products and sums rather than dot products: scores sum over K, outputs
    over S, each a non-minor axis of the cache block, which XLA's CPU backend vectorises along the
    contiguous axis (S for keys, K for values). As batched dots, each (slot, head) is a separate small
    matrix product, slower on these shapes (see `KVCache`).
    """
    scale = 1.0 / math.sqrt(q_bgrk.shape[-1])
    f32 = jnp.float32
    scores_bgrs = jnp.sum(keys_bgks[:, :, None].astype(f32) * q_bgrk[..., None].astype(f32), axis=3)
    scores_bgrs = jnp.where(visible_bs[:, None, None, :], scores_bgrs * scale, MASK_VALUE)
    probs_bgrs = jax.nn.softmax(scores_bgrs, axis=-1).astype(values_bgsk.dtype)
    out_bgrk = jnp.sum(probs_bgrs[..., None].astype(f32) * values_bgsk[:, :, None].astype(f32), axis=3)
    return out_bgrk.astype(values_bgsk.dtype)


def _forward_step(model, cache: KVCache, rows_b: jax.Array | None, tokens_b: jax.Array,
                  lengths_b: jax.Array, windows: tuple[int, ...], window_g: jax.Array):
    """One token per row at position lengths_b: writes its keys/values, returns (logits_bv, cache,
    routes [B, L_sparse, k] of a mixture-of-experts model, else None).

    rows_b: the cache slot of each row (None: row i is slot i). The rows come in len(window_g) equal
    consecutive groups; group g attends over the first windows[window_g[g]] cache positions, which hold
    all of its active sequences.
    """
    cfg = model.config
    b, num_groups = tokens_b.shape[0], window_g.shape[0]
    if b % num_groups or (rows_b is None and num_groups != 1):
        raise ValueError(f"{b} rows do not split into {num_groups} groups (all slots in order: one group)")
    positions_b1 = lengths_b[:, None]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    slots_b = jnp.arange(b) if rows_b is None else rows_b

    def windowed(window, layer, k_lbgks, v_lbgsk, q_mgrk, slots_m, lengths_m):
        """Attention of the m rows of one group over the first `window` positions of their slots."""
        # Each row sees its own cached positions and the token being written; the rest of the window
        # (junk from earlier occupants or prefill padding) stays hidden.
        visible_ms = jnp.arange(window)[None, :] <= lengths_m[:, None]
        if rows_b is None:  # all slots in order: a slice, no gather (a slot-sharded cache stays local)
            keys = jax.lax.dynamic_index_in_dim(k_lbgks, layer, 0, False)[..., :window]
            values = jax.lax.dynamic_index_in_dim(v_lbgsk, layer, 0, False)[:, :, :window]
        else:
            keys, values = k_lbgks[layer, slots_m, ..., :window], v_lbgsk[layer, slots_m, :, :window]
        return _cached_attention(q_mgrk, keys, values, visible_ms)

    branches = [functools.partial(windowed, w) for w in windows]

    def body(carry, p, layer, _):
        x_b1d, k_lbgks, v_lbgsk = carry

        def attend(q_b1grk, k_b1gk, v_b1gk):
            # The cache is the loop carry and is written with a scatter, which XLA does in place; a
            # per-layer cache passed as scan xs/ys would be copied whole at every step.
            k = k_lbgks.at[layer, slots_b, :, :, lengths_b].set(k_b1gk[:, 0].astype(k_lbgks.dtype))
            v = v_lbgsk.at[layer, slots_b, :, lengths_b].set(v_b1gk[:, 0].astype(v_lbgsk.dtype))
            # A loop over the groups rather than one switch per group: the window branches compile once.
            per_group = (window_g, *(a.reshape(num_groups, b // num_groups, *a.shape[1:])
                                     for a in (q_b1grk[:, 0], slots_b, lengths_b)))
            out_gmgrk = jax.lax.map(lambda xs: jax.lax.switch(xs[0], branches, layer, k, v, *xs[1:]),
                                    per_group)
            return out_gmgrk.reshape(b, 1, *out_gmgrk.shape[2:]), (k, v)

        x_b1d, (k_lbgks, v_lbgsk), stats = decoder_layer(cfg, p, x_b1d, positions_b1, inv_freq, None, attend)
        return (x_b1d, k_lbgks, v_lbgsk), None if stats is None else stats.topk_btk[:, 0]

    x_b1d = jnp.take(model.embed[...], tokens_b[:, None], axis=0)
    (x_b1d, k, v), topk = scan_layers(cfg, model.layers.stacked(), body, (x_b1d, cache.k_lbgks, cache.v_lbgsk),
                                      layer_xs=jnp.arange(cfg.num_layers))
    h_b1d = rms_norm(x_b1d, model.final_norm[...], cfg.rms_norm_eps)
    return model.logits(h_b1d)[:, 0], KVCache(k, v), _routes(cfg, topk)


def _filter_top_k_top_p(scaled_bv: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    The nucleus is the smallest set of most likely tokens (after top-k) whose mass reaches top_p; ties
    at a threshold are kept.
    """
    v = scaled_bv.shape[-1]
    sorted_bv = -jnp.sort(-scaled_bv, axis=-1)
    kth_b = jnp.take_along_axis(sorted_bv, jnp.clip(top_k_b - 1, 0, v - 1)[:, None], axis=-1)[:, 0]
    kth_b = jnp.where(top_k_b > 0, kth_b, -jnp.inf)
    sorted_bv = jnp.where(sorted_bv >= kth_b[:, None], sorted_bv, -jnp.inf)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    cutoff_b = jnp.min(jnp.where(mass_before_bv < top_p_b[:, None], sorted_bv, jnp.inf), axis=-1)
    threshold_b = jnp.maximum(kth_b, jnp.where(top_p_b < 1.0, cutoff_b, -jnp.inf))
    return jnp.where(scaled_bv >= threshold_b[:, None], scaled_bv, -jnp.inf)


def _argmax(x_bv: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximal index), int32, as a max and a min: XLA's CPU
    backend runs these two plain reductions several times faster than its arg-max reduction."""
    v = x_bv.shape[-1]
    max_b1 = jnp.max(x_bv, axis=-1, keepdims=True)
    first_b = jnp.min(jnp.where(x_bv == max_b1, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first_b, v - 1)  # no maximal index only with NaNs in the row


def _inverse_cdf(probs_bv: jax.Array, u_b: jax.Array) -> jax.Array:
    """Per row, the first token whose cumulative probability reaches u_b times the row's total mass.

    In two levels: the block (of about sqrt(V) tokens) where the running total crosses the target, then
    the token within it. A cumulative sum over the whole vocabulary is a reduction window as wide as
    the vocabulary on XLA's CPU backend (V^2 adds a row): at V = 512 it took half of sampling.
    """
    b, v = probs_bv.shape
    block = 1 << max(0, math.ceil(math.log2(v) / 2))
    nb = -(-v // block)
    probs_bnk = jnp.pad(probs_bv, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    block_sums_bn = jnp.sum(probs_bnk, axis=-1)
    ends_bn = jnp.cumsum(block_sums_bn, axis=-1)
    target_b = u_b * ends_bn[:, -1]
    # The first block whose end reaches the target holds mass (its end exceeds the previous one's).
    n_b = jnp.minimum(jnp.sum(ends_bn < target_b[:, None], axis=-1), nb - 1)
    rest_b = target_b - jnp.take_along_axis(ends_bn - block_sums_bn, n_b[:, None], axis=-1)[:, 0]
    in_block_bk = jnp.take_along_axis(probs_bnk, n_b[:, None, None], axis=1)[:, 0]
    k_b = jnp.sum(jnp.cumsum(in_block_bk, axis=-1) < rest_b[:, None], axis=-1)
    # Rounding may put the target past the block's own running total: then its last token with mass.
    last_b = jnp.max(jnp.where(in_block_bk > 0, jnp.arange(block), 0), axis=-1)
    return jnp.minimum(n_b * block + jnp.minimum(k_b, last_b), v - 1).astype(jnp.int32)


def sample_tokens(logits_bv: jax.Array, state: SlotState, logprobs_mode: str = "raw"):
    """Samples one token per slot with that slot's parameters; returns (tokens_b int32, logprobs_b f32).

    Temperature scales first, then top-k and top-p filter (as transformers and vLLM order them);
    temperature 0 takes the argmax of the unmodified logits. The key of a slot's j-th generated token is
    fold_in(key(seed), j), so a request's samples do not depend on its slot, its neighbours, chunking,
    or an abort and resume.

    logprobs_mode "raw": log-probabilities under the model's unmodified distribution (temperature 1, no
    filters), which is what the trainer recomputes as the behaviour policy. "processed": under the
    distribution actually sampled from (temperature and filters applied; at temperature 0, the filtered
    temperature-1 distribution).
    """
    logits_bv = logits_bv.astype(jnp.float32)
    sampling_b = state.temperature_b > 0
    scaled_bv = logits_bv / jnp.where(sampling_b, state.temperature_b, 1.0)[:, None]
    # The sort behind top-k/top-p is the costliest part of sampling with a large vocab: skip it when
    # no slot asks for a filter.
    filtered = jnp.any((state.top_k_b > 0) | (state.top_p_b < 1.0))
    processed_bv = jax.lax.cond(filtered, _filter_top_k_top_p, lambda s, k, p: s, scaled_bv,
                                state.top_k_b, state.top_p_b)
    keys_b = jax.vmap(lambda s, j: jax.random.fold_in(jax.random.key(s), j))(state.seeds_b,
                                                                             state.generated_b)
    # Inverse-CDF sampling: one uniform u in (0, 1] per row, and the first token whose cumulative
    # probability reaches u (a filtered token has probability 0 and is never the first). The same
    # distribution as jax.random.categorical, whose Gumbel noise draws a random number per vocabulary
    # entry: that cost more than the rest of a tiny model's decode step, and 4x the step at a 152k vocab.
    u_b = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_b)
    # A greedy row takes the argmax of its logits (its filters leave the maximum in place). The argmax
    # is skipped when no row is greedy (rollouts), as the draw is when every row is (evaluations).
    tokens_b = jax.lax.cond(jnp.any(sampling_b),
                            lambda: _inverse_cdf(jax.nn.softmax(processed_bv, axis=-1), u_b),
                            lambda: jnp.zeros(u_b.shape, jnp.int32))
    tokens_b = jax.lax.cond(jnp.all(sampling_b), lambda: tokens_b,
                            lambda: jnp.where(sampling_b, tokens_b, _argmax(processed_bv)))
    reported_bv = logits_bv if logprobs_mode == "raw" else processed_bv
    logprobs_b = (jnp.take_along_axis(reported_bv, tokens_b[:, None], axis=-1)[:, 0]
                  - jax.nn.logsumexp(reported_bv, axis=-1))
    return tokens_b, logprobs_b


@functools.partial(jax.jit, static_argnames=("graphdef", "num_steps", "windows", "logprobs_mode",
                                             "out_sharding"), donate_argnames=("cache",))
def decode(graphdef, params: nnx.State, cache: KVCache, state: SlotState, rows_b: jax.Array | None,
           window_g: jax.Array, *, num_steps: int, windows: tuple[int, ...], logprobs_mode: str,
           out_sharding):
    """Up to `num_steps` decode steps for B rows in one call; stops early once no row is active.

    state: the rows' SlotState ([B]). rows_b: int32 [B], the cache slot of each row, distinct (None: all
    slots, row i = slot i). Padding rows are inactive slots: they run (fixed shapes) but their state and
    outputs are frozen, and the keys/values they write land in free slots that a prefill rewrites before
    use.

    Attention windows: the rows come in len(window_g) equal consecutive groups (one when rows_b is None);
    group g attends over cache positions [0, windows[window_g[g]]) only. The caller picks each group's
    window so that all its active rows' lengths_b + num_steps fit, which saves reading the whole cache
    while sequences are short; window_g is traced, so one program serves every choice.

    A row stops after sampling a stop id (FINISH_STOP; the stop token is kept), reaching max_tokens
    generated, or filling the cache (FINISH_LENGTH: prompt + generated = S).
    Returns (cache, state, tokens_bc int32 with -1 where nothing was generated, logprobs_bc float32,
    routes_bclk: a mixture-of-experts model's routes of each generated token (those computed by the step
    that sampled it), -1 where nothing was generated; None for a dense model).
    """
    model = nnx.merge(graphdef, params)
    max_len = cache.v_lbgsk.shape[3]
    b = state.tokens_b.shape[0]

    def step(carry):
        i, cache, s, tokens_bc, logprobs_bc, routes_bclk = carry
        logits_bv, cache, routes_blk = _forward_step(model, cache, rows_b, s.tokens_b, s.lengths_b, windows,
                                                     window_g)
        token_b, logprob_b = sample_tokens(logits_bv, s, logprobs_mode)
        active_b = s.active_b
        stop_b = jnp.any(token_b[:, None] == s.stop_ids_bn, axis=-1)
        generated_b = s.generated_b + 1
        full_b = (generated_b >= s.max_tokens_b) | (s.lengths_b + 2 >= max_len)
        done_b = active_b & (stop_b | full_b)
        s = s._replace(
            tokens_b=jnp.where(active_b, token_b, s.tokens_b),
            lengths_b=jnp.where(active_b, s.lengths_b + 1, s.lengths_b),
            generated_b=jnp.where(active_b, generated_b, s.generated_b),
            active_b=active_b & ~done_b,
            finish_b=jnp.where(done_b, jnp.where(stop_b, FINISH_STOP, FINISH_LENGTH), s.finish_b))
        tokens_bc = tokens_bc.at[:, i].set(jnp.where(active_b, token_b, -1))
        logprobs_bc = logprobs_bc.at[:, i].set(jnp.where(active_b, logprob_b, 0.0))
        if routes_blk is not None:
            routes_bclk = routes_bclk.at[:, i].set(jnp.where(active_b[:, None, None], routes_blk, -1))
        return i + 1, cache, s, tokens_bc, logprobs_bc, routes_bclk

    def more(carry):
        return (carry[0] < num_steps) & jnp.any(carry[2].active_b)

    cfg = model.config
    state = state._replace(finish_b=jnp.zeros_like(state.finish_b))
    routes_bclk = None if not cfg.num_experts else jnp.full(
        (b, num_steps, len(cfg.sparse_layers), cfg.num_experts_per_tok), -1, route_dtype(cfg.num_experts))
    init = (jnp.int32(0), cache, state, jnp.full((b, num_steps), -1, jnp.int32),
            jnp.zeros((b, num_steps), jnp.float32), routes_bclk)
    _, cache, state, tokens_bc, logprobs_bc, routes_bclk = jax.lax.while_loop(more, step, init)
    return jax.lax.with_sharding_constraint(cache, out_sharding), state, tokens_bc, logprobs_bc, routes_bclk
