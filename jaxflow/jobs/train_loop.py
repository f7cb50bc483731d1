"""The RL job's train loop, the same for the embedded job (`jaxflow.jobs.rl`) and the cluster driver
(`jaxflow.jobs.rl_cluster`): consume buffer v, one PPO step, publish v+1, log, evaluate and checkpoint
on schedule; then `conclude` writes the accounting, the export and result.json.

What the loop drives comes in one `LoopParts`: the trainer (an `RLTrainer` in this process, or the
cluster's `TrainerGroup`), the trajectory service (or its Ray proxy), where the trainer publishes, the
coordinator (or the fleet of rollout actors), the checkpointer, the ledger, the run log, the held-out
`Evaluator` and the reward pool. Each job builds its pieces its own way and hands them over here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import ml_collections

from jaxflow.data.device_params import DeviceParamSource
from jaxflow.jobs.bookkeeping import REWARD_FAILURES, Ledger, RewardErrors, StopRequest, accounting, check_first_batch
from jaxflow.jobs.config import rollout_compute_dtype
from jaxflow.jobs.evaluation import evaluate
from jaxflow.jobs.prompts import eval_records
from jaxflow.jobs.run_log import RunLog
from jaxflow.trainer.checkpoint import Checkpointer
from rollout_bridge.factory import runs_episodes, with_episodes

__all__ = ["PHASES", "Evaluator", "LoopParts", "conclude", "phase_line", "train_loop", "usable_cores"]

# Seconds the trainer waits for a buffer before it prints where the groups are.
_STALL_REPORT_S = 120.0
# What the coordination strategies did, cumulative, in every step's metrics.
_COORDINATION_METRICS = ("requests_migrated", "requests_retried", "requests_resumed", "samples_redundant",
                         "buffers_released")
# The train loop's phases, in the order `phase_line` prints them; "other" is what the rest leave.
PHASES = ("wait_rollout", "batch", "update", "publish", "eval", "checkpoint")


class Evaluator:
    """Held-out greedy accuracy of the current policy, on a JAX engine of its own, computing in the rollout
    engines' dtype (rollout.compute_dtype, default model.compute_dtype): evals measure the policy as the
    rollouts serve it."""

    def __init__(self, config: ml_collections.ConfigDict, trainer, weights, task, tokenizer, pool, model=None):
        """trainer: its `version` is evaluated; weights: where that version is pulled from; pool: the reward
        pool that scores the answers; model: what the engine starts from (default the trainer's model; a
        path for a trainer in other processes)."""
        from rollout_bridge.jax_engine import JaxEngine
        r = config.rollout
        self.records = eval_records(config, task, tokenizer)
        # Beside JAX rollout engines in this process, the evaluator's engine takes their shapes, so that
        # every program it compiles at start is one they reuse (jit's in-memory cache: the tiny model's first
        # step 4 s sooner on two cores, even with a warm persistent cache). Otherwise (vLLM,
        # rollout actors) its KV cache is kept to 64 slots.
        shared = r.engine == "jax" and not config.cluster.rollout_actors and model is None
        self.episodes = runs_episodes(r.get("env"))
        self.engine = JaxEngine(trainer.model() if model is None else model,
                                max_slots=r.max_slots if shared else min(r.max_slots, 64),
                                max_len=r.max_len, decode_chunk=r.decode_chunk, version=trainer.version,
                                reuse_turns=self.episodes,
                                compute_dtype=rollout_compute_dtype(config))
        if isinstance(weights, DeviceParamSource):
            weights.add_target(self.engine.param_shardings)
        self.engine = with_episodes(r.get("env"), tokenizer)(self.engine)  # evals run the task's episodes too
        self.trainer, self.weights, self.task, self.tokenizer, self.pool, self.max_tokens = \
            trainer, weights, task, tokenizer, pool, r.max_tokens

    def __call__(self) -> float:
        """The held-out accuracy (fraction of `eval.num_prompts` answered right) of the trainer's version."""
        if self.engine.version != self.trainer.version:
            self.engine.update_weights(*self.weights.pull(self.trainer.version))
        self.last = evaluate(self.engine, self.records, decode=self.tokenizer.decode,
                             reward_ref=self.task.reward_ref, max_tokens=self.max_tokens,
                             stop_token_ids=[self.tokenizer.eos_id], pool=self.pool,
                             tag=f"eval{self.trainer.version}")
        return self.last.accuracy

    def extra(self) -> dict[str, float]:
        """The last eval's other figures worth a metric: with episodes, how often the environment answered."""
        return {"eval_env_frac": self.last.env_frac} if self.episodes else {}

    def close(self):
        self.engine.close()


