"""A rollout worker as a Ray actor: the coordinator (`jaxflow.coordination`) over one engine, talking to
the data services' actors through their proxies (`jaxflow.cluster.ray_actors`).

It is `jaxflow.jobs.rollout_worker` with Ray as the transport: the trajectory service's proxy in place of
the RPC client, and the parameter service's proxy (its `latest` and `pull`) in place of the parameter
client. `start_rollout_actor` places one: one GPU where the cluster has GPUs, one CPU otherwise, plus any
custom node resources (which pick the nodes it may run on).
"""

from __future__ import annotations

import collections
import os
import types
from typing import Any

from jaxflow.cluster import ray_actors
from jaxflow.coordination import Coordination, Coordinator
from jaxflow.jobs.rollout_worker import make_engine
from rollout_bridge.engine import SamplingParams


class RolloutActor:
    """The body of a rollout actor. trajectories / params: proxies of the two services. model: the HF
    directory the engine starts from (on the actor's node). reward_ref: "module:function" scoring
    (response text, meta) in the actor, or None to leave rewarding to the trainer's side. coordination:
    `Coordination` options (max_running defaults to slots; stuck buffers are the trainer's business, so
    `stuck` is "wait")."""

    def __init__(self, name: str, trajectories: Any, params: Any, model: str, *, engine: str = "jax",
                 max_len: int = 256, slots: int = 8, max_tokens: int = 64, temperature: float = 1.0,
                 stop_token_ids: tuple[int, ...] = (), reward_ref: str | None = None,
                 coordination: dict[str, Any] | None = None):
        options = {"max_running": slots, "sync": "all", **(coordination or {}), "stuck": "wait"}
        strategy = Coordination.from_config(options)
        self.engine = make_engine(engine, model, max_len, slots)
        reward_fn = None
        if reward_ref is not None:
            from jaxflow.rewards import resolve
            from jaxflow.tokenizer import Tokenizer
            score, tokenizer = resolve(reward_ref), Tokenizer.from_dir(model)

            def reward_fn(task, samples):
                return [float(score(tokenizer.decode(s.tokens), task.meta)) for s in samples]

        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                  stop_token_ids=tuple(stop_token_ids))
        self.coordinator = Coordinator(name, [self.engine], trajectories, params, strategy=strategy, eta=0,
                                       sampling=sampling, reward_fn=reward_fn, trace_every_s=0.25)

    def start(self) -> dict[str, Any]:
        """Loads the newest published weights and starts generating; {"pid", "node_id", "version"}."""
        self.coordinator.load_weights()
        self.coordinator.start()
        node = ray_actors.require_ray().get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node_id": node, "version": self.engine.version}

    def report(self, trace: bool = False) -> dict[str, Any]:
        """{"stats": the coordinator's stats, and with `trace` "trace": its trace as lists}."""
        out: dict[str, Any] = {"stats": self.coordinator.stats()}
        if trace:
            out["trace"] = {k: list(v) for k, v in self.coordinator.trace.items()}
        return out

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


class RolloutFleet:
    """Rollout actors seen as one coordinator by the RL job's train loop: `start`, `stop`, `counts`,
    `instances` (each with `idle_s`), `stats()` and `trace`, summed or joined over the actors."""

    def __init__(self, actors: list[Any]):
        self.actors, self.placed = actors, []

    def _reports(self, trace: bool = False) -> list[dict[str, Any]]:
        return ray_actors.require_ray().get([a.report.remote(trace) for a in self.actors])

    def start(self, timeout_s: float = 600) -> RolloutFleet:
        """Sets every actor going (each loads the newest weights first); `placed` says where they run.
        TimeoutError if they are not all generating within `timeout_s` (e.g. the cluster lacks the CPUs
        or GPUs to place them)."""
        ray = ray_actors.require_ray()
        try:
            self.placed = ray.get([a.start.remote() for a in self.actors], timeout=timeout_s)
        except BaseException as e:
            free = ray.available_resources()
            for a in self.actors:
                ray.kill(a)
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise TimeoutError(f"{len(self.actors)} rollout actors not started within {timeout_s}s; the "
                                   f"cluster has {free} free") from None
            raise
        return self

    @property
    def counts(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for r in self._reports():
            total.update({k: v for k, v in r["stats"].items() if isinstance(v, int)})
        return total

    @property
    def instances(self) -> list[types.SimpleNamespace]:
        return [types.SimpleNamespace(**i) for r in self._reports() for i in r["stats"]["instances"]]

    def stats(self) -> dict[str, Any]:
        reports = self._reports()
        out: dict[str, Any] = collections.Counter()
        for r in reports:
            out.update({k: v for k, v in r["stats"].items() if isinstance(v, int)})
        return {**out, "instances": [i for r in reports for i in r["stats"]["instances"]]}

    @property
    def trace(self) -> dict[str, list]:
        joined: dict[str, list] = collections.defaultdict(list)
        for r in self._reports(trace=True):
            for k, v in r["trace"].items():
                joined[k].extend(v)
        return dict(joined)

    def stop(self, abort_in_flight: bool = True) -> None:
        """Stops every actor (handing its in-flight groups back unless told to let them finish) and ends it."""
        ray = ray_actors.require_ray()
        try:
            ray.get([a.stop.remote(abort_in_flight) for a in self.actors], timeout=120)
        finally:
            for a in self.actors:
                ray.kill(a)


def start_fleet(config: Any, trajectories: Any, params: Any, model: Any, reward_ref: str,
                eos_id: int) -> RolloutFleet:
    """The RL job's `cluster.rollout_actors` rollout actors (each a coordinator over one engine of
    `rollout.engine`, with the `rollout.*` sizes and sampling and the `rollout.coordination` options),
    started and generating. Rewards are scored in the actors, by `reward_ref`."""
    r = config.rollout
    coordination = r.coordination.to_dict()
    actors = [start_rollout_actor(f"rollout-{i}-{os.getpid()}", trajectories, params, str(model),
                                  engine=r.engine, max_len=r.max_len, slots=r.max_slots, max_tokens=r.max_tokens,
                                  temperature=r.temperature, stop_token_ids=(eos_id,), reward_ref=reward_ref,
                                  coordination=coordination)
              for i in range(config.cluster.rollout_actors)]
    return RolloutFleet(actors).start()
