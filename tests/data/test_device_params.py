"""DeviceParamSource and reshard: publish/pull/versions like the parameter service, copies that survive the
trainer donating its state, placement onto another mesh (equal values, the target's shardings, no host
transfer), and bad input refused with nothing changed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow import sharding
from jaxflow.data.device_params import DeviceParamSource, DeviceWeights, UnknownVersionError, reshard
from jaxflow.data.reshard import route as reshard_route
from jaxflow.models import hf_io
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer

pytestmark = pytest.mark.slow  # compiles and trains the model

CFG = ModelConfig("Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                  dtype="float32")


def no_host_transfers():
    """Host<->device transfers refused, explicit ones included (device to device stays allowed), on the
    reshard route accelerators take (CPU devices take jax.device_put's, whose memory is the host's). On
    CPU, reading a device array on the host is a zero-copy view that the device-to-host guard does not
    see; the host-to-device guard is the one that bites there (see test_guard_refuses_the_host_path)."""
    import contextlib
    stack = contextlib.ExitStack()
    stack.enter_context(jax.transfer_guard_host_to_device("disallow_explicit"))
    stack.enter_context(jax.transfer_guard_device_to_host("disallow_explicit"))
    stack.enter_context(reshard_route("program"))
    return stack


@pytest.fixture(scope="module")
def trainer_mesh():
    return sharding.make_mesh(fsdp=8)


@pytest.fixture(scope="module")
def engine_mesh():
    """A subset of the trainer's devices, split another way."""
    return sharding.make_mesh(fsdp=1, tensor=2, devices=jax.devices()[4:6])


@pytest.fixture(scope="module")
def model(trainer_mesh):
    m = Transformer(CFG, rngs=nnx.Rngs(0))
    params = nnx.state(m, nnx.Param)
    nnx.update(m, jax.device_put(params, sharding.state_shardings(params, trainer_mesh)))
    return m


def params_of(model, shift=0.0):
    """The model's params (+ shift), fresh arrays with the model's shardings: what a train step returns."""
    return jax.tree.map(lambda a: a + shift, nnx.state(model, nnx.Param))


def assert_equal_values(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def buffers(tree) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(tree) for s in a.addressable_shards}


def test_publish_pull_versions_and_eviction(model):
    source = DeviceParamSource(keep=2)
    assert source.latest() is None and source.versions() == []
    with pytest.raises(UnknownVersionError, match="no version"):
        source.pull()
    published = {v: params_of(model, float(v)) for v in (3, 4, 7)}
    held = None
    for v, p in published.items():
        weights = source.publish(v, p)
        assert isinstance(weights, DeviceWeights) and weights.version == v
        held = held or weights
    assert source.latest() == 7 and source.versions() == [4, 7]
    version, latest = source.pull()
    assert version == 7 and latest is source.get(7)
    assert source.pull(4)[1].version == 4
    assert_equal_values(source.pull(4)[1].params, published[4])
    with pytest.raises(UnknownVersionError, match=r"version 3 is not published; available: \[4, 7\]"):
        source.pull(3)
    assert_equal_values(held.params, published[3])  # evicted from the source, still valid where held
    source.close()
    source.close()
    with pytest.raises(RuntimeError, match="closed"):
        source.latest()
    assert_equal_values(latest.params, published[7])


def test_published_copy_survives_the_trainer_donating_its_state(model):
    """The train step donates its state: what was published must not share those buffers."""
    source = DeviceParamSource()
    trainer_params = params_of(model, 1.0)
    expected = jax.tree.map(np.asarray, trainer_params)
    weights = source.publish(1, trainer_params)
    assert not buffers(weights.params) & buffers(trainer_params)
    shardings = jax.tree.map(lambda a: a.sharding, trainer_params)
    step = jax.jit(lambda p: jax.tree.map(lambda a: a * 2.0, p), in_shardings=(shardings,),
                   out_shardings=shardings, donate_argnums=0)
    step(trainer_params)
    # Donation is real here (XLA may keep a few small inputs it found no output to alias with).
    assert sum(a.is_deleted() for a in jax.tree.leaves(trainer_params)) >= 10
    assert_equal_values(weights.params, expected)
    with pytest.raises(ValueError, match="was deleted"):
        source.publish(2, trainer_params)


def _mesh(kind):
    d = jax.devices()
    return {"fsdp8": lambda: sharding.make_mesh(fsdp=8),
            "tp2 on 4,5": lambda: sharding.make_mesh(fsdp=1, tensor=2, devices=d[4:6]),
            "tp3 on 0-2": lambda: sharding.make_mesh(fsdp=1, tensor=3, devices=d[:3]),
            "one device 7": lambda: sharding.make_mesh(devices=d[7:]),
            "fsdp4 x tp2": lambda: sharding.make_mesh(fsdp=4, tensor=2),
            "tp8 reversed": lambda: sharding.make_mesh(fsdp=1, tensor=8, devices=d[::-1]),
            "data2 x tp4": lambda: sharding.make_mesh(data=2, fsdp=1, tensor=4)}[kind]()


