"""The NCCL weight path to vLLM (`rollout_bridge.nccl_weights`): its logic on CPU, through vLLM's own
trainer engine (`NCCLTrainerWeightTransferEngine`, with only the NCCL endpoint replaced by a recorder);
the whole transfer on CPU with a gloo group standing in for NCCL (vLLM's trainer engine, packed producer
and consumer and worker engine, in two processes: tests/rollout_bridge/gloo_weights.py); the engine's side
(`NcclEngineLink`: pause, send, label, resume) over a stand-in AsyncLLM; with JAXFLOW_VLLM_GLOO=1, a real
vLLM engine on CPU whose weight-transfer backend is the gloo stand-in; and the real NCCL transfer where two
CUDA GPUs exist (CI has none).

Skipped when vLLM is not importable, except under CI, where vLLM must be there.
"""

import asyncio
import multiprocessing
import os
import socket
import threading

import ml_dtypes
import numpy as np
import pytest
from engine_helpers import require_vllm

require_vllm("the NCCL weight sender tests")

import gloo_weights  # noqa: E402
import torch  # noqa: E402  (vLLM's dependency)
import vllm.distributed.weight_transfer.nccl_engine as nccl_engine  # noqa: E402
import vllm.distributed.weight_transfer.packed_tensor as packed_tensor  # noqa: E402
from gloo_weights import GlooGroup, PipeClient, worker, worker_stand_ins  # noqa: E402

from rollout_bridge.engine import WeightsRejected  # noqa: E402
from rollout_bridge.nccl_weights import (  # noqa: E402
    HFTensorSource,
    NcclEngineLink,
    NcclWeightSender,
    TensorSpec,
    buckets,
    check_bucket_bytes,
    plan,
)
from rollout_bridge.weight_transport import MAX_BUCKET_MB, WeightBucketTooLarge, WeightDtypeRefused  # noqa: E402

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
    with pytest.raises(WeightDtypeRefused, match="'b'"):
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
    assert init[1]["packed_buffer_size_bytes"] == 256 << 20
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
    with pytest.raises(WeightDtypeRefused):
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


# --- casting, buckets, limits --------------------------------------------------------------------------

