"""Asynchronous RL on a tiny model, on one machine: multi-step arithmetic with verifiable answers.

The first run builds the base model (a short supervised warm start, cached in base.dir), then trains
it with staleness-bounded asynchronous GRPO (decoupled PPO) against the exact-answer reward, with
held-out greedy evals along the way.

Variants: `:async` (default, eta=4), `:sync` (eta=0: the synchronous baseline through the same code),
`:vllm` (rollouts on vLLM instead of jaxflow's JAX engine), `:coordinated` (two JAX engines and every
strategy of `jaxflow.coordination`; the others drive their one engine with the same coordinator).
The option `small`, after a comma (`:async,small`, `:vllm,small`), shrinks any of them to a run of a few
minutes on a CPU: what the tests and CI run.

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py:sync --config.trainer.steps=50
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py --config.job=warm_start
"""

import ml_collections
from ml_collections.config_dict import placeholder

from jaxflow.cluster.config import ClusterConfig
from jaxflow.jobs.config import BaseConfig, CheckpointConfig, DataConfig, EvalConfig, RolloutConfig
from jaxflow.trainer.rl_trainer import TrainerConfig

VARIANTS = ("async", "sync", "vllm", "coordinated")
OPTIONS = ("small",)  # combine with a variant after a comma: "async,small"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, *options = (arg or "async").split(",")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    for option in options:
        if option not in OPTIONS:
            raise ValueError(f"unknown option {option!r} in {arg!r}; choose from {', '.join(OPTIONS)}")
    config = ml_collections.ConfigDict()
    # Which job jaxflow.main runs: "rl" (train) or "warm_start" (rebuild the base model only).
    config.job = "rl"
    # Checkpoints, logs, plots and the exported policy go here. A rerun with the same workdir resumes.
    config.workdir = f"runs/arithmetic_tiny_{variant}"
    config.seed = 0

    config.task = ml_collections.ConfigDict()
    # A registered task (jaxflow.tasks.TASKS) and its options.
    config.task.name = "arithmetic"
    # Operations per problem: mostly 1-2, rarely up to max_ops (response length ~ ops^2: a long tail).
    config.task.max_ops = 4
    # P(k operations) ~ ops_decay ** (k - 1).
    config.task.ops_decay = 0.6
    config.task.max_number = 9
    config.task.operators = "+-"
    # No system turn: on a tiny model the instructions are dozens of tokens it never reads but pays for.
    config.task.system_prompt = ""
    # A reward of your own, "module:function" with fn(response: str, meta: dict) -> float, instead of the
    # task's (RL rewards and evals; not part of the base model's cache key). None: the task's own.
    config.task.reward_ref = placeholder(str)

    # The train prompts (jaxflow.jobs.config.DataConfig says each key): 20000 distinct ones.
    config.data = DataConfig.section()

    # The tiny architecture the warm start builds (HF layout; vLLM loads it too). Written out, not generated
    # from jaxflow.jobs.config.ModelSection (which says each key): these keys are the base model's cache key.
    config.model = ml_collections.ConfigDict()
    config.model.architecture = "Qwen3ForCausalLM"
    config.model.hidden_size = 64
    config.model.intermediate_size = 128
    config.model.num_layers = 2
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    config.model.head_dim = 32  # vLLM's CPU attention kernels reject 16
    config.model.tie_word_embeddings = True
    # Tokenizer vocabulary to train (the model rounds it up to a multiple of 64).
    config.model.vocab_size = 512
    # What the update and the engines compute in: "float32" or "bfloat16" (master weights: trainer.param_dtype;
    # the engines alone: rollout.compute_dtype).
    # Not part of the cache key.
    config.model.compute_dtype = "float32"

    # The base model and the supervised warm start that builds it (jaxflow.jobs.config.BaseConfig says each
    # key): 800 steps of 32 demonstrations at lr 3e-3, cached in `dir`.
    config.base = BaseConfig.section(dir="runs/base/arithmetic_tiny")

    # Engines, sampling and rewards (jaxflow.jobs.config.RolloutConfig says each key): groups of 8 samples of at
    # most 128 tokens at temperature 1, 128 sequences per engine, one reward process.
    config.rollout = RolloutConfig.section(
        # "jax" (jaxflow's engine, in this process) or "vllm" (vLLM's AsyncLLM, its own processes).
        engine="vllm" if variant == "vllm" else "jax",
        # Engines, all driven by one coordinator: placement and weight sync in `coordination`
        # (jaxflow.coordination.Coordination says each key). One engine takes each new version at once
        # (sync "all"), keeping its requests across the sync (KV recomputed), with up to 128 of them running;
        # two use every strategy, 64 requests each.
        num_engines=2 if variant == "coordinated" else 1,
        coordination={"max_running": 64} if variant == "coordinated" else
        {"max_running": 128, "sync": "all", "sync_mode": "keep"})
    # Episodes (rollout.env, jaxflow.envs.config.EnvConfig) are off: single answers, scored by the task's reward.

    # The schedule, the batch and the update (jaxflow.trainer.rl_trainer.TrainerConfig says each key): 1000
    # steps of B = 32 groups; GRPO advantages, AdamW at lr 1e-4, packed rows sharing each group's prompt.
    config.trainer = TrainerConfig.section(
        # The staleness bound: a group admitted at version v is trained at a version <= v + eta (0: synchronous).
        eta=0 if variant == "sync" else 4,
        # 4 rows a micro-batch: this task's update takes 0.66-0.68x the time of 16 rows (2-core CPU).
        micro_batch_rows=4,
        # The policy loss (jaxflow.trainer.losses.LossConfig): its defaults, with AReaL's cap of 5 on the
        # behaviour weight w = pi_prox/mu.
        loss={"behav_weight_cap": 5.0})

    # Held-out greedy accuracy of 256 prompts every 50 steps, at the start and at the end (jaxflow.jobs.config.
    # EvalConfig); a checkpoint every 25 steps, 2 kept (CheckpointConfig).
    config.eval = EvalConfig.section()
    config.checkpoint = CheckpointConfig.section()

    # Where the services run (jaxflow.cluster.config.ClusterConfig says each key): all in this process.
    config.cluster = ClusterConfig.section()
    if "small" in options:
        _small(config)
    return config


def _small(config: ml_collections.ConfigDict) -> None:
    """The `small` option: a 30-step warm start on 400 examples, 2 groups of 4 samples a step, answers of
    up to 48 tokens, an eval of 16 prompts every 2 steps and a checkpoint every step."""
    config.base.steps, config.base.num_examples = 30, 400
    config.data.train_prompts = 400
    config.trainer.batch_groups = 2
    config.rollout.group_size, config.rollout.max_tokens = 4, 48
    config.rollout.max_slots = config.rollout.coordination.max_running = 16
    config.eval.num_prompts, config.eval.every = 16, 2
    config.checkpoint.every = 1
