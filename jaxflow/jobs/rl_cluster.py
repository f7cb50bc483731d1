"""The RL job on a Ray cluster with its trainer as N processes forming one mesh, and how it survives faults.

`jaxflow.jobs.rl.run` hands over to `run` here when `cluster.trainer_processes` > 0. The job's process
(the driver) keeps the train loop (`jaxflow.jobs.train_loop`, the same as embedded) and places the rest, each
a Ray actor named after the run (`jaxflow.cluster.names`):

    jaxflow-<tag>-data          the trajectory service and the weight publisher (manifests of the newest
                                versions), in one `ServiceHost`; restarted by Ray if its process dies
    jaxflow-<tag>-trainer-<i>   the trainer's processes (`trainer_group.TrainerGroup`): one JAX mesh;
                                each restores the newest checkpoint when it starts
    jaxflow-<tag>-rollout-<i>   rollout actors (`jaxflow.jobs.ray_rollout`), pulling each version's shards
                                from the object store through the publisher's manifests
    jaxflow-<tag>-rewards       the reward pool (`jaxflow.rewards.RewardPool`, its worker processes inside),
                                unless a reward model or LLM judge scores the rollouts
    jaxflow-<tag>-scorers       a reward model or LLM judge in place of the reward, and a teacher beside the
                                rollout (`jaxflow.jobs.scorers`), when the config has them

with the held-out evals on a JAX engine in the driver. Custom node resources place them
(`cluster.node_resource.<piece>`: each actor of that piece asks for one unit).

Faults. A checkpoint is written before the first step (so there is always one to go back to) and every
`checkpoint.every` steps, with the trajectory service's snapshot inside.
- A trainer process dies (or stops answering): the group is ended and a new one formed in fresh processes
  (`-r<n>` names), which restores the newest checkpoint.
- The data-services actor dies: Ray restarts it empty; the trainer processes roll back to the newest
  checkpoint in place.
Either way the rollout actors first stop and forget every group they hold (so no group of the old state
is ever finished into the restored one), the trajectory service is rebuilt from the checkpoint's
snapshot (groups that were running are requeued with their partial samples), the ledger and metrics
drop the steps after the checkpoint, the checkpoint's version is published again, and the rollout
actors resume on it. So no group is lost or trained twice, and every token of a trained group was
admitted by the restored service under the bound. A rollout actor that dies is restarted by Ray and
rejoins by itself; its groups come back to the service (`jaxflow.jobs.ray_rollout`). Each recovery is
printed and recorded in result.json's `recoveries` (kind, detected_at, recovered_s: until the next step
was trained).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import time
from typing import Any

import ml_collections

from jaxflow.cluster import names, ray_actors
from jaxflow.cluster.trainer_group import TrainerGroup, TrainerGroupFailed
from jaxflow.cluster.weights import PUBLISHER_METHODS, ManifestSource, RayWeightPublisher
from jaxflow.coordination import Coordination
from jaxflow.data.records import RouteSpec
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.jobs.bookkeeping import Ledger, RewardErrors, RewardNeverWorked, reward_pool_options
from jaxflow.jobs.config import compute_dtype
from jaxflow.jobs.prompts import prompt_source
from jaxflow.jobs.ray_rollout import start_fleet
from jaxflow.jobs.resume import ExtraCheck
from jaxflow.jobs.run_log import RunLog
from jaxflow.jobs.scorers import print_distillation, start_scorers
from jaxflow.jobs.train_loop import Evaluator, LoopParts, conclude, train_loop
from jaxflow.models.config import from_hf_config, read_hf_config
from jaxflow.models.lora import LoRASpec
from jaxflow.rewards import RewardPool
from jaxflow.trainer.rl_trainer import step_config

__all__ = ["run"]

_REWARD_METHODS = ("score_group", "stats")
# Seconds to wait for Ray to bring a dead data-services actor back.
_HOST_RESTART_S = 120.0


def _resources(config: ml_collections.ConfigDict, piece: str) -> dict[str, float] | None:
    name = config.cluster.node_resource.get(piece)
    return {name: 1.0} if name else None


class _Cluster:
    """The run's Ray pieces and how to rebuild them (see the module docstring)."""

    def __init__(self, config, base_dir: pathlib.Path, train_records, cleanup: contextlib.ExitStack):
        self.config, self.base_dir, self.train_records = config, base_dir, train_records
        self.workdir = pathlib.Path(config.workdir)
        self.tag = names.run_tag(self.workdir)
        t = config.trainer
        config_json = pathlib.Path(base_dir, "config.json")
        model_config = from_hf_config(read_hf_config(base_dir), source=str(config_json))
        self.vocab_size, self.model_config = model_config.vocab_size, model_config
        self.route_spec = RouteSpec.of(model_config)  # what a mixture-of-experts policy's samples record
        self.spec = TrainerGroup.spec(
            str(base_dir), t, seq_len=config.rollout.max_len, max_sequences=t.batch_groups * config.rollout.group_size,
            checkpoints=str(self.workdir / "checkpoints"), max_to_keep=config.checkpoint.max_to_keep,
            fsdp=config.cluster.trainer_mesh.fsdp, tensor=config.cluster.trainer_mesh.tensor,
            expert=config.cluster.trainer_mesh.get("expert", 1), lora_seed=config.seed,
            compute_dtype=compute_dtype(config),
            validate_extra=ExtraCheck(group_size=config.rollout.group_size, batch_groups=t.batch_groups, eta=t.eta,
                                      reserve_groups=Coordination.from_config(config.rollout.coordination)
                                      .reserve_groups(t.batch_groups), route_spec=self.route_spec))
        self.generation = 0
        ray = ray_actors.require_ray()
        self.host = ray_actors.start_host(name=names.data(self.tag), max_restarts=-1,
                                          resources=_resources(config, "data"))
        cleanup.callback(ray.kill, self.host, no_restart=True)
        self.group: TrainerGroup | None = None
        cleanup.callback(lambda: self.group is not None and self.group.close(graceful=False))

    def new_service(self, snapshot: dict | None) -> TrajectoryService:
        config, t = self.config, self.config.trainer
        strategy = Coordination.from_config(config.rollout.coordination)
        service = TrajectoryService(prompt_source(config, self.train_records),
                                    batch_groups=t.batch_groups, group_size=config.rollout.group_size, eta=t.eta,
                                    batch_rule=t.batch_rule, lease_s=config.rollout.get("lease_s", 60.0),
                                    reserve_groups=strategy.reserve_groups(t.batch_groups),
                                    # What the trainers can train: ids the model embeds, sequences a row holds.
                                    vocab_size=self.vocab_size, max_sequence_tokens=config.rollout.max_len,
                                    route_spec=self.route_spec)
        if snapshot is not None:
            service.restore(snapshot)
        return service

    def form_group(self) -> tuple[int, dict | None]:
        """A new trainer group (restoring the newest checkpoint); (its version, the checkpoint's extra)."""
        c = self.config.cluster
        self.group = TrainerGroup(self.spec, num_processes=c.trainer_processes, tag=self.tag,
                                  generation=self.generation, cpu_devices=c.trainer_cpu_devices,
                                  resources=_resources(self.config, "trainer"))
        self.generation += 1
        return self.group.start()

    def host_services(self, service: TrajectoryService) -> tuple[Any, Any]:
        """Hosts `service` and a new weight publisher in the data actor (replacing what it held); their
        proxies. Waits for Ray to bring the actor back if it is restarting."""
        ray = ray_actors.require_ray()
        deadline = time.monotonic() + _HOST_RESTART_S
        while True:
            try:
                ray.get(self.host.where.remote(), timeout=10)
                break
            except ray.exceptions.RayError:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"the data-services actor {names.data(self.tag)} did not come back "
                                          f"within {_HOST_RESTART_S:g} s") from None
                time.sleep(0.5)
        for name in ("trajectories", "weights"):
            ray.get(self.host.remove.remote(name))
        trajectories = ray_actors.host(service, ray_actors.TRAJECTORY_SERVICE_METHODS, on=self.host,
                                       name="trajectories")
        publisher = ray_actors.build(RayWeightPublisher, PUBLISHER_METHODS, kwargs={"keep": 2}, on=self.host,
                                     name="weights")
        return trajectories, publisher


