"""reshard_program: for each kind of layout pair a job makes (same devices split another way, a subset of
the devices, other devices), both routes put the same values on the target shardings, casting on the way if
asked: the program route (what accelerators run) device to device, the put route (what CPU devices run)
in one `jax.device_put`. Built from abstract shapes and cached; the route follows the platform; bad input is
named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow import sharding
from jaxflow.data.device_params import ReshardProgram, reshard, reshard_program
from jaxflow.data.reshard import route
from jaxflow.models.config import ModelConfig
from jaxflow.models.transformer import Transformer

pytestmark = pytest.mark.slow  # compiles one small program per layout pair

CFG = ModelConfig("Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                  dtype="float32")

# name -> (trainer devices, (data, fsdp, tensor)), (engine devices, (data, fsdp, tensor))
LAYOUTS = {
    "same layout": (((0, 8), (1, 8, 1)), ((0, 8), (1, 8, 1))),
    "same devices, fsdp4 x tp2": (((0, 8), (1, 8, 1)), ((0, 8), (1, 4, 2))),
    "same devices, tp8": (((0, 8), (2, 4, 1)), ((0, 8), (1, 1, 8))),
    "subset, tp2": (((0, 8), (1, 8, 1)), ((4, 6), (1, 1, 2))),
    "subset, one device": (((0, 8), (1, 8, 1)), ((0, 1), (1, 1, 1))),
    "other devices, tp4": (((0, 4), (1, 4, 1)), ((4, 8), (1, 1, 4))),
    "one device to one device": (((0, 1), (1, 1, 1)), ((0, 1), (1, 1, 1))),
}


def mesh(devices, axes):
    return sharding.make_mesh(*axes, devices=jax.devices()[devices[0]:devices[1]])


@pytest.fixture(scope="module")
def params():
    """The tiny model's params, as host arrays (placed per test on the trainer's layout)."""
    return jax.tree.map(np.asarray, nnx.state(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param))


def placed(params, layout):
    shardings = sharding.state_shardings(params, mesh(*layout))
    return jax.device_put(params, shardings)


def buffers(tree) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(tree) for s in a.addressable_shards}


@pytest.mark.parametrize("way", ["program", "put"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_program_gives_the_same_values_on_the_target_layout(params, kind, way):
    source_layout, target_layout = LAYOUTS[kind]
    source = placed(params, source_layout)
    target = sharding.state_shardings(params, mesh(*target_layout))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), source)
    program = reshard_program(abstract, target, route=way)
    assert isinstance(program, ReshardProgram) and program.route == way
    assert program.leaves_leaf_by_leaf == 0  # every layout a job makes is one program, no per-leaf route
    assert reshard_program(abstract, target, route=way) is program  # compiled once per layout pair
    with route(way):  # the route a block sets is the one a call naming none takes
        assert reshard_program(abstract, target) is program
    # The program route never goes through the host; the put route does where jax.device_put does.
    guard = "disallow_explicit" if way == "program" else "allow"
    with jax.transfer_guard_host_to_device(guard):
        moved = program(source)
        jax.block_until_ready(moved)
    for got, want, s in zip(jax.tree.leaves(moved), jax.tree.leaves(params), jax.tree.leaves(target), strict=True):
        assert got.sharding == s and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    assert not buffers(moved) & buffers(source)  # new arrays: the trainer may donate its own
    assert not any(a.is_deleted() for a in jax.tree.leaves(source))
    if program.compiled is not None:  # what a planner reads: per-device bytes of step 1
        assert program.compiled.memory_analysis().argument_size_in_bytes > 0


def test_cpu_devices_take_the_put_route(params):
    """On CPU devices (the host's memory) the route is jax.device_put's; see reshard.py's docstring."""
    source = placed(params, LAYOUTS["subset, tp2"][0])
    target = sharding.state_shardings(params, mesh(*LAYOUTS["subset, tp2"][1]))
    assert reshard_program(source, target).route == "put"
    assert reshard_program(source, target, route="auto").route == "put"


@pytest.mark.parametrize("way", ["program", "put"])
@pytest.mark.parametrize("given,wanted", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_program_casts_on_the_way(params, way, given, wanted):
    """Narrowing casts happen before the move, widening ones after it; the values are the cast's."""
    given_params = jax.tree.map(lambda a: a.astype(given), params)
    source = placed(given_params, LAYOUTS["subset, tp2"][0])
    target = sharding.state_shardings(params, mesh(*LAYOUTS["subset, tp2"][1]))
    moved = reshard(source, target, dtypes=jax.tree.map(lambda a: wanted, params), route=way)
    for got, want, s in zip(jax.tree.leaves(moved), jax.tree.leaves(given_params), jax.tree.leaves(target),
                            strict=True):
        assert got.dtype == wanted and got.sharding == s
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(wanted)))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # small ones with no output to alias
@pytest.mark.parametrize("way", ["program", "put"])
def test_donated_sources_are_reused(params, way):
    layout = LAYOUTS["same devices, fsdp4 x tp2"]
    source = placed(params, layout[0])
    expected = jax.tree.map(np.asarray, source)
    program = reshard_program(source, sharding.state_shardings(params, mesh(*layout[1])), donate=True, route=way)
    moved = program(source)
    assert sum(a.is_deleted() for a in jax.tree.leaves(source)) >= len(jax.tree.leaves(source)) // 2
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_bad_input_is_named(params):
    target = sharding.state_shardings(params, mesh((0, 2), (1, 2, 1)))
    bare = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    with pytest.raises(ValueError, match=r"leaf .*embed.* has no sharding"):
        reshard_program(bare, target)
    with pytest.raises(ValueError, match="tree structure"):
        reshard_program({"w": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
            jax.devices()[0]))}, target)
    with pytest.raises(ValueError, match="pytree of jax.sharding.Sharding"):
        reshard_program(placed(params, ((0, 2), (1, 2, 1))), jax.tree.map(lambda a: "fsdp", params))
    with pytest.raises(ValueError, match="reshard route must be one of"):
        reshard_program(placed(params, ((0, 2), (1, 2, 1))), target, route="host")
    with pytest.raises(ValueError, match="reshard route must be one of"), route("fast"):
        pass