@pytest.mark.parametrize("source,target", [
    ("fsdp8", "tp2 on 4,5"),      # a subset of the devices, split another way
    ("fsdp8", "tp3 on 0-2"),      # a device count that does not divide the source's
    ("one device 7", "fsdp4 x tp2"),
    ("fsdp4 x tp2", "tp8 reversed"),  # the same devices in another order
    ("data2 x tp4", "tp2 on 4,5"),  # every source shard held twice (data replicas)
    ("tp2 on 4,5", "data2 x tp4"),  # and every target shard wanted twice
    ("fsdp8", "fsdp8"),
])
def test_reshard_onto_another_mesh_without_host_transfer(model, source, target):
    params = reshard(params_of(model), sharding.state_shardings(params_of(model), _mesh(source)))
    want = sharding.state_shardings(params, _mesh(target))
    with no_host_transfers():
        moved = reshard(params, want)
        jax.block_until_ready(moved)
        copied = reshard(params, want, copy=True)
    assert_equal_values(moved, params)
    assert_equal_values(copied, params)
    for array, s in zip(jax.tree.leaves(moved), jax.tree.leaves(want), strict=True):
        assert array.sharding == s
    assert not buffers(copied) & buffers(params)
    assert not any(a.is_deleted() for a in jax.tree.leaves(params))  # nothing donated
    if source == target:  # already in place: the same buffers unless a copy is asked for
        assert buffers(moved) == buffers(params)
    else:  # some parameter really is laid out differently
        assert any(a.sharding != s for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)))


def test_guard_refuses_the_host_path(model, engine_mesh):
    """The guard of `no_host_transfers` does catch the HF host path: device -> HF numpy -> device."""
    tensors = dict(hf_io.iter_hf_tensors(model))
    with no_host_transfers(), pytest.raises(Exception, match="host-to-device"):
        hf_io.params_from_hf(CFG, tensors, engine_mesh)


def test_targets_are_placed_at_publish_and_shared(model, trainer_mesh, engine_mesh):
    params = params_of(model, 0.5)
    target = sharding.state_shardings(params, engine_mesh)
    source = DeviceParamSource(targets=[target])
    source.add_target(sharding.state_shardings(params, engine_mesh))  # the same layout: no second one
    with no_host_transfers():
        weights = source.publish(1, params)
        assert weights.layouts() == 1
        placed = weights.placed(target)
        assert placed is weights.params and weights.layouts() == 1  # made at publish, no new transfer
        assert [a.sharding for a in jax.tree.leaves(placed)] == jax.tree.leaves(target)
        # A layout nobody registered is made on first use and kept for the next engine asking for it.
        other = sharding.state_shardings(params, sharding.make_mesh(fsdp=2, devices=jax.devices()[:2]))
        first = weights.placed(other)
        assert weights.placed(other) is first and weights.layouts() == 2
    assert_equal_values(first, params)
    assert_equal_values(placed, params)


def test_without_targets_an_engine_on_the_trainer_layout_shares_the_one_copy(model, trainer_mesh):
    params = params_of(model)
    weights = DeviceParamSource().publish(0, params)
    placed = weights.placed(sharding.state_shardings(params, trainer_mesh))
    assert buffers(placed) == buffers(weights.params)


def test_bad_input_is_refused_and_nothing_changes(model, engine_mesh):
    source = DeviceParamSource()
    good = params_of(model)
    source.publish(5, good)
    with pytest.raises(ValueError, match="version 5 is not newer than the latest published version 5"):
        source.publish(5, good)
    for bad in (-1, 1.5, True, "6"):
        with pytest.raises(ValueError, match="non-negative int"):
            source.publish(bad, good)
    host = jax.tree.map(np.asarray, good)
    with pytest.raises(ValueError, match=r"params of version 6: leaf .*embed.* is a ndarray, not a "
                                         r"jax.Array"):
        source.publish(6, host)
    wrong_shape = jax.tree.map(lambda a: a, good)
    wrong_shape["embed"] = wrong_shape["embed"].replace(value=jnp.zeros((8, 8)))
    with pytest.raises(ValueError, match=r"leaf .*embed.* is float32\[8, 8\], expected float32\[512, 64\]"):
        source.publish(6, wrong_shape)
    with pytest.raises(ValueError, match="tree structure"):
        source.publish(6, {"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match="tree structure"):
        source.add_target({"w": jax.sharding.NamedSharding(engine_mesh, jax.sharding.PartitionSpec())})
    with pytest.raises(ValueError, match="pytree of jax.sharding.Sharding"):
        source.add_target(jax.tree.map(lambda a: "fsdp", good))
    with pytest.raises(ValueError, match="reshard: leaf .* is a ndarray"):
        reshard(host, sharding.state_shardings(good, engine_mesh))
    assert source.versions() == [5] and source.get().params is source.pull(5)[1].params
    for keep in (0, 1.0, True):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            DeviceParamSource(keep=keep)
