"""Checkpointer: exact round trips across mesh shapes, retention, atomicity, clear errors, and damaged steps
(checksummed, reported by name, the previous intact step used)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxflow import sharding
from jaxflow.models.config import ModelConfig
from jaxflow.models.hf_io import abstract_model
from jaxflow.models.transformer import Transformer
from jaxflow.trainer.checkpoint import CheckpointDamaged, Checkpointer
from jaxflow.trainer.state import abstract_train_state, create_train_state

pytestmark = pytest.mark.slow  # compiles and trains the model

CFG = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  qk_norm=True)
TX = optax.adamw(1e-2)
EXTRA = {"data": {"epoch": 1, "position": 17}, "trajectories": [{"v_start": 3, "ids": [1, 2]}]}


def _target(mesh, cfg=CFG):
    return abstract_train_state(abstract_model(cfg), TX, mesh)


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(fsdp=4, tensor=2)


@pytest.fixture(scope="module")
def state(mesh):
    """A state after one real adamw update (moments non-zero) with non-zero counters."""
    model = Transformer(CFG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(params, sharding.state_shardings(params, mesh)))
    ts = create_train_state(model, TX, mesh, version=7)
    grads = jax.tree.map(lambda p: jnp.sin(p * 3.0 + 1.0), ts.params)
    updates, opt_state = TX.update(grads, ts.opt_state, ts.params)
    return ts.replace(params=optax.apply_updates(ts.params, updates), opt_state=opt_state,
                      step=ts.step + 1, skipped=ts.skipped + 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, state, mesh):
    """A directory holding step 1 of `state` with EXTRA; its arrays copied to the host for comparison."""
    directory = tmp_path_factory.mktemp("ckpt")
    host = jax.tree.map(np.asarray, state)
    with Checkpointer(directory) as ckpt:
        assert ckpt.save(1, state, EXTRA)
    return directory, host


def _assert_restored(restored, host, target):
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    for got, want, tgt in zip(jax.tree.leaves(restored), jax.tree.leaves(host),
                              jax.tree.leaves(target)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want, strict=True)
        assert got.sharding == tgt.sharding


def test_round_trip_same_mesh(saved, state, mesh):
    directory, host = saved
    assert int(state.opt_state[0].count) == 1
    assert np.abs(np.asarray(state.opt_state[0].mu["embed"].get_value())).max() > 0
    target = _target(mesh)
    with Checkpointer(directory) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        restored, extra = ckpt.restore(target)
    _assert_restored(restored, host, target)
    assert extra == EXTRA
    assert (int(restored.step), int(restored.version), int(restored.skipped)) == (1, 7, 2)
    # Variable types and metadata come back too, so the state drops straight into nnx.update.
    assert restored.params["embed"].get_metadata()["logical_axes"] == ("vocab", "embed")


@pytest.mark.parametrize("mesh_kw", [dict(data=2, fsdp=2, tensor=2),
                                     dict(devices=jax.devices()[:1])],
                         ids=["2x2x2", "one-device"])
def test_restore_onto_other_mesh(saved, mesh_kw):
    directory, host = saved
    target = _target(sharding.make_mesh(**mesh_kw))
    with Checkpointer(directory) as ckpt:
        restored, extra = ckpt.restore(target, step=1)
    _assert_restored(restored, host, target)
    assert extra == EXTRA


def test_save_survives_donation(tmp_path, state, mesh):
    """save returns after the host copy, so the trainer may donate the state to the next step."""
    host = jax.tree.map(np.asarray, state)
    donated = jax.tree.map(jnp.copy, state)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, donated)
        jax.tree.map(lambda x: x.delete(), donated)
        restored, extra = ckpt.restore(_target(mesh))
    _assert_restored(restored, host, _target(mesh))
    assert extra == {}


def test_retention_and_interval(tmp_path, state):
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        saved = [s for s in range(1, 8) if ckpt.save(s, state, {"s": s})]
        assert saved == [1, 2, 4, 6]  # The first save into an empty directory always happens.
        assert ckpt.save(7, state, force=True)
        assert not ckpt.save(5, state)  # Not after the latest step.
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["6", "7"]
    with Checkpointer(tmp_path, max_to_keep=2) as reopened:
        assert reopened.all_steps() == [6, 7]


def test_incomplete_step_is_invisible(saved, tmp_path, mesh):
    """A step whose write never finished (orbax's tmp directory) is neither listed nor restored."""
    directory, host = saved
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp")
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        restored, _ = ckpt.restore(_target(mesh))
    _assert_restored(restored, host, _target(mesh))


def test_restore_errors_leave_checkpoint_usable(saved, tmp_path, mesh):
    directory, host = saved
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(FileNotFoundError, match="empty"):
            ckpt.restore(_target(mesh))
    with Checkpointer(directory) as ckpt:
        with pytest.raises(FileNotFoundError, match=r"step 5 .*available steps: \[1\]"):
            ckpt.restore(_target(mesh), step=5)
        bigger = dataclasses.replace(CFG, intermediate_size=256)
        with pytest.raises(ValueError, match=r"'params/layers/down_proj'.*\(2, 128, 64\).*"
                                             r"\(2, 256, 64\)"):
            ckpt.restore(_target(mesh, bigger))
        with pytest.raises(ValueError, match="opt_state"):
            ckpt.restore(abstract_train_state(abstract_model(CFG), optax.sgd(0.1), mesh))
        restored, extra = ckpt.restore(_target(mesh))
    _assert_restored(restored, host, _target(mesh))
    assert extra == EXTRA


def test_unserialisable_extra_writes_nothing(tmp_path, state):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(1, state, {"rng": np.arange(3)})
        with pytest.raises(TypeError, match="dict"):
            ckpt.save(1, state, [1, 2])
        assert ckpt.all_steps() == []
        assert ckpt.save(1, state, {"ok": True})
    assert [p.name for p in tmp_path.iterdir()] == ["1"]


# --- damaged checkpoints: every kind is reported by name and the previous intact step is used ---------

def _biggest_data_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir):
    f = _biggest_data_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _random_bytes(step_dir):
    """64 random bytes written over the middle of the largest array data file (its size unchanged)."""
    f = _biggest_data_file(step_dir)
    data = bytearray(f.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = np.random.default_rng(0).bytes(64)
    f.write_bytes(bytes(data))


def _missing_file(step_dir):
    _biggest_data_file(step_dir).unlink()


def _corrupt_metadata(step_dir):
    (step_dir / "state" / "_METADATA").write_text('{"tree_metadata": {"params": [')


def _corrupt_extra(step_dir):
    (step_dir / "extra" / "metadata").write_bytes(b"\xff{not json")


DAMAGE = {"truncated": _truncate, "random-bytes": _random_bytes, "missing-file": _missing_file,
          "corrupt-metadata": _corrupt_metadata, "corrupt-extra": _corrupt_extra}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, state):
    """Steps 1 and 2 of two different states; their host copies."""
    directory = tmp_path_factory.mktemp("two")
    later = state.replace(params=jax.tree.map(lambda p: p * 2.0 + 1.0, state.params), step=state.step + 1)
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state, {"s": 1})
        ckpt.save(2, later, {"s": 2})
    return directory, jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, later)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_step_falls_back_to_previous(two_steps, tmp_path, mesh, damage, caplog):
    directory, host1, _ = two_steps
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    DAMAGE[damage](tmp_path / "2")
    target = _target(mesh)
    with caplog.at_level("WARNING"), Checkpointer(tmp_path) as ckpt:
        restored, extra = ckpt.restore(target)
        assert ckpt.restored_step == 1
        assert [s for s, _ in ckpt.damaged] == [2]
    _assert_restored(restored, host1, target)
    assert extra == {"s": 1}
    assert f"checkpoint step 2 in {tmp_path}" in caplog.text and "restored step 1 instead" in caplog.text


