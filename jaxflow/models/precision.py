"""Mixed precision: the dtypes a model computes in and keeps its weights in, and the one cast between them.

A run keeps master weights in `param_dtype` (float32 by default) and computes the forward and backward pass
in `compute_dtype` (float32 or bfloat16): every floating parameter is cast to the compute dtype inside the
differentiated function, so gradients come back in the master dtype. Whatever the compute dtype, the
LM-head logits, log-probabilities, logsumexp, losses and their reductions are float32 (the model's
`logits` accumulates in float32; `jaxflow.trainer.step.token_logprobs` upcasts before its logsumexp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# What a model may compute in (`model.compute_dtype`); float16 is left out: without loss scaling its
# gradients underflow.
COMPUTE_DTYPES = ("float32", "bfloat16")
# What master weights may be kept in (`trainer.param_dtype`). AdamW's moments are float32 either way.
PARAM_DTYPES = ("float32", "bfloat16")
# What an HF export may be written in (`checkpoint.export_dtype`).
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class DtypeError(ValueError):
    """A dtype name that the model, trainer or engine cannot take; the message names the key and the choices."""


def dtype_of(name: str, choices: tuple[str, ...] = COMPUTE_DTYPES, key: str = "model.compute_dtype") -> jnp.dtype:
    """The jnp dtype called `name`, one of `choices`; DtypeError naming `key` otherwise."""
    if not isinstance(name, str) or name not in choices:
        raise DtypeError(f"{key} {name!r} is not one of {choices}")
    return jnp.dtype(name)


def cast_floating(tree, dtype):
    """`tree` (arrays, an nnx.State) with every floating leaf cast to `dtype` (None: unchanged); leaves
    already in `dtype`, integer leaves and leaves without a dtype are returned as they are."""
    if dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def cast(x):
        have = getattr(x, "dtype", None)
        if have is not None and jnp.issubdtype(have, jnp.floating) and have != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


# Whether `float32_dot_operands` upcasts on the CPU backend. benchmarks/pod_plan.py turns it off: it compiles
# for CPU devices that stand in for accelerators and never runs the programs, so it plans their dots.
UPCAST_ON_CPU = True


def float32_dot_operands(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """The operands of a dot that accumulates in float32 (`preferred_element_type=float32`), as the backend
    takes them: unchanged on accelerators, whose matrix units multiply bfloat16 into float32; upcast to
    float32 on the CPU backend, where XLA leaves some such dots unfused and its runtime then has no
    bfloat16 x bfloat16 -> float32 kernel ("Unsupported element type for DotThunk::Execute"), e.g. the
    JAX engine's attention over the cache when an episode's next turn extends it. A bfloat16 value is
    exact in float32, so the product is the same."""
    if not UPCAST_ON_CPU or jax.default_backend() != "cpu":
        return operands
    return tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in operands)
