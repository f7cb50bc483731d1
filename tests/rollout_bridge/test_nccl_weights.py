"""The NCCL weight path to vLLM (`rollout_bridge.nccl_weights`): its logic on CPU, through vLLM's own
trainer engine (`NCCLTrainerWeightTransferEngine`, with only the NCCL endpoint replaced by a recorder),
and the real NCCL transfer where two CUDA GPUs exist (CI has none).

Skipped when vLLM is not importable, except under CI, where vLLM must be there.
"""

import multiprocessing
import socket

import ml_dtypes
import numpy as np
import pytest
from engine_helpers import require_vllm

require_vllm("the NCCL weight sender tests")

import torch  # noqa: E402  (vLLM's dependency)
import vllm.distributed.weight_transfer.nccl_engine as nccl_engine  # noqa: E402

from rollout_bridge.nccl_weights import HFTensorSource, NcclWeightSender, TensorSpec, plan  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM engines, their own processes


def tensors():
    rng = np.random.default_rng(0)
    return {
        "model.norm.weight": rng.standard_normal(8).astype(np.float32),
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((12, 8)).astype(np.float16),
    }


class Client:
    """A VLLMWeightSyncClient that records the calls it gets."""

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


class Group:
    """Stands in for the PyNccl communicator: what the (unpacked) broadcast would send, in order."""

    def __init__(self):
        self.sent = []
        self.destroyed = False

    def broadcast(self, tensor, src, stream=None):
        assert src == 0
        self.sent.append(tensor.clone())

    def destroy(self):
        self.destroyed = True


class RecordingEngine(nccl_engine.NCCLTrainerWeightTransferEngine):
    """vLLM's trainer engine (its handshake, update info, source checks and RPC order), broadcasting into
    `Group` instead of NCCL (vLLM's broadcast loop needs CUDA streams)."""

    def _broadcast(self, source, meta):
        for _, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor, src=0)


@pytest.fixture
def sender(monkeypatch):
    group = Group()
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: group)
    client = Client()
    s = NcclWeightSender(client, master_address="127.0.0.1", master_port=29600, world_size=3, device="cpu",
                         engine_cls=RecordingEngine)
    s.connect()
    yield s, client, group
    s.close()


def test_plan_orders_by_name_and_checks_every_tensor():
    specs = plan(3, tensors())
    assert [s.name for s in specs] == sorted(tensors())
    assert specs[0] == TensorSpec("model.embed_tokens.weight", "bfloat16", (16, 8))
    assert [s.name for s in plan(3, list(tensors().items()), sort=False)] == list(tensors())
    with pytest.raises(ValueError, match="no tensors"):
        plan(3, {})
    with pytest.raises(ValueError, match="'a' is given twice"):
        plan(3, [("a", np.zeros(2, np.float32)), ("a", np.zeros(2, np.float32))])
    with pytest.raises(ValueError, match="'b' has dtype int32"):
        plan(3, {"b": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match="non-empty name"):
        plan(3, [("", np.zeros(2, np.float32))])
    shapes = {k: v.shape for k, v in tensors().items()}
    assert len(plan(3, tensors(), expected=shapes)) == 3
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
        plan(3, {k: v for k, v in tensors().items() if k != "model.norm.weight"}, expected=shapes)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(8,\), the engines' model has \(9,\)"):
        plan(3, tensors(), expected={**shapes, "model.norm.weight": (9,)})


def test_source_metadata_and_iteration_agree_and_keep_the_values():
    t = tensors()
    source = HFTensorSource(t, plan(1, t), device="cpu")
    meta = source.metadata()
    pairs = list(source)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, x.dtype, tuple(x.shape)) for n, x in pairs]
    assert [m.dtype for m in meta] == [torch.bfloat16, torch.float16, torch.float32]
    for name, x in pairs:
        want = t[name].astype(np.float32)
        np.testing.assert_array_equal(x.float().numpy(), want)
    assert list(source)[0][0] == pairs[0][0]  # a fresh pass each time


