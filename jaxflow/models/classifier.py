"""Scalar-head sequence classifiers (reward models): HF `...ForSequenceClassification` directories on our model.

A reward model in the HF layout is a decoder backbone (`model.*`, the tensors of the causal LM without its LM
head) plus `score.weight` [num_labels, hidden]; transformers computes `score(hidden_states)` at every position
and keeps, per row, the value at the rightmost token that is not `pad_token_id` (the last position when the
config sets no pad token). `SequenceClassifier` is our `Transformer` backbone with that head, and
`load_sequence_classifier` reads such a directory of a supported family (Llama, Qwen2, Qwen3, Qwen3-MoE) with
one label: a scalar score per sequence.

Design: the backbone is loaded through the same table and checks as a causal LM (`hf_io.params_from_hf`), its
config read as the family's causal LM with tied embeddings, so it has no LM head to allocate (a classifier
checkpoint has none). The head runs on the one pooled hidden state per row, in float32 (transformers runs it
in the parameter dtype on every position: the same numbers in float32, rounding apart in bfloat16).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.models.config import ModelConfig, ModelConfigError, from_hf_config, read_hf_config, to_hf_config
from jaxflow.models.hf_io import TOKENIZER_FILES, abstract_model, check_hf_names, iter_hf_tensors, params_from_hf
from jaxflow.models.safetensors_io import CheckpointError, CheckpointReader, write_checkpoint
from jaxflow.models.transformer import Transformer

# HF sequence-classifier architecture -> the causal LM whose backbone it shares.
SEQUENCE_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "Qwen3MoeForSequenceClassification": "Qwen3MoeForCausalLM",
}
SCORE_TENSOR = "score.weight"


def num_labels(hf: dict) -> int:
    """The label count of a parsed config.json as transformers reads it: len(id2label) when set, else
    `num_labels`, else 2 (transformers' default)."""
    id2label = hf.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label)
    value = hf.get("num_labels", 2)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else -1


def classifier_config(directory: str | os.PathLike) -> tuple[ModelConfig, int | None]:
    """(the backbone's ModelConfig, pad_token_id) of the HF sequence classifier in `directory`.

    Raises:
      ModelConfigError: naming the directory and what it holds: an architecture that is not a sequence
        classifier of a supported family (a causal LM is not a reward model), or not exactly one label.
    """
    directory = pathlib.Path(directory)
    hf = read_hf_config(directory)
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SEQUENCE_CLASSIFIERS:
        raise ModelConfigError(
            f"{directory} is not a reward model: its config.json names architecture {arch!r}; a reward model is a "
            f"sequence classifier with one label, one of {', '.join(SEQUENCE_CLASSIFIERS)}")
    labels = num_labels(hf)
    if labels != 1:
        raise ModelConfigError(
            f"{directory} is a {arch} with {labels} labels (id2label {hf.get('id2label')!r}); a reward model "
            "has exactly one (a scalar score per sequence)")
    pad = hf.get("pad_token_id")
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ModelConfigError(f"{directory / 'config.json'}: pad_token_id must be a token id or null, got {pad!r}")
    backbone = dict(hf, architectures=[SEQUENCE_CLASSIFIERS[arch]], tie_word_embeddings=True)
    return from_hf_config(backbone, source=str(directory / "config.json")), pad


class SequenceClassifier(nnx.Module):
    """A `Transformer` backbone with a scalar head: `score` [D, 1] on the hidden state of each row's last
    token that is not `pad_token_id` (the last real token when None), as transformers pools.

    The backbone is built with tied embeddings and its LM head is never used; `pad_token_id` is static."""

    def __init__(self, backbone: Transformer, score_dl: jax.Array, pad_token_id: int | None):
        if score_dl.shape != (backbone.config.hidden_size, 1):
            raise ValueError(f"score head must be [{backbone.config.hidden_size}, 1], got {tuple(score_dl.shape)}")
        self.backbone = backbone
        self.score = nnx.Param(score_dl, logical_axes=("embed", None))
        self.pad_token_id = pad_token_id

    @property
    def config(self) -> ModelConfig:
        return self.backbone.config

    def last_index(self, tokens_bt: jax.Array, lengths_b: jax.Array) -> jax.Array:
        """[B] int32: per row, the rightmost position < length whose token is not the pad token (0 when there
        is none), transformers' `(arange * non_pad).argmax(-1)` restricted to the row's real tokens."""
        real = jnp.arange(tokens_bt.shape[1])[None] < lengths_b[:, None]
        if self.pad_token_id is not None:
            real = real & (tokens_bt != self.pad_token_id)
        return jnp.argmax(jnp.arange(tokens_bt.shape[1], dtype=jnp.int32)[None] * real, axis=-1).astype(jnp.int32)

    def __call__(self, tokens_bt: jax.Array, lengths_b: jax.Array) -> jax.Array:
        """[B] float32 scores of right-padded rows: row b's sequence is tokens_bt[b, :lengths_b[b]] from
        position 0 (what follows is ignored)."""
        segments = (jnp.arange(tokens_bt.shape[1])[None] < lengths_b[:, None]).astype(jnp.int32)
        h_btd = self.backbone.hidden_states(tokens_bt, None, segments)
        index = self.last_index(tokens_bt, lengths_b)
        h_bd = jnp.take_along_axis(h_btd, index[:, None, None], axis=1)[:, 0]
        return jnp.einsum("bd,dl->bl", h_bd, self.score[...], preferred_element_type=jnp.float32)[:, 0]