def test_plan_casts_to_the_engines_dtype_and_refuses_what_does_not_cast():
    t = {**tensors(), "model.x.weight": np.ones(3, np.float64)}
    specs = plan(1, t, dtype="bfloat16")
    assert {s.dtype for s in specs} == {"bfloat16"}
    source = HFTensorSource(t, specs, device="cpu")
    for name, x in source:
        assert x.dtype == torch.bfloat16
        np.testing.assert_array_equal(x.float().numpy(), t[name].astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(WeightDtypeRefused, match="'i'"):
        plan(1, {**t, "i": np.zeros(2, np.int32)}, dtype="float32")
    with pytest.raises(WeightDtypeRefused, match="float64"):
        plan(1, t, dtype="float64")  # an engine serving a dtype the wire does not carry
    assert issubclass(WeightDtypeRefused, WeightsRejected)


def _vllm_chunks(specs, bucket_bytes):
    """The names of each bucket vLLM's own packer makes of `specs` (on CPU tensors)."""
    pairs = iter([(s.name, torch.zeros(s.shape, dtype=getattr(torch, s.dtype))) for s in specs])
    out = []
    while (chunk := packed_tensor.pack_tensors(pairs, lambda item: item[1], bucket_bytes)) is not None:
        out.append(chunk.names)
    return out


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's note on a big tensor
@pytest.mark.parametrize("bucket_bytes", [1, 100, 256, 300, 1 << 20])
def test_buckets_are_vllms_packing(bucket_bytes):
    specs = plan(1, tensors(), dtype="float32")  # 16x8x4 = 512, 12x8x4 = 384, 8x4 = 32 bytes
    mine = [[s.name for s in b] for b in buckets(specs, bucket_bytes)]
    assert mine == _vllm_chunks(specs, bucket_bytes)


def test_a_bucket_larger_than_the_engine_takes_is_refused_before_anything():
    assert check_bucket_bytes(MAX_BUCKET_MB << 20) == MAX_BUCKET_MB << 20
    client = Client()
    with pytest.raises(WeightBucketTooLarge):
        NcclWeightSender(client, master_address="h", master_port=1, world_size=2,
                         bucket_bytes=(MAX_BUCKET_MB + 1) << 20)
    with pytest.raises(WeightBucketTooLarge):
        NcclWeightSender(client, master_address="h", master_port=1, world_size=2, bucket_bytes=1 << 20,
                         max_bucket_bytes=1 << 19)
    with pytest.raises(ValueError, match="bucket_bytes"):
        check_bucket_bytes(0)
    with pytest.raises(WeightDtypeRefused):
        NcclWeightSender(client, master_address="h", master_port=1, world_size=2, dtype="int8")
    assert client.calls == []


# --- the engine's side: NcclEngineLink over a stand-in AsyncLLM --------------------------------------------

class FakeLLM:
    """The AsyncLLM coroutines NcclEngineLink uses, recorded in order; `label` is the weight version the
    engine core serves (what vLLM attaches to each token it emits)."""

    def __init__(self, client: Client):
        self.client, self.calls, self.label = client, [], "0"

    async def init_weight_transfer_engine(self, request):
        self.calls.append("init")
        self.client.init_weight_transfer_engine(request.init_info)

    async def pause_generation(self, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def start_weight_update(self):
        self.calls.append("start")

    async def update_weights(self, request):
        self.calls.append(("update", tuple(request.update_info["names"])))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        if weight_version is not None:
            self.label = weight_version

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append("reset")

    async def resume_generation(self):
        self.calls.append("resume")


@pytest.fixture
def link(monkeypatch):
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: Group())
    llm = FakeLLM(Client())
    shapes = {k: v.shape for k, v in tensors().items()}
    link = NcclEngineLink(llm, asyncio.run, world_size=2, expected=shapes, dtype="float32", bucket_bytes=300,
                          device="cpu", engine_cls=RecordingEngine)
    link.connect()
    init = llm.client.calls[0][1]
    assert llm.calls == ["init"] and init["world_size"] == 2 and init["packed_buffer_size_bytes"] == 300
    llm.calls.clear()
    yield link, llm
    link.close()


def test_swap_pauses_sends_labels_and_resumes(link):
    link, llm = link
    link.swap(4, tensors())
    assert llm.calls == [("pause", "keep", True), "start", ("update", tuple(sorted(tensors()))), ("finish", "4"),
                         "reset", "resume"]
    assert llm.label == "4" and link.sender.latest() == 4
    # float32: 512, 384 and 32 bytes, each of the first two past a 300-byte bucket on its own
    assert link.sender.last_buckets == len(buckets(plan(4, tensors(), dtype="float32"), 300)) == 3
    llm.calls.clear()
    link.swap(5, tensors(), keep_kv=True, stay_paused=lambda: True)  # the caller's pause outlives the update
    assert llm.calls == [("pause", "keep", False), "start", ("update", tuple(sorted(tensors()))), ("finish", "5")]


def test_a_rejected_version_pauses_nothing_and_the_engine_keeps_its_version(link):
    link, llm = link
    link.swap(2, tensors())
    llm.calls.clear()
    for bad, error in (({**tensors(), "model.norm.weight": np.zeros(8, np.int32)}, WeightDtypeRefused),
                       ({**tensors(), "model.norm.weight": np.zeros(9, np.float32)}, ValueError),
                       ({k: v for k, v in tensors().items() if k != "model.norm.weight"}, ValueError)):
        with pytest.raises(error):
            link.swap(3, bad)
    with pytest.raises(ValueError, match="not newer"):
        link.swap(2, tensors())
    assert llm.calls == [] and llm.label == "2" and link.sender.latest() == 2


# --- the whole transfer on CPU: vLLM's two sides over a gloo group ------------------------------------------

def test_versions_cross_a_gloo_group_through_vllms_trainer_and_worker_engines(monkeypatch):
    worker_stand_ins(monkeypatch.setattr)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint",
                        lambda info: GlooGroup(info.master_address, info.master_port, 0, info.world_size))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    here, there = multiprocessing.Pipe()
    thread = threading.Thread(target=worker, args=(there,), daemon=True)
    thread.start()
    client = PipeClient(here)
    s = NcclWeightSender(client, master_address="127.0.0.1", master_port=port, world_size=2, device="cpu",
                         dtype="bfloat16", bucket_bytes=300)
    try:
        s.connect()  # vLLM's handshake: the worker joins on its side while this process opens rank 0
        for version in (1, 2):
            t = {k: (v.astype(np.float32) * version).astype(v.dtype) for k, v in tensors().items()}
            s.publish(version, t)
            received, broadcasts, wire = client.received
            assert wire == (True, 300)  # the worker decodes with the trainer's wire parameters
            want = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in t.items()}
            assert sorted(received) == sorted(want)
            for name in want:
                np.testing.assert_array_equal(received[name], want[name])
            specs = plan(version, t, dtype="bfloat16")  # 256 + 192 + 16 bytes in bfloat16
            assert broadcasts == version * len(buckets(specs, 300)) == version * 2
            assert [c[0] for c in client.calls[-3:]] == ["start", "update", "finish"]
            assert client.calls[-1] == ("finish", str(version)) and s.latest() == version
    finally:
        s.close()
        here.send(("stop",))
        thread.join(60)
    assert not thread.is_alive()


