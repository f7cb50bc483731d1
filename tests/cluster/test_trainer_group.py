"""The RL job's trainer as Ray actors: its weights leave as per-process HF-layout pieces."""

import numpy as np
import pytest

from jaxflow import sharding
from jaxflow.cluster.trainer_group import _flat_start, hf_pieces
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.models.tiny import write_tiny_model

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
