"""RLTrainer.publish with a device source: the service's contract order (mark_published first), weights on
device that survive the next (donating) train step, and no HF host conversion without a parameter
service."""

import jax
import numpy as np
import pytest

from jaxflow import sharding
from jaxflow.config import load_config
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.data.param_service import ParameterService
from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
from jaxflow.models.hf_io import load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer.rl_trainer import RLTrainer

pytestmark = pytest.mark.slow  # compiles and trains the model


class Calls:
    """A trajectory service and a parameter service that only record, in one shared order."""

    def __init__(self, log, name, inner=None):
        self.log, self.name, self.inner = log, name, inner

    def mark_published(self, v):
        self.log.append((self.name, v))

    def publish(self, v, tensors):
        self.log.append((self.name, v))
        self.inner.publish(v, tensors)


def batch(version: int, seed: int) -> ConsumedBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = [Sample(rng.integers(3, 60, n).tolist(), [-2.0] * n, [version] * n, "stop")
                   for n in rng.integers(3, 20, 4)]
        prompt = rng.integers(3, 60, 8).tolist()
        groups.append(FinishedGroup(g, prompt, version, samples, [1.0, 0.0, 0.0, 1.0]))
    return ConsumedBatch(version, groups, "full")


@pytest.fixture
def trainer_and_source(tmp_path):
    config = load_config("configs/arithmetic_tiny.py", {})
    mesh = sharding.make_mesh(fsdp=2, devices=jax.devices()[:2])
    source = DeviceParamSource(keep=2)
    trainer = RLTrainer(load_model(write_tiny_model(tmp_path / "m"), mesh=mesh), config.trainer, mesh,
                        seq_len=64, max_sequences=16, device_weights=source)
    return trainer, source


def test_publish_order_and_weights_that_survive_the_next_step(trainer_and_source):
    trainer, source = trainer_and_source
    log = []
    service = ParameterService()
    trainer.publish_weights(Calls(log, "params", service))
    assert source.latest() == 0 and log == [("params", 0)]
    trainer.train(batch(0, seed=0))
    old_arrays = jax.tree.leaves(trainer.state.params)
    trainer.publish(Calls(log, "trajectories"), Calls(log, "params", service))
    assert log[1:] == [("trajectories", 1), ("params", 1)]  # the service hears of v1 before its weights
    published = source.get(1)
    v1 = [np.asarray(a) for a in jax.tree.leaves(trainer.state.params)]
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(published.params), v1))
    # The HF tensors of the parameter service hold the same weights.
    embed = service.pull(1)[1]["model.embed_tokens.weight"]
    np.testing.assert_array_equal(embed, np.asarray(trainer.state.params["embed"][...]))
    trainer.train(batch(1, seed=1))  # donates the state it was given
    assert any(a.is_deleted() for a in old_arrays)
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(published.params), v1))
    service.close()


def test_no_host_conversion_without_a_parameter_service(trainer_and_source, monkeypatch):
    trainer, source = trainer_and_source
    monkeypatch.setattr(trainer, "hf_tensors", lambda: pytest.fail("HF host tensors were made"))
    trainer.train(batch(0, seed=0))
    trainer.publish(Calls([], "trajectories"))
    assert source.versions() == [1]


def test_a_group_with_ids_the_model_cannot_embed_is_dropped_and_the_rest_trained(trainer_and_source):
    """A service that does not check (or an older one) hands over a group with an id the model cannot embed
    (the update would be NaN and skipped, good groups included) and one with an id beyond int32 (batching
    would raise OverflowError): both are dropped and counted, and the others train with a finite loss."""
    trainer, _ = trainer_and_source
    consumed = batch(0, seed=0)
    consumed.groups[1].samples[0].tokens[-1] = trainer.model().config.vocab_size
    consumed.groups[2].samples[3].tokens[0] = 2**31
    metrics, _ = trainer.train(consumed)
    assert metrics["groups_rejected"] == 2 and metrics["groups_trained"] == 2
    assert np.isfinite(metrics["loss"]) and metrics["updates_skipped"] == 0
    assert trainer.version == 1
