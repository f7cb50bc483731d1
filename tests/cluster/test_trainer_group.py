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
