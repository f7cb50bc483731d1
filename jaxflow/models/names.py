"""The one table between jaxflow parameter paths and HF tensor names.

Each row names a jaxflow parameter, the HF tensor it corresponds to, and how the two layouts relate.
Import, export and weight streaming to rollout engines all read this table, so a name or a transpose
is fixed in one place.

HF stores a linear layer as `weight[out, in]`; jaxflow stores kernels as `[in..., out...]` with heads
split out (q_proj is [D, H, K]). `in_dims` says how many leading jaxflow dims (after the layer axis)
form HF's `in` axis; rows without it are plain reshapes (biases [H, K] <-> [H*K]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from jaxflow.models.config import ModelConfig

LAYER_PREFIX = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One jaxflow parameter <-> one HF tensor (per layer when `hf` contains `{i}`)."""

    path: tuple[str, ...]  # attribute path in the nnx model, e.g. ("layers", "q_proj")
    hf: str  # HF tensor name, with `{i}` for the layer index of stacked parameters
    in_dims: int | None = None  # kernels: leading jaxflow dims that make HF's input axis
    hf_rank: int = 1  # non-kernels: rank of the HF tensor

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    def hf_name(self, layer: int | None = None) -> str:
        return self.hf.format(i=layer) if self.stacked else self.hf

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """HF shape of one (per-layer) jaxflow array of `shape`."""
        if self.in_dims is not None:
            return (math.prod(shape[self.in_dims:]), math.prod(shape[:self.in_dims]))
        lead = shape[:self.hf_rank - 1]
        return (*lead, math.prod(shape[self.hf_rank - 1:]))

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """jaxflow (per-layer) array -> HF tensor; a view when no transpose is needed."""
        if self.in_dims is not None:
            return x.reshape(math.prod(x.shape[:self.in_dims]), -1).T
        return x.reshape(self.hf_shape(x.shape))

    def from_hf(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """HF tensor -> jaxflow (per-layer) array of `shape`."""
        if self.in_dims is not None:
            return w.T.reshape(shape)
        return w.reshape(shape)


_ATTN = "self_attn."
_MLP = "mlp."
# Layer parameters: attribute name -> (HF suffix, in_dims). Optional ones appear only when the model
# has them (DecoderLayers decides which exist).
LAYER_TABLE = {
    "input_norm": ("input_layernorm.weight", None),
    "q_proj": (_ATTN + "q_proj.weight", 1),
    "k_proj": (_ATTN + "k_proj.weight", 1),
    "v_proj": (_ATTN + "v_proj.weight", 1),
    "o_proj": (_ATTN + "o_proj.weight", 2),
    "q_bias": (_ATTN + "q_proj.bias", None),
    "k_bias": (_ATTN + "k_proj.bias", None),
    "v_bias": (_ATTN + "v_proj.bias", None),
    "o_bias": (_ATTN + "o_proj.bias", None),
    "q_norm": (_ATTN + "q_norm.weight", None),
    "k_norm": (_ATTN + "k_norm.weight", None),
    "post_attn_norm": ("post_attention_layernorm.weight", None),
    "gate_proj": (_MLP + "gate_proj.weight", 1),
    "up_proj": (_MLP + "up_proj.weight", 1),
    "down_proj": (_MLP + "down_proj.weight", 1),
    "gate_bias": (_MLP + "gate_proj.bias", None),
    "up_bias": (_MLP + "up_proj.bias", None),
    "down_bias": (_MLP + "down_proj.bias", None),
}

# HF tensors that carry no parameters (rotary buffers saved by old transformers versions).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_maps(cfg: ModelConfig, layer_names: tuple[str, ...]) -> list[TensorMap]:
    """The table for one model: its top-level parameters and its layer parameters `layer_names`."""
    rows = [TensorMap(("embed",), "model.embed_tokens.weight", hf_rank=2)]
    for name in layer_names:
        suffix, in_dims = LAYER_TABLE[name]
        rows.append(TensorMap(("layers", name), LAYER_PREFIX + suffix, in_dims=in_dims))
    rows.append(TensorMap(("final_norm",), "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        rows.append(TensorMap(("lm_head",), "lm_head.weight", in_dims=1))
    return rows


def hf_names(cfg: ModelConfig, layer_names: tuple[str, ...]) -> Iterator[tuple[str, TensorMap, int | None]]:
    """Every HF tensor name of the model with its row and layer index (None for unstacked rows)."""
    for row in tensor_maps(cfg, layer_names):
        if row.stacked:
            for i in range(cfg.num_layers):
                yield row.hf_name(i), row, i
        else:
            yield row.hf_name(), row, None
