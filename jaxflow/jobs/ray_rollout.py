"""A rollout worker as a Ray actor: the coordinator (`jaxflow.coordination`) over one engine, talking to
the data services' actors through their proxies (`jaxflow.cluster.ray_actors`).

It is `jaxflow.jobs.rollout_worker` with Ray as the transport: the trajectory service's proxy in place of
the RPC client, and the parameter service's proxy (its `latest` and `pull`) in place of the parameter
client. `start_rollout_actor` places one: one GPU where the cluster has GPUs, one CPU otherwise, plus any
custom node resources (which pick the nodes it may run on).
"""

from __future__ import annotations

import os
from typing import Any

from jaxflow.cluster import ray_actors
from jaxflow.coordination import Coordination, Coordinator
from jaxflow.jobs.rollout_worker import make_engine
from rollout_bridge.engine import SamplingParams


class RolloutActor:
    """The body of a rollout actor. trajectories / params: proxies of the two services. model: the HF
    directory the engine starts from (on the actor's node). reward_ref: "module:function" scoring
    (response text, meta) in the actor, or None to leave rewarding to the trainer's side. coordination:
    `Coordination` options (max_running defaults to slots; stuck buffers are the trainer's business)."""

    def __init__(self, name: str, trajectories: Any, params: Any, model: str, *, engine: str = "jax",
                 max_len: int = 256, slots: int = 8, max_tokens: int = 64, temperature: float = 1.0,
                 reward_ref: str | None = None, coordination: dict[str, Any] | None = None):
        options = {"max_running": slots, "sync": "all", **(coordination or {}), "stuck": "wait"}
        strategy = Coordination(**options)
        self.engine = make_engine(engine, model, max_len, slots)
        reward_fn = None
        if reward_ref is not None:
            from jaxflow.rewards import resolve
            from jaxflow.tokenizer import Tokenizer
            score, tokenizer = resolve(reward_ref), Tokenizer.from_dir(model)

            def reward_fn(task, samples):
                return [float(score(tokenizer.decode(s.tokens), task.meta)) for s in samples]

        self.coordinator = Coordinator(name, [self.engine], trajectories, params, strategy=strategy, eta=0,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature),
                                       reward_fn=reward_fn)

    def start(self) -> dict[str, Any]:
        """Loads the newest published weights and starts generating; {"pid", "node_id", "version"}."""
        self.coordinator.load_weights()
        self.coordinator.start()
        node = ray_actors.require_ray().get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node_id": node, "version": self.engine.version}

    def stop(self, abort_in_flight: bool = True) -> dict[str, int]:
        """Stops the coordinator (handing in-flight groups back, or letting them finish) and closes the
        engine; the coordinator's counts."""
        self.coordinator.stop(abort_in_flight=abort_in_flight)
        self.engine.close()
        return dict(self.coordinator.counts)


def start_rollout_actor(name: str, trajectories: Any, params: Any, model: str, *,
                        resources: dict[str, float] | None = None, **options: Any) -> Any:
    """Starts a `RolloutActor` (one GPU if the cluster has any, else one CPU) and returns its handle;
    `options` are `RolloutActor`'s. Call `handle.start.remote()` to set it going."""
    ray = ray_actors.require_ray()
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    actor_options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if gpus else {"num_cpus": 1}
    if resources:
        actor_options["resources"] = dict(resources)
    return ray.remote(RolloutActor).options(name=name, **actor_options).remote(
        name, trajectories, params, model, **options)
