"""The trainer side of an RL run: a consumed buffer of groups in, one PPO update out, new weights published.

`RLTrainer.train(consumed)` turns the groups of buffer v (each sample with its tokens, behaviour log-probs
and per-token versions) into a packed `TrajectoryBatch`, runs the jitted staleness-aware step from
version v to v+1 (`trainer.minibatches` optimizer updates, each on an equal share of the rows), and
`publish()` then makes v+1 available to the rollout fleet in the order the trajectory service's
contract asks for: `mark_published(v+1)` first, then the weights: to the optional `DeviceParamSource`
(arrays on device, for JAX engines in this process: no host round trip) and to a parameter service
when one is given (HF-named host tensors, for vLLM and other processes; skipped when there is none, so
an all-in-process run never converts weights to the host).

Metrics per step: the step's own (loss, grad norm, importance-weight stats...), the batch's rewards and
response lengths, and the staleness histogram {v - token version: tokens} of the trained tokens. With
`trainer.skip_zero_signal`, groups whose samples all scored the same (advantage 0 on every token) are
consumed and accounted but left out of the update.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxflow.trainer import losses
from jaxflow.trainer.batch import Trajectory, make_batch
from jaxflow.models import hf_io
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.data.records import FinishedGroup
from jaxflow.trainer.state import TrainState, create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, make_optimizer
from jaxflow.data.records import ConsumedBatch


def optimizer_config(trainer: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The optimizer fields `make_optimizer` reads, from the run config's trainer section."""
    return ml_collections.ConfigDict(dict(
        lr=trainer.lr, warmup_steps=trainer.warmup_steps, schedule="constant", total_steps=trainer.steps,
        b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, max_grad_norm=trainer.max_grad_norm))


def trajectories_of(groups: list[FinishedGroup]) -> list[Trajectory]:
    """One Trajectory per sample of every group, rewards attached (advantages are computed per group)."""
    out = []
    for g in groups:
        for sample, reward in zip(g.samples, g.rewards):
            out.append(Trajectory(g.prompt, sample.tokens, sample.logprobs, sample.versions,
                                  reward=float(reward), group_id=g.group_id))
    return out


def _row_step(multiple: int) -> int:
    """The granularity of row counts: a multiple of 8 and of `multiple` (batch shards x minibatches)."""
    return max(8, multiple) if max(8, multiple) % multiple == 0 else 8 * multiple


