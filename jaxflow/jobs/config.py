"""The RL job's own config sections: `data`, `rollout`, `eval`, `checkpoint`, `base` and `model`.

Each is a `jaxflow.config.Section`: its fields are the keys and their defaults, its docstring says what each
key means, `Section.section(**overrides)` generates it for config files. The other sections live with the code
that owns them: `trainer` (`jaxflow.trainer.rl_trainer.TrainerConfig`, with `trainer.loss`,
`jaxflow.trainer.losses.LossConfig`), `rollout.coordination` (`jaxflow.coordination.Coordination`),
`rollout.env` (`jaxflow.envs.config.EnvConfig`) and `cluster` (`jaxflow.cluster.config.ClusterConfig`). The
task's options are the task's constructor arguments (`jaxflow.tasks`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxflow.config import Section, check_bool, check_choice, check_float, check_int
from jaxflow.coordination import Coordination
from jaxflow.envs.config import EnvConfig
from jaxflow.models.precision import COMPUTE_DTYPES, EXPORT_DTYPES
from jaxflow.rewards.judge_config import JudgeConfig
from jaxflow.rewards.model_config import RewardModelConfig
from rollout_bridge.weight_transport import MAX_BUCKET_MB, WEIGHT_TRANSPORTS

__all__ = ["ENGINES", "BaseConfig", "CheckpointConfig", "DataConfig", "EvalConfig", "ModelSection", "RolloutConfig"]

ENGINES = ("jax", "vllm")


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    """The `data` section.

    train_prompts: distinct train prompts, drawn from the task's train split (repeated in new orders when used up).
    """

    SECTION: ClassVar[str] = "data"

    train_prompts: int = 20000

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_int(problems, self.key("train_prompts"), self.train_prompts, 1)
        return problems


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """The `rollout` section: the engines, sampling, rewards and episodes.

    engine: "jax" (jaxflow's engine, in this process) or "vllm" (vLLM's AsyncLLM, its own processes).
    num_engines: engines, all driven by one coordinator.
    coordination: placement and weight sync of the coordinator (`jaxflow.coordination.Coordination`).
    group_size: samples per prompt (the GRPO group).
    temperature: sampling temperature.
    max_tokens: response tokens per sample at most (per model turn in episodes).
    max_len: context (prompt + response) of each engine's sequences.
    max_slots: concurrent sequences of each engine.
    decode_chunk: decode steps the JAX engine runs per call.
    reward_workers: reward processes.
    reward_timeout_s: seconds after which a reward call counts as failed.
    reward_memory_mb: each reward process's address-space limit in MiB (a runaway allocation raises in the
      reward function, scoring the sample 0); None: the processes share half of the machine's physical memory
      (`jaxflow.rewards.pool.default_memory_limit_mb`); 0: no limit.
    reward_model: a reward model scoring the samples in place of the task's reward function
      (`jaxflow.rewards.model_config.RewardModelConfig`; off while its dir is None).
    judge: an LLM judge scoring the samples in place of the task's reward function
      (`jaxflow.rewards.judge_config.JudgeConfig`; off while its dir is None; not with reward_model).
    lease_s: a group dispatched to a worker goes back to the queue (with its partial tokens) if the worker does
      not renew it for this long: a dead or hung worker cannot stall training.
    kv_cache_gib: vLLM only: GiB of KV cache each engine allocates (the JAX engine sizes its cache from max_slots).
    weight_transport: the path each version takes to the engines (`rollout_bridge.weight_transport`): "auto"
      (today's path for the engine kind and deployment: "device" for JAX engines in the job's process,
      "param_service" for vLLM engines in it and for rollout actors, "object_store" with trainer processes),
      one of those by name where it fits, or "nccl": vLLM engines in the job's process, on GPUs, take each
      version by an NCCL broadcast through vLLM's weight-transfer API.
    weight_bucket_mb: nccl only: MiB per bucket of the broadcast (at most MAX_BUCKET_MB, 1024).
    env: episodes, an environment answering between model turns (`jaxflow.envs.config.EnvConfig`).
    exact_logprobs: the JAX engine reports each token's log-prob from the per-sequence program the update
      computes π_prox with (`jaxflow.trainer.scoring`), so that on-policy tokens carry no train-rollout
      mismatch at all (π_prox / μ = 1 bit for bit). Costs a forward pass of each sample in the engine and one
      in the update; needs the JAX engine, `trainer.pack = False` and `trainer.prox = "recompute"`.
    compute_dtype: what the rollout engines (JAX and vLLM, the evaluator's JAX engine too) compute in:
      "float32" or "bfloat16", whatever the update computes in; each version is cast to it on its way in.
      None: model.compute_dtype (`rollout_compute_dtype`). bfloat16 rollouts under a float32 update are
      the cheaper-rollout case the loss's mismatch corrections are for (trainer.loss).
    """

    SECTION: ClassVar[str] = "rollout"

    engine: str = "jax"
    num_engines: int = 1
    coordination: Coordination = dataclasses.field(default_factory=Coordination)
    group_size: int = 8
    temperature: float = 1.0
    max_tokens: int = 128
    max_len: int = 192
    max_slots: int = 128
    decode_chunk: int = 16
    reward_workers: int = 1
    reward_timeout_s: float = 5.0
    reward_memory_mb: int | None = None
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    lease_s: float = 60.0
    kv_cache_gib: float = 0.5
    weight_transport: str = "auto"
    weight_bucket_mb: int = 256
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    exact_logprobs: bool = False
    compute_dtype: str | None = None

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_choice(problems, self.key("engine"), self.engine, ENGINES)
        check_bool(problems, self.key("exact_logprobs"), self.exact_logprobs)
        if self.exact_logprobs is True and self.engine == "vllm":
            problems.append("rollout.exact_logprobs needs rollout.engine = 'jax' (vLLM's kernels are not the "
                            "trainer's: its log-probs agree to rounding only)")
        if self.compute_dtype is not None:
            check_choice(problems, self.key("compute_dtype"), self.compute_dtype, COMPUTE_DTYPES)
        check_choice(problems, self.key("weight_transport"), self.weight_transport, WEIGHT_TRANSPORTS)
        check_int(problems, self.key("weight_bucket_mb"), self.weight_bucket_mb, 1, MAX_BUCKET_MB)
        before = len(problems)
        for name, low in (("max_tokens", 1), ("max_len", 2)):
            check_int(problems, self.key(name), getattr(self, name), low)
        if len(problems) == before and self.max_tokens >= self.max_len:
            problems.append(f"rollout.max_tokens ({self.max_tokens}) must be below rollout.max_len ({self.max_len})")
        for name, low in (("num_engines", 1), ("group_size", 2), ("max_slots", 1), ("decode_chunk", 1),
                          ("reward_workers", 1)):
            check_int(problems, self.key(name), getattr(self, name), low)
        check_int(problems, self.key("reward_memory_mb"), self.reward_memory_mb, 0, optional=True)
        check_float(problems, self.key("temperature"), self.temperature, 0.0)
        if self.reward_model.dir is not None and self.judge.dir is not None:
            problems.append("rollout.reward_model.dir and rollout.judge.dir are both set: one scores the rollouts, "
                            "set the other None")
        for name in ("reward_timeout_s", "kv_cache_gib", "lease_s"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, open_low=True)
        return problems


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """The `eval` section: held-out greedy accuracy every `every` steps (and at the start and the end).

    every: train steps between evals.
    num_prompts: held-out prompts per eval.
    """

    SECTION: ClassVar[str] = "eval"

    every: int = 50
    num_prompts: int = 256

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("every", "num_prompts"):
            check_int(problems, self.key(name), getattr(self, name), 1)
        return problems


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
    """The `checkpoint` section.

    every: train steps between checkpoints (and one after the last step).
    max_to_keep: checkpoints kept; older ones are deleted.
    export_dtype: the dtype of the HF model the run exports at its end (workdir/export): "float32",
      "bfloat16" or "float16". None: the trainer's parameter dtype (trainer.param_dtype).
    """

    SECTION: ClassVar[str] = "checkpoint"

    every: int = 25
    max_to_keep: int = 2
    export_dtype: str | None = None

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("every", "max_to_keep"):
            check_int(problems, self.key(name), getattr(self, name), 1)
        if self.export_dtype is not None:
            check_choice(problems, self.key("export_dtype"), self.export_dtype, EXPORT_DTYPES)
        return problems


@dataclasses.dataclass(frozen=True)
class BaseConfig(Section):
    """The `base` section: the base model the run starts from, and the supervised warm start that builds it.

    dir: the base model's directory (an HF model). A model the warm start built (with base_info.json) is a
      cache: rebuilt in place when its settings differ from these. A directory holding an HF model of your own
      (config.json, safetensors weights, tokenizer.json; no base_info.json) is used as given and never written;
      model and base settings then do not apply. Missing or empty: built when build_if_missing.
    build_if_missing: build the base model when `dir` holds none (or a stale one the warm start built).
    random_preset: None, or a published shape (`jaxflow.models.presets`, e.g. "qwen3-0.6b"): a missing or empty
      `dir` then gets a randomly initialised model of that shape and a tokenizer of its vocab size
      (`jaxflow.models.random_hf`) instead of the warm start, for real-size runs that check the plumbing,
      not learning. The model is then used as given; model and the other base settings do not apply.
    steps: warm-start steps.
    batch_size: demonstrations per warm-start step.
    lr: the warm start's peak learning rate.
    num_examples: distinct demonstrations.
    seed: the warm start's seed.
    """

    SECTION: ClassVar[str] = "base"

    dir: str = "runs/base/model"
    build_if_missing: bool = True
    random_preset: str | None = None
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    num_examples: int = 20000
    seed: int = 0

    def problems(self) -> list[str]:
        problems: list[str] = []
        if not isinstance(self.dir, str) or not self.dir:
            problems.append(f"base.dir must be a directory, got {self.dir!r}")
        check_bool(problems, self.key("build_if_missing"), self.build_if_missing)
        if self.random_preset is not None:
            from jaxflow.models.presets import preset_names

            check_choice(problems, self.key("random_preset"), self.random_preset, preset_names())
        for name, low in (("steps", 1), ("batch_size", 1), ("num_examples", 1), ("seed", 0)):
            check_int(problems, self.key(name), getattr(self, name), low)
        check_float(problems, self.key("lr"), self.lr, 0.0, open_low=True)
        return problems


@dataclasses.dataclass(frozen=True)
class ModelSection(Section):
    """The `model` section: the tiny architecture the warm start builds (HF layout; vLLM loads it too).

    Config files write this section out by hand: its keys are part of the base model's cache key, so a
    generated section (which would always hold extra_tokens) would rebuild caches that are still good.

    architecture: the HF architecture written into config.json (jaxflow.models.config.SUPPORTED_ARCHITECTURES).
    hidden_size: width of the residual stream.
    intermediate_size: width of the SwiGLU hidden layer.
    num_layers: decoder blocks.
    num_heads, num_kv_heads: query heads and key/value heads (grouped-query attention when fewer kv heads).
    head_dim: width of one attention head (vLLM's CPU attention kernels need >= 32).
    tie_word_embeddings: the LM head reuses the token embedding.
    vocab_size: tokenizer vocabulary to train (the model rounds it up to a multiple of 64).
    extra_tokens: strings that become one token each in the tokenizer (tool-call markers).
    num_experts: a mixture of experts (architecture "Qwen3MoeForCausalLM"): experts per sparse layer; 0: dense.
    num_experts_per_tok: experts each token goes through (top-k).
    moe_intermediate_size: width of one expert's SwiGLU hidden layer.
    mlp_only_layers: layers that keep a dense MLP among the sparse ones.
    router_aux_loss_coef: a mixture of experts: the weight of the routers' load-balancing loss in the warm
      start (HF's `router_aux_loss_coef`; the RL update's is trainer.moe.aux_loss_coef).
    compute_dtype: what the RL update computes in, and the engines unless rollout.compute_dtype says
      otherwise: "float32" or "bfloat16" (master weights in trainer.param_dtype; log-probs, losses and their
      reductions float32 either way). It applies to any base model, and is not part of the base model's
      cache key.
    """

    SECTION: ClassVar[str] = "model"

    architecture: str = "Qwen3ForCausalLM"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    tie_word_embeddings: bool = True
    vocab_size: int = 512
    extra_tokens: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    compute_dtype: str = "float32"

    def problems(self) -> list[str]:
        problems: list[str] = []
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size"):
            check_int(problems, self.key(name), getattr(self, name), 1)
        for name in ("num_experts", "moe_intermediate_size"):
            check_int(problems, self.key(name), getattr(self, name), 0)
        moe = self.architecture == "Qwen3MoeForCausalLM"
        if moe:
            check_int(problems, self.key("num_experts_per_tok"), self.num_experts_per_tok, 1, max(self.num_experts, 1))
        if moe != (self.num_experts > 0) or (moe and self.moe_intermediate_size < 1):
            problems.append(f"{self.key('num_experts')} and {self.key('moe_intermediate_size')} must be >= 1 for "
                            f"architecture 'Qwen3MoeForCausalLM' and num_experts 0 for any other (got "
                            f"{self.architecture!r} with {self.num_experts} experts of width "
                            f"{self.moe_intermediate_size})")
        check_float(problems, self.key("router_aux_loss_coef"), self.router_aux_loss_coef, 0.0)
        check_choice(problems, self.key("compute_dtype"), self.compute_dtype, COMPUTE_DTYPES)
        return problems


def compute_dtype(config) -> str:
    """model.compute_dtype: what the update computes in (and the engines, unless rollout.compute_dtype is
    set); the section's default when a config file's hand-written model section leaves the key out."""
    return config.model.get("compute_dtype", ModelSection.compute_dtype)


def rollout_compute_dtype(config) -> str:
    """What the rollout engines and the evaluator's engine compute in: rollout.compute_dtype, or where it is
    None (or a config's rollout section predates it) model.compute_dtype (`compute_dtype`)."""
    dtype = config.rollout.get("compute_dtype")
    return compute_dtype(config) if dtype is None else dtype
