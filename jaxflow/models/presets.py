"""Published architectures as presets: the fields of their HF config.json, written out, never downloaded.

They size real runs without a checkpoint at hand: the pod planner compiles their train step from abstract
shapes, and the real-size end-to-end run builds a randomly initialised model of the same shape. Each entry
holds the config.json fields jaxflow reads (`from_hf_config`), copied from the model's published
config.json on the Hugging Face Hub.
"""

from __future__ import annotations

from typing import Any

from jaxflow.models.config import ModelConfig, from_hf_config

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "qwen3-32b": {**_QWEN3_COMMON, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**_QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                      "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
}

# Published parameter counts (embedding counted once when tied), checked against `ModelConfig.num_params`.
PUBLISHED_PARAMS = {
    "qwen3-0.6b": 0.60e9,
    "qwen3-1.7b": 1.72e9,
    "qwen3-8b": 8.19e9,
    "qwen3-32b": 32.8e9,
    "qwen3-30b-a3b": 30.5e9,
    "llama-3.1-8b": 8.03e9,
}
# Parameters a token computes with (a mixture of experts' active experts only), as published.
PUBLISHED_ACTIVE_PARAMS = {"qwen3-30b-a3b": 3.3e9}


def preset_names() -> tuple[str, ...]:
    return tuple(HF_CONFIGS)


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a published architecture, by its lower-case name (e.g. "qwen3-8b")."""
    key = name.lower()
    if key not in HF_CONFIGS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(HF_CONFIGS)}")
    return from_hf_config(dict(HF_CONFIGS[key]), source=f"preset {key}")


def hf_config(name: str) -> dict[str, Any]:
    """A copy of the preset's config.json fields, to write next to randomly initialised weights."""
    preset(name)  # validates the name
    return dict(HF_CONFIGS[name.lower()])
