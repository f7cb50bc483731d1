"""What a vLLM engine takes as a new version's weights: the HF tensors a model of its config has (names and
shapes from jaxflow's name table), checked before anything changes, and cut into raw-byte messages for the
worker extension (`rollout_bridge.vllm_worker_ext`) that loads them inside vLLM."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from jaxflow.models import hf_io, names
from jaxflow.models.config import ModelConfig
from rollout_bridge.engine import WeightsRejected
from rollout_bridge.weight_transport import WeightDtypeRefused

__all__ = ["check_weights", "expected_hf_tensors", "weight_payloads"]

# Most tensor bytes per weight-update message: bounds the copies one message makes on its way.
_CHUNK_BYTES = 256 * 2**20


def expected_hf_tensors(cfg: ModelConfig) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]]]:
    """The model's layer parameter names, and HF name -> HF shape of every tensor of a model of `cfg`,
    from jaxflow's name table (shapes only, no memory)."""
    model = hf_io.abstract_model(cfg)
    shapes = {}
    for name, row, _ in names.hf_names(cfg, model.layers.names):
        node = model
        for part in row.path:
            node = getattr(node, part)
        shape = node.get_value().shape
        shapes[name] = row.hf_shape(shape[row.lead:])
    return model.layers.names, shapes


def check_weights(cfg: ModelConfig, layer_names: tuple[str, ...], expected: Mapping[str, tuple[int, ...]],
                  tensors: Mapping[str, np.ndarray], dtype: np.dtype, *, cast: bool, source: str) -> None:
    """Raises WeightsRejected naming the tensor unless `tensors` are exactly the model's HF tensors by
    name and shape, and of `dtype` (of any float dtype when `cast`; WeightDtypeRefused otherwise). Reads only
    `.shape` and `.dtype`. A tied model's `lm_head.weight` and old rotary buffers are tolerated (and not sent)."""
    hf_io.check_hf_names(cfg, layer_names, tensors.keys(), source=source, error=WeightsRejected)
    for name, want in expected.items():
        tensor = tensors[name]
        got = tuple(tensor.shape)
        if got != want:
            raise WeightsRejected(f"{source}: tensor {name!r} has shape {got}, expected {want} from the "
                                  f"config")
        got_dtype = np.dtype(tensor.dtype)
        castable = got_dtype.kind == "f" or got_dtype.name == "bfloat16"
        if got_dtype != dtype and not (cast and castable):
            why = "not a float dtype" if cast else "casting was not asked for"
            raise WeightDtypeRefused(f"{source}: tensor {name!r} has dtype {got_dtype}, expected {dtype} "
                                     f"(the serving dtype; {why})")


def weight_payloads(expected: Iterable[str], tensors: Mapping[str, np.ndarray], dtype: np.dtype,
                    chunk_bytes: int = _CHUNK_BYTES) -> list[list[tuple[str, str, list[int], memoryview]]]:
    """Chunks of (name, dtype name, shape, raw bytes) for the worker extension, in `expected` order.

    Raw bytes because vLLM's RPC turns arrays into nested lists. The bytes are memoryviews of the arrays
    themselves (copied only where a cast or a non-contiguous layout needs it), so nothing is copied
    before vLLM serialises the message.
    """
    chunks, chunk, size = [], [], 0
    for name in expected:
        array = np.ascontiguousarray(np.asarray(tensors[name]).astype(dtype, copy=False))
        if chunk and size + array.nbytes > chunk_bytes:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append((name, array.dtype.name, list(array.shape), array.reshape(-1).view(np.uint8).data))
        size += array.nbytes
    if chunk:
        chunks.append(chunk)
    return chunks
