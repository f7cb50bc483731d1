"""The models that score a run's samples besides the task's reward function, built where the engines can reach
them: a reward model or an LLM judge in place of the reward (`rollout.reward_model`, `rollout.judge`), and the
teacher of on-policy distillation beside the rollout (`trainer.distill.where = "rollout"`).

With the engines in the job's process they are built there. With rollout actors (`cluster.rollout_actors`,
also under `cluster.trainer_processes`) they are built in one Ray actor of their own, `jaxflow-<tag>-scorers`
(`jaxflow.cluster.names`), which every rollout actor calls through a proxy: all the actors' groups then share
the model's batches, and the model is loaded once. That actor asks for one GPU where the cluster has GPUs (on a
CPU cluster for no CPU, as the reward pool's actor: it computes on the cores of its node) and for the node
resource `cluster.node_resource.scorers`; one not placed within `PLACE_TIMEOUT_S` stops the job with an error
naming it and the cluster's free resources. It prints its own scoring failures (Ray forwards them to the job's
stderr); their counts reach the step metrics through its `stats()`.

Each coordinator scores finished groups on `SCORING_THREADS` threads when one of these models scores, so that
groups meet in the model's batches while the coordinator goes on generating.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import ml_collections

from jaxflow.jobs.bookkeeping import RewardErrors
from jaxflow.rewards.judge_config import JudgeConfig
from jaxflow.rewards.model_config import RewardModelConfig, reward_model_options

__all__ = ["PLACE_TIMEOUT_S", "SCORING_THREADS", "Scorers", "print_distillation", "start_scorers"]

# Seconds the scorers' actor may wait for the resources it asks for.
PLACE_TIMEOUT_S = 600.0
# Groups a reward model, judge or teacher scores at once, per coordinator (`Coordinator(scoring_threads=)`).
SCORING_THREADS = 8
# The methods a rollout actor and the job call on a placed reward model or judge, and on a placed teacher.
_ANSWER_METHODS = ("score_group", "stats")
_TEACHER_METHODS = ("score_group", "stats", "summary")


@dataclasses.dataclass
class Scorers:
    """What `start_scorers` built.

    answers: the reward model or judge (or the proxy of the one in the scorers' actor), with the reward pool's
      `score_group(reward_ref, texts, meta)` and `stats()`; None: the task's reward function scores.
    reward_ref: the name to pass `answers` as `fn_ref` (None without `answers`).
    errors: the printer of `answers`' failures in this process (a placed model prints its own: `first` stays None).
    teacher: the teacher scorer (or its proxy), whose `score_group(task, samples)` is a coordinator's
      `teacher_fn`; None without a teacher beside the rollout.
    placed: {"pid", "node_id"} of the scorers' Ray actor; None when built in this process.
    """

    answers: Any = None
    reward_ref: str | None = None
    errors: RewardErrors | None = None
    teacher: Any = None
    placed: dict[str, Any] | None = None

    @property
    def threads(self) -> int:
        """Scoring threads per coordinator: `SCORING_THREADS` when a model scores, else 0 (scored in its loop)."""
        return SCORING_THREADS if self.answers is not None or self.teacher is not None else 0


def start_scorers(config: ml_collections.ConfigDict, cleanup: contextlib.ExitStack, *, step: Any = None,
                  param_dtype: Any = None, in_ray: bool = False, rollout_actors: int = 1) -> Scorers:
    """Builds the checked config's reward model or judge and its rollout-side teacher; each is closed (or its
    actor ended) by `cleanup`.

    Args:
      config: the run's config (`rollout.reward_model`, `rollout.judge`, `cluster.node_resource.scorers`).
      step: the train step's `StepConfig`: with `distill` whose teacher log-probs are `recorded`, a teacher is
        built, computing as the step's teacher would (`logprob_chunk`, `compute_dtype`); None: no teacher.
      param_dtype: the dtype the teacher is loaded in (`trainer.param_dtype`).
      in_ray: build them in the scorers' Ray actor (Ray connected) rather than in this process.
      rollout_actors: the callers in Ray (each calls with `SCORING_THREADS` threads).
    """
    rm = RewardModelConfig.from_config(config.rollout.get("reward_model"))
    judge = JudgeConfig.from_config(config.rollout.get("judge"))
    distill = None if step is None else step.distill
    teacher = distill if distill is not None and distill.recorded else None
    if rm.dir is None and judge.dir is None and teacher is None:
        return Scorers()
    # A vLLM judge alone in the actor: JAX there only reads shapes, on the CPU, and never takes the GPU memory
    # vLLM is given (as in a rollout actor with a vLLM engine).
    env = {"JAX_PLATFORMS": "cpu"} if judge.dir is not None and judge.engine == "vllm" and teacher is None else {}
    out, build = Scorers(), _Builder(config, cleanup, in_ray, rollout_actors, env)
    if rm.dir is not None:
        from jaxflow.rewards.model import RewardModel
        out.reward_ref, out.errors = f"reward_model:{rm.dir}", RewardErrors(failed_value=rm.failed_value)
        out.answers = build(RewardModel, "reward_model", _ANSWER_METHODS, directory=str(rm.dir), name=out.reward_ref,
                            on_failure=out.errors, **reward_model_options(rm))
        print(f"jaxflow: rollouts are scored by the reward model {rm.dir}{_where(in_ray, config)} (evals by the "
              "task's reward)", flush=True)
    elif judge.dir is not None:
        from rollout_bridge.judge import build_judge
        out.reward_ref, out.errors = f"judge:{judge.dir}", RewardErrors(failed_value=judge.failed_value)
        out.answers = build(build_judge, "judge", _ANSWER_METHODS, section=judge, seed=config.seed,
                            on_failure=out.errors, name=out.reward_ref)
        print(f"jaxflow: rollouts are scored by the judge {judge.dir} on its own {judge.engine} engine"
              f"{_where(in_ray, config)} (prompt {judge.prompt_ref}, verdicts read by {judge.parse_ref}; evals by "
              "the task's reward)", flush=True)
    if teacher is not None:
        from rollout_bridge.teacher import TeacherScorer
        out.teacher = build(TeacherScorer, "teacher", _TEACHER_METHODS, directory=str(teacher.teacher),
                            max_len=config.rollout.max_len, chunk=step.logprob_chunk,
                            compute_dtype=step.compute_dtype, param_dtype=param_dtype)
    if in_ray:
        out.placed = build.where()
    return out


def _where(in_ray: bool, config: ml_collections.ConfigDict) -> str:
    from jaxflow.cluster import names
    return f" in the Ray actor {names.scorers(names.run_tag(config.workdir))}" if in_ray else ""


class _Builder:
    """Builds each scorer here (closed by `cleanup`), or in the scorers' Ray actor, started on first use."""

    def __init__(self, config: ml_collections.ConfigDict, cleanup: contextlib.ExitStack, in_ray: bool,
                 rollout_actors: int, env: dict[str, str]):
        self.config, self.cleanup, self.in_ray, self.callers = config, cleanup, in_ray, max(rollout_actors, 1)
        self.env, self.host = env, None

    def __call__(self, factory: Any, service: str, methods: tuple[str, ...], **kwargs: Any) -> Any:
        """`factory(**kwargs)`, here or hosted as `service` in the scorers' actor (then its proxy, serving
        `methods`)."""
        if not self.in_ray:
            made = factory(**kwargs)
            self.cleanup.callback(made.close)
            return made
        from jaxflow.cluster import ray_actors
        if self.host is None:
            self.host = self._start_host()
        # The first build waits for the model to load (and a judge's engine to compile its programs).
        return ray_actors.build(factory, methods, kwargs=kwargs, on=self.host, name=service)

    def _start_host(self) -> Any:
        from jaxflow.cluster import names, ray_actors
        ray = ray_actors.require_ray()
        gpus = ray.cluster_resources().get("GPU", 0) > 0
        resource = self.config.cluster.node_resource.get("scorers")
        custom = {resource: 1.0} if resource else None
        ask = {**({"GPU": 1} if gpus else {}), **(custom or {})}
        name = names.scorers(names.run_tag(self.config.workdir))
        # Each rollout actor's scoring threads call at once.
        host = ray_actors.start_host(name=name, num_gpus=1 if gpus else 0, resources=custom,
                                     env={**ray_actors.jax_env(), **self.env},
                                     max_concurrency=SCORING_THREADS * (self.callers + 1))
        self.cleanup.callback(ray.kill, host)
        ready, _ = ray.wait([host.where.remote()], timeout=PLACE_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"the scorers' Ray actor {name} (asking for {ask or 'nothing'}) was not placed within "
                               f"{PLACE_TIMEOUT_S:g}s; the cluster has {ray.available_resources()} free")
        return host

    def where(self) -> dict[str, Any]:
        from jaxflow.cluster import ray_actors
        return ray_actors.require_ray().get(self.host.where.remote())


def print_distillation(distill: Any, scorer: Any, step_teacher: Any) -> None:
    """Prints the run's teacher: `scorer` (the rollout-side teacher or its proxy, with `summary()`) or else
    `step_teacher` (the model the train step scores with; None where the trainer processes hold it)."""
    if scorer is not None:
        about, where = scorer.summary(), "beside the rollout engines"
    else:
        where, about = "in the train step", {"directory": distill.teacher}
        if step_teacher is not None:
            import jax
            from flax import nnx
            about.update(architecture=step_teacher.config.architecture,
                         parameters=sum(x.size for x in jax.tree.leaves(nnx.state(step_teacher))))
    described = (f" ({about['architecture']}, {about['parameters']:,} parameters, frozen, scored {where})"
                 if "architecture" in about else f" (frozen, scored {where})")
    print(f"jaxflow: distilling from the teacher {distill.teacher}{described}: advantage {distill.coef:g} x "
          f"(log pi_teacher - log pi_student) + {distill.task_coef:g} x the task's", flush=True)
