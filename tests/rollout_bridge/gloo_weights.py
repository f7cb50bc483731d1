"""vLLM's NCCL weight transfer with a gloo group standing in for NCCL, so both of its sides run on CPU
(the worker's side in a thread of its own here, talking to the trainer's side over a pipe: a process of its
own would spend most of the test importing vLLM again).

What stays vLLM's own code: the trainer engine (`NCCLTrainerWeightTransferEngine`: the init handshake on a
side thread, the update info, the metadata/iteration check, the RPC order), the packed producer and consumer
(`packed_nccl_broadcast_producer` / `_consumer`: bucket boundaries, packing, unpacking) and the worker engine
(`NCCLWeightTransferEngine`: parsing the init and update info, keeping the trainer's wire parameters,
receiving). What stands in: the communicator (`GlooGroup`, a gloo process group with PyNcclCommunicator's
`broadcast` / `destroy`), CUDA streams and device syncs (no-ops), and the model (`RecordingModel`, whose
`load_weights` keeps what arrives). vLLM's layerwise reload in start/finish_weight_update needs a real model
and is left out; the worker records those calls and the version label instead.
"""

from __future__ import annotations

import contextlib
import datetime
import types


class GlooGroup:
    """PyNcclCommunicator's interface (broadcast, destroy) over a gloo process group of its own (no global
    torch.distributed state)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=datetime.timedelta(seconds=120))
        self.pg = dist.ProcessGroupGloo(self.store, rank, world_size)
        self.broadcasts = 0

    def broadcast(self, tensor, src: int, stream=None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()
        self.broadcasts += 1

    def destroy(self) -> None:
        self.pg = None


class _NoStream:
    def synchronize(self) -> None:
        pass


def cpu_stand_ins(setattr_) -> None:
    """Replaces what vLLM's packed broadcast needs CUDA for (streams, the device index, device syncs) with
    no-ops, through `setattr_(obj, name, value)` (pytest's monkeypatch.setattr, or plain setattr)."""
    import torch
    from vllm.distributed.weight_transfer import packed_tensor

    setattr_(packed_tensor, "_get_streams", lambda device, n: tuple(_NoStream() for _ in range(n)))
    setattr_(torch.accelerator, "current_device_index", lambda: 0)
    setattr_(torch.accelerator, "synchronize", lambda *a, **k: None)
    setattr_(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


class RecordingModel:
    """Stands in for vLLM's model: `load_weights` keeps {name: float32 numpy copy}."""

    def __init__(self):
        self.loaded: dict = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.float().numpy().copy()
        return set(self.loaded)


def worker_stand_ins(setattr_) -> None:
    """`cpu_stand_ins`, and the worker's NCCL group as a `GlooGroup`."""
    from vllm.distributed.weight_transfer import nccl_engine

    cpu_stand_ins(setattr_)
    setattr_(nccl_engine, "worker_init_process_group", lambda info, parallel: GlooGroup(
        info.master_address, info.master_port, info.rank_offset, info.world_size))


def worker(conn) -> None:
    """A vLLM worker's weight-transfer side (rank 1), driven by messages on `conn`: ("init", init_info),
    ("start",), ("update", update_info), ("finish", version label), ("stop",). Answers each with "ok" or,
    after an update, with ({name: array} received, broadcasts so far, the wire parameters it decodes with).
    Call `worker_stand_ins` first."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_engine

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(), model_config=None)
    model = RecordingModel()
    engine = nccl_engine.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), config, "cpu", model)
    while True:
        msg = conn.recv()
        if msg[0] == "init":
            conn.send("ok")  # before the rendezvous, which waits for the trainer's side too
            engine.init_transfer_engine(engine.parse_init_info(msg[1]))
        elif msg[0] == "update":
            model.loaded = {}
            engine.update_weights(msg[1])
            conn.send((dict(model.loaded), engine.model_update_group.broadcasts,
                       (engine.packed, engine.packed_buffer_size_bytes)))
        elif msg[0] in ("start", "finish"):
            conn.send("ok")
        else:
            engine.shutdown()
            return


class PipeClient:
    """A VLLMWeightSyncClient reaching `worker` over a pipe; `calls` records what it was asked."""

    def __init__(self, conn):
        self.conn, self.calls, self.received = conn, [], None

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))
        self.conn.send(("init", init_info))
        assert self.conn.recv() == "ok"

    def start_weight_update(self):
        self.calls.append(("start",))
        self.conn.send(("start",))
        assert self.conn.recv() == "ok"

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))
        self.conn.send(("update", update_info))
        self.received = self.conn.recv()

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        self.conn.send(("finish", weight_version))
        assert self.conn.recv() == "ok"


# --- a real vLLM engine on CPU with the gloo stand-in as its weight-transfer backend -------------------------

BACKEND = "jaxflow_gloo_stand_in"


def _gloo_worker_engine():
    """vLLM's NCCL worker engine with its group a GlooGroup (the receive path otherwise vLLM's own)."""
    from vllm.distributed.weight_transfer import nccl_engine

    class GlooWorkerEngine(nccl_engine.NCCLWeightTransferEngine):
        def init_transfer_engine(self, init_info):
            self.packed = init_info.packed
            self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
            self.packed_num_buffers = init_info.packed_num_buffers
            rank = self.parallel_config.rank + init_info.rank_offset
            self.model_update_group = GlooGroup(init_info.master_address, init_info.master_port, rank,
                                                init_info.world_size)

    return GlooWorkerEngine


def register_backend() -> None:
    """Registers the gloo stand-in as a vLLM weight-transfer backend in this process (once), with the CPU
    stand-ins for CUDA streams and syncs."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        cpu_stand_ins(setattr)
        WeightTransferEngineFactory.register_engine(BACKEND, _gloo_worker_engine())


try:  # in a vLLM worker process, importing the extension below registers the backend first
    from rollout_bridge.vllm_worker_ext import JaxflowWorkerExtension

    class GlooWorkerExtension(JaxflowWorkerExtension):
        """jaxflow's worker extension, in a worker whose weight-transfer backend is the gloo stand-in."""

    register_backend()
except ImportError:  # no vLLM/torch: the tests that need them skip
    pass
