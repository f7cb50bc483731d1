"""Loading an HF model directory straight onto a mesh, and exporting back to one.

Both directions read `jaxflow.models.names`: the same rows that load a checkpoint write it, and
`iter_hf_tensors` (export's source) is what weight streaming to rollout engines sends.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.models.config import ModelConfig, from_hf_config, read_hf_config, to_hf_config
from jaxflow.models.lora import LoRASpec, attach
from jaxflow.models.names import IGNORED_HF_SUFFIXES, TensorMap, hf_names, tensor_maps
from jaxflow.models.safetensors_io import CheckpointError, CheckpointReader, write_checkpoint
from jaxflow.models.transformer import Transformer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def abstract_model(cfg: ModelConfig, param_dtype=None) -> Transformer:
    """The model with ShapeDtypeStructs in place of arrays: shapes and logical axes, no memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))


def check_hf_names(cfg: ModelConfig, layer_names: tuple[str, ...], names, *, source: str,
                   error=ValueError) -> None:
    """Raises `error` naming `source` and the tensors if `names` are not exactly the model's HF names.

    An `lm_head.weight` beside tied embeddings and old rotary buffers are tolerated (and unused), as
    transformers does.
    """
    expected = {name for name, _, _ in hf_names(cfg, layer_names)}
    present = set(names)
    missing = sorted(expected - present)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise error(f"{source} is missing tensor(s) {missing[:5]}{more} required by its config "
                    f"({cfg.architecture})")
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(n for n in present - expected - ignorable
                        if not n.endswith(IGNORED_HF_SUFFIXES))
    if unexpected:
        raise error(f"{source} has tensor(s) {unexpected[:5]} that a {cfg.architecture} with this "
                    f"config does not have")


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                   mesh: jax.sharding.Mesh | None = None, *, param_dtype=None, cast: bool = True,
                   rules=None, source: str = "weights", where=None, error=ValueError) -> nnx.State:
    """The model's parameter State, placed on `mesh`, from HF-named tensors in HF layout.

    Every name, shape and (unless `cast`) dtype is checked against the table in
    `jaxflow.models.names` before anything is converted or sent to a device, so a bad input changes
    nothing. tensors: name -> array-like with .shape and .dtype (read only after the checks; lazy
    mappings such as a checkpoint reader work). param_dtype: default the config's dtype. cast: convert
    other dtypes to param_dtype; when False a dtype mismatch is an error. source: what the tensors are,
    for messages; where(name): how to name one tensor in messages (default `tensor 'name'`).
    Each parameter is placed with its logical-axis sharding: a device receives only its slice.
    """
    dtype = jnp.dtype(param_dtype or cfg.dtype)
    mesh = mesh or sharding.make_mesh(devices=jax.devices()[:1])
    where = where or (lambda name: f"{source}: tensor {name!r}")
    shapes = abstract_model(cfg, dtype)
    layer_names = shapes.layers.names
    check_hf_names(cfg, layer_names, tensors.keys(), source=source, error=error)
    abstract = nnx.state(shapes)
    rows = {row.path: row for row in tensor_maps(cfg, layer_names)}
    per_layer = {path: var.get_value().shape[rows[tuple(path)].lead:] for path, var in nnx.to_flat_state(abstract)}
    for name, row, _ in hf_names(cfg, layer_names):
        tensor = tensors[name]
        got, want = tuple(tensor.shape), row.hf_shape(per_layer[row.path])
        if got != want:
            raise error(f"{where(name)} has shape {got}, expected {want} from the config")
        if not cast and np.dtype(tensor.dtype) != dtype:
            raise error(f"{where(name)} has dtype {np.dtype(tensor.dtype)}, expected {dtype} (the "
                        f"parameter dtype; casting was not asked for)")

    def host_row(row: TensorMap, shape) -> np.ndarray:
        host = np.empty(shape, dtype)
        for name, index in row.units():
            host[index] = row.from_hf(np.asarray(tensors[name]), shape[row.lead:])
        return host

    placed = []
    for path, var in nnx.to_flat_state(abstract):
        shape = var.get_value().shape
        host = host_row(rows[tuple(path)], shape)
        target = sharding.named_sharding(var.get_metadata()["logical_axes"], shape, mesh, rules)
        array = jax.make_array_from_callback(shape, target, lambda index, h=host: h[index])
        placed.append((path, var.replace(value=array)))
    return nnx.from_flat_state(placed)