class _Backbone:
    """A checkpoint reader seen as the backbone's name -> tensor mapping: everything but the score head."""

    def __init__(self, reader: CheckpointReader):
        self._reader = reader

    def keys(self):
        return [name for name in self._reader if name != SCORE_TENSOR]

    def __getitem__(self, name: str) -> np.ndarray:
        if name == SCORE_TENSOR:
            raise KeyError(name)
        return self._reader.get(name)


def check_classifier_files(directory: str | os.PathLike) -> tuple[ModelConfig, int | None]:
    """Checks the HF sequence classifier in `directory` without reading its weights: `classifier_config`, then
    the checkpoint's tensor names (the backbone's exactly, as `hf_io.check_hf_names` asks of a causal LM, plus
    `score.weight`) and the head's shape [1, hidden]. Returns what `classifier_config` returns.

    Raises:
      ModelConfigError: as `classifier_config`.
      CheckpointError: no checkpoint, a tensor missing or extra, or a head of the wrong shape (named with its file).
    """
    directory = pathlib.Path(directory)
    cfg, pad = classifier_config(directory)
    with CheckpointReader(directory) as reader:
        names = set(reader)
        if SCORE_TENSOR not in names:
            raise CheckpointError(f"checkpoint {directory} has no {SCORE_TENSOR!r}: not a sequence classifier's "
                                  f"weights (its config.json says {read_hf_config(directory)['architectures'][0]})")
        shape = tuple(reader.get(SCORE_TENSOR).shape)
        if shape != (1, cfg.hidden_size):
            raise CheckpointError(f"{reader.file_of(SCORE_TENSOR)}: tensor {SCORE_TENSOR!r} has shape {shape}, "
                                  f"expected (1, {cfg.hidden_size}) (one label, hidden_size)")
    check_hf_names(cfg, abstract_model(cfg).layers.names, names - {SCORE_TENSOR}, source=f"checkpoint {directory}",
                   error=CheckpointError)
    return cfg, pad


def load_sequence_classifier(directory: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
                             param_dtype=None, rules=None) -> SequenceClassifier:
    """Loads the HF sequence classifier with one label in `directory` (config.json + safetensors).

    Everything is checked (`check_classifier_files`, then every backbone tensor's shape) before anything is
    placed. mesh: default one device; param_dtype: default the config's dtype. The head is replicated; the
    backbone is placed with its logical-axis shardings.

    Raises:
      ModelConfigError: the directory does not hold a one-label sequence classifier of a supported family.
      CheckpointError: a tensor is missing, extra or of the wrong shape (named with its file).
    """
    directory = pathlib.Path(directory)
    cfg, pad = check_classifier_files(directory)
    dtype = jnp.dtype(param_dtype or cfg.dtype)
    mesh = mesh or sharding.make_mesh(devices=jax.devices()[:1])
    graphdef = nnx.graphdef(abstract_model(cfg, param_dtype))
    with CheckpointReader(directory) as reader:
        state = params_from_hf(cfg, _Backbone(reader), mesh, param_dtype=param_dtype, rules=rules,
                               source=f"checkpoint {directory}", error=CheckpointError,
                               where=lambda name: f"{reader.file_of(name)}: tensor {name!r}")
        head_dl = np.asarray(reader.get(SCORE_TENSOR), dtype=dtype).T.copy()
    score = jax.device_put(head_dl, sharding.named_sharding(("embed", None), head_dl.shape, mesh, rules))
    return SequenceClassifier(nnx.merge(graphdef, state), score, pad)


def export_sequence_classifier(classifier: SequenceClassifier, directory: str | os.PathLike, *,
                               tokenizer_dir: str | os.PathLike | None = None, overwrite: bool = False) -> pathlib.Path:
    """Writes `classifier` as the HF one-label `...ForSequenceClassification` directory transformers'
    `save_pretrained` writes for its family: the backbone's `model.*` tensors (never an LM head),
    `score.weight` [1, hidden], config.json with one label and the pad token, and the tokenizer files of
    `tokenizer_dir`. `load_sequence_classifier` and transformers' `AutoModelForSequenceClassification` load it.
    Refuses to write over an existing model directory unless `overwrite`."""
    directory = pathlib.Path(directory)
    if (directory / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{directory} already holds a model (config.json); pass overwrite=True or choose "
                              f"another directory")
    cfg = classifier.config
    architecture = {causal: name for name, causal in SEQUENCE_CLASSIFIERS.items()}.get(cfg.architecture)
    if architecture is None:
        raise ModelConfigError(f"no sequence classifier for the architecture {cfg.architecture!r}")
    tensors = {name: t for name, t in iter_hf_tensors(classifier.backbone) if not name.startswith("lm_head.")}
    tensors[SCORE_TENSOR] = np.asarray(classifier.score[...], dtype=np.float32).T.copy()
    config = {**to_hf_config(cfg), "architectures": [architecture], "tie_word_embeddings": False,
              "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "pad_token_id": classifier.pad_token_id}
    directory.mkdir(parents=True, exist_ok=True)
    write_checkpoint(directory, tensors)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (directory / name).resolve():
                shutil.copyfile(src, directory / name)
    return directory
