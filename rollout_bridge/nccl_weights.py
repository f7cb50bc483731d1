"""Weights to vLLM engines on GPUs by NCCL, through vLLM's public weight-transfer interface.

The GPU counterpart of the host paths (`ParameterService.publish`, `RayWeightPublisher.publish`): the
trainer process calls `publish(version, hf_tensors)` and every vLLM worker of the engines behind
`client` receives the tensors by an NCCL broadcast from this process (rank 0) and loads them in place.

    client = RayVLLMWeightSyncClient([engine_actor, ...])      # or HTTPVLLMWeightSyncClient(url)
    sender = NcclWeightSender(client, master_address="10.0.0.5", master_port=29600,
                              world_size=1 + n_workers, device="cuda:0", dtype="bfloat16")
    sender.connect()                                            # the NCCL rendezvous, once
    sender.publish(7, {"model.embed_tokens.weight": array, ...})
    sender.close()

A `VllmEngine` started with `weight_transport="nccl"` does this itself for its own workers
(`NcclEngineLink`): the RL job's `rollout.weight_transport = "nccl"`.

What vLLM provides (vLLM >= 0.32, `vllm.distributed.weight_transfer`): the trainer-side
`NCCLTrainerWeightTransferEngine` opens rank 0 of a `StatelessProcessGroup` + `PyNcclCommunicator` group
with the workers (their side is vLLM's `NCCLWeightTransferEngine`, selected with
`weight_transfer_config={"backend": "nccl"}` on the engine), and each `send_weights` drives
`start_weight_update` -> `update_weights(names, dtype_names, shapes)` beside the broadcast ->
`finish_weight_update` through a `VLLMWeightSyncClient` (vLLM's Ray and HTTP clients, `AsyncLLMClient`
here, or anything with those methods). Tensors cross packed into buckets: both sides cut the same
buckets from the metadata (`buckets` says where), each closing once it holds more than `bucket_bytes`, so
a tensor bigger than a bucket travels in one of its own. vLLM's other backends (CUDA IPC, sparse NCCL,
M2N, sharded RDT) need GPUs too; none has a CPU collective. This module adds what jaxflow needs around it:

  * `HFTensorSource`: a `WeightSource` over one version's {HF name: array}, in a fixed order (the order
    given, or sorted names), which metadata and iteration share, so the workers size their receive
    buffers from exactly what is sent. Each tensor is cast to the wire dtype (the engine's) on the way:
    numpy float32/float16 and ml_dtypes bfloat16 arrays (bfloat16 through its raw 16 bits: numpy has no
    such dtype torch knows), or any array with `__dlpack__` (a JAX array on the same GPU, no copy).
  * checks before anything is sent (`plan`): names are non-empty unique strings, arrays are of a float
    dtype the engine's dtype can be cast from (`WeightDtypeRefused` otherwise), shapes match an optional
    expected {name: shape}; a version must be newer than the last one sent; the bucket is within what
    the engine takes (`WeightBucketTooLarge`, `rollout_bridge.weight_transport.MAX_BUCKET_MB`).
  * versions: vLLM's engine calls `finish_weight_update()` without a version, so the sender hands the
    engine a client wrapper that adds `weight_version=str(version)`: the engines label the tokens they
    generate afterwards with the published version, as `VllmEngine.update_weights` does.

torch and vLLM are imported inside the functions that need them (the `vllm` extra); the NCCL transfer
itself needs CUDA on both sides (tests/rollout_bridge/test_nccl_weights.py runs the same code over a gloo
group on CPU, and the NCCL transfer only where two GPUs exist).
"""

from __future__ import annotations

import socket
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from rollout_bridge.weight_transport import MAX_BUCKET_MB, WeightBucketTooLarge, WeightDtypeRefused

__all__ = ["DEFAULT_BUCKET_BYTES", "WIRE_DTYPES", "AsyncLLMClient", "HFTensorSource", "NcclEngineLink",
           "NcclWeightSender", "TensorSpec", "buckets", "plan"]