class _ReaderTensors(Mapping):
    """A checkpoint reader seen as name -> tensor: each value is a zero-copy view of the mapped file, so
    checking shapes and dtypes reads no data."""

    def __init__(self, reader: CheckpointReader):
        self._reader = reader

    def __getitem__(self, name: str) -> np.ndarray:
        return self._reader.get(name)

    def __iter__(self):
        return iter(self._reader)

    def __len__(self) -> int:
        return len(self._reader)


def load_model(directory: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
               param_dtype=None, rules=None, lora: LoRASpec | None = None, lora_seed: int = 0) -> Transformer:
    """Loads an HF Llama/Qwen2/Qwen3/Qwen3-MoE directory (config.json + safetensors, single or sharded).

    Each parameter is placed directly with its mesh sharding: a device receives only its own slice.
    mesh: default a one-device mesh. param_dtype: default the checkpoint's config dtype. lora: fresh
    LoRA adapters on these targets (`jaxflow.models.lora.attach`, seeded `lora_seed`) over the loaded base.
    """
    directory = pathlib.Path(directory)
    cfg = from_hf_config(read_hf_config(directory), source=str(directory / "config.json"))
    graphdef = nnx.graphdef(abstract_model(cfg, param_dtype))
    with CheckpointReader(directory) as reader:
        state = params_from_hf(cfg, _ReaderTensors(reader), mesh, param_dtype=param_dtype, rules=rules,
                               source=f"checkpoint {directory}", error=CheckpointError,
                               where=lambda name: f"{reader.file_of(name)}: tensor {name!r}")
    model = nnx.merge(graphdef, state)
    if lora is not None:
        attach(model.layers, lora, jax.random.key(lora_seed), mesh or sharding.make_mesh(devices=jax.devices()[:1]),
               rules)
    return model


def _param(model: Transformer, path: tuple[str, ...]):
    node = model
    for part in path:
        node = getattr(node, part)
    return node[...]


def iter_hf_tensors(model: Transformer, dtype=None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array in HF layout) for every tensor of the model, one at a time.

    dtype: cast on the way out (default: the parameter's dtype). Sharded parameters are gathered. A model
    with LoRA adapters gives its weights as it computes them: each target merged, W + (alpha / r) A B
    (the adapters alone: `jaxflow.models.lora.peft_tensors`).
    """
    cfg = model.config
    spec = model.layers.lora
    for row in tensor_maps(cfg, model.layers.names):
        host = np.asarray(jax.device_get(_param(model, row.path)))
        if spec is not None and row.path[0] == "layers" and row.path[-1] in spec.targets:
            a = np.asarray(jax.device_get(getattr(model.layers, f"{row.path[-1]}_lora_a")[...]), np.float32)
            b = np.asarray(jax.device_get(getattr(model.layers, f"{row.path[-1]}_lora_b")[...]), np.float32)
            delta = np.matmul(a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
            host = (host.astype(np.float32) + spec.scale * delta.reshape(host.shape)).astype(host.dtype)
        if dtype is not None:
            host = host.astype(dtype)
        for name, index in row.units():
            yield name, np.ascontiguousarray(row.to_hf(host[index]))


def export_model(model: Transformer, directory: str | os.PathLike, *, hf_config: dict | None = None,
                 dtype=None, tokenizer_dir: str | os.PathLike | None = None,
                 max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> pathlib.Path:
    """Writes an HF directory that transformers and vLLM load: config.json, safetensors, tokenizer.

    hf_config: the original config.json to keep (default: generated from the model's config).
    dtype: e.g. "bfloat16" to cast on export. tokenizer_dir: where to copy tokenizer files from.
    Refuses to write over an existing model directory unless `overwrite`.
    """
    directory = pathlib.Path(directory)
    existing = [p.name for p in [directory / "config.json", *directory.glob("model*.safetensors")]
                if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{directory} already holds a model ({', '.join(sorted(existing))}); "
                              f"pass overwrite=True or choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(hf_config) if hf_config is not None else to_hf_config(model.config)
    tensors = dict(iter_hf_tensors(model, dtype))
    if dtype is not None:
        config["dtype"] = str(jnp.dtype(dtype))
        config.pop("torch_dtype", None)
    write_checkpoint(directory, tensors, max_shard_bytes=max_shard_bytes)
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / "config.json")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (directory / name).resolve():
                shutil.copyfile(src, directory / name)
    return directory