def _rows_for(trajectories: list[Trajectory], seq_len: int, multiple: int) -> int:
    """Packed rows for these sequences, with ~10% room for first-fit packing, rounded up to `_row_step`:
    few compiled shapes, little padding."""
    need = -(-sum(len(t.prompt) + len(t.completion) for t in trajectories) * 11 // (10 * seq_len))
    step = _row_step(multiple)
    return -(-need // step) * step


class RLTrainer:
    """Owns the policy's TrainState and the jitted step.

    model: the policy (a Transformer on `mesh`). trainer: the run config's trainer section (loss,
    advantage, lr, pack...). seq_len: tokens per row (the rollout context). device_weights: a source
    that `publish` puts each version's params in, on device (for JAX engines in this process).
    """

    def __init__(self, model, trainer: ml_collections.ConfigDict, mesh, *, seq_len: int,
                 device_weights: DeviceParamSource | None = None):
        self.mesh, self.seq_len, self.cfg = mesh, seq_len, trainer
        self.device_weights = device_weights
        self.graphdef = nnx.graphdef(model)
        self._rest = nnx.state(model, nnx.Not(nnx.Param))
        self.tx = make_optimizer(optimizer_config(trainer))
        self.state: TrainState = create_train_state(model, self.tx, mesh)
        self.shardings = train_state_shardings(self.state.params, self.tx, mesh)
        self.minibatches = trainer.minibatches
        step_cfg = StepConfig(loss=losses.LossConfig(name=trainer.loss,
                                                    behav_weight_cap=trainer.behav_weight_cap),
                              minibatches=self.minibatches)
        self._step = TrainStep(self.graphdef, self.tx, step_cfg, mesh, self.shardings)
        # Rows split evenly over the minibatches, and each minibatch's rows over the batch shards.
        self._row_multiple = mesh.shape["data"] * mesh.shape["fsdp"] * self.minibatches

    @property
    def version(self) -> int:
        return int(self.state.version)

    def model(self):
        """The current policy as a Transformer (shares the state's arrays)."""
        return nnx.merge(self.graphdef, self.state.params, self._rest)

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """The policy's weights as HF-named host arrays: what the parameter service publishes."""
        return dict(hf_io.iter_hf_tensors(self.model()))

    def train(self, consumed: ConsumedBatch) -> tuple[dict[str, float], dict[int, int]]:
        """One update on buffer `consumed.step` (== this trainer's version). Returns (metrics, staleness
        histogram {versions behind: trained tokens}). An empty buffer (the data ran out) raises."""
        v = self.version
        if consumed.step != v:
            raise ValueError(f"buffer {consumed.step} handed to the trainer at version {v}")
        if not consumed.groups:
            raise ValueError(f"buffer {v} holds no groups: the prompt source is exhausted")
        signal = [max(g.rewards) != min(g.rewards) for g in consumed.groups]
        groups = consumed.groups
        if self.cfg.skip_zero_signal:
            # A group whose samples all scored the same has advantage 0 on every token: it only costs compute
            # (and dilutes a token-mean loss). A buffer with no signal at all is trained as is.
            groups = [g for g, s in zip(consumed.groups, signal) if s] or consumed.groups
        trajs = trajectories_of(groups)
        start = time.perf_counter()
        rows = (_rows_for(trajs, self.seq_len, self._row_multiple) if self.cfg.pack
                else -(-len(trajs) // self._row_multiple) * self._row_multiple)
        while True:
            try:
                batch, adv_stats = make_batch(trajs, num_rows=rows, seq_len=self.seq_len, pack=self.cfg.pack,
                                              micro_batches=self.minibatches,
                                              advantage_estimator=self.cfg.advantage)
                break
            except ValueError as e:  # first-fit packing needed more rows than estimated
                if not self.cfg.pack or "do not fit" not in str(e):
                    raise
                rows += _row_step(self._row_multiple)
        self.state, step_metrics = self._step(self.state, batch)
        step_metrics = {k: float(x) for k, x in jax.device_get(step_metrics).items()}
        step_s = time.perf_counter() - start
        staleness = collections.Counter()
        for t in trajs:
            staleness.update(v - ver for ver in t.versions)
        # Rewards and lengths describe everything the rollout produced; trained_tokens what the update used.
        rewards = np.asarray([r for g in consumed.groups for r in g.rewards], np.float64)
        lengths = np.asarray([len(s.tokens) for g in consumed.groups for s in g.samples])
        metrics: dict[str, Any] = {
            **step_metrics,
            "reward_mean": float(rewards.mean()),
            "solved_frac": float((rewards >= 1.0).mean()),
            "zero_signal_groups_frac": 1.0 - float(np.mean(signal)),
            "response_tokens_mean": float(lengths.mean()),
            "response_tokens_max": float(lengths.max()),
            "trained_tokens": float(sum(len(t.completion) for t in trajs)),
            "consumed_tokens": float(lengths.sum()),
            "groups": float(len(consumed.groups)),
            "groups_trained": float(len(groups)),
            "step_s": step_s,
            **{f"adv_{k}": float(x) for k, x in adv_stats.items()},
        }
        return metrics, dict(sorted(staleness.items()))

    def publish(self, trajectories, params=None) -> int:
        """Makes the current version available: the service first (its contract), then the weights."""
        v = self.version
        trajectories.mark_published(v)
        self.publish_weights(params)
        return v

    def publish_weights(self, params=None) -> int:
        """Publishes the current version's weights: on device to `device_weights` (copied there, so the
        next step's donation of the state leaves them intact), and as HF host tensors to `params` (a
        ParameterService or client) unless None. Returns the version."""
        v = self.version
        if self.device_weights is not None:
            self.device_weights.publish(v, self.state.params)
        if params is not None:
            params.publish(v, self.hf_tensors())
        return v
