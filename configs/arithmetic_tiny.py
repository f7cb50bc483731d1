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

from jaxflow.models.lora import LORA_TARGETS
from ml_collections.config_dict import placeholder

from jaxflow.coordination import config_section
from jaxflow.envs.config import env_section

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
    # The base model's directory (an HF model). A model the warm start built (with base_info.json) is a
    # cache: rebuilt in place when its settings differ from these. A directory holding an HF model of your
    # own (config.json, safetensors weights, tokenizer.json; no base_info.json) is used as given and never
    # written; model and base settings then do not apply. Missing or empty: built when build_if_missing.
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
    # requests in flight across a sync (KV recomputed), "keep_kv" them with their KV as it was (no
    # recompute: PipelineRL's in-flight update) or "abort" them (resumed from their prefix).
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
    # A group dispatched to a worker goes back to the queue (with its partial tokens) if the worker does
    # not renew it for this long: a dead or hung worker cannot stall training.
    config.rollout.lease_s = 60.0
    # vLLM only: GiB of KV cache each engine allocates (the JAX engine sizes its cache from max_slots).
    config.rollout.kv_cache_gib = 0.5
    # Episodes: an environment answers between model turns (jaxflow.envs.config says each key). ref None:
    # single answers, scored by the task's reward.
    config.rollout.env = env_section()

    config.trainer = ml_collections.ConfigDict()
    config.trainer.steps = 1000
    # Stop after this many seconds of the train loop (from its first wait for rollouts), as after the
    # last step: held-out eval, checkpoint, export. 0: no limit, train all `steps`.
    config.trainer.time_limit_s = 0.0
    # Groups per train step (B) and the staleness bound (eta): a group admitted at version v is
    # trained at a version <= v + eta. eta = 0 is synchronous RL.
    config.trainer.batch_groups = 32
    config.trainer.eta = 0 if variant == "sync" else 4
    config.trainer.batch_rule = "full"
    # Optimizer updates per train step, each on 1/minibatches of the batch (PPO minibatches; pi_prox is the
    # step's starting policy). About the same compute; 4 learned no faster than 1 on this task.
    config.trainer.minibatches = 1
    # Rows per micro-batch: each minibatch's gradient is accumulated over micro-batches of this many rows
    # (less activation memory, same update); a multiple of the trainer mesh's data x fsdp shards. The step
    # is compiled once, at start-up, for room for every sequence of a batch; the micro-batches a batch
    # leaves empty are skipped, so smaller ones waste less compute on padding, and rows cut into the same
    # parts attend together. Here 4 rows: this task's update takes 0.66-0.68x the time of 16 rows (2-core
    # CPU). 0 = the whole minibatch in one micro-batch, padding included.
    config.trainer.micro_batch_rows = 4
    # pi_prox, decoupled PPO's proximal policy: "recompute" (the step's starting weights; an extra forward
    # pass when minibatches > 1) or "loglinear" (AReaL's interpolation between mu and pi_theta, no pass).
    config.trainer.prox = "recompute"
    # Recompute each block's activations in the backward pass (less memory, ~1/3 more compute).
    config.trainer.remat = False
    # Leave groups whose samples all scored the same out of the update: their advantage is 0 on every token,
    # so they cost trainer time and only dilute the token-mean loss. They are still consumed and accounted.
    config.trainer.skip_zero_signal = True
    # Advantage estimator (grpo, dr_grpo, rloo); GRPO divides by the group's reward std (adv_scale_by_std),
    # the population std (adv_std_ddof=0) or the unbiased one (1).
    config.trainer.advantage = "grpo"
    config.trainer.adv_scale_by_std = True
    config.trainer.adv_std_ddof = 0
    # AdamW behind global-norm clipping: linear warmup to lr, then "constant" or "cosine" decay to 0 at
    # trainer.steps. Norm scales and biases are not weight-decayed.
    config.trainer.lr = 1e-4
    config.trainer.warmup_steps = 5
    config.trainer.schedule = "constant"
    config.trainer.b1 = 0.9
    config.trainer.b2 = 0.999
    config.trainer.adam_eps = 1e-8
    config.trainer.weight_decay = 0.0
    config.trainer.max_grad_norm = 1.0
    # LoRA (jaxflow/models/lora.py): rank 0 trains every weight; rank r >= 1 freezes the base and trains
    # rank-r adapters on `targets` (their output scaled by alpha / r). The optimizer then holds the adapters
    # alone, checkpoints store them (the base is the base model's directory), and a weight sync to a JAX
    # engine moves only them (vLLM gets the merged weights). Raise lr with it ("LoRA without regret":
    # rank-1 adapters matched full fine-tuning for RL at about 10x its learning rate).
    config.trainer.lora = ml_collections.ConfigDict({"rank": 0, "alpha": 32.0, "targets": LORA_TARGETS})
    # Pack several sequences per row (segment ids keep them apart) instead of one padded row each.
    config.trainer.pack = True
    # With pack: the samples of a GRPO group share one copy of their prompt in a row (jaxflow.trainer.batch),
    # so the update runs the prompt's tokens once per copy instead of once per sample, for the same
    # log-probabilities and gradients (this task: 0.75x the tokens, 0.91-0.98x the update's time). False lays
    # every sample out with its own prompt.
    config.trainer.share_prompts = True

    # The policy loss (jaxflow.trainer.losses.LossConfig); u = pi_theta/pi_prox, w = pi_prox/mu, A = advantage.
    config.trainer.loss = ml_collections.ConfigDict()
    loss = config.trainer.loss
    # decoupled_ppo, ppo, dual_clip, tis, cispo, topr or gspo.
    loss.name = "decoupled_ppo"
    # Trust region: u is clipped to [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high = 0.28).
    loss.eps_low = 0.2
    loss.eps_high = 0.2
    # Dual clip for A < 0: the loss is at most -c*A (c >= 1, typically 3). None = off.
    loss.dual_clip_c = placeholder(float)
    # Bounds on w (AReaL caps it at 5); behav_weight_mode "clamp" clips w to them, "mask" drops the token,
    # "none" ignores them. A floor of None = no lower bound.
    loss.behav_weight_cap = 5.0
    loss.behav_weight_floor = placeholder(float)
    loss.behav_weight_mode = "clamp"
    # "tis": IS weight sg(clip(pi_theta/mu, tis_floor, tis_cap)).
    loss.tis_cap = 2.0
    loss.tis_floor = 0.0
    # "cispo": IS weight sg(clip(u, 1 - cispo_eps_low, 1 + cispo_eps_high)) (1.0: no lower clip); with the
    # unified mask, tokens with A > 0, u > 1 + eps_high or A < 0, u < 1 - eps_low are also dropped.
    loss.cispo_eps_low = 1.0
    loss.cispo_eps_high = 0.28
    loss.cispo_unified_mask = False
    # "topr": weight on positive sequences, and on negative ones (times sg(clip(pi_theta/mu, 0, 1)));
    # topr_split: a sequence is positive when its "advantage" > 0 or its raw "reward" > 0.
    loss.topr_pos_weight = 1.0
    loss.topr_neg_weight = 1.0
    loss.topr_split = "advantage"
    # KL penalty to the initial policy (kept frozen when kl_coef > 0): + kl_coef * k(pi_theta, pi_ref)
    # per token, with Schulman's estimator k1, k2 or k3. Reported as kl_ref.
    loss.kl_coef = 0.0
    loss.kl_estimator = "k3"
    # How token losses become the batch loss: token_mean, seq_mean_token_mean, seq_mean_token_sum or
    # constant (Dr.GRPO: sum / (sequences * constant_normalizer); None = the row length).
    loss.aggregation = "token_mean"
    loss.constant_normalizer = placeholder(float)

    config.eval = ml_collections.ConfigDict()
    # Held-out greedy accuracy every `every` steps (and at the start and the end).
    config.eval.every = 50
    config.eval.num_prompts = 256

    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.every = 25
    config.checkpoint.max_to_keep = 2

    config.cluster = ml_collections.ConfigDict()
    # Where the services run: "embedded" (all in this process) or "ray" (the trajectory service in a Ray
    # actor of its own, reached through a proxy; everything else as embedded). Needs the cluster extra.
    config.cluster.mode = "embedded"
    # The Ray cluster to join ("host:port", or "auto" for the one started on this machine with `ray
    # start`); None starts a local Ray for the run and stops it at the end. Ray's token auth stays on.
    config.cluster.address = placeholder(str)
    # Rollout engines each in a Ray actor of its own (mode "ray"; one GPU each where the cluster has GPUs,
    # one CPU otherwise), scoring rewards there; 0 keeps rollout.num_engines engines in this process.
    config.cluster.rollout_actors = 0
    # The trainer as this many Ray actors (one GPU each where the cluster has GPUs) forming one JAX mesh
    # (mode "ray", with rollout actors); 0 trains in the job's process.
    config.cluster.trainer_processes = 0
    # CPU devices per trainer process (CPU hosts and tests); None: what JAX finds there.
    config.cluster.trainer_cpu_devices = placeholder(int)
    # The mesh over all the trainer processes' devices: fsdp x tensor (fsdp -1: the devices left).
    config.cluster.trainer_mesh = ml_collections.ConfigDict({"fsdp": -1, "tensor": 1})
    # Custom Ray node resources that place each piece: the actors of a piece each ask for one unit of the
    # named resource, so they run on the nodes started with it (`ray start --resources='{"trainer": 8}'`);
    # None: any node.
    config.cluster.node_resource = ml_collections.ConfigDict(
        {"data": placeholder(str), "trainer": placeholder(str), "rollout": placeholder(str),
         "rewards": placeholder(str)})
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
