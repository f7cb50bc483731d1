"""Asynchronous RL on a tiny model, on one machine: multi-step arithmetic with verifiable answers.

The first run builds the base model (a short supervised warm start, cached in base.dir), then trains
it with staleness-bounded asynchronous GRPO (decoupled PPO) against the exact-answer reward, with
held-out greedy evals along the way.

Variants: `:async` (default, eta=4), `:sync` (eta=0: the synchronous baseline through the same code),
`:vllm` (rollouts on vLLM instead of jaxflow's JAX engine), `:coordinated` (two JAX engines and every
strategy of `jaxflow.coordination`; the others drive their one engine with the same coordinator).

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py:sync --config.trainer.steps=50
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tiny.py --config.job=warm_start
"""

import ml_collections

from jaxflow.coordination import config_section

VARIANTS = ("async", "sync", "vllm", "coordinated")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "async"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
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

    config.data = ml_collections.ConfigDict()
    # Distinct train prompts (drawn from the task's train split; repeated in new orders when used up).
    config.data.train_prompts = 20000

    config.model = ml_collections.ConfigDict()
    # The tiny architecture the warm start builds (HF layout; vLLM loads it too).
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

    config.base = ml_collections.ConfigDict()
    # The base model's directory (an HF model). Built here when missing and build_if_missing.
    config.base.dir = "runs/base/arithmetic_tiny"
    config.base.build_if_missing = True
    # Supervised warm start: steps, demonstrations per step, peak learning rate, distinct examples.
    config.base.steps = 800
    config.base.batch_size = 32
    config.base.lr = 3e-3
    config.base.num_examples = 20000
    config.base.seed = 0

    config.rollout = ml_collections.ConfigDict()
    # "jax" (jaxflow's engine, in this process) or "vllm" (vLLM's AsyncLLM, its own processes).
    config.rollout.engine = "vllm" if variant == "vllm" else "jax"
    # Engines, all driven by one coordinator: placement and weight sync in `coordination` (fields and
    # their meaning: jaxflow.coordination.Coordination). sync "all": every engine takes each new version
    # at once, "selective": when idle (sync_idle_below) or lagging (sync_max_lag); sync_mode "keep"
    # requests in flight across a sync (KV recomputed) or "abort" them (resumed from their prefix).
    # max_running: requests kept on one engine.
    config.rollout.num_engines = 2 if variant == "coordinated" else 1
    if variant == "coordinated":
        config.rollout.coordination = config_section(max_running=64)
    else:
        config.rollout.coordination = config_section(max_running=128, sync="all", sync_mode="keep")
    # Samples per prompt (the GRPO group) and sampling.
    config.rollout.group_size = 8
    config.rollout.temperature = 1.0
    config.rollout.max_tokens = 128
    # Context (prompt + response) and concurrent sequences of each engine.
    config.rollout.max_len = 192
    config.rollout.max_slots = 128
    config.rollout.decode_chunk = 16
    # Reward processes, and the seconds after which a reward call counts as failed.
    config.rollout.reward_workers = 1
    config.rollout.reward_timeout_s = 5.0

    config.trainer = ml_collections.ConfigDict()
    config.trainer.steps = 1000
    # Groups per train step (B) and the staleness bound (eta): a group admitted at version v is
    # trained at a version <= v + eta. eta = 0 is synchronous RL.
    config.trainer.batch_groups = 32
    config.trainer.eta = 0 if variant == "sync" else 4
    config.trainer.batch_rule = "full"
    # Optimizer updates per train step, each on 1/minibatches of the batch (PPO minibatches; pi_prox is the
    # step's starting policy). About the same compute; 4 learned no faster than 1 on this task.
    config.trainer.minibatches = 1
    # Leave groups whose samples all scored the same out of the update: their advantage is 0 on every token,
    # so they cost trainer time and only dilute the token-mean loss. They are still consumed and accounted.
    config.trainer.skip_zero_signal = True
    config.trainer.loss = "decoupled_ppo"
    config.trainer.advantage = "grpo"
    # Cap on the behaviour importance weight pi_prox / mu (AReaL uses 5); None leaves it uncapped.
    config.trainer.behav_weight_cap = 5.0
    config.trainer.lr = 1e-4
    config.trainer.warmup_steps = 5
    config.trainer.max_grad_norm = 1.0
    config.trainer.pack = True
    # Rows per micro-batch (gradients are accumulated over micro-batches; 0: one per minibatch). The
    # step is compiled once for room for every sequence; micro-batches a batch leaves empty are skipped.
    config.trainer.micro_batch_rows = 16

    config.eval = ml_collections.ConfigDict()
    # Held-out greedy accuracy every `every` steps (and at the start and the end).
    config.eval.every = 50
    config.eval.num_prompts = 256

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 25
    config.checkpoint.max_to_keep = 2
    return config