@dataclasses.dataclass
class LoopParts:
    """What `train_loop` drives and `conclude` accounts for.

    trainer: `train(batch) -> (metrics, staleness)`, `publish(service, params)`, `checkpoint(ckpt, extra)`,
    `version`, `compiles`, `compile_s` (an `RLTrainer`, or the cluster's `TrainerGroup`). service: the
    trajectory service or its proxy (`consume`, `stats`, `snapshot`). params: where `trainer.publish` puts
    each version (a parameter service, its proxy, the cluster's weight publisher, or None). coordinator:
    the `Coordinator`, or the fleet of rollout actors (`start`, `instances`, `counts`). ckpt: the
    checkpointer (None when the trainer writes its own). rewards: the reward pool or its proxy (`stats`);
    reward_errors: its failure printer; reward_ref: the task's "module:function" reward (named in the
    error that stops a run whose reward never works)."""

    trainer: Any
    service: Any
    params: Any
    coordinator: Any
    ckpt: Checkpointer | None
    ledger: Ledger
    run_log: RunLog
    evaluator: Evaluator
    rewards: Any
    reward_errors: RewardErrors
    reward_ref: str


def phase_line(result: dict[str, Any]) -> str:
    """One line: the train loop's wall time split by phase (`result["phases_s"]`), how busy the rollout
    engines were meanwhile, and how many cores the run's processes kept busy (`result["cpu_s"]` per second)."""
    phases, wall = result.get("phases_s"), result.get("wall_s")
    if not phases or not wall:
        return ""
    parts = ", ".join(f"{k.replace('_', ' ')} {x:.1f}s ({x / wall:.0%})" for k, x in phases.items())
    idle = result.get("rollout_idle_frac")
    busy = "" if idle is None else f"; rollout engines busy {1.0 - idle:.0%} of it"
    cpu = f"; this process and its children used {result['cpu_s'] / wall:.2f} of {result['cores']} cores"
    return f"jaxflow: train loop {wall:.1f}s: {parts}{busy}{cpu}\n"


def cpu_time() -> float:
    """CPU seconds (user and system) of this process and of its child processes so far: the live ones
    (psutil, all generations) and those already waited for."""
    import resource

    import psutil

    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + reaped.ru_utime + reaped.ru_stime
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        try:
            times = child.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        total += times.user + times.system
    return total


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _consume(service, version: int, stop: StopRequest, coordinator=None):
    """Waits for buffer `version`; None if a stop was requested meanwhile. Raises the coordinator's error
    (`Coordinator.error`: a rollout engine failed) rather than wait for a buffer that will not fill."""
    waited = 0.0
    while not stop.requested:
        try:
            return service.consume(version, timeout=0.5)
        except TimeoutError:
            error = getattr(coordinator, "error", None)
            if error is not None:
                raise error from error.__cause__
            waited += 0.5
            if waited % _STALL_REPORT_S == 0:
                print(f"jaxflow: still waiting for buffer {version} after {waited:.0f}s: "
                      f"{service.stats()['next_buffer']}", file=sys.stderr, flush=True)
    return None


