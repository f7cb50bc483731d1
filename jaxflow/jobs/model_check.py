"""The model check job: build (or reuse) a tiny HF model, load it onto the local mesh, score chat
prompts with it, export it back to HF layout and verify the round trip is bit-identical.

It exercises the whole model floor the RL stack stands on, in well under a minute on a laptop CPU.
"""

from __future__ import annotations

import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.models.hf_io import export_model, iter_hf_tensors, load_model
from jaxflow.models.safetensors_io import CheckpointReader
from jaxflow.models.tiny import write_tiny_model
from jaxflow.models.transformer import positions_from_mask
from jaxflow.tokenizer import Tokenizer

PROMPTS = [
    "Using the numbers [3, 7, 25], make 46. Show your work in <answer></answer> tags.",
    "What is 12 + 7 * 3?",
    "Using the numbers [2, 9, 11, 40], make 60.",
    "Compute (8 - 3) * 4.",
]


@nnx.jit
def _token_logprobs(model, tokens_bt, mask_bt):
    """log p(token_t | tokens_<t) for t >= 1, [B, T-1] float32."""
    logits = model(tokens_bt, positions_from_mask(mask_bt), mask_bt)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        tokens[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return tokens, mask


def run(config: ml_collections.ConfigDict) -> int:
    """Runs the check described in the module docstring; prints progress and a summary table."""
    workdir = pathlib.Path(config.workdir)
    base = workdir / "base_model"
    m = config.model
    if (base / "config.json").exists():
        print(f"[1/4] reusing tiny model at {base}")
    else:
        t0 = time.perf_counter()
        write_tiny_model(base, architecture=m.architecture, hidden_size=m.hidden_size,
                         intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                         num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                         tie_word_embeddings=m.tie_word_embeddings, seed=config.seed)
        print(f"[1/4] wrote tiny {m.architecture} + tokenizer to {base} ({time.perf_counter() - t0:.1f}s)")

    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    t0 = time.perf_counter()
    model = load_model(base, mesh=mesh)
    tokenizer = Tokenizer.from_dir(base)
    print(f"[2/4] loaded {model.config.num_params():,} parameters onto mesh {dict(mesh.shape)} "
          f"({time.perf_counter() - t0:.1f}s)")

    rows = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    tokens, mask = _left_pad(rows, tokenizer.pad_id)
    t0 = time.perf_counter()
    logp = np.asarray(_token_logprobs(model, tokens, mask))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(config.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(_token_logprobs(model, tokens, mask))
        times.append(time.perf_counter() - t0)
    scored = mask[:, 1:] * mask[:, :-1]
    nll = -(logp * scored).sum(1) / scored.sum(1)
    tokens_per_s = int(mask.sum()) / statistics.median(times)
    print(f"[3/4] scored {len(PROMPTS)} chat prompts ({int(mask.sum())} tokens): first call "
          f"{compile_s:.2f}s, median {statistics.median(times) * 1e3:.1f} ms, {tokens_per_s:,.0f} tokens/s")
    for prompt, value in zip(PROMPTS, nll):
        print(f"      nll/token {value:6.3f}  (uniform would be {np.log(model.config.vocab_size):.3f})  "
              f"{prompt[:48]}")

    out = export_model(model, workdir / "export", tokenizer_dir=base, overwrite=True)
    exported = dict(iter_hf_tensors(model))
    with CheckpointReader(base) as original:
        identical = all(np.array_equal(original.get(n).view(np.uint8), exported[n].view(np.uint8))
                        for n in original.names()) and set(original.names()) == set(exported)
    reloaded = load_model(out, mesh=mesh)
    same_logp = np.array_equal(np.asarray(_token_logprobs(reloaded, tokens, mask)), logp)
    print(f"[4/4] exported to {out}: tensors bit-identical to the original: {identical}; "
          f"reloaded log-probs identical: {same_logp}")
    return 0 if identical and same_logp else 1
