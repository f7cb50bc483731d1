"""Randomly initialised HF models of a published shape (a preset), with a tokenizer of the real vocab size.

A real-size run needs a model that transformers, vLLM and jaxflow all load, with the published
architecture (e.g. Qwen3-0.6B: 28 layers, hidden 1,024, vocab 151,936), but not its weights: the run checks
the plumbing, not learning, and nothing may be downloaded. `make_random_hf_model` writes config.json (the
preset's fields), random safetensors and a tokenizer whose vocabulary is exactly the model's:
256 byte-level tokens (any text encodes), filler tokens up to the vocab size, and ChatML's special tokens at
the ids the preset's config.json names (`bos_token_id`, `eos_token_id`), so generation stops where the real
model's would.

    .venv/bin/python -m jaxflow.models.random_hf --preset qwen3-0.6b --out runs/base/qwen3-0.6b-random
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxflow.models.tiny import ENDOFTEXT, IM_END, IM_START, write_tokenizer_config
from jaxflow.tokenizer import Tokenizer

__all__ = ["filler_token", "make_random_hf_model", "write_filler_tokenizer"]

# 256 byte tokens (ByteLevel's alphabet) + ChatML's three special tokens: the smallest vocab this writes.
MIN_FILLER_VOCAB = 256 + 3


def filler_token(token_id: int) -> str:
    """The text of the filler token at `token_id`: a token no text encodes to (BPE has no merges to reach it)."""
    return f"<|filler_{token_id}|>"


def write_filler_tokenizer(directory: str | os.PathLike, vocab_size: int, *, special_ids: dict[str, int] | None = None,
                           model_max_length: int = 40960) -> Tokenizer:
    """Writes a byte-level tokenizer with exactly `vocab_size` ids as an HF tokenizer directory.

    Ids 0-255 are the byte-level alphabet (any text encodes to them, one token a byte; no merges), the
    special tokens sit at `special_ids`, and every other id is a filler token (`filler_token(id)`) that
    decodes to its own text. Qwen's <|endoftext|> pads, <|im_end|> ends a turn (eos); the chat template
    is ChatML.

    Args:
      directory: where `tokenizer.json` and `tokenizer_config.json` go; created if missing.
      vocab_size: ids in the vocabulary (the model's embedding rows), >= 259.
      special_ids: ids of <|endoftext|>, <|im_start|>, <|im_end|>; default: the three ids after the bytes.
        Qwen3's are 151643, 151644, 151645.
      model_max_length: the longest sequence in tokens, written to tokenizer_config.json.

    Returns:
      the written tokenizer, loaded back with `Tokenizer.from_dir`.

    Raises:
      ValueError: vocab_size too small, or special ids outside 256..vocab_size-1 or not distinct.
    """
    if not isinstance(vocab_size, int) or vocab_size < MIN_FILLER_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_FILLER_VOCAB} (256 bytes + 3 special tokens), "
                         f"got {vocab_size!r}")
    special_ids = dict(special_ids or {ENDOFTEXT: 256, IM_START: 257, IM_END: 258})
    if set(special_ids) != {ENDOFTEXT, IM_START, IM_END}:
        raise ValueError(f"special_ids must name exactly {ENDOFTEXT}, {IM_START}, {IM_END}; got {sorted(special_ids)}")
    ids = list(special_ids.values())
    if len(set(ids)) != 3 or any(not isinstance(i, int) or not 256 <= i < vocab_size for i in ids):
        raise ValueError(f"special_ids must be 3 distinct ids in [256, {vocab_size}), got {special_ids}")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    by_id = {i: tok for tok, i in special_ids.items()}
    for i in range(256, vocab_size):
        vocab[by_id.get(i) or filler_token(i)] = i
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                  for t in (ENDOFTEXT, IM_START, IM_END)])
    tokenizer.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(directory, model_max_length)
    written = Tokenizer.from_dir(directory)
    if written.vocab_size != vocab_size:  # a filler colliding with an alphabet entry would shrink it
        raise AssertionError(f"wrote {written.vocab_size} ids, meant {vocab_size}")
    return written


def make_random_hf_model(directory: str | os.PathLike, preset: str = "qwen3-0.6b", *, dtype: str | None = None,
                         seed: int = 0, overwrite: bool = False, log=print) -> pathlib.Path:
    """Writes a randomly initialised model of a published shape, plus a tokenizer of its vocab size.

    config.json holds the preset's fields (`jaxflow.models.presets`) with `torch_dtype` set to `dtype`; the
    weights are drawn as jaxflow initialises a model (`initializer_range`), in `dtype`; the tokenizer is
    `write_filler_tokenizer` with Qwen's special-token ids when the preset names them. transformers, vLLM
    and `jaxflow.models.hf_io.load_model` load the result.

    Args:
      directory: the model directory; created if missing.
      preset: a `jaxflow.models.presets` name (e.g. "qwen3-0.6b").
      dtype: "float32" or "bfloat16": the weights' and config.json's dtype, and so the dtype jaxflow trains and
        serves them in; None: the preset's published `torch_dtype` (bfloat16 for every preset here).
      seed: seeds the weights.
      overwrite: replace a model already in `directory` (else FileExistsError).
      log: progress lines go here (building a 0.6B model takes tens of seconds and its size in memory).

    Returns:
      `directory`.
    """
    from flax import nnx

    from jaxflow.models import presets
    from jaxflow.models.hf_io import export_model
    from jaxflow.models.transformer import Transformer

    hf = presets.hf_config(preset)
    dtype = hf.get("torch_dtype", "float32") if dtype is None else dtype
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    directory = pathlib.Path(directory)
    if (directory / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{directory} already holds a model (config.json); pass overwrite=True or choose "
                              "another directory")
    hf["torch_dtype"] = dtype
    cfg = presets.preset(preset)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    vocab = cfg.vocab_size
    eos = hf.get("eos_token_id")
    special_ids = None
    if preset.lower().startswith("qwen") and isinstance(hf.get("bos_token_id"), int) and isinstance(eos, int):
        # Qwen's layout: <|endoftext|> = bos_token_id, <|im_start|> next, <|im_end|> = eos_token_id.
        special_ids = {ENDOFTEXT: hf["bos_token_id"], IM_START: hf["bos_token_id"] + 1, IM_END: eos}
    t0 = time.perf_counter()
    log(f"random model: {preset} ({cfg.num_params() / 1e9:.2f}B parameters, {dtype}) -> {directory}")
    tokenizer = write_filler_tokenizer(directory, vocab, special_ids=special_ids,
                                       model_max_length=cfg.max_position_embeddings)
    log(f"random model: tokenizer of {tokenizer.vocab_size:,} ids written ({time.perf_counter() - t0:.1f} s)")
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    log(f"random model: weights drawn ({time.perf_counter() - t0:.1f} s); writing safetensors")
    export_model(model, directory, hf_config=hf, overwrite=overwrite)
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    log(f"random model: done, {size / 2**30:.2f} GiB of safetensors ({time.perf_counter() - t0:.1f} s)")
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="default: the preset's published dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    make_random_hf_model(args.out, args.preset, dtype=args.dtype, seed=args.seed, overwrite=args.overwrite)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