# numpy dtype name -> torch dtype name: what the wire carries (vLLM's workers `getattr(torch, name)`).
WIRE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
# Bytes per bucket unless told (the RL job's default `rollout.weight_bucket_mb`).
DEFAULT_BUCKET_BYTES = 256 << 20


class TensorSpec(NamedTuple):
    """One tensor of a version, as the workers are told about it (in broadcast order)."""
    name: str
    dtype: str  # a key of WIRE_DTYPES: the dtype it crosses in (the engine's, when casting)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * (4 if self.dtype == "float32" else 2)


def _dtype_name(array: Any) -> str:
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return type(array).__name__
    try:
        return np.dtype(dtype).name
    except TypeError:  # a torch dtype
        return str(dtype).removeprefix("torch.")


def plan(version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *,
         expected: Mapping[str, Iterable[int]] | None = None, sort: bool = True,
         dtype: str | None = None) -> list[TensorSpec]:
    """Checks one version's tensors and returns their broadcast order; raises ValueError naming the
    first bad tensor (WeightDtypeRefused for a dtype). Reads only names, `.dtype` and `.shape`.

    expected: {HF name: shape} the engines serve; when given, `tensors` must be exactly these.
    sort: broadcast in sorted-name order (the default: the same order whatever the caller's dict order),
        else in the order given.
    dtype: the engines' dtype, which every tensor is cast to (any float dtype casts); None: each tensor
        crosses in its own dtype, which must then be one of WIRE_DTYPES.
    """
    if dtype is not None and dtype not in WIRE_DTYPES:
        raise WeightDtypeRefused(f"version {version}: the engines serve {dtype}; the NCCL path carries "
                                 f"{', '.join(WIRE_DTYPES)}")
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
        dtype_name = _dtype_name(array)
        if dtype is None and dtype_name not in WIRE_DTYPES:
            raise WeightDtypeRefused(f"version {version}: tensor {name!r} has dtype {dtype_name}; the NCCL "
                                     f"path carries {', '.join(WIRE_DTYPES)}")
        if dtype is not None and dtype_name not in WIRE_DTYPES and dtype_name != "float64":
            raise WeightDtypeRefused(f"version {version}: tensor {name!r} has dtype {dtype_name}, which does "
                                     f"not cast to the engines' {dtype} (a float dtype does)")
        specs.append(TensorSpec(name, dtype or dtype_name, tuple(int(d) for d in np.shape(array))))
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


def buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """The buckets `specs` cross in, in order: vLLM's packing rule (`packed_tensor.pack_tensors` and the
    worker's consumer), where a bucket closes once it holds more than `bucket_bytes`, so each holds at most
    `bucket_bytes` plus its last tensor."""
    out: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        out[-1].append(spec)
        size += spec.nbytes
        if size > bucket_bytes:
            out.append([])
            size = 0
    return [b for b in out if b]


