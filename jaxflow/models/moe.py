"""The mixture-of-experts MLP of Qwen3-MoE: a top-k softmax router, dropless experts, routing replay.

A sparse layer's MLP (`ModelConfig.sparse_layers`) sends each token to k of its E experts:

    p = softmax(h W_router)                      (float32, [E] per token)
    top-k experts i_1..i_k by p, weights w_j = p_{i_j}   (/ sum_j p_{i_j} when norm_topk_prob)
    out = sum_j w_j * down_{i_j}(silu(gate_{i_j}(h)) * up_{i_j}(h))

as transformers' Qwen3MoeSparseMoeBlock computes it. The experts run dropless: every (token, expert)
assignment is computed, none is dropped to meet a capacity. Assignments are sorted by expert and each
projection is one grouped matmul (`jax.lax.ragged_dot`) over the experts' stacked weights [E, D, F].

Routing replay (R3). `routes_btk` gives, per token, the experts some other forward chose: the rollout
engine records the experts each generated token went through, and the trainer's forward passes them
back in. A token with recorded routes (all entries >= 0) goes to those experts instead of its own top-k;
their weights are still the router's own probabilities p_{i_j} (renormalised as above), so the router
gets gradients through the gate values of the experts the token actually used. A token without (-1)
routes itself. The router's own top-k is returned either way, which is how the trainer measures how
often replay overrode it.

Expert parallelism. The experts' weights are split over the mesh's `expert` axis (logical axis
`experts`), their hidden dim over `fsdp` and their width over `tensor`. Inside `jax.shard_map` each
device gathers the tokens of the rows its expert group holds (an all-gather over `expert`, the "gather"
form of the token exchange: the all-to-all's traffic at small scale, one collective), runs the
assignments that fall on its own experts, and a reduce-scatter over `expert` (a sum over `tensor`) hands
every token's output back to the device that holds its row. On one device, or with no mesh set around
the trace, the same local function runs on all experts.

Shapes: B batch, T tokens, D hidden, E experts, F expert width, k experts per token, N = B*T.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxflow import sharding
from jaxflow.models.config import ModelConfig

# Mesh axes the experts' weights and the tokens' rows are split over.
EXPERT_AXIS = "expert"
ROW_AXES = sharding.BATCH_AXES


class RouterStats(NamedTuple):
    """One sparse layer's routing over the tokens of a forward pass (sums over the `valid` tokens).

    topk_btk: int32, the router's own top-k experts per token (sorted by probability, largest first),
    whatever replay did. load_e: assignments each expert received (after replay). prob_e: the router's
    probabilities summed over tokens. z: the sum of squared log-partition functions (logsumexp of the
    router logits), the router z-loss's numerator. tokens: how many tokens were summed."""

    topk_btk: jax.Array
    load_e: jax.Array
    prob_e: jax.Array
    z: jax.Array
    tokens: jax.Array


def route(cfg: ModelConfig, router_de: jax.Array, h_btd: jax.Array, routes_btk: jax.Array | None = None,
          valid_bt: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats]:
    """The experts [B, T, k] (int32) and weights [B, T, k] (h's dtype) each token goes through, and the
    layer's `RouterStats`. routes_btk: recorded experts to replay (rows with a -1 route themselves)."""
    k = cfg.num_experts_per_tok
    logits = jnp.einsum("btd,de->bte", h_btd, router_de.astype(h_btd.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    own_w, own_i = jax.lax.top_k(probs, k)
    experts = own_i
    if routes_btk is not None:
        replayed = jnp.all(routes_btk >= 0, axis=-1, keepdims=True)
        experts = jnp.where(replayed, routes_btk.astype(jnp.int32), own_i)
    weights = jnp.take_along_axis(probs, experts, axis=-1) if routes_btk is not None else own_w
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    valid = (jnp.ones(h_btd.shape[:2], jnp.float32) if valid_bt is None else valid_bt.astype(jnp.float32))
    load = jnp.sum(jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.float32) * valid[..., None, None],
                   axis=(0, 1, 2))
    stats = RouterStats(
        topk_btk=own_i.astype(jnp.int32), load_e=jax.lax.stop_gradient(load),
        prob_e=jnp.sum(probs * valid[..., None], axis=(0, 1)),
        z=jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * valid), tokens=jnp.sum(valid))
    return experts, weights.astype(h_btd.dtype), stats


