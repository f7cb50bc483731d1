"""The model description shared by the Llama, Qwen2, Qwen3 and Qwen3-MoE layouts, and its HF config.json form.

One frozen dataclass describes every supported checkpoint; the layout differences (qkv bias, q/k RMSNorm,
tied embeddings, rope scaling, mixture-of-experts MLPs) are fields, not subclasses, so the forward pass has
one code path.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

# HF architecture name -> model_type. The layout flags are read per architecture in `from_hf_config`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = ("float32", "bfloat16", "float16")


class ModelConfigError(ValueError):
    """A config.json that jaxflow cannot turn into a model; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and layout of a decoder-only transformer.

    Hashable (it is static data of the nnx module), so list-like HF fields are stored as tuples.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # ("rope_type", ...) plus the type's own fields, as sorted (key, value) pairs.
    rope_scaling: tuple[tuple[str, Any], ...] = (("rope_type", "default"),)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    # Checkpoint dtype: the dtype parameters are kept in unless a loader is told otherwise.
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (Qwen3-MoE; `jaxflow.models.moe`). num_experts 0: every MLP is dense. A layer i
    # is sparse unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0, as transformers
    # decides; a sparse layer's experts are [moe_intermediate_size] wide, a dense layer's MLP
    # [intermediate_size]. The router keeps each token's num_experts_per_tok most likely experts, their
    # weights renormalised to sum to 1 when norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.dtype not in _DTYPES:
            raise ModelConfigError(f"dtype {self.dtype!r} is not one of {_DTYPES}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ModelConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                       f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ModelConfigError(f"moe_intermediate_size={self.moe_intermediate_size} and "
                                       f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ModelConfigError(f"mlp_only_layers {bad} are not layers of a {self.num_layers}-layer model")
        elif self.architecture == "Qwen3MoeForCausalLM":
            raise ModelConfigError("Qwen3MoeForCausalLM needs num_experts >= 1")
        rope_type = dict(self.rope_scaling).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope(self) -> dict[str, Any]:
        """The rope settings as a dict with at least `rope_type`."""
        return dict(self.rope_scaling)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts, in order (none for a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense MLP, in order."""
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding counted once when tied); `active`: with only the experts one
        token runs (num_experts_per_tok of each sparse layer's num_experts)."""
        d, f, h, g, k = (self.hidden_size, self.intermediate_size, self.num_heads,
                         self.num_kv_heads, self.head_dim)
        attn = d * (h + 2 * g) * k + h * k * d
        attn += (h + 2 * g) * k * self.qkv_bias + d * self.o_bias + 2 * k * self.qk_norm
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        experts = self.num_experts_per_tok if active else self.num_experts
        moe = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        per_layer = attn + 2 * d
        mlps = len(self.dense_layers) * mlp + len(self.sparse_layers) * moe
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + mlps + d + head


def _tuple(x):
    return tuple(x) if isinstance(x, list) else x


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """Reads rope settings from where transformers 5 writes them (`rope_parameters`) or older files do."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    params.setdefault("rope_type", "default")
    return theta, tuple(sorted((k, _tuple(v)) for k, v in params.items()))


def from_hf_config(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json; `source` names the file in error messages."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: architecture {arch!r} (model_type {hf.get('model_type')!r}) is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key):
        if key not in hf:
            raise ModelConfigError(f"{source}: missing required field {key!r} for {arch}")
        return hf[key]

    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window"):
        raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = hf.get("head_dim") or hidden // num_heads
    theta, rope = _rope_from_hf(hf)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    attention_bias = bool(hf.get("attention_bias", False))
    layout = {
        "LlamaForCausalLM": dict(qkv_bias=attention_bias, o_bias=attention_bias,
                                 mlp_bias=bool(hf.get("mlp_bias", False)), qk_norm=False),
        "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
        "Qwen3ForCausalLM": dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
                                 qk_norm=True),
        "Qwen3MoeForCausalLM": dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=False,
                                    qk_norm=True),
    }[arch]
    if arch == "Qwen3MoeForCausalLM":
        # transformers 5 writes the expert count as num_local_experts, the Hub's files as num_experts.
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ModelConfigError(f"{source}: missing required field 'num_experts' for {arch}")
        layout.update(num_experts=int(experts), num_experts_per_tok=int(need("num_experts_per_tok")),
                      moe_intermediate_size=int(need("moe_intermediate_size")),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                      mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            dtype=str(dtype),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_tuple(hf.get("eos_token_id")),
            **layout,
        )
    except ModelConfigError as e:
        raise ModelConfigError(f"{source}: {e}") from None


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json that transformers 5 reads back into the same model."""
    rope = {"rope_theta": cfg.rope_theta, **cfg.rope}
    hf = {
        "architectures": [cfg.architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {k: list(v) if isinstance(v, tuple) else v for k, v in rope.items()},
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "dtype": cfg.dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
    }
    if cfg.architecture == "LlamaForCausalLM":
        if cfg.qkv_bias != cfg.o_bias:
            raise ModelConfigError("Llama layout has one attention_bias flag for q/k/v and o")
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    elif cfg.architecture == "Qwen3ForCausalLM":
        hf.update(attention_bias=cfg.qkv_bias, use_sliding_window=False)
    elif cfg.architecture == "Qwen3MoeForCausalLM":
        hf.update(attention_bias=cfg.qkv_bias, use_sliding_window=False, num_experts=cfg.num_experts,
                  num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                  norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                  mlp_only_layers=list(cfg.mlp_only_layers))
    else:
        hf.update(use_sliding_window=False)
    return hf


def read_hf_config(directory: str | pathlib.Path) -> dict[str, Any]:
    """Parses `<directory>/config.json`, naming the file in any error."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"no config.json in {directory} (expected an HF model directory)")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    return hf
