"""LoRA adapters on the policy: what they are, how they are named, and PEFT's format on disk.

A target projection W (q, k, v, o, gate, up, down; jaxflow layout [in..., out...], stacked over layers)
gets two trainable matrices per layer, A [in, r] and B [r, out], and computes

    y = x W + (alpha / r) (x A) B

unmerged: the frozen W is never rewritten, the adapters add a rank-r path beside it (`decoder_layer`
reads them from `DecoderLayers.stacked()`), in the trainer's forward and in the JAX engine's alike. A is
random (std 1/sqrt(in)), B zero: a model with fresh adapters computes exactly what its base does. The
adapters are `nnx.LoRAParam`s (a kind of `nnx.Param`), so `nnx.state(model, nnx.LoRAParam)` is the
adapter-only state: what the optimizer holds, what a checkpoint stores and what a weight sync moves.

Why our own few lines and not qwix or `flax.nnx.LoRA`: jaxflow's layers are stacked [L, ...] arrays
that one `lax.scan` runs and the engine's decode reuses (no `nnx.Linear` modules to wrap, which is what
both of those rewrite), and the adapters must keep HF/PEFT names for the sync to vLLM and the export.
qwix's quantised base (QLoRA) is the reason to revisit this; it is not done here.

PEFT's names and layout (what `peft` and vLLM load): `adapter_model.safetensors` holds, per layer and
target, `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (HF's [out, in] convention), with W_hf + (alpha / r) B A the adapted weight; and
`adapter_config.json` says r, lora_alpha and target_modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.models import names

__all__ = ["LORA_TARGETS", "LoRASpec", "adapter_names", "attach", "lora_problems"]

# Projections that can carry adapters, in the order of the layer table.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The targets a mixture-of-experts model (Qwen3-MoE) may carry: its MLPs are experts, which take no adapters.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# jaxflow input dims (after the layer axis) of each target: HF's `in` axis (names.py's table).
IN_DIMS = {t: names.LAYER_TABLE[t][1] for t in LORA_TARGETS}
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """rank r >= 1, alpha > 0 (the adapters' output is scaled by alpha / r) and the target projections."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        problems = lora_problems(self.rank, self.alpha, self.targets, prefix="lora.")
        if not problems and self.rank == 0:  # rank 0 is the config's "no LoRA", never an adapter
            problems = ["lora.rank must be >= 1 for adapters (rank 0 means no LoRA: no LoRASpec)"]
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    @classmethod
    def from_config(cls, section) -> LoRASpec | None:
        """The `trainer.lora` section (rank 0: no adapters) as a spec, or None."""
        if section is None or section.rank == 0:
            return None
        return cls(int(section.rank), float(section.alpha), tuple(section.targets))

    def peft_config(self, base_model: str | None = None) -> dict[str, Any]:
        """adapter_config.json's fields for these adapters (PEFT's LoraConfig, task CAUSAL_LM)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": list(self.targets), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
                "init_lora_weights": True, "modules_to_save": None,
                "base_model_name_or_path": base_model}


def lora_problems(rank, alpha, targets, prefix: str = "trainer.lora.") -> list[str]:
    """What is wrong with a LoRA setting (rank 0 switches LoRA off and is fine), one message per key."""
    problems = []
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
        problems.append(f"{prefix}rank must be an int >= 0 (0: no LoRA), got {rank!r:.80}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        problems.append(f"{prefix}alpha must be a number > 0, got {alpha!r:.80}")
    if isinstance(targets, str) or not isinstance(targets, Iterable):
        problems.append(f"{prefix}targets must be a list of projections from {', '.join(LORA_TARGETS)}, "
                        f"got {targets!r:.80}")
    else:
        targets = list(targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            problems.append(f"{prefix}targets: {', '.join(map(repr, unknown))} not a projection; valid: "
                            f"{', '.join(LORA_TARGETS)}")
        elif not targets:
            problems.append(f"{prefix}targets is empty; name at least one of {', '.join(LORA_TARGETS)}")
        elif len(set(targets)) != len(targets):
            problems.append(f"{prefix}targets names a projection twice: {targets}")
    return problems


def attach(layers, spec: LoRASpec, key: jax.Array, mesh: jax.sharding.Mesh | None = None, rules=None) -> None:
    """Gives `layers` (a `DecoderLayers`, its kernels loaded or abstract) fresh adapters for `spec`'s
    targets: A normal with std 1/sqrt(in), B zero, in the kernels' dtype, with the kernels' logical axes
    (the rank axis replicated); placed on `mesh` when given. Raises ValueError when it has adapters."""
    if getattr(layers, "lora", None) is not None:
        raise ValueError(f"the model already has LoRA adapters ({layers.lora}); load a base model to add others")
    mlp = [t for t in spec.targets if t not in ATTENTION_TARGETS]
    if "router" in layers.names and mlp:
        raise ValueError(f"lora targets {', '.join(mlp)}: a mixture-of-experts model carries adapters on its "
                         f"attention projections only ({', '.join(ATTENTION_TARGETS)}); its experts have none")
    for target, k in ((t, IN_DIMS[t]) for t in spec.targets):
        kernel = getattr(layers, target)
        axes, shape, dtype = kernel.get_metadata()["logical_axes"], kernel[...].shape, kernel[...].dtype
        a_shape, b_shape = (shape[0], *shape[1:1 + k], spec.rank), (shape[0], spec.rank, *shape[1 + k:])
        a_axes, b_axes = (*axes[:1 + k], "lora_rank"), (axes[0], "lora_rank", *axes[1 + k:])
        key, sub = jax.random.split(key)
        std = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
        a = (std * jax.random.normal(sub, a_shape, np.float32)).astype(dtype)
        b = jax.numpy.zeros(b_shape, dtype)
        if mesh is not None:
            a = jax.device_put(a, sharding.named_sharding(a_axes, a_shape, mesh, rules))
            b = jax.device_put(b, sharding.named_sharding(b_axes, b_shape, mesh, rules))
        setattr(layers, f"{target}_lora_a", nnx.LoRAParam(a, logical_axes=a_axes))
        setattr(layers, f"{target}_lora_b", nnx.LoRAParam(b, logical_axes=b_axes))
    layers.lora = spec


def adapter_names(num_layers: int, targets: Iterable[str]) -> Iterator[tuple[str, str, str, int]]:
    """(PEFT name, target, "a" or "b", layer) of every adapter tensor, in a fixed order."""
    for i in range(num_layers):
        for t in targets:
            stem = PEFT_PREFIX + names.LAYER_PREFIX.format(i=i) + names.LAYER_TABLE[t][0].removesuffix(".weight")
            yield f"{stem}.lora_A.weight", t, "a", i
            yield f"{stem}.lora_B.weight", t, "b", i


def to_peft(which: str, x: np.ndarray) -> np.ndarray:
    """One layer's jaxflow A [in..., r] or B [r, out...] -> PEFT's lora_A [r, in] or lora_B [out, r]."""
    if which == "a":
        return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)
    return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)


def from_peft(which: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """PEFT's lora_A [r, in] / lora_B [out, r] -> the jaxflow per-layer array of `shape`."""
    return w.T.reshape(shape)


def peft_tensors(layers) -> dict[str, np.ndarray]:
    """The adapters of `layers` (a `DecoderLayers` with LoRA) as PEFT-named host arrays (gathered)."""
    spec = layers.lora
    stacked = {(t, w): np.asarray(jax.device_get(getattr(layers, f"{t}_lora_{w}")[...]))
               for t in spec.targets for w in "ab"}
    return {name: to_peft(w, stacked[t, w][i])
            for name, t, w, i in adapter_names(stacked[spec.targets[0], "a"].shape[0], spec.targets)}


def adapter_arrays(layers, tensors: Mapping[str, np.ndarray], *, source: str,
                   error: type[Exception] = ValueError) -> dict[str, np.ndarray]:
    """PEFT-named `tensors` -> {"<target>_lora_a"/"_b": stacked jaxflow host array} for `layers` (a
    `DecoderLayers` with LoRA), after checking that they are exactly its adapters: every name present and
    no other, each shape and dtype as the model's. `error` (naming `source` and the tensor) otherwise."""
    spec = layers.lora
    if spec is None:
        raise error(f"{source}: the model has no LoRA adapters to load them into")
    num_layers = getattr(layers, spec.targets[0] + "_lora_a")[...].shape[0]
    expected = {name: (t, w, i) for name, t, w, i in adapter_names(num_layers, spec.targets)}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise error(f"{source}: not this model's adapters (rank {spec.rank}, targets {', '.join(spec.targets)}): "
                    + "; ".join(filter(None, [missing and f"{len(missing)} missing, e.g. {missing[0]!r}",
                                              extra and f"{len(extra)} unexpected, e.g. {extra[0]!r}"])))
    by_key = {key: name for name, key in expected.items()}
    out = {}
    for t in spec.targets:
        for w in "ab":
            var = getattr(layers, f"{t}_lora_{w}")
            shape, dtype = var[...].shape, var[...].dtype
            layer_shape = shape[1:]
            peft_shape = to_peft(w, np.zeros(layer_shape, np.float32)).shape
            stacked = np.empty(shape, dtype)
            for i in range(num_layers):
                name = by_key[t, w, i]
                x = np.asarray(tensors[name])
                if x.shape != peft_shape:
                    raise error(f"{source}: tensor {name!r} has shape {x.shape}, expected {peft_shape} (rank "
                                f"{spec.rank})")
                if x.dtype != dtype:
                    raise error(f"{source}: tensor {name!r} has dtype {x.dtype}, expected {dtype}")
                stacked[i] = from_peft(w, x, layer_shape)
            out[f"{t}_lora_{w}"] = stacked
    return out


def check_peft_tensors(spec: LoRASpec, hf_shapes: Mapping[str, tuple[int, ...]], num_layers: int,
                       tensors: Mapping[str, np.ndarray], dtype, *, source: str,
                       error: type[Exception] = ValueError) -> None:
    """Checks that PEFT-named `tensors` are exactly the adapters `spec` puts on a model of `num_layers`
    layers whose HF weights have `hf_shapes` ({HF name: [out, in]}): every name present and no other, each
    lora_A [rank, in] and lora_B [out, rank], each of `dtype`. For an engine that holds no jaxflow model
    (vLLM); `error` names `source` and the tensor."""
    expected = {}
    for name, t, w, i in adapter_names(num_layers, spec.targets):
        out_dim, in_dim = hf_shapes[names.LAYER_PREFIX.format(i=i) + names.LAYER_TABLE[t][0]]
        expected[name] = (spec.rank, in_dim) if w == "a" else (out_dim, spec.rank)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise error(f"{source}: not this engine's adapters (rank {spec.rank}, targets {', '.join(spec.targets)}): "
                    + "; ".join(filter(None, [missing and f"{len(missing)} missing, e.g. {missing[0]!r}",
                                              extra and f"{len(extra)} unexpected, e.g. {extra[0]!r}"])))
    for name, shape in expected.items():
        x = tensors[name]
        if tuple(x.shape) != shape:
            raise error(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, expected {shape} (rank {spec.rank})")
        if np.dtype(x.dtype) != np.dtype(dtype):
            raise error(f"{source}: tensor {name!r} has dtype {x.dtype}, expected {np.dtype(dtype)}")


def write_adapter(directory: str | os.PathLike, spec: LoRASpec, tensors: Mapping[str, np.ndarray], *,
                  base_model: str | None = None, overwrite: bool = False) -> pathlib.Path:
    """Writes `tensors` (PEFT-named, as `Transformer` adapters give them) as a PEFT adapter directory:
    adapter_config.json + adapter_model.safetensors. Refuses to overwrite an adapter unless `overwrite`."""
    from jaxflow.models.safetensors_io import write_safetensors
    directory = pathlib.Path(directory)
    if (directory / ADAPTER_CONFIG).exists() and not overwrite:
        raise FileExistsError(f"{directory} already holds an adapter; pass overwrite=True or choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    write_safetensors(directory / ADAPTER_WEIGHTS, dict(tensors))
    tmp = directory / (ADAPTER_CONFIG + ".tmp")
    tmp.write_text(json.dumps(spec.peft_config(base_model), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / ADAPTER_CONFIG)
    return directory


def read_adapter(directory: str | os.PathLike) -> tuple[LoRASpec, dict[str, np.ndarray]]:
    """A PEFT adapter directory -> (its spec, its PEFT-named tensors).

    Raises:
      ValueError naming the file (and the key or tensor): an `adapter_config.json` that does not read as a
        JSON object, lacks `r` or `lora_alpha`, or gives a value of the wrong type (`r` an int >= 1, never a
        string, float or bool); what jaxflow cannot apply (another PEFT type, rsLoRA or DoRA, per-module
        ranks or alphas, modules it has no adapters for); a weights file that is not valid safetensors, or a
        lora_A / lora_B tensor that is not 2-D of rank `r` ([r, in] / [out, r]) or holds NaN or inf.
      FileNotFoundError: `adapter_model.safetensors` is missing.
    """
    from jaxflow.models.safetensors_io import SafetensorsFile
    directory = pathlib.Path(directory)
    path = directory / ADAPTER_CONFIG
    spec = _read_adapter_config(path)
    weights = directory / ADAPTER_WEIGHTS
    with SafetensorsFile(weights) as f:
        tensors = {name: np.array(f.get(name)) for name in f.names()}
    _check_adapter_tensors(weights, spec, tensors)
    return spec, tensors


def _read_adapter_config(path: pathlib.Path) -> LoRASpec:
    """The LoRASpec an adapter_config.json describes; ValueError naming `path` and the key otherwise."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the adapter config ({e})") from None
    except RecursionError:  # json recurses per nesting level; a hostile file can nest 100k deep
        raise ValueError(f"{path}: cannot read the adapter config (JSON nested too deeply)") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: the adapter config is a JSON {type(cfg).__name__}, expected an object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r:.80} is not LORA")
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key) not in (None, False):
            raise ValueError(f"{path}: {key} is {cfg[key]!r:.80}; jaxflow applies plain LoRA only")
    for key in ("rank_pattern", "alpha_pattern"):  # per-module r or alpha: one LoRASpec cannot say it
        if cfg.get(key):
            raise ValueError(f"{path}: {key} is set; jaxflow applies one rank and alpha to every module")
    problems = [f"{key} is missing" for key in ("r", "lora_alpha") if key not in cfg]
    rank, alpha, targets = cfg.get("r", 1), cfg.get("lora_alpha", 1.0), cfg.get("target_modules")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"r must be an int >= 1, got {rank!r:.80}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        problems.append(f"lora_alpha must be a number > 0, got {alpha!r:.80}")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        problems.append(f"target_modules must be a list of module names, got {targets!r:.80}")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    try:
        return LoRASpec(rank, float(alpha), tuple(targets))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _check_adapter_tensors(path: pathlib.Path, spec: LoRASpec, tensors: Mapping[str, np.ndarray]) -> None:
    """ValueError naming `path` and the tensor: a lora_A that is not [r, in] or a lora_B not [out, r] for
    `spec.rank` (the config's `r` must be the tensors' rank), or a tensor with a NaN or inf."""
    for name, x in tensors.items():
        rank_axis = 0 if name.endswith(".lora_A.weight") else 1 if name.endswith(".lora_B.weight") else None
        if rank_axis is not None and (x.ndim != 2 or x.shape[rank_axis] != spec.rank):
            layout = "[r, in]" if rank_axis == 0 else "[out, r]"
            raise ValueError(f"{path}: tensor {name!r} has shape {x.shape}, expected {layout} with r = {spec.rank} "
                             f"(adapter_config.json's r)")
        # Floating kinds: "f", "c", and "V" for ml_dtypes' bfloat16 and float8 (ints and bools hold no NaN).
        if x.dtype.kind in "fcV" and not (finite := np.isfinite(x)).all():
            raise ValueError(f"{path}: tensor {name!r} holds {finite.size - int(finite.sum())} NaN or inf values")
