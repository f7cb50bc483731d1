"""A rollout worker as a Ray actor: the coordinator (`jaxflow.coordination`) over one engine, talking to
the data services' actors through their proxies (`jaxflow.cluster.ray_actors`).

It is `jaxflow.jobs.rollout_worker` with Ray as the transport: the trajectory service's proxy in place of
the RPC client, and the parameter service's proxy (its `latest` and `pull`) in place of the parameter
client. `start_rollout_actor` places one: one GPU where the cluster has GPUs, one CPU otherwise, plus any
custom node resources (which pick the nodes it may run on).

Its engine is a JAX or a vLLM engine (`make_engine`, as the RL job's and the rollout worker CLI's). A vLLM
engine runs its engine core and worker in child processes of the actor (they end with it, also when Ray
kills it) and loads each pulled version's HF-named host tensors. On a CPU node vLLM's worker binds its
threads to the node's cores itself (`VLLM_CPU_OMP_THREADS_BIND`, default "auto", which also sets its
OMP_NUM_THREADS), whatever the one CPU Ray counts for the actor and the OMP_NUM_THREADS=1 Ray gives it.
"""

from __future__ import annotations

import collections
import logging
import os
import types
from typing import Any

from jaxflow.cluster import names, ray_actors
from jaxflow.coordination import Coordination, Coordinator
from jaxflow.data.param_service import UnknownVersionError
from jaxflow.jobs.config import rollout_compute_dtype
from rollout_bridge.engine import SamplingParams
from rollout_bridge.factory import make_engine, runs_episodes, with_episodes

log = logging.getLogger(__name__)