def _local_experts(x_nd, experts_nk, weights_nk, gate_edf, up_edf, down_efd, first_expert):
    """The summed output [N, D] of the assignments that fall on the experts held here
    (first_expert .. first_expert + E_local - 1); others contribute nothing."""
    n, k = experts_nk.shape
    e_local = gate_edf.shape[0]
    local = experts_nk.reshape(-1) - first_expert
    here = (local >= 0) & (local < e_local)
    key = jnp.where(here, local, e_local)  # assignments elsewhere sort last, past every group
    order = jnp.argsort(key, stable=True)
    rows = order // k
    sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    x_md = jnp.take(x_nd, rows, axis=0)
    gate = jax.lax.ragged_dot(x_md, gate_edf, sizes)
    up = jax.lax.ragged_dot(x_md, up_edf, sizes)
    y_md = jax.lax.ragged_dot(jax.nn.silu(gate) * up, down_efd, sizes)  # rows past the groups are 0
    y_md = y_md * jnp.take(weights_nk.reshape(-1), order)[:, None].astype(y_md.dtype)
    return jnp.zeros_like(x_nd).at[rows].add(y_md.astype(x_nd.dtype))


def experts_mlp(p: dict[str, jax.Array], h_btd: jax.Array, experts_btk: jax.Array,
                weights_btk: jax.Array) -> jax.Array:
    """The experts' output [B, T, D] for the assignments `experts_btk` weighted by `weights_btk`.

    p: one layer's `expert_gate` / `expert_up` [E, D, F] and `expert_down` [E, F, D]. Under a mesh
    (`jax.set_mesh` around the trace) with any axis > 1 the work is split as the module docstring says."""
    gate, up, down = p["expert_gate"], p["expert_up"], p["expert_down"]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        b, t, d = h_btd.shape
        out = _local_experts(h_btd.reshape(b * t, d), experts_btk.reshape(b * t, -1),
                             weights_btk.reshape(b * t, -1), gate, up, down, 0)
        return out.reshape(b, t, d)
    return _sharded_experts(mesh, h_btd, experts_btk, weights_btk, gate, up, down)


def _axis(mesh, name: str, dim: int) -> str | None:
    """`name` if the mesh has it with size > 1 dividing `dim`, else None (that dimension stays whole)."""
    size = mesh.shape.get(name, 1)
    return name if size > 1 and dim % size == 0 else None


def _sharded_experts(mesh, h_btd, experts_btk, weights_btk, gate, up, down):
    e, d, f = gate.shape
    rows = tuple(a for a in ROW_AXES if mesh.shape.get(a, 1) > 1)
    if rows and h_btd.shape[0] % math.prod(mesh.shape[a] for a in rows):
        rows = ()  # rows that do not divide stay whole on every device
    ex, fs, tp = _axis(mesh, EXPERT_AXIS, e), _axis(mesh, "fsdp", d), _axis(mesh, "tensor", f)
    gathered = ex is not None and ex in rows  # tokens are split over the expert axis: gather them
    row_spec = P(rows or None, None, None)
    in_specs = (row_spec, row_spec, row_spec, P(ex, fs, tp), P(ex, fs, tp), P(ex, tp, fs))

    def body(x_btd, experts_btk, weights_btk, gate, up, down):
        if fs is not None:  # the experts' hidden dim, split like every fsdp weight, is gathered to use
            gate = jax.lax.all_gather(gate, fs, axis=1, tiled=True)
            up = jax.lax.all_gather(up, fs, axis=1, tiled=True)
            down = jax.lax.all_gather(down, fs, axis=2, tiled=True)
        if gathered:
            x_btd, experts_btk, weights_btk = (jax.lax.all_gather(a, ex, axis=0, tiled=True)
                                               for a in (x_btd, experts_btk, weights_btk))
        b, t, dd = x_btd.shape
        first = jax.lax.axis_index(ex) * gate.shape[0] if ex is not None else 0
        out = _local_experts(x_btd.reshape(b * t, dd), experts_btk.reshape(b * t, -1),
                             weights_btk.reshape(b * t, -1), gate, up, down, first).reshape(b, t, dd)
        if tp is not None:
            out = jax.lax.psum(out, tp)
        if gathered:
            return jax.lax.psum_scatter(out, ex, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, ex) if ex is not None else out

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=row_spec)(
        h_btd, experts_btk, weights_btk, gate, up, down)


def moe_mlp(cfg: ModelConfig, p: dict[str, jax.Array], h_btd: jax.Array, routes_btk: jax.Array | None = None,
            valid_bt: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
    """One sparse layer's MLP on the post-attention-norm hidden states: (output [B, T, D], stats)."""
    experts, weights, stats = route(cfg, p["router"], h_btd, routes_btk, valid_bt)
    return experts_mlp(p, h_btd, experts, weights), stats


def router_losses(stats: RouterStats, num_experts: int, top_k: int) -> tuple[jax.Array, jax.Array]:
    """(load-balancing loss, z-loss) of one layer's stats, as the anchors define them.

    Load balancing (Switch Transformer; transformers' `load_balancing_loss_func`): E * sum_e f_e P_e,
    f_e the fraction of assignments expert e received and P_e its mean router probability; 1 when the
    load is uniform. z-loss (ST-MoE): the mean squared logsumexp of the router logits."""
    n = jnp.maximum(stats.tokens, 1.0)
    fraction = stats.load_e / (n * top_k)
    aux = num_experts * jnp.sum(fraction * stats.prob_e / n)
    return aux, stats.z / n
