"""The staleness-aware PPO update: forward, loss, gradients and optimizer as one jit-compiled function.

One call consumes the batch for policy version v and returns the state of version v+1. Inside, the
batch's micro-batches [M, b, T] are grouped into K minibatches; each minibatch is one optimizer update
(gradients accumulated over its micro-batches with `lax.scan`). π_prox, the proximal policy of
decoupled PPO, is the weights at the start of the call:

- prox="recompute": with K = 1 the gradient is taken at exactly those weights, so π_prox is the
  current log-prob with its gradient stopped (no extra pass); with K > 1 a forward-only scan over the
  batch computes it first.
- prox="loglinear": AReaL's interpolation between μ and π_θ by per-token versions, no extra pass.
- prox="exact": a forward-only pass of `scoring.sequence_logprobs`, one sequence a row (unpacked rows), the
  program the JAX engine's exact mode reports its log-probs with: on-policy tokens get π_prox = μ bit for bit.

A train-rollout mismatch correction (loss.mismatch) reads ρ = π_prox/μ, so π_prox is computed for
every loss when one is set, and it needs prox="recompute": the log-linear π_prox equals μ on tokens of
the current version, where ρ would be 1.

With a KL penalty (loss.kl_coef > 0) the caller passes the reference policy's parameters and a
forward-only pass over the batch computes its log-probs (no gradient) for the loss's `ref_logp_bt`.

On-policy distillation (`StepConfig.distill`, jaxflow/trainer/distill.py): the TrainStep holds a frozen teacher
(its own graphdef and parameters, on the same mesh), and the step scores the batch with it in a forward-only
pass, as it does the reference policy. A second forward-only pass of the same program gives the student's
log-probs at the step's starting weights (the π_prox pass itself where prox="recompute" with K > 1 computes
it anyway), so a teacher equal to the student gives an advantage of exactly 0 (a mixture-of-experts teacher
routes every token itself, where routing replay sends the student's through the recorded experts). Each
token's advantage is then `distill.distill_advantage` (teacher minus student, mixed with the task's), a
constant of the update that the policy loss weighs with its usual corrections. With the teacher beside the
rollout (`DistillOptions.where = "rollout"`) the TrainStep holds no teacher: the batch carries the teacher's
recorded log-probs (`TrajectoryBatch.teacher_logp`), which take the teacher pass's place; the student's pass is
the same.

A mixture-of-experts policy (`jaxflow.models.moe`): with routing_replay "rollout" every forward of the
step (π_θ, π_prox, the reference) sends each input token to the experts the rollout engine recorded for
it (`TrajectoryBatch.routes`; unrecorded positions route themselves). The router's load-balancing and z
losses join the loss with their coefficients (0 by default, as the anchors' RL recipes run), and the
metrics report the expert load (max over mean), both losses and, where routes were recorded, the
fraction of tokens whose own top-k differs from the recorded one (route_flip_frac).

An update whose loss or gradient is not finite is skipped (parameters and optimizer state unchanged),
counted in `state.skipped`, and reported; it never corrupts the state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow import sharding
from jaxflow.config import ConfigError
from jaxflow.data.records import RouteSpec
from jaxflow.models import moe, precision
from jaxflow.trainer import distill, losses, scoring
from jaxflow.trainer.batch import FIELD_DTYPES, TrajectoryBatch, validate_batch
from jaxflow.trainer.state import TrainState

logger = logging.getLogger(__name__)

PROX_MODES = ("recompute", "loglinear")
ROUTING_REPLAY = ("off", "rollout")
# Also a StepConfig.prox: π_prox from `scoring.sequence_logprobs`, the program the JAX engine's exact mode reports
# log-probs with (rows of one sequence each). The job sets it with `rollout.exact_logprobs`.
EXACT_PROX = "exact"
# Positions per chunk of the log-prob computation (`token_logprobs`) unless the config says otherwise.
LOGPROB_CHUNK = 512


def prox_problems(prox: str, loss: Any) -> list[str]:
    """Why `trainer.prox` cannot serve the loss config `loss` ([] when it can): a mismatch correction needs
    the recomputed π_prox (see the module docstring)."""
    mismatch = getattr(loss, "mismatch", "none")
    if prox == "loglinear" and mismatch != "none":
        return [f"trainer.loss.mismatch {mismatch!r} needs trainer.prox 'recompute', got 'loglinear': the "
                f"log-linear π_prox equals μ on tokens sampled at the current version, so the mismatch ratio "
                f"π_prox/μ would be 1 and the correction would do nothing"]
    return []


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the update computes. loss: a `losses.LossConfig`. minibatches: optimizer updates per batch
    (K). prox: how π_prox is obtained (see module docstring). remat: recompute each block in the
    backward pass to save activation memory. logprob_chunk: sequence positions per chunk of the
    log-prob and entropy computation (`token_logprobs`); 0 computes the whole sequence at once.
    compute_dtype: what the forward and backward pass compute in ("float32" or "bfloat16"); the
    parameters stay in their own (master) dtype, and so do their gradients.
    Mixture of experts: routing_replay "off" | "rollout" (replay the batch's recorded routes);
    route_spec: the policy's routing (`jaxflow.data.records.RouteSpec`), which replay needs;
    router_aux_coef / router_z_coef: weights of the router's load-balancing and z losses.
    distill: on-policy distillation's coefficients (`distill.DistillOptions`, its teacher set; where "step" the
    TrainStep is given the teacher model itself, where "rollout" each batch carries the teacher's recorded
    log-probs, `TrajectoryBatch.teacher_logp`); None: the batch's advantages train as they are.
    """

    loss: losses.LossConfig = losses.LossConfig()
    minibatches: int = 1
    prox: str = "recompute"
    remat: bool = False
    logprob_chunk: int = LOGPROB_CHUNK
    compute_dtype: str = "float32"
    routing_replay: str = "off"
    route_spec: RouteSpec | None = None
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0
    distill: distill.DistillOptions | None = None

    def __post_init__(self):
        if self.distill is not None and (not isinstance(self.distill, distill.DistillOptions)
                                         or not self.distill.enabled):
            raise ValueError(f"distill must be None or a DistillOptions with its teacher set, got {self.distill!r}")
        if self.routing_replay not in ROUTING_REPLAY:
            raise ValueError(f"routing_replay must be one of {ROUTING_REPLAY}, got {self.routing_replay!r}")
        if self.routing_replay == "rollout" and self.route_spec is None:
            raise ValueError("routing_replay 'rollout' needs route_spec (the policy has no experts?)")
        for name in ("router_aux_coef", "router_z_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.logprob_chunk, bool) or not isinstance(self.logprob_chunk, int) or self.logprob_chunk < 0:
            raise ValueError(f"logprob_chunk must be an int >= 0, got {self.logprob_chunk!r}")
        precision.dtype_of(self.compute_dtype)
        if self.prox not in (*PROX_MODES, EXACT_PROX):
            raise ValueError(f"unknown prox mode {self.prox!r}; valid: {', '.join((*PROX_MODES, EXACT_PROX))}")
        if self.minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {self.minibatches}")
        losses.validate_loss_config(self.loss)
        problems = prox_problems(self.prox, self.loss)
        if problems:
            raise ConfigError("bad trainer config: " + "; ".join(problems), problems)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """AdamW behind global-norm clipping, with a linear warmup (from lr / warmup_steps) then constant or
    cosine decay.

    Norm scales and biases are not weight-decayed. Fields: lr, warmup_steps, schedule ("constant" or
    "cosine"), total_steps (cosine only), b1, b2, eps, weight_decay, max_grad_norm.
    """
    # Update k (from 0) of the warmup gets lr * (k + 1) / warmup_steps: the first update is not a no-op.
    def warmup(count):
        return config.lr * jnp.minimum((count + 1) / max(config.warmup_steps, 1), 1.0)

    if config.schedule == "constant":
        after = optax.constant_schedule(config.lr)
    elif config.schedule == "cosine":
        after = optax.cosine_decay_schedule(config.lr, max(config.total_steps - config.warmup_steps, 1))
    else:
        raise ValueError(f"unknown lr schedule {config.schedule!r}; valid: constant, cosine")
    schedule = optax.join_schedules([warmup, after], [config.warmup_steps])

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any(str(getattr(k, "key", k)).endswith(("norm", "bias")) for k in path),
            params)

    return float32_state(optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                    weight_decay=config.weight_decay, mask=decay_mask)))


