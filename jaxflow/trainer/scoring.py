"""Exact log-probabilities: one per-sequence program that the JAX engine and the trainer both run.

The log-probability an engine reports for a sampled token (μ) and the one the trainer recomputes at the same
weights (π_prox) differ unless the two computations are the same arithmetic in the same order. The engine's
decode step and the trainer's forward pass are not: one token against a KV cache versus whole rows, different
fusions, different reduction orders, and on XLA's CPU backend a row's result even depends on how many rows
share its program (a float32 block output moved by ~1e-5 between 8 and 16 rows of the tiny model).

`sequence_logprobs` removes those differences by construction. It runs the trainer's `token_logprobs` on one
sequence at a time (a `lax.map` over rows), each sequence alone in a row of fixed length T starting at
position 0. A row's program then sees the same shapes and the same inputs wherever it runs, so:

- the number of rows does not change a row's result (each is the loop body, compiled once for [1, T]);
- a prefix's log-probs do not depend on what follows it (causal attention; positions past a sequence's
  length are masked and contribute exact zeros), so tokens scored when a turn, an abort or a weight swap
  ended them equal those of the whole sequence scored later;
- the same body inside the train step (`trainer.step` with prox "exact") gives the same bits as the
  engine's standalone call on the same weights and compute dtype.

The JAX engine's exact mode (`rollout.exact_logprobs`) rescores each sample's tokens with it under the weights
that sampled them; the trainer computes π_prox with it; so on-policy tokens get π_prox / μ = 1 exactly. The
price: one more forward pass of every sample in the engine (a prefill's work, without its cache) and one in
the update (π_prox can no longer come free from the gradient's forward pass), rows of one sequence each
(`trainer.pack = False`), and no batching across rows inside the program.

Exactness holds for one compiled program on one kind of device: an engine and a trainer on different
hardware, or on meshes that split the model differently (tensor parallelism reorders the sums), agree to
rounding only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class _Row:
    """The fields of one row that `token_logprobs` reads (a TrajectoryBatch of one row, [1, T])."""

    def __init__(self, tokens_t: jax.Array, length: jax.Array):
        t = tokens_t.shape[0]
        self.tokens = tokens_t[None]
        self.positions = jnp.arange(t, dtype=jnp.int32)[None]
        self.segment_ids = (jnp.arange(t) < length).astype(jnp.int32)[None]
        self.context_ids = jnp.zeros_like(self.segment_ids)


def sequence_logprobs(model: nnx.Module, tokens_nt: jax.Array, lengths_n: jax.Array, chunk: int) -> jax.Array:
    """log π(token_t | tokens_<t) of N sequences, one a row, [N, T] float32 (0 at t = 0 and past a length).

    tokens_nt: int32, sequence n in tokens_nt[n, :lengths_n[n]] from position 0 (the rest is ignored).
    chunk: the trainer's `logprob_chunk`. Call it inside a jitted function; each row runs alone (see the
    module docstring), so the result of a row is the same whatever N is and whatever else is in the batch.
    """
    from jaxflow.trainer.step import token_logprobs  # the step builds on this module

    def one(xs):
        tokens_t, length = xs
        logp = token_logprobs(model, _Row(tokens_t, length), False, chunk)[0][0]
        return jnp.where(jnp.arange(tokens_t.shape[0]) < length, logp, 0.0)

    return jax.lax.map(one, (tokens_nt, lengths_n))


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk"))
def score(graphdef, params: nnx.State, tokens_nt: jax.Array, lengths_n: jax.Array, *, chunk: int) -> jax.Array:
    """`sequence_logprobs` of the model (graphdef, params) as served: params already in the compute dtype
    (the engine casts them once; the trainer's step casts its master weights the same way)."""
    return sequence_logprobs(nnx.merge(graphdef, params), tokens_nt, lengths_n, chunk)

