"""Random tiny transformers models written to disk: the outside reference for the model tests."""

from __future__ import annotations

import numpy as np
import torch
import transformers

# name -> (transformers config class, extra config fields)
CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama_bias_rope3": (transformers.LlamaConfig, dict(
        attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32)),
}


def make_hf_model(case: str, tied: bool, directory, dtype=torch.float32, seed: int = 0):
    """Writes a random model of `case` to `directory` with save_pretrained; returns the torch model.

    Every parameter (norm scales and biases included) is randomised so that a layout mistake shows.
    """
    config_cls, extra = CASES[case]
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        rms_norm_eps=1e-5, tie_word_embeddings=tied, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model = model.to(dtype).eval()
    model.save_pretrained(directory)
    return model


def padded_batch(seed: int = 0, batch: int = 3, length: int = 12, vocab: int = 256):
    """Left-padded token ids, attention mask and HF-style position ids (numpy int32)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), np.int32)
    for b, pad in enumerate([0, 3, 7][:batch]):
        mask[b, :pad] = 0
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0) * mask  # torch needs writable arrays: copies below
    return tokens, mask, positions.astype(np.int32)


def hf_logits(model, tokens, mask, positions) -> np.ndarray:
    """transformers logits [B, T, V] as float32 numpy."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.array(tokens), dtype=torch.long),
                    attention_mask=torch.tensor(np.array(mask), dtype=torch.long),
                    position_ids=torch.tensor(np.array(positions), dtype=torch.long))
    return out.logits.float().numpy()