def check_bucket_bytes(bucket_bytes: Any, max_bucket_bytes: int = MAX_BUCKET_MB << 20) -> int:
    """`bucket_bytes` as an int; ValueError unless a positive int, WeightBucketTooLarge above the engines'
    `max_bucket_bytes`."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    if bucket_bytes > max_bucket_bytes:
        raise WeightBucketTooLarge(f"a weight bucket of {bucket_bytes / 2**20:g} MiB is larger than the "
                                   f"{max_bucket_bytes / 2**20:g} MiB the engines take")
    return int(bucket_bytes)


def _to_torch(array: Any, device: Any, dtype: str):
    """A torch tensor of `array` on `device` in `dtype` (a WIRE_DTYPES key): a host numpy array (no host
    copy when contiguous), or anything with `__dlpack__` (no copy when already on `device`)."""
    import torch

    if hasattr(array, "__dlpack__") and not isinstance(array, np.ndarray):
        tensor = torch.from_dlpack(array)
    else:
        array = np.ascontiguousarray(array)
        with warnings.catch_warnings():
            # A parameter service's arrays are read-only views; the tensor is only read (cast, staged, sent).
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            if array.dtype.name == "bfloat16":
                tensor = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
            else:
                tensor = torch.from_numpy(array)
    return tensor.to(device=device, dtype=getattr(torch, WIRE_DTYPES[dtype]))


def HFTensorSource(tensors: Mapping[str, Any], specs: list[TensorSpec], device: Any = "cuda"):  # noqa: N802
    """A vLLM `WeightSource` yielding `tensors` in the order of `specs` (from `plan`), on `device`, each in
    its spec's dtype.

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
                    yield s.name, _to_torch(self._tensors[s.name], self._device, s.dtype)

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
        `HTTPVLLMWeightSyncClient`, or `AsyncLLMClient`), whose engines run with
        `weight_transfer_config={"backend": "nccl"}`.
    master_address: the host where this process opens the group's rendezvous (a TCPStore).
    master_port: the rendezvous's TCP port.
    world_size: 1 (this process) + every worker of every engine.
    expected: {HF name: shape} the engines serve, checked on every publish (optional).
    device: where tensors are staged for the broadcast (this process's CUDA device).
    dtype: the engines' dtype, which every tensor is cast to on the way (None: each crosses as given).
    packed: whether tensors cross packed into buckets (vLLM's wire parameter; unpacked: one at a time).
    bucket_bytes: bytes per bucket (vLLM's `packed_buffer_size_bytes`); at most `max_bucket_bytes`.
    packed_num_buffers: buckets in flight at once (None: vLLM's default, 2).
    max_bucket_bytes: the largest bucket the engines take (`MAX_BUCKET_MB`).
    engine_cls: the trainer engine class (vLLM's `NCCLTrainerWeightTransferEngine`; a stand-in in tests).
    """

    def __init__(self, client: Any, *, master_address: str, master_port: int, world_size: int,
                 expected: Mapping[str, Iterable[int]] | None = None, device: Any = "cuda",
                 dtype: str | None = None, packed: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 packed_num_buffers: int | None = None, max_bucket_bytes: int = MAX_BUCKET_MB << 20,
                 engine_cls: Any = None):
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
        if dtype is not None and dtype not in WIRE_DTYPES:
            raise WeightDtypeRefused(f"the engines serve {dtype}; the NCCL path carries {', '.join(WIRE_DTYPES)}")
        self.bucket_bytes = check_bucket_bytes(bucket_bytes, max_bucket_bytes)
        self.expected = None if expected is None else {k: tuple(v) for k, v in expected.items()}
        self.device, self.dtype = device, dtype
        self._client = _VersionedClient(client)
        self._wire = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                      "packed": bool(packed), "packed_buffer_size_bytes": self.bucket_bytes}
        if packed_num_buffers is not None:
            self._wire["packed_num_buffers"] = int(packed_num_buffers)
        self._engine_cls = engine_cls
        self._engine = None
        self._lock = threading.Lock()
        self._latest: int | None = None
        self.last_buckets = 0  # buckets of the latest version sent

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

    def check(self, version: int, tensors: Mapping[str, Any]) -> list[TensorSpec]:
        """Everything `publish` checks, without sending: the broadcast order; ValueError (WeightDtypeRefused
        for a dtype) naming the first problem."""
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"a version must be a non-negative int, got {version!r}")
        with self._lock:
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest sent version {self._latest}")
        return plan(int(version), tensors, expected=self.expected, dtype=self.dtype)

    def publish(self, version: int, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Broadcasts `version`'s HF tensors to every worker; returns once they are loaded and labelled.

        Everything is checked before the first byte moves (ValueError, nothing sent). A failure part way
        leaves the NCCL group unusable (vLLM's rule): `close` and `connect` again.
        """
        if self._engine is None:
            raise RuntimeError(f"cannot publish version {version}: call connect() first")
        tensors = dict(tensors.items()) if isinstance(tensors, Mapping) else dict(tensors)
        specs = self.check(version, tensors)
        version = int(version)
        with self._lock:
            if self._engine is None:
                raise RuntimeError(f"cannot publish version {version}: the sender was closed")
            if self._latest is not None and version <= self._latest:
                raise ValueError(f"version {version} is not newer than the latest sent version {self._latest}")
            self._engine.source = HFTensorSource(tensors, specs, self.device)
            self._client.version = version
            try:
                self._engine.send_weights()
            finally:
                self._client.version = None
                self._engine.source = None
            self._latest = version
            self.last_buckets = len(buckets(specs, self.bucket_bytes)) if self._wire["packed"] else len(specs)

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


class AsyncLLMClient:
    """A `VLLMWeightSyncClient` over a vLLM `AsyncLLM` in this process: each call runs the engine's
    coroutine through `call` (which runs a coroutine on the engine's event loop and waits for its result,
    as `VllmEngine._call` does), so it may be called from any thread but the loop's."""

    def __init__(self, llm: Any, call: Callable[[Any], Any]):
        self.llm, self.call = llm, call

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.call(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self.call(self.llm.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.call(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call(self.llm.finish_weight_update(weight_version))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for the rendezvous of a group on one machine)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class NcclEngineLink:
    """One vLLM engine's own NCCL group with this process: what `VllmEngine(weight_transport="nccl")`
    holds. `connect` once after the engine is up; `check` a version (nothing sent); `swap` it in.

    llm: the engine's `AsyncLLM` (anything with its pause/resume, weight-transfer and prefix-cache
        coroutines); call: runs one of its coroutines to completion from this thread.
    world_size: 1 + the engine's workers (tensor x pipeline x data parallel).
    expected: {HF name: shape} of the engine's model; dtype: its serving dtype (tensors are cast to it).
    bucket_bytes, max_bucket_bytes, device, engine_cls: as `NcclWeightSender`'s.
    master_address, master_port: the rendezvous (default: this host's loopback and a free port).
    """

    def __init__(self, llm: Any, call: Callable[[Any], Any], *, world_size: int,
                 expected: Mapping[str, Iterable[int]], dtype: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 max_bucket_bytes: int = MAX_BUCKET_MB << 20, device: Any = "cuda",
                 master_address: str = "127.0.0.1", master_port: int | None = None, engine_cls: Any = None):
        self.llm, self.call = llm, call
        self.sender = NcclWeightSender(AsyncLLMClient(llm, call), master_address=master_address,
                                       master_port=master_port or free_port(master_address),
                                       world_size=world_size, expected=expected, device=device, dtype=dtype,
                                       bucket_bytes=bucket_bytes, max_bucket_bytes=max_bucket_bytes,
                                       engine_cls=engine_cls)

    def connect(self) -> None:
        """The rendezvous with the engine's workers (vLLM's init handshake)."""
        self.sender.connect()

    def check(self, version: int, tensors: Mapping[str, Any]) -> list[TensorSpec]:
        """What `swap` checks before it pauses anything (NcclWeightSender.check)."""
        return self.sender.check(version, tensors)

    def swap(self, version: int, tensors: Mapping[str, Any], *, keep_kv: bool = False,
             stay_paused: Callable[[], bool] = lambda: False) -> None:
        """Pause (requests kept) -> broadcast + load + label `version` -> drop KV (unless keep_kv) -> resume
        (unless `stay_paused()`: a pause of the caller's outlives the update). The checks run first, so a
        rejected version pauses nothing. A failure once the broadcast began leaves the group unusable."""
        self.check(version, tensors)
        self.call(self.llm.pause_generation(mode="keep", clear_cache=not keep_kv))
        try:
            self.sender.publish(version, tensors)
            if not keep_kv:
                self.call(self.llm.reset_prefix_cache(reset_running_requests=True))
        finally:
            if not stay_paused():
                self.call(self.llm.resume_generation())

    def close(self) -> None:
        """Tears the group down (idempotent)."""
        self.sender.close()
