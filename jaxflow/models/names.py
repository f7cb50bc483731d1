"""The one table between jaxflow parameter paths and HF tensor names.

Each row names a jaxflow parameter, the HF tensor it corresponds to, and how the two layouts relate.
Import, export and weight streaming to rollout engines all read this table, so a name or a transpose
is fixed in one place.

HF stores a linear layer as `weight[out, in]`; jaxflow stores kernels as `[in..., out...]` with heads
split out (q_proj is [D, H, K]). `in_dims` says how many leading jaxflow dims (after the layer axis)
form HF's `in` axis; rows without it are plain reshapes (biases [H, K] <-> [H*K]).

A mixture-of-experts layer (Qwen3-MoE) stacks its experts too: jaxflow's `expert_gate` is [L_sparse, E,
D, F], HF's `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` is one [F, D] tensor per layer and expert
(the layout of the published checkpoints, which transformers 5 also writes). A row's `layers` says which
HF layers its stack holds: all of them, only the sparse ones (router and experts) or only the dense ones
(a dense MLP among sparse layers).
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
    hf: str  # HF tensor name, with `{i}` for the layer index of stacked parameters, `{e}` for the expert
    in_dims: int | None = None  # kernels: leading jaxflow dims that make HF's input axis
    hf_rank: int = 1  # non-kernels: rank of the HF tensor
    layers: tuple[int, ...] = ()  # stacked rows: the HF layer index of each entry of the stack
    experts: int = 0  # expert rows: the number of experts stacked after the layer axis

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf

    @property
    def lead(self) -> int:
        """How many leading jaxflow axes index HF tensors: 0, 1 (layer) or 2 (layer, expert)."""
        return self.stacked + bool(self.experts)

    def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
        return self.hf.format(i=layer, e=expert) if self.stacked else self.hf

    def units(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(HF name, index into the jaxflow array) of each HF tensor this row holds, in stack order."""
        if not self.stacked:
            yield self.hf, ()
            return
        for s, layer in enumerate(self.layers):
            if self.experts:
                for e in range(self.experts):
                    yield self.hf_name(layer, e), (s, e)
            else:
                yield self.hf_name(layer), (s,)

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
    "router": (_MLP + "gate.weight", 1),
    "expert_gate": (_MLP + "experts.{e}.gate_proj.weight", 1),
    "expert_up": (_MLP + "experts.{e}.up_proj.weight", 1),
    "expert_down": (_MLP + "experts.{e}.down_proj.weight", 1),
}
# Layer parameters of a dense MLP and of a mixture of experts: in a Qwen3-MoE model each exists only in
# the layers of its kind (`ModelConfig.dense_layers`, `ModelConfig.sparse_layers`).
DENSE_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_bias", "up_bias", "down_bias")
MOE_NAMES = ("router", "expert_gate", "expert_up", "expert_down")
EXPERT_NAMES = ("expert_gate", "expert_up", "expert_down")


def layers_of(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers whose stack holds the layer parameter `name`, in stack order."""
    if name in MOE_NAMES:
        return cfg.sparse_layers
    if name in DENSE_MLP_NAMES:
        return cfg.dense_layers
    return tuple(range(cfg.num_layers))

# HF tensors that carry no parameters (rotary buffers saved by old transformers versions).
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_maps(cfg: ModelConfig, layer_names: tuple[str, ...]) -> list[TensorMap]:
    """The table for one model: its top-level parameters and its layer parameters `layer_names`."""
    rows = [TensorMap(("embed",), "model.embed_tokens.weight", hf_rank=2)]
    for name in layer_names:
        suffix, in_dims = LAYER_TABLE[name]
        rows.append(TensorMap(("layers", name), LAYER_PREFIX + suffix, in_dims=in_dims,
                              layers=layers_of(cfg, name),
                              experts=cfg.num_experts if name in EXPERT_NAMES else 0))
    rows.append(TensorMap(("final_norm",), "model.norm.weight"))
    if not cfg.tie_word_embeddings:
        rows.append(TensorMap(("lm_head",), "lm_head.weight", in_dims=1))
    return rows


def hf_names(cfg: ModelConfig, layer_names: tuple[str, ...]) -> Iterator[tuple[str, TensorMap, tuple[int, ...]]]:
    """Every HF tensor name of the model with its row and its index into the row's jaxflow array (()
    for unstacked rows, (stack position,) for layer rows, (stack position, expert) for expert rows)."""
    for row in tensor_maps(cfg, layer_names):
        for name, index in row.units():
            yield name, row, index
