"""The trainer side of an RL run: a consumed buffer of groups in, one PPO update out, new weights published.

`RLTrainer.train(consumed)` turns the groups of buffer v (each sample with its tokens, behaviour log-probs
and per-token versions) into a packed `TrajectoryBatch`, runs the jitted staleness-aware step from
version v to v+1 (`trainer.minibatches` optimizer updates, each on an equal share of the rows), and
`publish()` then makes v+1 available to the rollout fleet in the order the trajectory service's
contract asks for: `mark_published(v+1)` first, then the weights: to the optional `DeviceParamSource`
(arrays on device, for JAX engines in this process: no host round trip) and to a parameter service
when one is given (HF-named host tensors, for vLLM and other processes; skipped when there is none, so
an all-in-process run never converts weights to the host).

A sample split into training sequences (`Sample.sequence_starts`: an agent that rewrote its history) trains
as one trajectory per sequence (`trajectories_of`), each seeing only its own context; they all carry the
sample's reward and member index, so the group's advantages count the member once.

Metrics per step: the step's own (loss, grad norm, importance-weight stats...), the batch's rewards and
response lengths, and the staleness histogram {v - token version: tokens} of the trained tokens. With
`trainer.skip_zero_signal`, groups whose samples all scored the same (advantage 0 on every token) are
consumed and accounted but left out of the update.

A consumed group that could not be trained (token ids the model cannot embed, NaN or positive log-probs,
rewards whose float32 statistics are not finite, token versions out of range, a training sequence with its
context longer than a row: the trajectory service refuses these at `finish`, so only a service that does
not check gets here) is dropped from the update by `screen_groups` before the batch is built, logged with
its reason and counted in the step's `groups_rejected` metric; the job goes on, and the update trains the
other groups. Only a buffer with no usable group at all raises, naming every group and its fault.

Every option of the update is a key of the run config's trainer section: `step_config` and
`optimizer_config` read them all and `check_trainer_config` validates them, naming the bad key, before a
run starts. With `trainer.loss.kl_coef > 0` the trainer keeps a frozen copy of the parameters it was built
with as the KL reference policy (on resume: the base model, not the restored step). With
`trainer.distill.teacher` set it loads that HF directory as a frozen teacher on its mesh (in the dtype of
the policy's weights), whose per-token log-probs the step turns into the advantage
(jaxflow/trainer/distill.py), and trains every group, skip_zero_signal notwithstanding; the job checks the
teacher's vocabulary against the student's first (`distill.teacher_problems`). With `trainer.distill.where =
"rollout"` it loads no teacher: each sample carries its teacher log-probs (`Sample.teacher_logprobs`, scored
beside the rollout engines), the batch carries them to the step, and a group without them is dropped from the
update like any other that cannot be trained.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.config import ConfigError, Section, check_bool, check_choice, check_float, check_int
from jaxflow.data import checks
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.data.records import ConsumedBatch, FinishedGroup, RouteSpec, Sample
from jaxflow.data.trajectory_service import BATCH_RULES
from jaxflow.models import hf_io, lora, precision
from jaxflow.models.config import from_hf_config, read_hf_config
from jaxflow.trainer import distill, losses
from jaxflow.trainer.advantages import ADVANTAGE_ESTIMATORS
from jaxflow.trainer.batch import BatchOverflow, Trajectory, make_batch
from jaxflow.trainer.state import TrainState, create_train_state, frozen_state, train_state_shardings, trainable
from jaxflow.trainer.step import (
    EXACT_PROX,
    LOGPROB_CHUNK,
    PROX_MODES,
    ROUTING_REPLAY,
    StepConfig,
    TrainStep,
    make_optimizer,
    prox_problems,
)

SCHEDULES = ("constant", "cosine")


def _bad(key: str, value, valid: str) -> ValueError:
    return ValueError(f"trainer.{key}={value!r} is invalid; valid: {valid}")


logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoraOptions(Section):
    """The `trainer.lora` section (jaxflow/models/lora.py): rank 0 trains every weight; rank r >= 1 freezes the
    base and trains rank-r adapters on `targets`, their output scaled by alpha / r. The optimizer then holds the
    adapters alone, checkpoints store them (the base is the base model's directory), and a weight sync to a JAX
    engine moves only them (vLLM gets the merged weights). Raise lr with it ("LoRA without regret": rank-1
    adapters matched full fine-tuning for RL at about 10x its learning rate).

    rank: adapter rank; 0: no LoRA.
    alpha: the adapters' output is scaled by alpha / rank.
    targets: the projections that carry adapters (jaxflow.models.lora.LORA_TARGETS).
    """

    SECTION: ClassVar[str] = "trainer.lora"

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = lora.LORA_TARGETS

    def problems(self) -> list[str]:
        return lora.lora_problems(self.rank, self.alpha, self.targets, prefix=f"{self.SECTION}.")


@dataclasses.dataclass(frozen=True)
class MoeOptions(Section):
    """The `trainer.moe` section: options of a mixture-of-experts policy (jaxflow/models/moe.py); a dense model
    ignores them, but refuses routing replay.

    routing_replay: "off" (the update routes every token itself) or "rollout" (routing replay, R3: the
      update's forwards send each generated token through the experts the rollout engine chose for it, so a
      route that flipped between the engine's and the trainer's numerics cannot turn the behaviour
      log-probs stale; the router still learns through the chosen experts' gate values).
    aux_loss_coef: weight of the router's load-balancing loss (Switch Transformer's E * sum f_e P_e); 0 by
      default, as RL recipes run it.
    z_loss_coef: weight of the router z-loss (mean squared logsumexp of the router logits); 0 by default.
    """

    SECTION: ClassVar[str] = "trainer.moe"

    routing_replay: str = "off"
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_choice(problems, self.key("routing_replay"), self.routing_replay, ROUTING_REPLAY)
        for name in ("aux_loss_coef", "z_loss_coef"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        return problems


def moe_problems(trainer: ml_collections.ConfigDict, num_experts: int) -> list[str]:
    """Why the `trainer.moe` section cannot apply to a policy with `num_experts` experts (0: dense)."""
    moe = trainer.get("moe")
    if moe is None or num_experts or moe.get("routing_replay", "off") == "off":
        return []
    return ["trainer.moe.routing_replay = 'rollout' needs a mixture-of-experts policy; this model is dense "
            "(no experts to replay)"]


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    """The `trainer` section: the schedule, the batch and every option of the update.

    steps: train steps (policy versions) of the run.
    time_limit_s: stop after this many seconds of the train loop (from its first wait for rollouts), as after the
      last step: held-out eval, checkpoint, export. 0: no limit, train all `steps`.
    batch_groups: groups per train step (B).
    eta: the staleness bound: a group admitted at version v is trained at a version <= v + eta; 0 is synchronous RL.
    batch_rule: "full" waits for B groups; "ready_with_capacity" may release a fuller-than-needed buffer early
      (jaxflow.data.trajectory_service).
    minibatches: optimizer updates per train step, each on 1/minibatches of the batch (PPO minibatches; pi_prox
      is the step's starting policy). About the same compute.
    micro_batch_rows: rows per micro-batch: each minibatch's gradient is accumulated over micro-batches of this
      many rows (less activation memory, same update); a multiple of the trainer mesh's data x fsdp shards.
      The step is compiled once, for room for every sequence of a batch; micro-batches a batch leaves empty are
      skipped, so smaller ones waste less compute on padding. 0: the whole minibatch in one, padding included.
    prox: pi_prox, decoupled PPO's proximal policy: "recompute" (the step's starting weights; an extra forward
      pass when minibatches > 1) or "loglinear" (AReaL's interpolation between mu and pi_theta, no pass).
    remat: recompute each block's activations in the backward pass (less memory, ~1/3 more compute).
    logprob_chunk: sequence positions per chunk of the LM head when the update computes token log-probs and
      entropy: each chunk's [rows, chunk, vocab] logits are made, used and recomputed in the backward pass, so
      no [rows, T, vocab] array exists. A sequence no longer than the chunk is one chunk. 0: the whole
      sequence at once.
    param_dtype: the dtype the trainer keeps its (master) weights in: "float32" or "bfloat16"; the model
      computes in model.compute_dtype, and AdamW's moments are float32 either way.
    skip_zero_signal: leave groups whose samples all scored the same out of the update: their advantage is 0 on
      every token, so they cost trainer time and only dilute the token-mean loss (still consumed and accounted).
      Not applied with a distillation teacher (`distill`), whose advantage is not 0 on such groups.
    advantage: the advantage estimator: grpo, dr_grpo or rloo.
    adv_scale_by_std: GRPO divides by the group's reward std.
    adv_std_ddof: that std's ddof: 0 (population) or 1 (unbiased).
    lr: AdamW's peak learning rate, behind global-norm clipping.
    warmup_steps: linear warmup to lr over this many steps.
    schedule: after the warmup, "constant" or "cosine" decay to 0 at `steps`.
    b1, b2, adam_eps: AdamW's moment decays and epsilon.
    weight_decay: AdamW's decoupled weight decay (norm scales and biases are not decayed).
    max_grad_norm: the global gradient norm is clipped to this.
    lora: LoRA adapters instead of full fine-tuning (`LoraOptions`).
    pack: pack several sequences per row (segment ids keep them apart) instead of one padded row each.
    share_prompts: with pack, the samples of a GRPO group share one copy of their prompt in a row
      (jaxflow.trainer.batch): the prompt's tokens run once per copy, not once per sample, for the same
      log-probabilities and gradients. False lays every sample out with its own prompt.
    loss: the policy loss (`jaxflow.trainer.losses.LossConfig`).
    moe: options of a mixture-of-experts policy (`MoeOptions`).
    distill: on-policy distillation from a frozen teacher (`jaxflow.trainer.distill.DistillOptions`).
    """

    SECTION: ClassVar[str] = "trainer"

    steps: int = 1000
    time_limit_s: float = 0.0
    batch_groups: int = 32
    eta: int = 4
    batch_rule: str = "full"
    minibatches: int = 1
    micro_batch_rows: int = 0
    prox: str = "recompute"
    remat: bool = False
    logprob_chunk: int = LOGPROB_CHUNK
    param_dtype: str = "float32"
    skip_zero_signal: bool = True
    advantage: str = "grpo"
    adv_scale_by_std: bool = True
    adv_std_ddof: int = 0
    lr: float = 1e-4
    warmup_steps: int = 5
    schedule: str = "constant"
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lora: LoraOptions = dataclasses.field(default_factory=LoraOptions)
    pack: bool = True
    share_prompts: bool = True
    loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)
    moe: MoeOptions = dataclasses.field(default_factory=MoeOptions)
    distill: distill.DistillOptions = dataclasses.field(default_factory=distill.DistillOptions)

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name, low in (("steps", 1), ("batch_groups", 1), ("eta", 0), ("minibatches", 1),
                          ("micro_batch_rows", 0), ("warmup_steps", 0), ("logprob_chunk", 0)):
            check_int(problems, self.key(name), getattr(self, name), low)
        for name, valid in (("batch_rule", BATCH_RULES), ("prox", PROX_MODES), ("advantage", ADVANTAGE_ESTIMATORS),
                            ("adv_std_ddof", (0, 1)), ("schedule", SCHEDULES),
                            ("param_dtype", precision.PARAM_DTYPES)):
            check_choice(problems, self.key(name), getattr(self, name), valid)
        for name in ("remat", "skip_zero_signal", "adv_scale_by_std", "pack", "share_prompts"):
            check_bool(problems, self.key(name), getattr(self, name))
        check_float(problems, self.key("time_limit_s"), self.time_limit_s, 0.0)
        for name in ("lr", "adam_eps", "max_grad_norm"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, open_low=True)
        for name in ("b1", "b2"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, 1.0, open_high=True)
        check_float(problems, self.key("weight_decay"), self.weight_decay, 0.0)
        if self.share_prompts is True and self.pack is False:
            problems.append("trainer.share_prompts must be False when trainer.pack is False (prompts are shared "
                            "within packed rows)")
        problems += prox_problems(self.prox, self.loss)
        return problems


def optimizer_config(trainer: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The optimizer fields `make_optimizer` reads, from the run config's trainer section (checked by
    `check_trainer_config`)."""
    return ml_collections.ConfigDict({
        "lr": trainer.lr, "warmup_steps": trainer.warmup_steps, "schedule": trainer.schedule,
        "total_steps": trainer.steps, "b1": trainer.b1, "b2": trainer.b2, "eps": trainer.adam_eps,
        "weight_decay": trainer.weight_decay, "max_grad_norm": trainer.max_grad_norm})


def loss_config(section: ml_collections.ConfigDict) -> losses.LossConfig:
    """The `trainer.loss` section as a LossConfig; fields it leaves out take LossConfig's defaults, an unknown
    key or a bad value raises ConfigError (a ValueError) naming `trainer.loss.<key>`."""
    if not isinstance(section, ml_collections.ConfigDict):
        raise ConfigError(f"trainer.loss must be a section of loss options (trainer.loss.name = ..., "
                          f"trainer.loss.eps_high = ...), got {section!r}")
    return losses.LossConfig.from_config(section)


def step_config(trainer: ml_collections.ConfigDict, compute_dtype: str = "float32",
                exact_logprobs: bool = False, model_config=None) -> StepConfig:
    """What the jitted update computes, from the run config's trainer section: the loss (`trainer.loss.*`),
    `minibatches`, `prox`, `remat` and `logprob_chunk`; and the model's compute dtype (`model.compute_dtype`).
    exact_logprobs (`rollout.exact_logprobs`): π_prox from the engine's exact program (prox "exact"), which
    takes unpacked rows and a recomputed π_prox. model_config: the policy's `ModelConfig`, for the
    `trainer.moe` options of a mixture-of-experts policy. A bad value raises ValueError naming its key."""
    loss = loss_config(trainer.loss)
    chunk = trainer.get("logprob_chunk", LOGPROB_CHUNK)
    problems: list[str] = []
    check_int(problems, "trainer.minibatches", trainer.minibatches, 1)
    check_choice(problems, "trainer.prox", trainer.prox, PROX_MODES)
    check_bool(problems, "trainer.remat", trainer.remat)
    check_int(problems, "trainer.logprob_chunk", chunk, 0)
    check_choice(problems, "model.compute_dtype", compute_dtype, precision.COMPUTE_DTYPES)
    problems += prox_problems(trainer.prox, loss)
    problems += exact_logprobs_problems(trainer, exact_logprobs)
    moe = MoeOptions.from_config(trainer.moe) if "moe" in trainer else MoeOptions()
    distill_options = distill_config(trainer)
    experts = getattr(model_config, "num_experts", 0)
    problems += moe_problems(trainer, experts)
    if problems:
        raise ConfigError("bad trainer config: " + "; ".join(problems), problems)
    prox = EXACT_PROX if exact_logprobs else trainer.prox
    route_spec = RouteSpec.of(model_config) if experts else None
    return StepConfig(loss=loss, minibatches=trainer.minibatches, prox=prox, remat=trainer.remat,
                      logprob_chunk=chunk, compute_dtype=compute_dtype, routing_replay=moe.routing_replay,
                      route_spec=route_spec, router_aux_coef=moe.aux_loss_coef, router_z_coef=moe.z_loss_coef,
                      distill=distill_options if distill_options.enabled else None)


def distill_config(trainer: ml_collections.ConfigDict) -> distill.DistillOptions:
    """The `trainer.distill` section (defaults, i.e. no teacher, where the section is absent); a bad key or
    value raises ConfigError naming it."""
    return distill.DistillOptions.from_config(trainer.distill) if "distill" in trainer else distill.DistillOptions()


def exact_logprobs_problems(trainer: ml_collections.ConfigDict, exact_logprobs) -> list[str]:
    """What in the trainer section keeps `rollout.exact_logprobs` from holding: the exact program scores one
    sequence a row from position 0, and π_prox must be recomputed (the log-linear one equals μ on
    on-policy tokens by definition)."""
    if exact_logprobs is not True:
        return []
    problems = []
    if trainer.get("pack", TrainerConfig.pack) is not False:
        problems.append("rollout.exact_logprobs needs trainer.pack = False (the exact program scores one "
                        "sequence a row)")
    if trainer.get("prox", TrainerConfig.prox) != "recompute":
        problems.append(f"rollout.exact_logprobs needs trainer.prox = 'recompute', not {trainer.get('prox')!r}")
    if (trainer.get("moe") or {}).get("routing_replay", "off") != "off":
        problems.append("rollout.exact_logprobs cannot run with trainer.moe.routing_replay = 'rollout': the exact "
                        "program routes every token itself")
    return problems


def check_trainer_config(trainer: ml_collections.ConfigDict) -> None:
    """Validates the trainer section (`TrainerConfig`: every key RLTrainer and the job read); raises one
    ConfigError naming every bad or unknown key. No model, no device work."""
    if "loss" in trainer and not isinstance(trainer.loss, ml_collections.ConfigDict):
        loss_config(trainer.loss)  # an old-style `trainer.loss = "name"`: say what the section looks like
    TrainerConfig.from_config(trainer)


def trajectories_of(groups: list[FinishedGroup]) -> list[Trajectory]:
    """One Trajectory per training sequence of every sample (`Sample.sequences`; one per sample without
    `sequence_starts`), each with its sample's reward and member index (advantages are computed per group,
    each member counted once). The sequence before the first start (if any) follows the group's prompt; a
    started one is its own context: its prompt is the env span it opens with, its completion the rest of
    it (env spans, log-probs, versions, routes and teacher log-probs cut to it; the routes of its prompt
    dropped, as a prompt's positions route themselves)."""
    out = []
    for g in groups:
        for member, (sample, reward) in enumerate(zip(g.samples, g.rewards)):
            if not sample.sequence_starts:
                out.append(Trajectory(g.prompt, sample.tokens, sample.logprobs, sample.versions,
                                      reward=float(reward), group_id=g.group_id, env_spans=sample.env_spans,
                                      routes=sample.routes, member=member, teacher_logp=sample.teacher_logprobs))
                continue
            starts = set(sample.sequence_starts)
            for start, end in sample.sequences():
                if start in starts:  # its context: the env span it opens with
                    prompt = sample.tokens[start:next(b for a, b in sample.env_spans if a == start)]
                else:  # the tokens before the first start, after the group's prompt
                    prompt = g.prompt
                first = start + len(prompt) if start in starts else start
                spans = [[a - first, b - first] for a, b in sample.env_spans if first <= a and b <= end]
                out.append(Trajectory(prompt, sample.tokens[first:end], sample.logprobs[first:end],
                                      sample.versions[first:end], reward=float(reward), group_id=g.group_id,
                                      env_spans=spans, member=member,
                                      routes=None if sample.routes is None else sample.routes[first:end],
                                      teacher_logp=None if sample.teacher_logprobs is None
                                      else sample.teacher_logprobs[first:end]))
    return out


def longest_sequence(prompt: list[int], sample: Sample) -> int:
    """The tokens of the sample's longest training sequence with its context: the group's prompt for the
    first one unless it is started, nothing else for a started one (`Sample.sequence_starts`)."""
    starts = set(sample.sequence_starts)
    return max(end - start + (0 if start in starts else len(prompt)) for start, end in sample.sequences())


def screen_groups(groups: list[FinishedGroup], version: int, seq_len: int, vocab_size: int | None = None,
                  route_spec: RouteSpec | None = None,
                  teacher: bool = False) -> tuple[list[FinishedGroup], list[tuple[int, str]]]:
    """(the groups the update at `version` can train, [(group id, why not)] for the others, each logged).
    vocab_size: the model's; prompt and sample token ids must lie in [0, vocab_size) (None: below 2**31,
    what the int32 batch holds). route_spec: the model's routing, which recorded routes must match (None:
    a dense model, whose samples carry none). teacher: every sample must carry its teacher log-probs
    (`Sample.teacher_logprobs`, distillation with the teacher beside the rollout). Raises ValueError naming
    every group and its fault when none is usable."""
    good, rejected = [], []
    for g in groups:
        try:
            if teacher:
                missing = [i for i, s in enumerate(g.samples) if getattr(s, "teacher_logprobs", None) is None]
                if missing:
                    raise ValueError(f"group {g.group_id}: samples {missing} carry no teacher_logprobs, which "
                                     f"trainer.distill.where = 'rollout' trains with (no teacher scored them)")
            checks.check_token_ids(f"group {g.group_id}", "prompt", list(g.prompt), vocab_size)
            checks.check_samples(g.group_id, len(g.samples), g.samples, "consumed", g.v_start, version,
                                 finished=False, vocab_size=vocab_size, route_spec=route_spec)
            checks.check_rewards(g.group_id, len(g.samples), g.rewards)
            longest = max((longest_sequence(g.prompt, s) for s in g.samples), default=0)
            if not g.samples or longest > seq_len:
                raise ValueError(f"group {g.group_id}: the longest training sequence with its context (prompt + "
                                 f"longest sample, unless split) is {longest} tokens, more than seq_len={seq_len} "
                                 f"(or the group has no samples)")
        except (TypeError, ValueError) as e:
            rejected.append((g.group_id, str(e)))
            logger.error("dropping group %d from the update at version %d: %s", g.group_id, version, e)
            continue
        good.append(g)
    if not good:
        raise ValueError(f"buffer {version}: all {len(groups)} groups were rejected: "
                         + "; ".join(why for _, why in rejected))
    return good, rejected


def batch_shape(max_sequences: int, seq_len: int, minibatches: int, micro_batch_rows: int,
                rows_per_shard: int) -> tuple[int, int, int]:
    """The one batch shape [micro-batches, rows, seq_len] the trainer compiles: room for every sequence
    in a row of its own (the worst case, packed or not), dealt over the minibatches, in micro-batches of
    `micro_batch_rows` rows (0: one micro-batch per minibatch). The step skips the micro-batches a
    batch leaves empty, so the padding costs transfer, not compute."""
    if micro_batch_rows % rows_per_shard:
        raise _bad("micro_batch_rows", micro_batch_rows, f"0 or a multiple of the {rows_per_shard} data x fsdp shards")
    per_minibatch = -(-max_sequences // minibatches)
    rows = micro_batch_rows or -(-per_minibatch // rows_per_shard) * rows_per_shard
    return minibatches * -(-per_minibatch // rows), rows, seq_len


class RLTrainer:
    """Owns the policy's TrainState and the jitted step.

    model: the policy (a Transformer on `mesh`). trainer: the run config's trainer section (loss,
    advantage, optimizer, pack, micro_batch_rows...). seq_len: tokens per row (the rollout context).
    max_sequences: the most trajectories a batch holds (batch_groups x group_size). device_weights: a
    source that `publish` puts each version's params in, on device (for JAX engines in this process).

    The train step is compiled once, here, for one padded batch shape (`batch_shape`): a run pays one
    compile before its first step, whatever its batches hold. A batch with more sequences than
    `max_sequences` gets a shape twice as deep, compiled when it arrives (with a warning).
    compute_dtype: what the update computes in (`model.compute_dtype`); the weights stay in the model's dtype
    (`trainer.param_dtype`, applied when the model is loaded). exact_logprobs: `rollout.exact_logprobs`
    (π_prox from `scoring`, the program the JAX engine's exact mode reports log-probs with).
    """

    def __init__(self, model, trainer: ml_collections.ConfigDict, mesh, *, seq_len: int, max_sequences: int,
                 device_weights: DeviceParamSource | None = None, compute_dtype: str = "float32",
                 exact_logprobs: bool = False):
        check_trainer_config(trainer)
        self.batch_shape = batch_shape(max_sequences, seq_len, trainer.minibatches, trainer.micro_batch_rows,
                                       sharding.rows_per_shard(mesh))
        self.mesh, self.seq_len, self.cfg = mesh, seq_len, trainer
        self.device_weights = device_weights
        self.graphdef = nnx.graphdef(model)
        self.vocab_size = model.config.vocab_size  # token ids a batch may hold: [0, vocab_size)
        self.route_spec = RouteSpec.of(model.config)  # what recorded routes must look like (None: dense)
        # With LoRA adapters (`trainer.lora`, added when the model was loaded) the optimizer trains them
        # alone: the base is the frozen rest, an argument of the step, and each version is the adapters.
        self.lora = model.layers.lora
        self.publish_adapters = False  # see publish_tensors
        self._rest = nnx.state(model, nnx.Not(trainable(model)))
        self.tx = make_optimizer(optimizer_config(trainer))
        self.state: TrainState = create_train_state(model, self.tx, mesh)
        self.shardings = train_state_shardings(self.state.params, self.tx, mesh)
        self.minibatches = trainer.minibatches
        self.step_config = step_config(trainer, compute_dtype, exact_logprobs, model.config)
        # The KL reference: the initial policy, frozen (a copy: the state's arrays are donated to the step).
        self.ref_params = (jax.tree.map(jnp.copy, self.state.params) if self.step_config.loss.kl_coef > 0
                           else None)
        self.teacher = self._load_teacher(model, mesh)
        self._step = TrainStep(self.graphdef, self.tx, self.step_config, mesh, self.shardings,
                               frozen=frozen_state(model), teacher=self.teacher)
        seconds = self._step.compile(self.state, self.batch_shape, with_ref=self.ref_params is not None)
        logger.info("train step compiled for batches of %s in %.1f s", self.batch_shape, seconds)

    def _load_teacher(self, model, mesh):
        """The distillation teacher (`trainer.distill.teacher`) loaded onto `mesh` in the dtype of the policy's
        (base) weights, or None without one. Its vocab size must be the policy's (the job also compares the
        tokenizers, `distill.teacher_problems`, before it builds anything)."""
        options = self.step_config.distill
        if options is None or not options.in_step:  # where "rollout": the samples carry the teacher's log-probs
            return None
        source = f"{options.teacher}/config.json"
        vocab_size = from_hf_config(read_hf_config(options.teacher), source=source).vocab_size  # before any weight
        if vocab_size != model.config.vocab_size:
            raise ConfigError(f"trainer.distill.teacher {options.teacher} has vocab size {vocab_size} and the policy "
                              f"{model.config.vocab_size}: the teacher must share the student's vocabulary")
        dtype = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.LoRAParam)))[0].dtype
        return hf_io.load_model(options.teacher, mesh=mesh, param_dtype=dtype)

    @property
    def compiles(self) -> int:
        """Train-step compiles so far (1 after construction unless a batch outgrew the shape)."""
        return self._step.compiles

    @property
    def compile_s(self) -> float:
        return self._step.compile_s

    @property
    def trainable_params(self) -> int:
        """Parameters the optimizer trains (with LoRA, the adapters')."""
        return sum(x.size for x in jax.tree.leaves(self.state.params))

    @property
    def frozen_params(self) -> int:
        """Parameters held fixed (with LoRA, the base's; else 0)."""
        return sum(x.size for x in jax.tree.leaves(self._rest))

    @property
    def version(self) -> int:
        return int(self.state.version)

    def model(self):
        """The current policy as a Transformer (shares the state's arrays)."""
        return nnx.merge(self.graphdef, self.state.params, self._rest)

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """The policy's weights as HF-named host arrays (with LoRA merged: W + (alpha / r) A B), as vLLM
        and an HF export take them."""
        return dict(hf_io.iter_hf_tensors(self.model()))

    def sync_tensors(self) -> dict[str, np.ndarray]:
        """What a version is for engines that take host tensors: the HF weights, or with LoRA the adapters
        alone, PEFT-named (`jaxflow.models.lora.peft_tensors`), which JAX engines apply over their base."""
        if self.lora is None:
            return self.hf_tensors()
        return lora.peft_tensors(self.model().layers)

    def _route_spec(self, trajs: list[Trajectory]):
        """The batch's route layout: the policy's with replay on; else None, the samples' routes dropped."""
        if self.step_config.routing_replay == "off":
            for t in trajs:
                t.routes = None
            return None
        return self.step_config.route_spec

    def train(self, consumed: ConsumedBatch) -> tuple[dict[str, float], dict[int, int]]:
        """One update on buffer `consumed.step` (== this trainer's version). Returns (metrics, staleness
        histogram {versions behind: trained tokens}). An empty buffer (the data ran out) raises."""
        v = self.version
        if consumed.step != v:
            raise ValueError(f"buffer {consumed.step} handed to the trainer at version {v}")
        if not consumed.groups:
            raise ValueError(f"buffer {v} holds no groups: the prompt source is exhausted")
        recorded = self.step_config.distill is not None and self.step_config.distill.recorded
        usable, rejected = screen_groups(consumed.groups, v, self.seq_len, self.vocab_size, self.route_spec,
                                         teacher=recorded)
        signal = [max(g.rewards) != min(g.rewards) for g in usable]
        groups = usable
        if self.cfg.skip_zero_signal and self.step_config.distill is None:
            # A group whose samples all scored the same has advantage 0 on every token: it only costs compute
            # (and dilutes a token-mean loss). A buffer with no signal at all is trained as is. With a teacher
            # the advantage is the teacher's too, and every group trains.
            groups = [g for g, s in zip(usable, signal) if s] or usable
        trajs = trajectories_of(groups)
        start = time.perf_counter()
        micro, rows, _ = self.batch_shape
        while True:
            try:
                batch, adv_stats = make_batch(trajs, num_rows=micro * rows, seq_len=self.seq_len,
                                              pack=self.cfg.pack, share_prompts=self.cfg.share_prompts,
                                              micro_batches=micro,
                                              minibatches=self.minibatches, advantage_estimator=self.cfg.advantage,
                                              scale_by_std=self.cfg.adv_scale_by_std,
                                              std_ddof=self.cfg.adv_std_ddof, route_spec=self._route_spec(trajs),
                                              teacher=recorded)
                break
            except BatchOverflow:  # more sequences than the rows hold: a deeper shape, compiled once
                micro *= 2
                logger.warning("%d trajectories do not fit the compiled batch shape %s; trying %d micro-batches",
                               len(trajs), self.batch_shape, micro)
        self.batch_shape = (micro, rows, self.seq_len)  # a deeper shape, once needed, is kept
        batch_s = time.perf_counter() - start
        self.state, step_metrics = self._step(self.state, batch, self.ref_params)
        step_metrics = {k: float(x) for k, x in jax.device_get(step_metrics).items()}
        step_s = time.perf_counter() - start
        staleness = collections.Counter()
        for t in trajs:  # the model's tokens (the environment's are not trained)
            model = np.ones(len(t.versions), bool)
            for span_start, span_end in t.env_spans:
                model[span_start:span_end] = False
            staleness.update(v - ver for ver, m in zip(t.versions, model) if m)
        # Rewards and lengths describe everything the rollout produced; trained_tokens what the update used.
        rewards = np.asarray([r for g in usable for r in g.rewards], np.float64)
        lengths = np.asarray([len(s.tokens) for g in usable for s in g.samples])
        metrics: dict[str, Any] = {
            **step_metrics,
            "reward_mean": float(rewards.mean()),
            "solved_frac": float((rewards >= 1.0).mean()),
            "zero_signal_groups_frac": 1.0 - float(np.mean(signal)),
            "response_tokens_mean": float(lengths.mean()),
            "response_tokens_max": float(lengths.max()),
            "trained_tokens": float(sum(len(t.completion) - sum(b - a for a, b in t.env_spans) for t in trajs)),
            # Multi-turn episodes: tokens their environments wrote (context, not trained), per sample.
            "env_tokens_mean": float(np.mean([sum(b - a for a, b in s.env_spans) for g in usable for s in g.samples])),
            "env_frac": float(np.mean([bool(s.env_spans) for g in usable for s in g.samples])),
            "consumed_tokens": float(lengths.sum()),
            "groups": float(len(consumed.groups)),
            "groups_trained": float(len(groups)),
            "groups_rejected": float(len(rejected)),
            "step_s": step_s,
            "batch_s": batch_s,  # of step_s: the host building the batch (packing, advantages)
            "rows_filled": float(np.any(np.asarray(batch.segment_ids) > 0, axis=-1).sum()),
            "train_step_compiles": float(self._step.compiles),
            "compile_s": self._step.compile_s,
            **{f"adv_{k}": float(x) for k, x in adv_stats.items()},
        }
        return metrics, dict(sorted(staleness.items()))

    def checkpoint(self, ckpt, extra: dict) -> None:
        """Saves the current version to `ckpt` (a `Checkpointer`) with `extra`, overwriting nothing."""
        ckpt.save(self.version, self.state, extra, force=True)

    def publish(self, trajectories, params=None) -> int:
        """Makes the current version available: the service first (its contract), then the weights."""
        v = self.version
        trajectories.mark_published(v)
        self.publish_weights(params)
        return v

    def publish_weights(self, params=None) -> int:
        """Publishes the current version's weights: on device to `device_weights` (copied there, so the
        next step's donation of the state leaves them intact), and as HF host tensors to `params` (a
        ParameterService or client; `publish_tensors`) unless None. Returns the version."""
        v = self.version
        if self.device_weights is not None:
            self.device_weights.publish(v, self.state.params)
        if params is not None:
            params.publish(v, self.publish_tensors())
        return v

    def publish_tensors(self) -> dict[str, np.ndarray]:
        """What `publish_weights` gives a parameter service: the LoRA adapters alone when
        `publish_adapters` is set (every engine pulling from it applies adapters over its base), else the
        HF tensors of the whole (merged) policy."""
        return self.sync_tensors() if self.publish_adapters else self.hf_tensors()
