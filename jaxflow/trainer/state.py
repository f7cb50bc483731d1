"""The trainer's state: parameters, optimizer state and counters, as one sharded pytree.

The policy version lives here (not in Python) so that it is checkpointed with the weights it names and
can never drift from them across a restart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow import sharding


@struct.dataclass
class TrainState:
    """params: nnx.State of the policy's trainable parameters (all of them; with LoRA its adapters only),
    arrays sharded by their logical axes. opt_state: optax state,
    sharded like params. step: optimizer updates applied. version: policy version of `params` (the
    trainer publishes version+1 after each step). skipped: updates skipped for a non-finite loss/grad.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    version: jax.Array
    skipped: jax.Array


def trainable(model: nnx.Module):
    """The nnx filter of the parameters the optimizer trains: the LoRA adapters of a model that has them
    (its base stays frozen), else every parameter."""
    layers = getattr(model, "layers", None)
    return nnx.LoRAParam if getattr(layers, "lora", None) is not None else nnx.Param


def frozen_state(model: nnx.Module) -> nnx.State | None:
    """What the train step holds fixed: the base parameters of a model with LoRA adapters, else None."""
    if trainable(model) is nnx.Param:
        return None
    return nnx.state(model, nnx.Not(nnx.LoRAParam))


def train_state_shardings(params: nnx.State, tx: optax.GradientTransformation, mesh,
                          rules=None) -> TrainState:
    """A TrainState of NamedShardings: params by their logical axes, optimizer leaves that mirror a
    parameter like that parameter, everything else (counts, scalars) replicated. `params` may be
    abstract (ShapeDtypeStructs).
    """
    param_shardings = sharding.state_shardings(params, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, opt_shapes, param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable))
    return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated,
                      version=replicated, skipped=replicated)


def create_train_state(model: nnx.Module, tx: optax.GradientTransformation, mesh, *, rules=None,
                       version: int = 0) -> TrainState:
    """A fresh state for `model` (already loaded onto `mesh`) starting at policy `version`: its trainable
    parameters (`trainable`) and their optimizer state."""
    params = nnx.state(model, trainable(model))
    shardings = train_state_shardings(params, tx, mesh, rules)
    opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
    scalar = lambda v: jax.device_put(jnp.asarray(v, jnp.int32), shardings.step)  # noqa: E731
    return TrainState(params=params, opt_state=opt_state, step=scalar(0), version=scalar(version),
                      skipped=scalar(0))


def abstract_train_state(model: nnx.Module, tx: optax.GradientTransformation, mesh,
                         rules=None) -> TrainState:
    """ShapeDtypeStructs carrying shardings on `mesh`: the restore target that lets a checkpoint
    written on one mesh be read onto another. `model` may be abstract (`hf_io.abstract_model`).
    """
    params = nnx.state(model, trainable(model))
    shardings = train_state_shardings(params, tx, mesh, rules)
    shapes = TrainState(params=params, opt_state=jax.eval_shape(tx.init, params),
                        step=jax.ShapeDtypeStruct((), jnp.int32),
                        version=jax.ShapeDtypeStruct((), jnp.int32),
                        skipped=jax.ShapeDtypeStruct((), jnp.int32))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                        shardings)