@pytest.mark.parametrize("damage", ["random-bytes", "truncated"])
def test_no_intact_step_stops_with_directory_named(two_steps, tmp_path, mesh, damage):
    directory, _, _ = two_steps
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    DAMAGE[damage](tmp_path / "1")
    DAMAGE[damage](tmp_path / "2")
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CheckpointDamaged, match=rf"no intact checkpoint in {tmp_path}.*step 2.*step 1"):
            ckpt.restore(_target(mesh))
        with pytest.raises(CheckpointDamaged, match=rf"checkpoint step 2 in {tmp_path}"):
            ckpt.restore(_target(mesh), step=2)  # an explicitly named step does not fall back


def test_random_bytes_never_restore_as_weights(two_steps, tmp_path, mesh):
    """Whatever the damaged bytes decode to, the step's checksum catches it: not one wrong weight."""
    directory, _, host2 = two_steps
    for seed in range(3):
        shutil.rmtree(tmp_path / "c", ignore_errors=True)
        shutil.copytree(directory, tmp_path / "c")
        f = _biggest_data_file(tmp_path / "c" / "2")
        data = bytearray(f.read_bytes())
        rng = np.random.default_rng(seed)
        at = int(rng.integers(len(data) // 4, len(data) - 64))
        data[at:at + 64] = rng.bytes(64)
        f.write_bytes(bytes(data))
        with Checkpointer(tmp_path / "c") as ckpt:
            with pytest.raises(CheckpointDamaged, match="step 2"):
                ckpt.restore(_target(mesh), step=2)


def test_checksums_stay_out_of_extra_and_set_aside(two_steps, tmp_path, mesh):
    directory, _, host2 = two_steps
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    with Checkpointer(tmp_path) as ckpt:
        restored, extra = ckpt.restore(_target(mesh))
        assert ckpt.restored_step == 2 and ckpt.damaged == [] and extra == {"s": 2}
        _assert_restored(restored, host2, _target(mesh))
        with pytest.raises(ValueError, match="reserved"):
            ckpt.save(3, restored, {"_jaxflow_checksums": {}})
        kept = ckpt.set_aside(2)
        assert kept.exists() and ckpt.all_steps() == [1]
        assert ckpt.save(2, restored, {"s": 22}, force=True)  # the step number is free again
        ckpt.wait_until_finished()
        assert ckpt.restore(_target(mesh))[1] == {"s": 22}


def test_restore_into_another_dtype_verifies_the_saved_bytes(two_steps, mesh):
    """The checksum is of the saved dtype's bytes: arrays are read in it, verified, then cast."""
    directory, _, host2 = two_steps
    bf16 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=s.sharding)
                        if s.dtype == jnp.float32 else s, _target(mesh))
    with Checkpointer(directory) as ckpt:
        restored, _ = ckpt.restore(bf16)
        assert ckpt.damaged == [] and ckpt.restored_step == 2
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(host2)):
        expected = want.astype(jnp.bfloat16) if want.dtype == np.float32 else want
        np.testing.assert_array_equal(np.asarray(got), expected, strict=True)


def test_a_step_without_checksums_restores_with_a_warning(two_steps, tmp_path, mesh, caplog):
    """A step saved before checksums existed (its extra without them) is read, and said to be unverified."""
    directory, _, host2 = two_steps
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    meta = tmp_path / "2" / "extra" / "metadata"
    meta.write_text(json.dumps({"s": 2}))
    with caplog.at_level("WARNING"), Checkpointer(tmp_path) as ckpt:
        restored, extra = ckpt.restore(_target(mesh))
    assert extra == {"s": 2} and "step 2" in caplog.text and "restored unverified" in caplog.text
    _assert_restored(restored, host2, _target(mesh))
