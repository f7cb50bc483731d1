"""Model check on a tiny model: build an HF model + tokenizer, load onto the local mesh, score, export.

Variants pick the layout: `:llama`, `:qwen2`, `:qwen3` (default).

Command:
  .venv/bin/python -m jaxflow.main --config=configs/tiny_model.py
  .venv/bin/python -m jaxflow.main --config=configs/tiny_model.py:llama --config.mesh.tensor=1
"""

import ml_collections

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "qwen3"
    if variant not in ARCHITECTURES:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(ARCHITECTURES)}")
    config = ml_collections.ConfigDict()
    # Which job jaxflow.main runs.
    config.job = "model_check"
    # Where the tiny model, its export and any logs go (created if missing).
    config.workdir = f"runs/tiny_model_{variant}"
    # Seed for the random model weights.
    config.seed = 0
    # Timed forward passes after the first (compiling) one; the median is reported.
    config.repeats = 5

    config.model = ml_collections.ConfigDict()
    # HF architecture written into config.json.
    config.model.architecture = ARCHITECTURES[variant]
    # Width of the residual stream.
    config.model.hidden_size = 64
    # Width of the SwiGLU hidden layer.
    config.model.intermediate_size = 128
    # Number of decoder blocks.
    config.model.num_layers = 2
    # Query heads and key/value heads (grouped-query attention when fewer kv heads).
    config.model.num_heads = 4
    config.model.num_kv_heads = 2
    # Width of one attention head (vLLM's CPU attention needs >= 32).
    config.model.head_dim = 32
    # Whether the LM head reuses the token embedding.
    config.model.tie_word_embeddings = True

    config.mesh = ml_collections.ConfigDict()
    # Mesh axis sizes; one may be -1 to take the remaining devices.
    config.mesh.data = 1
    config.mesh.fsdp = -1
    config.mesh.tensor = 1
    return config
