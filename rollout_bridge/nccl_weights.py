"""Weights to vLLM engines on GPUs by NCCL, through vLLM's public weight-transfer interface.

The GPU counterpart of the host paths (`ParameterService.publish`, `RayWeightPublisher.publish`): the
trainer process calls `publish(version, hf_tensors)` and every vLLM worker of the engines behind
`client` receives the tensors by an NCCL broadcast from this process (rank 0) and loads them in place.

    client = RayVLLMWeightSyncClient([engine_actor, ...])      # or HTTPVLLMWeightSyncClient(url)
    sender = NcclWeightSender(client, master_address="10.0.0.5", master_port=29600,
                              world_size=1 + n_workers, device="cuda:0")
    sender.connect()                                            # the NCCL rendezvous, once
    sender.publish(7, {"model.embed_tokens.weight": array, ...})
    sender.close()

What vLLM provides (vLLM >= 0.32, `vllm.distributed.weight_transfer`): the trainer-side
`NCCLTrainerWeightTransferEngine` opens rank 0 of a `StatelessProcessGroup` + `PyNcclCommunicator` group
with the workers (their side is vLLM's `NCCLWeightTransferEngine`, selected with
`weight_transfer_config={"backend": "nccl"}` on the engine), and each `send_weights` drives
`start_weight_update` -> `update_weights(names, dtype_names, shapes)` beside the broadcast ->
`finish_weight_update` through a `VLLMWeightSyncClient` (vLLM's Ray and HTTP clients, or anything with
those methods). This module adds what jaxflow needs around it:

  * `HFTensorSource`: a `WeightSource` over one version's {HF name: host array}, in a fixed order (the
    order given, or sorted names), which metadata and iteration share, so the workers size their receive
    buffers from exactly what is sent; numpy float32/float16 and ml_dtypes bfloat16 become torch tensors
    on `device` (bfloat16 through its raw 16 bits: numpy has no such dtype torch knows).
  * validation before anything is sent (`plan`): names are non-empty unique strings, arrays have a
    dtype the wire carries, shapes match an optional expected {name: shape}; a version must be newer
    than the last one sent.
  * versions: vLLM's engine calls `finish_weight_update()` without a version, so the sender hands the
    engine a client wrapper that adds `weight_version=str(version)`: the engines label the tokens they
    generate afterwards with the published version, as `VllmEngine.update_weights` does.

torch and vLLM are imported inside the functions that need them (the `vllm` extra); the NCCL transfer
itself needs CUDA on both sides (tests/test_nccl_weights.py runs it only where two GPUs exist).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["WIRE_DTYPES", "HFTensorSource", "NcclWeightSender", "TensorSpec", "plan"]

# numpy dtype name -> torch dtype name: what the wire carries (vLLM's workers `getattr(torch, name)`).
WIRE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class TensorSpec(NamedTuple):
    """One tensor of a version, as the workers are told about it (in broadcast order)."""
    name: str
    dtype: str  # a key of WIRE_DTYPES
    shape: tuple[int, ...]


def plan(version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
         expected: Mapping[str, Iterable[int]] | None = None, sort: bool = True) -> list[TensorSpec]:
    """Checks one version's tensors and returns their broadcast order; raises ValueError naming the
    first bad tensor. Reads only names, `.dtype` and `.shape`.

    expected: {HF name: shape} the engines serve; when given, `tensors` must be exactly these.
    sort: broadcast in sorted-name order (the default: the same order whatever the caller's dict order),
        else in the order given.
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    if not items:
        raise ValueError(f"version {version}: no tensors to send")
    specs, seen = [], set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]):
            raise ValueError(f"version {version}: expected (non-empty name, array) pairs, got {item!r:.80}")
        name, array = item
        if name in seen:
            raise ValueError(f"version {version}: tensor {name!r} is given twice")
        seen.add(name)
        dtype = getattr(array, "dtype", None)
        dtype_name = np.dtype(dtype).name if dtype is not None else type(array).__name__
        if dtype_name not in WIRE_DTYPES:
            raise ValueError(f"version {version}: tensor {name!r} has dtype {dtype_name}; the NCCL path "
                             f"carries {', '.join(WIRE_DTYPES)}")
        specs.append(TensorSpec(name, dtype_name, tuple(int(d) for d in np.shape(array))))
    if expected is not None:
        want = {name: tuple(int(d) for d in shape) for name, shape in expected.items()}
        missing = sorted(set(want) - seen)
        extra = sorted(seen - set(want))
        if missing or extra:
            raise ValueError(f"version {version}: the tensors differ from the engines' model: missing "
                             f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                             f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
        for spec in specs:
            if spec.shape != want[spec.name]:
                raise ValueError(f"version {version}: tensor {spec.name!r} has shape {spec.shape}, the "
                                 f"engines' model has {want[spec.name]}")
    return sorted(specs) if sort else specs


def _to_torch(array: Any, device: Any):
    """A torch tensor of a host array (float32/float16/bfloat16) on `device`; no host copy when contiguous."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        tensor = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(array)
    return tensor.to(device)


def HFTensorSource(tensors: Mapping[str, Any], specs: list[TensorSpec], device: Any = "cuda"):  # noqa: N802
    """A vLLM `WeightSource` yielding `tensors` in the order of `specs` (from `plan`), on `device`.

    A function, so that importing this module needs no vLLM; the class is made on first use.
    """
    global _SOURCE_CLASS
    if _SOURCE_CLASS is None:
        from vllm.distributed.weight_transfer.base import WeightSource

        class _HFTensorSource(WeightSource):
            def __init__(self, tensors, specs, device):
                self._tensors, self._specs, self._device = tensors, list(specs), device

            def metadata(self):
                import torch
                from vllm.distributed.weight_transfer.base import ParamMeta

                return [ParamMeta(s.name, getattr(torch, WIRE_DTYPES[s.dtype]), s.shape) for s in self._specs]

            def __iter__(self) -> Iterator:
                for s in self._specs:
                    yield s.name, _to_torch(self._tensors[s.name], self._device)

        _SOURCE_CLASS = _HFTensorSource
    return _SOURCE_CLASS(tensors, specs, device)


_SOURCE_CLASS = None


class _VersionedClient:
    """Forwards a `VLLMWeightSyncClient`'s calls, adding the version being sent to `finish_weight_update`."""

    def __init__(self, client: Any):
        self.client = client
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.version is not None:
            weight_version = str(self.version)
        self.client.finish_weight_update(weight_version=weight_version)


class NcclWeightSender:
    """The trainer side of the NCCL path: `connect` once, then `publish(version, tensors)` per version.

    client: a `VLLMWeightSyncClient` reaching every engine (vLLM's `RayVLLMWeightSyncClient` /
        `HTTPVLLMWeightSyncClient`), whose engines run with `weight_transfer_config={"backend": "nccl"}`.
    master_address: the host where this process opens the group's rendezvous (a TCPStore).
    master_port: the rendezvous's TCP port.
    world_size: 1 (this process) + every worker of every engine.
    expected: {HF name: shape} the engines serve, checked on every publish (optional).
    device: where tensors are staged for the broadcast (this process's CUDA device).
    packed: whether tensors cross the wire packed into staging buffers (vLLM's wire parameter).
    packed_buffer_size_bytes: bytes per packing buffer (None: vLLM's default).
    packed_num_buffers: packing buffers in flight at once (None: vLLM's default).
    engine_cls: the trainer engine class (vLLM's `NCCLTrainerWeightTransferEngine`; a stand-in in tests).
    """

    def __init__(self, client: Any, *, master_address: str, master_port: int, world_size: int,
                 expected: Mapping[str, Iterable[int]] | None = None, device: Any = "cuda",
                 packed: bool = True, packed_buffer_size_bytes: int | None = None,
                 packed_num_buffers: int | None = None, engine_cls: Any = None):
        if not isinstance(master_address, str) or not master_address:
            raise ValueError(f"master_address must be a non-empty str, got {master_address!r}")
        for name, value, low, high in (("master_port", master_port, 1, 65535), ("world_size", world_size, 2, 1 << 20)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        for method in ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                       "finish_weight_update"):
            if not callable(getattr(client, method, None)):
                raise TypeError(f"client {type(client).__name__} has no {method}(): it must be a "
                                f"VLLMWeightSyncClient")
        self.expected = None if expected is None else {k: tuple(v) for k, v in expected.items()}
        self.device = device
        self._client = _VersionedClient(client)
        self._wire = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                      "packed": bool(packed)}
        if packed_buffer_size_bytes is not None:
            self._wire["packed_buffer_size_bytes"] = int(packed_buffer_size_bytes)
        if packed_num_buffers is not None:
            self._wire["packed_num_buffers"] = int(packed_num_buffers)
        self._engine_cls = engine_cls
        self._engine = None
        self._lock = threading.Lock()
        self._latest: int | None = None

    def connect(self) -> None:
        """The NCCL rendezvous with every worker (they join when the client asks them to)."""
        with self._lock:
            if self._engine is not None:
                raise RuntimeError("NcclWeightSender is already connected")
            engine_cls = self._engine_cls
            if engine_cls is None:
                from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

                engine_cls = NCCLTrainerWeightTransferEngine
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(rank=0, **self._wire)
            # The source is replaced on every publish; the engine requires one at init.
            self._engine = engine_cls.trainer_init(info, client=self._client,
                                                   source=HFTensorSource({}, [], self.device))

    def publish(self, version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Broadcasts `version`'s HF tensors to every worker; returns once they are loaded and labelled.

        Everything is checked before the first byte moves (ValueError, nothing sent). A failure part way
        leaves the NCCL group unusable (vLLM's rule): `close` and `connect` again.
        """
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"a version must be a non-negative int, got {version!r}")
        version = int(version)
        tensors = dict(tensors.items()) if isinstance(tensors, Mapping) else dict(tensors)
        with self._lock:
            if self._engine is None:
                raise RuntimeError(f"cannot publish version {version}: call connect() first")
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest sent version {self._latest}")
            specs = plan(version, tensors, expected=self.expected)
            self._engine.source = HFTensorSource(tensors, specs, self.device)
            self._client.version = version
            try:
                self._engine.send_weights()
            finally:
                self._client.version = None
                self._engine.source = None
            self._latest = version

    def latest(self) -> int | None:
        """The newest version every worker has loaded, or None."""
        with self._lock:
            return self._latest

    def close(self) -> None:
        """Tears the NCCL group down (idempotent)."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