def run(config: ml_collections.ConfigDict, cleanup: contextlib.ExitStack, base_dir: pathlib.Path, tokenizer,
        task, train_records) -> int:
    """The RL job with `cluster.trainer_processes` trainer processes (see the module docstring); the exit
    code, as `rl.run`'s."""
    ray = ray_actors.require_ray()
    c = config.cluster
    # A local Ray started for the run gets a logical CPU for each actor that asks for one, however few
    # cores the machine has (they share them; on a real cluster the nodes declare their own).
    cpus = max(os.cpu_count() or 1, c.trainer_processes + c.rollout_actors + config.rollout.reward_workers)
    if ray_actors.connect(c.address, num_cpus=cpus):
        cleanup.callback(ray.shutdown)
    workdir, t, r = pathlib.Path(config.workdir), config.trainer, config.rollout
    cluster = _Cluster(config, base_dir, train_records, cleanup)
    version, extra = cluster.form_group()
    group = cluster.group
    service = cluster.new_service(extra["trajectories"] if extra else None)
    print(f"jaxflow: {config.cluster.trainer_processes} trainer processes form one mesh "
          f"{group.started[0]['mesh']} (train step compiled in {group.compile_s:.1f}s)"
          + (f"; resuming {workdir} from step {version}" if extra else ""), flush=True)
    if (spec := LoRASpec.from_config(config.trainer.get("lora"))) is not None:
        print(f"jaxflow: LoRA rank {spec.rank} (alpha {spec.alpha:g}) on {', '.join(spec.targets)}: "
              f"{group.trainable_params:,} trained parameters; weight syncs to the rollout actors carry merged "
              f"weights", flush=True)
    if version >= t.steps:
        print(f"jaxflow: {workdir} already ran {version} of {t.steps} steps; nothing to do")
        return 0
    base_accuracy = (extra or {}).get("base_accuracy")
    trajectories, publisher = cluster.host_services(service)
    if extra is None:  # a checkpoint to come back to before the first step
        group.checkpoint(None, {"trajectories": trajectories.snapshot(), "base_accuracy": None})
    group.publish_weights(publisher)
    task_errors = RewardErrors(failed_value=0.0)  # the task reward's failures that reach this process (the evals')
    step = step_config(t, compute_dtype(config), model_config=cluster.model_config)  # what the trainers compute
    scorers = start_scorers(config, cleanup, step=step, param_dtype=t.param_dtype, in_ray=True,
                            rollout_actors=c.rollout_actors)
    if step.distill is not None:
        print_distillation(step.distill, scorers.teacher, None)
    # The rollouts' reward: a reward model's or judge's, or the task's in the reward pool's actor (the evals keep
    # the task's, in the pool below).
    if scorers.answers is not None:
        rewards, reward_errors, reward_ref = scorers.answers, scorers.errors, scorers.reward_ref
    else:
        reward_host = ray_actors.start_host(name=names.rewards(cluster.tag),
                                            resources=_resources(config, "rewards"))
        cleanup.callback(ray.kill, reward_host)
        rewards = ray_actors.build(RewardPool, _REWARD_METHODS, on=reward_host, name="rewards",
                                   kwargs=reward_pool_options(r))
        reward_errors, reward_ref = task_errors, task.reward_ref
    pool = RewardPool(**{**reward_pool_options(r), "num_workers": 1}, on_failure=task_errors)
    cleanup.callback(pool.close)
    evaluator = Evaluator(config, group, ManifestSource(publisher), task, tokenizer, pool, model=str(base_dir))
    cleanup.callback(evaluator.close)
    where = ray.get(cluster.host.where.remote())
    result: dict[str, Any] = {"base_accuracy": base_accuracy, "recoveries": [], "cluster": {
        "mode": "ray", "trajectory_service": where, "trainer_processes": [
            {k: s[k] for k in ("pid", "mesh")} for s in group.started]}}
    if result["base_accuracy"] is None:
        result["base_accuracy"] = evaluator()
    fleet = start_fleet(config, trajectories, ManifestSource(publisher), base_dir, reward_ref,
                        tokenizer.eos_id, resources=_resources(config, "rollout"), rewards=rewards,
                        teacher=scorers.teacher, scoring_threads=scorers.threads)
    result["cluster"]["rollout_actors"] = fleet.placed
    if scorers.placed is not None:
        result["cluster"]["scorers"] = scorers.placed
    cleanup.callback(fleet.stop)
    never_worked = None
    while True:
        ledger = Ledger(workdir / "ledger.jsonl", version)
        run_log = RunLog(workdir, total_steps=t.steps, start_step=version, resume=version > 0)
        if version == 0 and not result["recoveries"]:
            run_log.log_eval(0, result["base_accuracy"])
        pending = result["recoveries"][-1] if result["recoveries"] else None

        def step_done(step: int, pending=pending) -> None:
            if pending is not None and "recovered_s" not in pending:
                pending["recovered_s"] = round(time.time() - pending["detected_at"], 2)
        # ckpt None: the trainer processes write the checkpoints.
        parts = LoopParts(trainer=group, service=trajectories, params=publisher, coordinator=fleet, ckpt=None,
                          ledger=ledger, run_log=run_log, evaluator=evaluator, rewards=rewards,
                          reward_errors=reward_errors, reward_ref=reward_ref)
        try:
            result.update(train_loop(config, parts, start_step=version, base_accuracy=result["base_accuracy"],
                                     step_done=step_done))
            break
        except RewardNeverWorked as e:
            never_worked = str(e)
            break
        except (TrainerGroupFailed, ConnectionError) as e:
            kind = "trainer" if isinstance(e, TrainerGroupFailed) else "data"
            detected = time.time()
            print(f"jaxflow: {'a trainer process' if kind == 'trainer' else 'the data-services actor'} failed "
                  f"({e}); recovering from the newest checkpoint", file=sys.stderr, flush=True)
            fleet.pause()
            version, extra, group = _recover(cluster, kind)
            service = cluster.new_service(extra["trajectories"])
            trajectories, publisher = cluster.host_services(service)
            group.publish_weights(publisher)
            evaluator.weights = ManifestSource(publisher)
            evaluator.trainer = group
            fleet.resume(trajectories, ManifestSource(publisher))
            result["recoveries"].append({"kind": kind, "detected_at": round(detected, 3), "step": version,
                                         "error": str(e)[:500], "ready_s": round(time.time() - detected, 2)})
            print(f"jaxflow: recovered from the {kind} failure in {time.time() - detected:.1f}s; resuming at "
                  f"step {version}", flush=True)
        finally:
            ledger.close()
            run_log.close()
    result["coordination"] = {k: v for k, v in fleet.stats().items() if k != "instances"}
    return conclude(config, result, parts, never_worked,
                    lambda: group.export(workdir / "export", base_dir, workdir / "adapter"))


def _recover(cluster: _Cluster, kind: str) -> tuple[int, dict, TrainerGroup]:
    """Brings the trainer back to the newest checkpoint: a new group after a trainer failure, the same
    one rolled back in place after a data-services failure (a new one if that fails too)."""
    if kind == "data":
        try:
            version, extra = cluster.group.restore_latest()
            return version, extra, cluster.group
        except TrainerGroupFailed:
            pass
    cluster.group.close(graceful=False)
    version, extra = cluster.form_group()
    return version, extra, cluster.group
