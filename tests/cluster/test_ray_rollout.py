"""Rollout actors on a 3-node Ray cluster (one machine, `ray.cluster_utils.Cluster`): the data services in
an actor on the "data" node, a coordinator over one JAX engine in each of two actors on the "rollout"
nodes, pulling weights from the parameter service actor; this test is the trainer. Every consumed group
keeps the staleness bound token by token, and the accounting closes."""

import numpy as np
import pytest
import ray  # the `cluster` extra, which the setup script installs: a missing Ray fails here, never skips
from service_placements import start_cluster  # noqa: E402

from jaxflow.cluster import ray_actors  # noqa: E402
from jaxflow.data.param_service import ParameterService  # noqa: E402
from jaxflow.data.prompt_source import PromptSource  # noqa: E402
from jaxflow.data.trajectory_service import TrajectoryService  # noqa: E402
from jaxflow.jobs.ray_rollout import start_rollout_actor  # noqa: E402
from jaxflow.models.hf_io import iter_hf_tensors, load_model  # noqa: E402
from jaxflow.models.tiny import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # Ray clusters and actors

ETA, BATCH, STEPS = 1, 2, 3


@pytest.fixture
def cluster():
    c = start_cluster({"data": 1}, [{"num_cpus": 1, "resources": {"rollout": 1}}] * 2)
    yield c
    ray.shutdown()
    c.shutdown()


def test_two_rollout_actors_on_their_own_nodes_keep_the_bound_and_the_accounting(cluster, tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    v0 = dict(iter_hf_tensors(load_model(model_dir)))
    rng = np.random.default_rng(0)
    v1 = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in v0.items()}
    records = [{"prompt": [5 + i % 30, 6, 7, 8 + i % 5], "meta": {"answer": "1"}} for i in range(200)]
    on = ray_actors.start_host(resources={"data": 0.01})
    traj = ray_actors.host(TrajectoryService(PromptSource(records, shuffle=False), batch_groups=BATCH,
                                             group_size=2, eta=ETA), ray_actors.TRAJECTORY_SERVICE_METHODS, on=on)
    params = ray_actors.build(ParameterService, ray_actors.PARAMETER_SERVICE_METHODS, kwargs={"keep": 2}, on=on)
    params.publish(0, v0)
    actors = [start_rollout_actor(f"rollout-{i}", traj, params, str(model_dir), resources={"rollout": 1},
                                  max_len=64, max_slots=4, max_tokens=6, reward_ref="jaxflow.tasks.arithmetic:reward")
              for i in range(2)]
    placed = ray.get([a.start.remote() for a in actors], timeout=300)
    data_node = ray.get(on.where.remote())["node_id"]
    assert len({p["node_id"] for p in placed} | {data_node}) == 3  # each on a node of its own
    for step in range(STEPS):  # the trainer: consume buffer v, "train", publish v + 1
        batch = traj.consume(step, timeout=300)
        assert len(batch.groups) == BATCH
        for g in batch.groups:
            assert step - g.v_start <= ETA
            assert all(step - v <= ETA for s in g.samples for v in s.versions)  # token by token
        traj.mark_published(step + 1)
        params.publish(step + 1, v1 if step % 2 == 0 else v0)
    counts = ray.get([a.stop.remote() for a in actors], timeout=120)
    assert all(c["syncs"] >= 1 for c in counts)  # both took new weights from the parameter actor
    stats = traj.stats()
    g = stats["groups"]
    in_flight = g["requeued"] + g["running"] + g["finished"] + g["occupied"]
    assert stats["counts"]["created"] == g["consumed"] + in_flight + g["failed"] + g["surplus"]
    assert g["consumed"] == STEPS * BATCH and g["running"] == 0  # stopped actors handed their groups back