def float32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` with its state, and the arithmetic of its updates, in float32 whatever the parameters' dtype:
    AdamW's moments of bfloat16 master weights stay float32 (a bfloat16 second moment loses the small
    squared gradients). The updates come out float32; `optax.apply_updates` casts each sum to its
    parameter's dtype. For float32 parameters this is `tx` itself, state structure included."""
    def up(tree):
        return None if tree is None else precision.cast_floating(tree, jnp.float32)

    return optax.GradientTransformation(lambda params: tx.init(up(params)),
                                        lambda grads, state, params=None: tx.update(up(grads), state, up(params)))


def _logits_sharding(mesh, shape, rules=None):
    """The sharding of logits [b, positions, V]: rows as the batch, vocab as the LM head's vocab axis."""
    return sharding.named_sharding(("batch", "seq", "vocab"), shape, mesh, rules)


def vocab_parallel_rules(mesh, vocab: int):
    """Sharding rules for the chunked LM head (`token_logprobs`), or None where the vocab does not split.

    The head is vocab-parallel over fsdp as well as tensor: each device computes the logits of its slice
    of the vocab for the rows of its whole fsdp group, so the head's weight stays split and its gradient
    is accumulated over the chunks on its own device. Laid out as the rest of the model (rows over
    data x fsdp, the weight gathered over fsdp), every chunk's backward pass would all-reduce the whole
    [V, D] weight gradient: 11.2 GB a step per device against 3.6 for Qwen3-0.6B at 4,096 tokens on
    8 devices. Per chunk, this layout moves the chunk's hidden states instead (rows x chunk x D)."""
    if mesh is None:
        return None
    split = sharding.LOGICAL_RULES["batch"]
    over = tuple(a for a in ("fsdp", "tensor") if mesh.shape.get(a, 1) > 1)
    if "fsdp" not in over or vocab % math.prod(mesh.shape[a] for a in over):
        return None
    return {**sharding.LOGICAL_RULES, "batch": tuple(a for a in split if a != "fsdp"), "vocab": over}


def _chunk_logprobs(model: nnx.Module, h_bcd: jax.Array, targets_bc: jax.Array, mesh=None, weight=None,
                    rules=None):
    """log π(target) and the entropy, both [b, c] float32, from hidden states h_bcd [b, c, D]: the LM head
    (`weight`, default the model's own) for these c positions only, upcast to float32 before the
    logsumexp whatever the compute dtype. rules: the sharding rules of the logits (default
    `jaxflow.sharding`'s)."""
    if mesh is not None and rules is not None:
        h_bcd = jax.lax.with_sharding_constraint(
            h_bcd, sharding.named_sharding(("batch", None, None), h_bcd.shape, mesh, rules))
    logits = model.logits(h_bcd, weight).astype(jnp.float32)
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, _logits_sharding(mesh, logits.shape, rules))
    # logit - logsumexp rather than a gathered log_softmax: no [b, c, V] log-probabilities to store for
    # the backward pass (0.96x the tiny model's train step).
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets_bc[..., None], axis=-1)[..., 0] - lse
    logits, lse = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logp, entropy


def token_logprobs(model: nnx.Module, mb: TrajectoryBatch, remat: bool = False, chunk: int = 0, mesh=None,
                   router: bool = False):
    """log π(token_t | tokens_<t) and the policy entropy at t, both [b, T] float32 (0 at t = 0); with
    `router`, also the sparse layers' `moe.RouterStats` (None for a dense model). A batch with routes
    replays them (`TrajectoryBatch.routes`).

    chunk: positions per chunk of the LM head. 0, or a chunk that covers the sequence, makes the logits
    [b, T-1, V] at once. Otherwise the positions are cut into chunks (the last one padded), mapped over in
    turn, each under `jax.checkpoint`: the backward pass recomputes a chunk's logits instead of keeping
    them, so this part holds O(b x chunk x V) floats instead of O(b x T x V). mesh: when given, each
    chunk's logits are constrained to the batch and vocab shardings (`jaxflow.sharding`).
    The entropy carries no gradient: it is a diagnostic.
    """
    h_btd, stats = model.hidden_states(mb.tokens, mb.positions, mb.segment_ids, mb.context_ids, remat=remat,
                                       routes_btlk=getattr(mb, "routes", None), with_router=True)
    h_btd = h_btd[:, :-1]
    targets_bt = mb.tokens[:, 1:]
    b, n, d = h_btd.shape
    if chunk <= 0 or chunk >= n:
        logp, entropy = _chunk_logprobs(model, h_btd, targets_bt, mesh)
    else:
        k = -(-n // chunk)
        pad = k * chunk - n  # padded positions compute junk that is sliced off below
        h_kbcd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, k, chunk, d).swapaxes(0, 1)
        t_kbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, k, chunk).swapaxes(0, 1)
        # The head's weight is laid out once for every chunk (vocab-parallel, `vocab_parallel_rules`; else
        # gathered over fsdp): inside the loop each chunk would move it again, forward and backward.
        weight, axes = model.head_weight()
        rules = vocab_parallel_rules(mesh, weight.shape[axes.index("vocab")])
        if mesh is not None:
            weight = jax.lax.with_sharding_constraint(
                weight, sharding.named_sharding(axes, weight.shape, mesh, rules))
        per_chunk = jax.checkpoint(lambda xs: _chunk_logprobs(model, xs[0], xs[1], mesh, weight, rules))
        logp, entropy = jax.lax.map(per_chunk, (h_kbcd, t_kbc))
        logp, entropy = (x.swapaxes(0, 1).reshape(b, k * chunk)[:, :n] for x in (logp, entropy))
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))  # noqa: E731
    return (pad(logp), pad(entropy), stats) if router else (pad(logp), pad(entropy))


def router_metrics(stats, routes_btlk, num_experts: int, top_k: int) -> tuple[jax.Array, jax.Array, dict]:
    """(load-balancing loss, z-loss, metrics) of a forward's sparse-layer `moe.RouterStats` [L_sparse, ...],
    each loss the mean over the sparse layers. routes_btlk: the replayed routes, or None."""
    aux, z = jax.vmap(lambda s: moe.router_losses(s, num_experts, top_k))(stats)
    load = stats.load_e  # [L_sparse, E]
    metrics = {"router_aux_loss": jnp.mean(aux), "router_z_loss": jnp.mean(z),
               "expert_load_max": jnp.max(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))}
    if routes_btlk is not None:
        own = jnp.sort(jnp.moveaxis(stats.topk_btk, 0, 2), axis=-1)  # [B, T, L_sparse, k]
        recorded = jnp.all(routes_btlk >= 0, axis=-1)  # [B, T, L_sparse]
        differs = jnp.any(own != jnp.sort(routes_btlk.astype(jnp.int32), axis=-1), axis=-1) & recorded
        tokens = jnp.any(recorded, axis=-1)
        metrics["route_flip_frac"] = jnp.sum(jnp.any(differs, -1)) / jnp.maximum(jnp.sum(tokens), 1)
    return jnp.mean(aux), jnp.mean(z), metrics


def _combine(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Reduces per-micro-batch metrics (leading axis) to one value each, weighting means by tokens."""
    n = metrics["num_tokens"]
    total = jnp.maximum(jnp.sum(n), 1.0)
    out = {}
    for key, value in metrics.items():
        if key in ("loss", "num_tokens"):
            out[key] = jnp.sum(value)
        elif key.endswith("_max"):
            out[key] = jnp.max(value)
        else:
            out[key] = jnp.sum(value * n) / total
    return out


def _has_tokens(mb: TrajectoryBatch) -> jax.Array:
    return jnp.any(mb.loss_mask > 0)


def _train_step(graphdef, tx, cfg: StepConfig, state: TrainState, batch: TrajectoryBatch,
                ref_params, frozen=None, mesh=None, teacher_graphdef=None,
                teacher_params=None) -> tuple[TrainState, dict[str, Any]]:
    m, b, t = batch.tokens.shape
    k = cfg.minibatches
    version = state.version
    lc = cfg.loss
    # A mismatch correction reads π_prox whatever the loss.
    uses_prox = losses.POLICY_LOSS_USES_PROX[lc.name] or getattr(lc, "mismatch", "none") != "none"

    compute = jnp.dtype(cfg.compute_dtype)

    def merged(params):  # with LoRA, params are the adapters and `frozen` the base
        # The one cast to the compute dtype, inside the differentiated function: gradients come back in
        # the parameters' own dtype.
        params = precision.cast_floating(params, compute)
        return (nnx.merge(graphdef, params) if frozen is None
                else nnx.merge(graphdef, params, precision.cast_floating(frozen, compute)))

    replay = cfg.routing_replay == "rollout"
    if not replay:
        batch = batch.replace(routes=None)

    def forward(params, mb, router=False):
        return token_logprobs(merged(params), mb, cfg.remat, cfg.logprob_chunk, mesh, router=router)

    def model_logp(model_fn, mb):  # forward only; no work on a micro-batch with nothing to train
        return jax.lax.cond(_has_tokens(mb),
                            lambda: token_logprobs(model_fn(), mb, cfg.remat, cfg.logprob_chunk, mesh)[0],
                            lambda: jnp.zeros(mb.tokens.shape, jnp.float32))

    def forward_logp(params, mb):
        return model_logp(lambda: merged(params), mb)

    # π_prox for K > 1: the start-of-step weights, before any update of this call.
    prox_all = None
    if uses_prox and cfg.prox == "recompute" and k > 1:
        prox_all = jax.lax.map(lambda mb: forward_logp(state.params, mb), batch)
    elif cfg.prox == EXACT_PROX:  # rows hold one sequence each, from position 0 (unpacked)
        def exact_logp(mb):  # no work on a micro-batch with nothing to train, as `forward_logp`
            return jax.lax.cond(_has_tokens(mb), lambda: scoring.sequence_logprobs(
                merged(state.params), mb.tokens, jnp.sum(mb.segment_ids > 0, axis=1), cfg.logprob_chunk),
                lambda: jnp.zeros(mb.tokens.shape, jnp.float32))
        prox_all = jax.lax.map(exact_logp, batch)
    ref_all = None
    if ref_params is not None:
        ref_all = jax.lax.map(lambda mb: forward_logp(ref_params, mb), batch)
    teacher_all = start_all = None
    if cfg.distill is not None:
        # The teacher and the student's starting weights through the same forward-only program: equal models
        # give equal log-probs, bit for bit.
        def teacher_model():
            return nnx.merge(teacher_graphdef, precision.cast_floating(teacher_params, compute))

        if cfg.distill.recorded:  # scored beside the rollout: the batch carries them
            teacher_all = batch.teacher_logp
        else:  # a mixture-of-experts teacher routes every token itself: the recorded routes are the student's
            teacher_all = jax.lax.map(lambda mb: model_logp(teacher_model, mb.replace(routes=None)), batch)
        reuse = uses_prox and cfg.prox == "recompute" and k > 1  # prox_all is this very pass
        start_all = prox_all if reuse else jax.lax.map(lambda mb: forward_logp(state.params, mb), batch)

    def loss_fn(params, mb, weights, seq_ids, prox, ref, teacher, start):
        logp, entropy, stats = forward(params, mb, router=True)
        if cfg.prox == "loglinear":
            prox = losses.loglinear_prox_logp(mb.behav_logp, logp, mb.versions, version) if uses_prox else None
        elif prox is None and (uses_prox or k == 1):
            # K = 1: π_prox is the current log-prob, free, so the mismatch metrics have it for every loss.
            prox = jax.lax.stop_gradient(logp)
        advantages = mb.advantages
        if cfg.distill is not None:
            advantages = distill.distill_advantage(teacher, start, mb.advantages, cfg.distill.coef,
                                                   cfg.distill.task_coef)
        loss, metrics = losses.loss_and_metrics(lc.name, lc, logp, mb.behav_logp, prox, advantages,
                                                mb.loss_mask, weights, ref, mb.rewards, seq_ids)
        mask = mb.loss_mask > 0
        if cfg.distill is not None:
            metrics.update(distill.distill_metrics(teacher, start, advantages, mask))
        metrics["entropy"] = jnp.sum(jnp.where(mask, entropy, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
        if stats is not None:
            mcfg = merged(params).config
            aux, z, router = router_metrics(stats, mb.routes, mcfg.num_experts, mcfg.num_experts_per_tok)
            # Each micro-batch's share of the minibatch's token weights, so the accumulated gradient is
            # the minibatch's mean over micro-batches.
            share = jnp.sum(weights)
            loss = loss + share * (cfg.router_aux_coef * aux + cfg.router_z_coef * z)
            metrics.update(router)
        if cfg.prox != "loglinear" and prox is not None:
            # The train-rollout mismatch at equal weights: tokens sampled at this step's version, whose
            # log-prob the trainer recomputed at the same weights (0 in exact mode).
            on_policy = mask & (mb.versions == version)
            gap = jnp.abs(prox - mb.behav_logp)
            metrics["onpolicy_logp_gap_max"] = jnp.max(jnp.where(on_policy, gap, 0.0))
        return loss, metrics

    def split(x):  # [M, ...] -> [K, M/K, ...]
        return None if x is None else x.reshape(k, m // k, *x.shape[1:])

    def update(carry, minibatch):
        params, opt_state, skipped = carry
        mbs, prox, ref, teacher, start = minibatch
        flat_mask = mbs.loss_mask.reshape(-1, t)
        # Sequences are (row, segment) pairs, so aggregation is right for packed rows too.
        seq_ids = mbs.segment_ids.reshape(-1, t) + t * jnp.arange(flat_mask.shape[0])[:, None]
        weights = losses.token_weights(flat_mask, lc.aggregation, lc.constant_normalizer,
                                       sequence_ids_bt=seq_ids).reshape(mbs.loss_mask.shape)
        seq_ids = seq_ids.reshape(mbs.loss_mask.shape)  # each micro-batch's slice, still unique across its rows

        def micro(grad_sum, xs):
            mb, w, s, p, r, te, st = xs

            def compute():
                (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb, w, s, p, r, te, st)
                return jax.tree.map(jnp.add, grad_sum, grads), metrics

            # A micro-batch that only pads the batch to its compiled shape costs a branch, not a pass.
            # Its metrics are zeros with num_tokens 0, which `_combine` weights out.
            empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(compute)[1])
            return jax.lax.cond(_has_tokens(mb), compute, lambda: (grad_sum, empty))

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, per_micro = jax.lax.scan(micro, zeros, (mbs, weights, seq_ids, prox, ref, teacher, start))
        metrics = _combine(per_micro)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda a, c: jnp.where(finite, a, c), new, old)  # noqa: E731
        params, opt_state = keep(new_params, params), keep(new_opt, opt_state)
        metrics.update(grad_norm=grad_norm, update_norm=optax.tree.norm(updates) * finite,
                       finite=finite.astype(jnp.float32))
        return (params, opt_state, skipped + (~finite).astype(jnp.int32)), metrics

    (params, opt_state, skipped), per_update = jax.lax.scan(
        update, (state.params, state.opt_state, state.skipped),
        (jax.tree.map(split, batch), split(prox_all), split(ref_all), split(teacher_all), split(start_all)))

    metrics = {key: (jnp.max(v) if key.endswith("_max") else jnp.mean(v)) for key, v in per_update.items()}
    metrics["num_tokens"] = jnp.sum(per_update["num_tokens"])
    metrics["updates_skipped"] = jnp.sum(1.0 - per_update["finite"])
    mask = batch.loss_mask > 0
    staleness = jnp.where(mask, version - batch.versions, 0)
    metrics["staleness_mean"] = jnp.sum(staleness) / jnp.maximum(jnp.sum(mask), 1)
    metrics["staleness_max"] = jnp.max(staleness)
    metrics["param_norm"] = optax.tree.norm(params)
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + k,
                              version=version + 1, skipped=skipped)
    return new_state, metrics


class TrainStep:
    """The jitted update with explicit shardings; call it as `state, metrics = step(state, batch)`.

    The state is donated: the caller must use the returned state and drop the one passed in.
    Batches are validated on the host (shapes, empty mask, future versions) before they are sent. On a
    mesh over several processes every process passes the same whole host batch and sends only its own rows.

    Each batch shape is compiled once; `compile(state, shape)` does it ahead of the first call (the RL
    trainer compiles its one padded shape at start-up), and a shape first seen in a call is compiled
    then, with a warning. `compiles` and `compile_s` count them all.

    teacher: with `cfg.distill` where "step", the frozen teacher model (on `mesh`, any shape whose vocab is the
    policy's); it goes into every call as an argument of its own, on its own shardings, never donated. It
    must not share arrays with the state, which is donated (a copy of the policy: `jnp.copy` its state).
    Where "rollout" there is none: every batch must carry `teacher_logp`.
    """

    def __init__(self, graphdef, tx: optax.GradientTransformation, cfg: StepConfig, mesh,
                 state_shardings: TrainState, frozen: nnx.State | None = None, teacher: nnx.Module | None = None):
        in_step = cfg.distill is not None and cfg.distill.in_step
        if in_step != (teacher is not None):
            raise ValueError("a teacher model goes with StepConfig.distill where 'step', and that with a teacher "
                             f"model (distill: {cfg.distill!r}, teacher given: {teacher is not None})")
        self.recorded_teacher = cfg.distill is not None and cfg.distill.recorded
        self.cfg, self.mesh = cfg, mesh
        batch_axes = tuple(a for a in sharding.BATCH_AXES if mesh.shape.get(a, 1) > 1) or None
        self.rows_per_shard = sharding.rows_per_shard(mesh)
        self.batch_sharding = NamedSharding(mesh, PartitionSpec(None, batch_axes, None))
        batch_shardings = TrajectoryBatch(**{f.name: self.batch_sharding for f in dataclasses.fields(TrajectoryBatch)
                                             if f.name not in ("routes", "teacher_logp")})
        if cfg.routing_replay == "rollout":
            batch_shardings = batch_shardings.replace(routes=self.batch_sharding)
        if self.recorded_teacher:
            batch_shardings = batch_shardings.replace(teacher_logp=self.batch_sharding)

        # With LoRA the frozen base goes in as an argument of its own (never a constant of the program,
        # never donated), on the shardings it already has.
        self.frozen = frozen
        frozen_shardings = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
        teacher_graphdef, self.teacher = (None, None) if teacher is None else nnx.split(teacher)
        teacher_shardings = None if teacher is None else jax.tree.map(lambda x: x.sharding, self.teacher)

        def fn(state, batch, ref_params, frozen, teacher):
            return _train_step(graphdef, tx, cfg, state, batch, ref_params, frozen, mesh, teacher_graphdef, teacher)

        self._jitted = jax.jit(fn, in_shardings=(state_shardings, batch_shardings, state_shardings.params,
                                                 frozen_shardings, teacher_shardings),
                               out_shardings=(state_shardings, None), donate_argnums=0)
        self._jitted_no_ref = jax.jit(lambda s, bt, fr, te: fn(s, bt, None, fr, te),
                                      in_shardings=(state_shardings, batch_shardings, frozen_shardings,
                                                    teacher_shardings),
                                      out_shardings=(state_shardings, None), donate_argnums=0)
        self._compiled: dict[tuple, Any] = {}
        self.compiles, self.compile_s = 0, 0.0

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        m, b, _ = shape
        if m % self.cfg.minibatches:
            raise ValueError(f"{m} micro-batches cannot form {self.cfg.minibatches} minibatches")
        if b % self.rows_per_shard:
            raise ValueError(f"{b} rows per micro-batch do not split over {self.rows_per_shard} "
                             f"data x fsdp shards")

    def compile(self, state: TrainState, shape: tuple[int, int, int], with_ref: bool = False) -> float:
        """Compiles the step for batches of `shape` [micro_batches, rows, seq_len] (and a reference
        policy when `with_ref`); returns the seconds it took (0 if already compiled)."""
        self._check_shape(shape)
        key = (tuple(shape), with_ref)
        if key in self._compiled:
            return 0.0
        start = time.perf_counter()
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
        abstract_state = jax.tree.map(spec, state)
        abstract_batch = TrajectoryBatch(**{
            name: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=self.batch_sharding)
            for name, dtype in FIELD_DTYPES.items()})
        if self.cfg.routing_replay == "rollout":
            route = self.cfg.route_spec  # not `spec`, which the frozen base and the teacher are mapped with below
            abstract_batch = abstract_batch.replace(routes=jax.ShapeDtypeStruct(
                (*shape, route.layers, route.top_k), route.dtype, sharding=self.batch_sharding))
        if self.recorded_teacher:
            abstract_batch = abstract_batch.replace(teacher_logp=jax.ShapeDtypeStruct(
                tuple(shape), np.dtype(np.float32), sharding=self.batch_sharding))
        abstract_frozen = None if self.frozen is None else jax.tree.map(spec, self.frozen)
        abstract_teacher = None if self.teacher is None else jax.tree.map(spec, self.teacher)
        # Traced with the mesh set, so that the model keeps activations split by rows (`rows_sharded`).
        with jax.set_mesh(self.mesh):
            if with_ref:
                lowered = self._jitted.lower(abstract_state, abstract_batch, abstract_state.params,
                                             abstract_frozen, abstract_teacher)
            else:
                lowered = self._jitted_no_ref.lower(abstract_state, abstract_batch, abstract_frozen, abstract_teacher)
        self._compiled[key] = lowered.compile()
        elapsed = time.perf_counter() - start
        self.compiles += 1
        self.compile_s += elapsed
        return elapsed

    def compiled(self, shape: tuple[int, int, int], with_ref: bool = False):
        """The compiled program for batches of `shape` (see `compile`, which must have run): its
        `memory_analysis()`, `cost_analysis()` and HLO size a run before it has devices
        (benchmarks/pod_plan.py)."""
        key = (tuple(shape), with_ref)
        if key not in self._compiled:
            raise KeyError(f"the step is not compiled for batch shape {tuple(shape)} (with_ref={with_ref}); "
                           f"call compile() first")
        return self._compiled[key]

    def __call__(self, state: TrainState, batch: TrajectoryBatch, ref_params=None):
        validate_batch(batch, int(state.version))
        if self.cfg.routing_replay == "rollout":
            spec = self.cfg.route_spec
            want = (*np.shape(batch.tokens), spec.layers, spec.top_k)
            if batch.routes is None or np.shape(batch.routes) != want or batch.routes.dtype != spec.dtype:
                got = None if batch.routes is None else f"{batch.routes.dtype} {np.shape(batch.routes)}"
                raise ValueError(f"routing replay needs batch.routes {spec.dtype} {want}, got {got}")
        else:
            batch = batch.replace(routes=None)
        if self.recorded_teacher:
            if batch.teacher_logp is None:
                raise ValueError("trainer.distill.where 'rollout' needs batch.teacher_logp (the teacher's recorded "
                                 "log-probs: make_batch(teacher=True)), got None")
        else:
            batch = batch.replace(teacher_logp=None)
        shape = tuple(np.shape(batch.tokens))
        self._check_shape(shape)
        if self.cfg.loss.kl_coef > 0 and ref_params is None:
            raise ValueError("loss.kl_coef > 0 needs ref_params (the reference policy's parameters)")
        key = (shape, ref_params is not None)
        if key not in self._compiled:
            if self._compiled:
                logger.warning("train step: compiling for a new batch shape %s (compiled so far: %s)",
                               shape, sorted(k[0] for k in self._compiled))
            self.compile(state, shape, with_ref=ref_params is not None)
        # On a mesh over several processes each process feeds only its own rows of the batch.
        batch = jax.tree.map(lambda x: sharding.put_global(x, self.batch_sharding), batch)
        if ref_params is None:
            return self._compiled[key](state, batch, self.frozen, self.teacher)
        return self._compiled[key](state, batch, ref_params, self.frozen, self.teacher)