# --- the real NCCL transfer ---------------------------------------------------------------------------

def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _worker(conn):
    """A vLLM worker's receiving side on cuda:1: joins the group, then receives each update with vLLM's
    packed consumer and sends back {name: float32 array}."""
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

    torch.cuda.set_device(1)
    group, bucket_bytes = None, None
    while True:
        msg = conn.recv()
        if msg[0] == "init":
            info = msg[1]
            bucket_bytes = info["packed_buffer_size_bytes"]
            conn.send("ok")
            group = stateless_init_process_group(info["master_address"], info["master_port"],
                                                 info["rank_offset"], info["world_size"], device=1)
        elif msg[0] == "update":
            info, got = msg[1], {}

            def keep(pairs, got=got):
                got.update({n: x.float().cpu().numpy() for n, x in pairs})

            packed_nccl_broadcast_consumer(
                ((n, (s, getattr(torch, d))) for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])),
                group=group, src=0, post_unpack_func=keep, buffer_size_bytes=bucket_bytes, device="cuda:1")
            torch.cuda.synchronize()
            conn.send(got)
        else:
            return


class CudaPipeClient(Client):
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


@pytest.mark.skipif(not _two_gpus(), reason="no two CUDA GPUs here (NCCL wants one rank per GPU); CI has none")
def test_real_nccl_broadcast_reaches_a_worker():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(there,), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    client = CudaPipeClient(here)
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


# --- a real vLLM engine on CPU, its weight-transfer backend the gloo stand-in ---------------------------------

@pytest.mark.skipif(not os.environ.get("JAXFLOW_VLLM_GLOO"),
                    reason="starts a vLLM engine of its own (minutes on a 2-core machine); set JAXFLOW_VLLM_GLOO=1")
def test_vllm_engine_over_the_gloo_stand_in_serves_each_version(monkeypatch, qwen3_dir):
    """VllmEngine(weight_transport="nccl") end to end on CPU: vLLM's layerwise reload of a real model, the
    label on every token, and a rejected version leaving the engine on its own."""
    from engine_helpers import GREEDY

    from jaxflow.models.hf_io import iter_hf_tensors, load_model
    from rollout_bridge.engine import Request
    from rollout_bridge.vllm_engine import VllmEngine

    worker_stand_ins(monkeypatch.setattr)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint",
                        lambda info: GlooGroup(info.master_address, info.master_port, 0, info.world_size))
    base = dict(iter_hf_tensors(load_model(qwen3_dir)))
    half = {k: (v * 0.5).astype(v.dtype) for k, v in base.items()}
    engine = VllmEngine(qwen3_dir, weight_transport="nccl", nccl_device="cpu", weight_bucket_bytes=4096,
                        max_len=128, max_slots=4, kv_cache_gib=0.25, enforce_eager=True,
                        weight_transfer_config={"backend": gloo_weights.BACKEND},
                        worker_extension_cls="gloo_weights.GlooWorkerExtension")

    def greedy(tag):
        engine.submit(Request(tag, [1, 2, 3, 4], GREEDY))
        out = []
        while not out:
            out = engine.poll(timeout=1.0)
        return out[0].sample

    try:
        before = greedy("before")
        engine.update_weights(3, half)
        changed = greedy("v3")
        engine.update_weights(4, base)
        after = greedy("v4")
        assert set(changed.versions) == {3} and set(after.versions) == {4} and engine.version == 4
        assert changed.tokens != before.tokens and after.tokens == before.tokens
        np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)
        bad = {**base, "model.norm.weight": np.zeros(base["model.norm.weight"].shape, np.int32)}
        with pytest.raises(WeightDtypeRefused):
            engine.update_weights(5, bad)
        assert engine.version == 4 and set(greedy("still v4").versions) == {4}
    finally:
        engine.close()
