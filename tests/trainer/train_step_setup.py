"""The tiny model, optimizer and jitted update the train-step tests share (tests/trainer/test_train_step.py,
test_shared_prompts.py), and the comparisons they make between two runs of it."""

import jax
import ml_collections
import numpy as np
from flax import nnx
from tolerances import F32_EPS

from jaxflow import sharding
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.batch import Trajectory
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, make_optimizer

CFG = ModelConfig("Qwen3ForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)
SEQ_LEN = 32


def optimizer(lr=1e-3, eps=1e-3):
    # A large Adam eps keeps the first update continuous in the gradient: with eps=1e-8 it is
    # lr * sign(g), and summation-order noise on near-zero gradients would flip whole elements.
    return make_optimizer(ml_collections.ConfigDict(dict(
        lr=lr, warmup_steps=0, schedule="constant", total_steps=100, b1=0.9, b2=0.999, eps=eps,
        weight_decay=0.01, max_grad_norm=1.0)))


def setup(mesh, step_cfg=None, tx=None, seed=0):
    step_cfg = StepConfig() if step_cfg is None else step_cfg
    model = Transformer(CFG, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
    tx = tx or optimizer()
    state = create_train_state(model, tx, mesh)
    step = TrainStep(nnx.graphdef(model), tx, step_cfg, mesh, train_state_shardings(state.params, tx, mesh))
    return state, step, model


def trajectories(seed=0, n=16, version=0, max_lag=2):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(3, 20))
        out.append(Trajectory(
            prompt=rng.integers(0, 256, int(rng.integers(2, 8))).tolist(),
            completion=rng.integers(0, 256, k).tolist(),
            behav_logp=(-5.5 + 0.3 * rng.normal(size=k)).tolist(),
            versions=np.clip(version - rng.integers(0, max_lag + 1, k), 0, None).tolist(),
            reward=float(rng.integers(0, 2)), group_id=i // 4))
    return out


def one_device():
    return sharding.make_mesh(devices=jax.devices()[:1])


def host(tree):
    return jax.tree.map(np.asarray, tree)


def assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def assert_grad_norms_close(actual, desired, num_tokens):
    # Each gradient element sums one term per token; its norm inherits their relative rounding
    # (num_tokens * eps) as long as the elements are not all cancellations, which a random batch's are not.
    np.testing.assert_allclose(actual, desired, rtol=4 * num_tokens * F32_EPS)


# The TrainStep of every `run` on a mesh with a config, by (mesh, StepConfig): a batch shape it compiled serves
# the next run as it is, where a new TrainStep would trace the step again (the persistent cache spares the
# compile, not the trace). Its optimizer is `optimizer()`, as the new state's is.
_RUN_STEPS: dict = {}


def run(mesh, batch, step_cfg=None, steps=1):
    """`steps` updates of a fresh model (seed 0) on `batch`: (host params, [host metrics per step])."""
    state, step, _ = setup(mesh, step_cfg)
    step = _RUN_STEPS.setdefault((mesh, step.cfg), step)
    metrics = []
    for _ in range(steps):
        state, m = step(state, batch)
        metrics.append(host(m))
    return host(state.params), metrics