def test_publish_drives_vllm_round_trip_in_order_with_the_version(sender):
    s, client, group = sender
    init = client.calls[0]
    assert init[0] == "init"
    assert init[1]["rank_offset"] == 1 and init[1]["world_size"] == 3 and init[1]["packed"] is True
    assert init[1]["master_address"] == "127.0.0.1" and init[1]["master_port"] == 29600
    client.calls.clear()
    t = tensors()
    s.publish(7, t)
    assert [c[0] for c in client.calls] == ["start", "update", "finish"]
    info = client.calls[1][1]
    order = sorted(t)
    assert info["names"] == order
    assert info["dtype_names"] == ["bfloat16", "float16", "float32"]
    assert info["shapes"] == [list(t[n].shape) for n in order]
    assert client.calls[2] == ("finish", "7")
    assert [x.shape for x in group.sent] == [torch.Size(t[n].shape) for n in order]
    np.testing.assert_array_equal(group.sent[2].numpy(), t["model.norm.weight"])
    assert s.latest() == 7


def test_publish_rejects_before_sending_anything(sender):
    s, client, group = sender
    s.publish(2, tensors())
    client.calls.clear()
    group.sent.clear()
    with pytest.raises(ValueError, match="version 2 is not newer than the latest sent version 2"):
        s.publish(2, tensors())
    with pytest.raises(ValueError, match="dtype int64"):
        s.publish(3, {"x": np.zeros(3, np.int64)})
    with pytest.raises(ValueError, match="non-negative int"):
        s.publish(-1, tensors())
    assert client.calls == [] and group.sent == [] and s.latest() == 2


def test_expected_shapes_are_checked_and_close_tears_the_group_down(monkeypatch):
    group = Group()
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: group)
    s = NcclWeightSender(Client(), master_address="h", master_port=1, world_size=2, device="cpu",
                         engine_cls=RecordingEngine, expected={"model.norm.weight": (8,)})
    with pytest.raises(RuntimeError, match="call connect"):
        s.publish(1, tensors())
    s.connect()
    with pytest.raises(ValueError, match="unexpected"):
        s.publish(1, tensors())
    s.publish(1, {"model.norm.weight": np.ones(8, np.float32)})
    s.close()
    s.close()
    assert group.destroyed


def test_constructor_names_the_bad_argument():
    with pytest.raises(ValueError, match="master_port must be an int in"):
        NcclWeightSender(Client(), master_address="h", master_port=0, world_size=2)
    with pytest.raises(ValueError, match="world_size must be an int in"):
        NcclWeightSender(Client(), master_address="h", master_port=1, world_size=1)
    with pytest.raises(TypeError, match="has no init_weight_transfer_engine"):
        NcclWeightSender(object(), master_address="h", master_port=1, world_size=2)


# --- the real NCCL transfer ---------------------------------------------------------------------------

def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _worker(conn):
    """A vLLM worker's receiving side on cuda:1: joins the group, then receives each update with vLLM's
    packed consumer and sends back {name: float32 array}."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    torch.cuda.set_device(1)
    group = None
    while True:
        msg = conn.recv()
        if msg[0] == "init":
            info = msg[1]
            conn.send("ok")
            group = stateless_init_process_group(info["master_address"], info["master_port"],
                                                 info["rank_offset"], info["world_size"], device=1)
        elif msg[0] == "update":
            info, got = msg[1], {}

            def keep(pairs, got=got):
                got.update({n: x.float().cpu().numpy() for n, x in pairs})

            packed_nccl_broadcast_consumer(
                ((n, (s, getattr(torch, d))) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])),
                group=group, src=0, post_unpack_func=keep, device="cuda:1")
            torch.cuda.synchronize()
            conn.send(got)
        else:
            return


class PipeClient(Client):
    def __init__(self, conn):
        super().__init__()
        self.conn, self.received = conn, None

    def init_weight_transfer_engine(self, init_info):
        super().init_weight_transfer_engine(init_info)
        self.conn.send(("init", init_info))
        assert self.conn.recv() == "ok"

    def update_weights(self, update_info):
        super().update_weights(update_info)
        self.conn.send(("update", update_info))
        self.received = self.conn.recv()


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs (NCCL wants one rank per GPU); CI has none")
def test_real_nccl_broadcast_reaches_a_worker():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(there,), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    client = PipeClient(here)
    s = NcclWeightSender(client, master_address="127.0.0.1", master_port=port, world_size=2, device="cuda:0")
    try:
        s.connect()
        for version in (1, 2):
            t = {k: (v.astype(np.float32) * version).astype(v.dtype) for k, v in tensors().items()}
            s.publish(version, t)
            assert sorted(client.received) == sorted(t)
            for name, want in t.items():
                np.testing.assert_array_equal(client.received[name], want.astype(np.float32))
            assert client.calls[-1] == ("finish", str(version))
    finally:
        s.close()
        here.send(("stop",))
        proc.join(30)