class RolloutActor:
    """The body of a rollout actor: one engine and the coordinator that drives it, fed by the trajectory
    service and synced from the parameter service.

    Args:
      name: the actor's name (in its reports and logs).
      trajectories: a proxy of the trajectory service.
      params: a proxy of any weight source with `latest` / `pull` (a vLLM engine takes the pulled versions'
        HF-named host tensors, as every weight source's `pull` returns them).
      model: the HF directory the engine starts from (on the actor's node).
      engine: "jax" or "vllm" (`rollout_bridge.factory.make_engine`).
      max_len: the engine's context (prompt + completion) in tokens.
      max_slots: sequences the engine runs at once.
      seed: the engine's sampling seed.
      decode_chunk: JAX engine only: decode steps per jitted call.
      kv_cache_gib: vLLM only: GiB of KV cache.
      max_tokens: tokens a sample may generate.
      temperature: the sampling temperature.
      stop_token_ids: tokens that end a sample besides the tokenizer's end of sequence.
      reward_ref: "module:function" scoring (response text, meta), or None to leave rewarding to the
        trainer's side.
      rewards: the proxy of a `RewardPool` in its own actor to score in (its time limit and crash
        isolation), or of a reward model or judge with its interface (`jaxflow.jobs.scorers`), or None to score
        in this actor.
      teacher: the proxy of a teacher scorer (`rollout_bridge.teacher.TeacherScorer`, in the scorers' actor)
        whose `score_group` records each finished sample's teacher log-probs (on-policy distillation with
        `trainer.distill.where = "rollout"`), or None.
      scoring_threads: groups scored at once, off the coordinator's loop (`Coordinator(scoring_threads=)`): for
        a reward model, judge or teacher, whose batches the groups then share; 0 scores in the loop.
      coordination: `Coordination` options (max_running defaults to max_slots; stuck buffers are the
        trainer's business, so `stuck` is "wait").
      index: the actor's place in its fleet (in its reports).
      env: the `rollout.env` section as a dict, to run that environment's episodes on the engine
        (`with_episodes`; scored by their environments), or None for single answers.
      dtype: what the engine computes in ("float32" or "bfloat16"; the RL job passes rollout.compute_dtype,
        default model.compute_dtype), casting each pulled version; None: `make_engine`'s default.
    """

    def __init__(self, name: str, trajectories: Any, params: Any, model: str, *, engine: str = "jax",
                 max_len: int = 256, max_slots: int = 8, seed: int = 0, decode_chunk: int = 16,
                 kv_cache_gib: float | None = 1.0, max_tokens: int = 64, temperature: float = 1.0,
                 stop_token_ids: tuple[int, ...] = (), reward_ref: str | None = None, rewards: Any = None,
                 coordination: dict[str, Any] | None = None, index: int = 0, env: dict | None = None,
                 dtype: str | None = None, teacher: Any = None, scoring_threads: int = 0):
        options = {"max_running": max_slots, "sync": "all", **(coordination or {}), "stuck": "wait"}
        strategy = Coordination.from_config(options)
        from jaxflow.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(model)
        self.engine = with_episodes(env, tokenizer)(
            make_engine(engine, model, max_len, max_slots, seed=seed, decode_chunk=decode_chunk,
                        kv_cache_gib=kv_cache_gib, episodes=runs_episodes(env), dtype=dtype))
        reward_fn = None
        if reward_ref is not None:
            from jaxflow.rewards import group_reward_fn, resolve
            if rewards is not None:
                reward_fn = group_reward_fn(rewards, reward_ref, tokenizer.decode)
            else:
                score = resolve(reward_ref)

                def reward_fn(task, samples):
                    return [float(score(tokenizer.decode(s.tokens), task.meta)) for s in samples]

        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                  stop_token_ids=tuple(stop_token_ids))
        self.name, self.index = name, index
        self._coordinator_args = dict(strategy=strategy, eta=0, sampling=sampling, reward_fn=reward_fn,
                                      trace_every_s=0.25, scoring_threads=scoring_threads,
                                      teacher_fn=None if teacher is None else teacher.score_group)
        self.coordinator = Coordinator(name, [self.engine], trajectories, params, **self._coordinator_args)
        self._started = False
        if ray_actors.require_ray().get_runtime_context().was_current_actor_reconstructed:
            # Ray restarted this actor after its process died: what the old process held goes back to the
            # service now (rather than when its leases run out), then this one generates again.
            try:
                trajectories.release_worker(name, "rollout actor restarted")
            except Exception as e:  # noqa: BLE001 - the service may be down too; its leases then run out
                log.warning("%s: could not release the groups of the previous process: %s", name, e)
            try:
                self.start()
            except UnknownVersionError as e:
                # The newest version's tensors went with the trainer process that held them (it died
                # too): the driver recovers from that, republishes and resumes every actor (`resume`).
                # Raising here would end this actor for good (Ray does not restart a failed constructor).
                log.warning("%s: restarted, but the newest weights are gone (%s); waiting to be resumed",
                            name, e)

    def start(self) -> dict[str, Any]:
        """Loads the newest published weights and starts generating (unless it already is); {"pid",
        "node_id", "version"}."""
        if not self._started:
            self.coordinator.load_weights()
            self.coordinator.start()
            self._started = True
        node = ray_actors.require_ray().get_runtime_context().get_node_id()
        return {"pid": os.getpid(), "node_id": node, "version": self.engine.version}

    def pause(self) -> dict[str, int]:
        """Stops generating and forgets every group held (handed back to the service if it answers): before
        the services are restored from a checkpoint, so that no group of the old state is finished into
        the new one. The engine and its weights stay. The stopped coordinator's counts."""
        self.coordinator.stop(abort_in_flight=True)
        self._started = False
        return dict(self.coordinator.counts)

    def resume(self, trajectories: Any = None, params: Any = None) -> dict[str, Any]:
        """After `pause`: a new coordinator (over these service proxies, default the old ones) loads the
        newest published version, whatever the engine held, and generates again; as `start`."""
        old = self.coordinator
        self.coordinator = Coordinator(self.name, [self.engine], trajectories or old.trajectories,
                                       params or old.params, **self._coordinator_args)
        self._started = False
        return self.start()

    def report(self, trace: bool = False) -> dict[str, Any]:
        """{"stats": the coordinator's stats, and with `trace` "trace": its trace as lists}."""
        out: dict[str, Any] = {"stats": self.coordinator.stats(), "index": self.index, "pid": os.getpid()}
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
                        resources: dict[str, float] | None = None, max_restarts: int = -1,
                        **options: Any) -> Any:
    """Starts a `RolloutActor` named `name` (one GPU if the cluster has any, else one CPU) and returns its
    handle; `options` are `RolloutActor`'s. Call `handle.start.remote()` to set it going. Ray restarts
    the actor when its process dies, up to `max_restarts` times (-1: always); a restarted actor hands back
    what its old process held and generates again by itself. An actor with a vLLM engine runs JAX on the
    CPU platform (JAX_PLATFORMS=cpu; it only reads shapes there), so that JAX never takes the GPU memory
    that vLLM is given."""
    ray = ray_actors.require_ray()
    env = ray_actors.jax_env()
    if options.get("engine") == "vllm":
        env["JAX_PLATFORMS"] = "cpu"
    actor_options = {**ray_actors.actor_options(resources, env), "max_restarts": max_restarts}
    return ray.remote(RolloutActor).options(name=name, **actor_options).remote(
        name, trajectories, params, model, **options)