def train_loop(config: ml_collections.ConfigDict, parts: LoopParts, *, start_step: int, base_accuracy: float,
               step_done: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Trains steps `start_step` .. `trainer.steps - 1` (or until `trainer.time_limit_s`, or Ctrl-C), each
    on the buffer of its version; logs every step, evaluates every `eval.every` steps and at the end, and
    checkpoints (with the trajectory service's snapshot and `base_accuracy`) every `checkpoint.every` steps
    and at the end. step_done(step): called after each step is logged. Returns what goes into result.json:
    interrupted, final_accuracy, wall_s, eval_s, cpu_s, eval_cpu_s, cores, phases_s, rollout_idle_frac.
    Raises `RewardNeverWorked` when the reward failed on every sample of the first batch."""
    t = config.trainer
    trainer, service, coordinator, rewards = parts.trainer, parts.service, parts.coordinator, parts.rewards
    rewards_before = rewards.stats()
    coordinator.start()
    out: dict[str, Any] = {}
    loop_start, trained_tokens, consumed_tokens = time.monotonic(), 0.0, 0.0
    # CPU time of every thread of this process (the trainer, embedded JAX engines, XLA's thread pools) and
    # of its child processes (isolated environments and agents, the reward pool's workers, a vLLM server it
    # started); Ray actors elsewhere are not in it.
    cpu_start, eval_cpu = cpu_time(), 0.0
    # The train loop's wall time by what it was doing (the rollout runs beside it): `phase_line` prints it.
    phases = dict.fromkeys(PHASES, 0.0)
    accuracy = rollout_idle = None

    saved = [start_step]

    def save():
        if saved[-1] != trainer.version:
            save_from = time.monotonic()
            trainer.checkpoint(parts.ckpt, {"trajectories": service.snapshot(), "base_accuracy": base_accuracy})
            saved.append(trainer.version)
            phases["checkpoint"] += time.monotonic() - save_from

    with StopRequest() as stop:
        for step in range(start_step, t.steps):
            before = time.monotonic()
            consumed = _consume(service, step, stop, coordinator)
            if consumed is None:
                break
            phases["wait_rollout"] += time.monotonic() - before
            if step == start_step:  # before any update: a reward that never works must not train on zeros
                check_first_batch(rewards, rewards_before, t.batch_groups * config.rollout.group_size,
                                  parts.reward_errors, parts.reward_ref)
            busy_from = time.monotonic()
            metrics, staleness = trainer.train(consumed)
            published_from = time.monotonic()
            trainer.publish(service, parts.params)
            metrics["publish_s"] = time.monotonic() - published_from
            metrics["trainer_busy_s"] = time.monotonic() - busy_from
            batch_s = metrics.get("batch_s", 0.0)  # the trainer group's steps do not split it out
            phases["batch"] += batch_s
            phases["update"] += published_from - busy_from - batch_s
            phases["publish"] += metrics["publish_s"]
            parts.ledger.record(step, [g.group_id for g in consumed.groups])
            elapsed = time.monotonic() - loop_start
            trained_tokens += metrics["trained_tokens"]
            consumed_tokens += metrics["consumed_tokens"]
            instances = coordinator.instances
            idle = sum(i.idle_s for i in instances) / (elapsed * max(len(instances), 1))
            counts = service.stats()["counts"]
            metrics.update(trainer_idle_frac=phases["wait_rollout"] / elapsed, rollout_idle_frac=min(idle, 1.0),
                           trained_tokens_per_s=trained_tokens / elapsed,
                           consumed_tokens_per_s=consumed_tokens / elapsed,
                           groups_aborted=float(counts["aborted"]), groups_failed=float(counts["failed"]),
                           groups_surplus=float(counts["surplus"]),
                           # finishes the service refused (ids the model cannot embed, too long, bad rewards)
                           finishes_refused=float(counts.get("refused", 0)),
                           weight_syncs=float(coordinator.counts["syncs"]))
            rollout_idle = metrics["rollout_idle_frac"]
            metrics.update({k: float(coordinator.counts[k]) for k in _COORDINATION_METRICS})
            reward_stats = rewards.stats()
            metrics.update({f"reward_{k}": float(reward_stats[k]) for k in REWARD_FAILURES})
            # A time limit ends the run like its last step: a held-out eval, a checkpoint, the export.
            done = step + 1 == t.steps or 0 < t.time_limit_s <= elapsed
            if (step + 1) % config.eval.every == 0 or done:
                eval_from, eval_cpu_from = time.monotonic(), cpu_time()
                accuracy = parts.evaluator()
                metrics["eval_accuracy"] = accuracy
                metrics.update(parts.evaluator.extra())
                metrics["eval_s"] = time.monotonic() - eval_from
                eval_cpu += cpu_time() - eval_cpu_from
                phases["eval"] += metrics["eval_s"]
            parts.run_log.log_step(step, metrics, staleness=staleness)
            if step_done is not None:  # the cluster driver times its recoveries by it
                step_done(step)
            if (step + 1) % config.checkpoint.every == 0 or done or stop.requested:
                save()
            if stop.requested or done:
                break
        if stop.requested:
            save()
    out["interrupted"] = stop.requested
    out["final_accuracy"] = accuracy
    out["wall_s"] = time.monotonic() - loop_start
    out["eval_s"] = phases["eval"]
    out["cpu_s"], out["eval_cpu_s"] = cpu_time() - cpu_start, eval_cpu
    out["cores"] = usable_cores()
    phases["other"] = max(out["wall_s"] - sum(phases.values()), 0.0)  # metrics, logging, the ledger
    out["phases_s"] = {k: round(x, 3) for k, x in phases.items()}
    out["rollout_idle_frac"] = rollout_idle
    return out


def conclude(config: ml_collections.ConfigDict, result: dict[str, Any], parts: LoopParts,
             never_worked: str | None, export: Callable[[], None]) -> int:
    """After the train loop: the accounting (of `parts`' service, ledger and reward pool), the export
    (`export()`), result.json and the closing lines. never_worked: the error of a run whose reward never
    worked (result.json gets it, nothing is exported). Returns the process exit code: 0, 2 (the reward
    never worked) or 130 (stopped by Ctrl-C; rerunning resumes)."""
    workdir, t, trainer = pathlib.Path(config.workdir), config.trainer, parts.trainer
    if result.get("interrupted"):
        print(f"jaxflow: stopped at step {trainer.version}; rerun the same command to resume", flush=True)
        return 130
    result["accounting"] = accounting(parts.service, parts.ledger, parts.rewards)
    a = result["accounting"]
    reward_line = (f"jaxflow: reward calls {a['reward_calls']}: scored {a['reward_scored']}, failed (scored 0) "
                   + ", ".join(f"{k.replace('_', ' ')} {a['reward_' + k]}" for k in REWARD_FAILURES))
    if never_worked is not None:
        result["error"] = never_worked
        (workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"jaxflow: error: {never_worked}\n{reward_line}", file=sys.stderr, flush=True)
        return 2
    result["train_step_compiles"], result["train_step_compile_s"] = trainer.compiles, round(trainer.compile_s, 2)
    if hasattr(trainer, "trainable_params"):  # the trainer group (cluster mode) does not count them
        result["trained_params"] = trainer.trainable_params
    export()
    (workdir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    adapter = workdir / "adapter"
    print(f"jaxflow: done. held-out accuracy {result['base_accuracy']:.1%} (base) -> "
          f"{result['final_accuracy']:.1%} after {trainer.version} steps"
          + (f" (trainer.time_limit_s {t.time_limit_s:g} reached)" if trainer.version < t.steps else "")
          + f"; policy exported to {workdir / 'export'}"
          + (f" (its LoRA adapters alone, PEFT's format: {adapter})" if getattr(trainer, "lora", None) else "")
          + "\n"
          f"jaxflow: groups created {a['created']} = consumed {a['consumed']} + in flight {a['in_flight']} + "
          f"failed {a['failed']} + surplus {a['surplus']}; the ledger holds {a['ledger_groups']} trained groups, "
          f"{a['ledger_duplicates']} trained twice\n"
          f"jaxflow: train-step compiles: {trainer.compiles} ({trainer.compile_s:.1f}s)\n{phase_line(result)}"
          f"{reward_line}",
          flush=True)
    return 0
