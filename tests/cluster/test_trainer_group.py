"""The RL job's trainer as Ray actors: its weights leave as per-process HF-layout pieces."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jaxflow import sharding
from jaxflow.cluster.trainer_group import _flat_start, hf_pieces
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer import distributed

pytestmark = pytest.mark.slow  # Ray clusters and actors


@pytest.mark.parametrize("fsdp,tensor", [(4, 2), (2, 4), (8, 1), (1, 1)])
def test_the_pieces_of_a_sharded_policy_assemble_to_its_hf_tensors(tmp_path, fsdp, tensor):
    import jax
    mesh = sharding.make_mesh(1, fsdp, tensor, devices=jax.devices()[:fsdp * tensor])
    model = load_model(write_tiny_model(tmp_path / "model"), mesh=mesh)
    want = dict(iter_hf_tensors(model))
    got: dict[str, np.ndarray] = {}
    covered: dict[str, int] = {}
    for name, shape, start, piece in hf_pieces(model):
        whole = got.setdefault(name, np.full(shape, np.nan, np.float32))
        block = tuple(slice(s, s + n) for s, n in zip(start, piece.shape))
        assert np.isnan(whole[block]).all(), f"{name}: two pieces overlap at {start}"
        whole[block] = piece
        covered[name] = covered.get(name, 0) + piece.size
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert covered[name] == w.size, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def test_flat_start_finds_contiguous_blocks_only():
    assert _flat_start([0, 2], [1, 2], [3, 4]) == 2      # one row, a run of columns
    assert _flat_start([2, 0], [1, 4], [3, 4]) == 8      # one whole row
    assert _flat_start([1, 0], [2, 4], [3, 4]) == 4      # whole rows
    assert _flat_start([0, 1], [2, 2], [3, 4]) is None   # two rows of a partial run: not one run


def test_lora_targets_leave_merged_and_the_merge_is_compiled_once(tmp_path):
    import jax

    from jaxflow.cluster import trainer_group
    from jaxflow.models.lora import LoRASpec
    mesh = sharding.make_mesh(1, 4, 2, devices=jax.devices()[:8])
    spec = LoRASpec(rank=4, alpha=8)
    model = load_model(write_tiny_model(tmp_path / "model"), mesh=mesh, lora=spec)
    rng = np.random.default_rng(0)
    for target in spec.targets:  # B starts at zero: give it values, so that the merge shows
        b = getattr(model.layers, f"{target}_lora_b")
        b[...] = jax.device_put(rng.normal(size=b[...].shape).astype(np.float32), b[...].sharding)
    want = dict(iter_hf_tensors(model))  # merged on the host
    before = trainer_group._merge_program.cache_info().currsize
    for _ in range(2):  # a second publish reuses the first one's merge programs
        got: dict[str, np.ndarray] = {}
        for name, shape, start, piece in hf_pieces(model):
            whole = got.setdefault(name, np.zeros(shape, np.float32))
            whole[tuple(slice(s, s + n) for s, n in zip(start, piece.shape))] = piece
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-5, err_msg=name)
        made = trainer_group._merge_program.cache_info().currsize - before
        assert 0 < made <= len(spec.targets)


# One process of a two-process group: joins, lets itself write to the compile cache, compiles one program.
_COMPILE_IN_A_GROUP = """
import sys
import jax
import jax.numpy as jnp
from jaxflow.cluster.trainer_group import cache_every_process
from jaxflow.trainer import distributed
address, process_id, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
distributed.initialize(address, 2, process_id, timeout_s=60)
cache_every_process()
mesh = jax.sharding.Mesh(jax.devices(), ("x",))
row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
jax.jit(lambda a: jnp.sin(a) * 2.0, out_shardings=row).lower(
    jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=row)).compile()
jax.distributed.shutdown()
"""


def test_every_trainer_process_writes_its_own_compile_cache_entries(tmp_path):
    """A multi-process program's cache key holds the process index, and JAX writes from process 0 only:
    without `cache_every_process` process 1 would compile each program again in every group it forms."""
    cache = tmp_path / "cache"
    env = {**os.environ, **distributed.cpu_devices_env(1),
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    address = f"127.0.0.1:{distributed.free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_IN_A_GROUP, address, str(i), str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # One entry per process: their keys differ, and process 1's is there too.
    assert len([f for f in cache.iterdir() if f.name.endswith("-cache")]) == 2, sorted(cache.iterdir())