class RolloutFleet:
    """Rollout actors seen as one coordinator by the RL job's train loop: `start`, `stop`, `counts`,
    `instances` (each with `idle_s`), `stats()` and `trace`, summed or joined over the actors that answer
    (one that is dead or being restarted by Ray is left out of that report); `restarts` counts the actor
    processes seen replaced; `pause` and `resume` stop and restart generation on every actor."""

    def __init__(self, actors: list[Any], report_timeout_s: float = 10.0):
        self.actors, self.placed, self.report_timeout_s = actors, [], report_timeout_s
        self._pids: list[set[int]] = [set() for _ in actors]

    @property
    def restarts(self) -> int:
        return sum(max(len(p) - 1, 0) for p in self._pids)

    def _answers(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """`method(*args)` on every actor; the answers of those that gave one."""
        ray = ray_actors.require_ray()
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s or self.report_timeout_s)
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=0.01))
            except ray.exceptions.RayError as e:
                log.warning("rollout actor %d gave no %s: %s", i, method, type(e).__name__)
                ray.cancel(ref)
        return out

    def _reports(self, trace: bool = False) -> list[dict[str, Any]]:
        reports = self._answers("report", trace)
        for r in reports:
            self._pids[r["index"]].add(r["pid"])
        return reports

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

    def pause(self, timeout_s: float = 120.0) -> None:
        """Every actor that answers stops generating and forgets its groups (see `RolloutActor.pause`)."""
        self._answers("pause", timeout_s=timeout_s)

    def resume(self, trajectories: Any = None, params: Any = None, timeout_s: float = 300.0) -> None:
        """Every actor that answers generates again, over these service proxies (default its old ones)."""
        self._answers("resume", trajectories, params, timeout_s=timeout_s)

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
        return {**out, "instances": [i for r in reports for i in r["stats"]["instances"]],
                "actor_restarts": self.restarts}

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
            self._answers("stop", abort_in_flight, timeout_s=120)
        finally:
            for a in self.actors:
                ray.kill(a, no_restart=True)


def start_fleet(config: Any, trajectories: Any, params: Any, model: Any, reward_ref: str,
                eos_id: int, resources: dict[str, float] | None = None, rewards: Any = None, teacher: Any = None,
                scoring_threads: int = 0) -> RolloutFleet:
    """The RL job's `cluster.rollout_actors` rollout actors (each a coordinator over one engine of
    `rollout.engine`, with the `rollout.*` sizes and sampling and the `rollout.coordination` options,
    seeded `seed` + i, named `names.rollout(tag, i)`), started and generating. Rewards are scored by
    `reward_ref`, in the reward pool's actor `rewards` (a proxy; or a reward model's or judge's, `jaxflow.jobs.
    scorers`), or in the actors when None; with `rollout.env` set, the actors run its episodes, which their
    environments score. teacher: a teacher scorer's proxy, recording each sample's teacher log-probs (or None).
    scoring_threads: each actor's (`RolloutActor`). Their engines compute in rollout.compute_dtype (default
    model.compute_dtype). resources: custom node resources each actor needs."""
    r = config.rollout
    coordination = r.coordination.to_dict()
    tag = names.run_tag(config.workdir)
    actors = [start_rollout_actor(names.rollout(tag, i), trajectories, params, str(model), index=i,
                                  resources=resources,
                                  engine=r.engine, max_len=r.max_len, max_slots=r.max_slots, seed=config.seed + i,
                                  decode_chunk=r.decode_chunk, kv_cache_gib=r.kv_cache_gib,
                                  max_tokens=r.max_tokens,
                                  temperature=r.temperature, stop_token_ids=(eos_id,), reward_ref=reward_ref,
                                  rewards=rewards, teacher=teacher, scoring_threads=scoring_threads,
                                  coordination=coordination,
                                  env=r.env.to_dict() if r.get("env") is not None else None,
                                  dtype=rollout_compute_dtype(config))
              for i in range(config.cluster.rollout_actors)]
    return RolloutFleet(actors).start()
