"""The `rl` job: an asynchronous, staleness-bounded RL run on one machine, everything embedded.

    python -m jaxflow.main --config=configs/arithmetic_tiny.py

Pieces, all in this process (vLLM engines run their own processes; with `cluster.mode = "ray"` the
trajectory and parameter services run in a Ray actor, reached through proxies with their methods and
exceptions, and with `cluster.rollout_actors` > 0 the rollout engines run in Ray actors of their own,
`jaxflow.jobs.ray_rollout`; with `cluster.trainer_processes` > 0 the trainer runs as that many Ray
processes forming one mesh, and `jaxflow.jobs.rl_cluster` drives the run through the same train loop,
`jaxflow.jobs.train_loop`):

- the base model: built by the supervised warm start on first use and cached (`jaxflow.jobs.warm_start`);
- a trajectory service (Reserve -> Occupy -> Consume, staleness bound eta) over the task's train prompts;
- the newest weights: on device (`jaxflow.data.device_params`) for the JAX engines, which take them device
  to device, plus, with vLLM engines only, a parameter service of HF-named host tensors;
- `rollout.num_engines` engines (jaxflow's JAX engine, or vLLM; with `rollout.weight_transport = "nccl"` each
  vLLM engine takes the parameter service's versions by an NCCL broadcast from this process), all driven by
  one coordinator (`jaxflow.coordination`) that places every request and syncs weights by the options of
  `rollout.coordination`, with rewards scored in a process pool (a crashing or hanging reward scores
  the sample 0, counted, and never stops the run: each distinct error is printed once, the counts are
  in every step's metrics as reward_raised/timed_out/crashed/invalid and in result.json's accounting;
  but a reward that fails on every sample of the first batch stops the run with exit code 2 rather
  than train on zeros);
- the trainer (`jaxflow.trainer.rl_trainer`): consume buffer v, one PPO step, publish v+1;
- with on-policy distillation whose teacher sits beside the rollout (`trainer.distill.where = "rollout"`), a
  teacher scorer (`rollout_bridge.teacher.TeacherScorer`) that the coordinator hands each finished group to
  before it finishes it, recording the teacher's log-probs on its samples (the trainer then loads no teacher);
  it, and a reward model or judge in place of the task's reward, run where `jaxflow.jobs.scorers` puts them (in
  this process, or with rollout actors in a Ray actor they share).

eta = 0 with the "full" batch rule is synchronous RL through the same code: engines only ever generate
with the weights being trained.

Output in config.workdir: metrics.jsonl + TensorBoard + plots (`jaxflow.jobs.run_log`), orbax checkpoints
(with the trajectory service's state, `jaxflow.jobs.resume`; a damaged newest one, in its arrays or its
snapshot, is reported, kept aside as checkpoints/damaged-<step>, and the run resumes from the one before;
with none usable the run stops with exit code 2), ledger.jsonl (the groups each step
trained), export/ (the final policy as an HF model), result.json and coordinator_trace.json (engine loads,
group lengths and weight-sync times: what benchmarks/simulate.py fits the simulator to). Ctrl-C stops
after the step in progress and checkpoints (a second Ctrl-C stops at once); rerunning the same command
resumes from the newest checkpoint, with no group lost or trained twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import sys
import tempfile
import time
from typing import Any

import jax
import ml_collections

from jaxflow import sharding
from jaxflow.cluster.config import cluster_problems
from jaxflow.config import ConfigError, check_int, number_problems
from jaxflow.coordination import Coordination, Coordinator
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.data.param_service import ParameterService
from jaxflow.data.records import RouteSpec
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.envs.config import env_problems, runs_agents
from jaxflow.jobs import warm_start
from jaxflow.jobs.bookkeeping import Ledger, RewardErrors, RewardNeverWorked, reward_pool_options
from jaxflow.jobs.config import (
    BaseConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelSection,
    RolloutConfig,
    compute_dtype,
    rollout_compute_dtype,
)
from jaxflow.jobs.prompts import prompt_source, train_records
from jaxflow.jobs.resume import ExtraCheck
from jaxflow.jobs.run_log import RunLog
from jaxflow.jobs.scorers import print_distillation, start_scorers
from jaxflow.jobs.train_loop import Evaluator, LoopParts, conclude, train_loop
from jaxflow.models import hf_io, lora
from jaxflow.models.lora import LoRASpec
from jaxflow.rewards import RewardPool, group_reward_fn, resolve
from jaxflow.tasks import get_task
from jaxflow.tokenizer import Tokenizer
from jaxflow.trainer.checkpoint import CheckpointDamaged, Checkpointer
from jaxflow.trainer.distill import teacher_problems
from jaxflow.trainer.rl_trainer import RLTrainer, check_trainer_config, exact_logprobs_problems
from jaxflow.trainer.state import abstract_train_state
from rollout_bridge.engine import SamplingParams
from rollout_bridge.factory import make_engine, runs_episodes, with_episodes
from rollout_bridge.weight_transport import WeightTransportMismatch, resolve_weight_transport

log = logging.getLogger(__name__)



# The sections check_config checks, each a Section: its keys, their defaults and their checks.
_SECTIONS = (("data", DataConfig), ("rollout", RolloutConfig), ("eval", EvalConfig),
             ("checkpoint", CheckpointConfig), ("base", BaseConfig), ("model", ModelSection))


def check_config(config: ml_collections.ConfigDict) -> None:
    """Checks every value the run uses (types, ranges, finiteness) before anything starts; raises one
    ConfigError naming each bad key."""
    problems: list[str] = []
    check_int(problems, "seed", config.seed, 0)
    for name, section in _SECTIONS:
        problems += section.config_problems(config[name])
    try:  # the schedule and the update's options (TrainerConfig): each bad or unknown key named
        check_trainer_config(config.trainer)
    except ConfigError as e:
        problems += e.problems
    # Any other float that is nan or inf (trainer.lr=inf passes its "> 0"), or int beyond int64: load_config
    # refuses them too; this catches a config built or changed in code.
    problems += number_problems(config, problems)
    problems += _task_problems(config)
    problems += cluster_problems(config.cluster)
    exact = config.rollout.get("exact_logprobs", False)
    problems += [p for p in exact_logprobs_problems(config.trainer, exact) if p not in problems]
    if exact is True and config.cluster.get("rollout_actors"):
        problems.append("rollout.exact_logprobs needs the engines in the job's process (cluster.rollout_actors "
                        "is set)")
    problems += [p for p in replay_problems(config) if p not in problems]
    problems += [p for p in agent_problems(config) if p not in problems]
    problems += distill_problems(config)
    problems += [p for p in reward_model_problems(config) if p not in problems]
    problems += [p for p in judge_problems(config) if p not in problems]
    if not problems:  # the transport against the engine kind and the deployment, once those are sound
        try:
            weight_transport(config)
        except WeightTransportMismatch as e:
            problems.append(str(e))
    env = config.rollout.get("env")
    if env is not None:  # the environment's factory imports and builds with its options
        problems += [p for p in env_problems(env) if p not in problems]
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))


# Engines that record each generated token's experts (`Sample.routes`) for routing replay.
ROUTE_RECORDING_ENGINES = ("jax",)


def replay_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Why `trainer.moe.routing_replay = "rollout"` cannot run with this config: the engine must record
    routes, and the warm start must build a mixture of experts (a given base model is checked when the
    trainer is built with its config, `rl_trainer.moe_problems`; exact mode, `exact_logprobs_problems`)."""
    moe = config.trainer.get("moe")
    if moe is None or moe.get("routing_replay", "off") != "rollout":
        return []
    problems = []
    engine = config.rollout.get("engine", "jax")
    if engine not in ROUTE_RECORDING_ENGINES:
        problems.append(f"trainer.moe.routing_replay = 'rollout' needs an engine that records each token's "
                        f"experts ({', '.join(ROUTE_RECORDING_ENGINES)}); rollout.engine = {engine!r} does not")
    architecture = config.model.get("architecture")
    if config.base.get("build_if_missing", True) and architecture and architecture != "Qwen3MoeForCausalLM" \
            and not _given_model(config):
        problems.append(f"trainer.moe.routing_replay = 'rollout' needs a mixture-of-experts policy; model.architecture "
                        f"{architecture!r} is dense")
    return problems


def reward_model_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Why `rollout.reward_model.dir` cannot score this run's samples: the directory must hold a one-label
    sequence classifier of a supported family (`jaxflow.models.classifier.check_classifier_files`: its
    config.json, its tensors' names and the head's shape; no weights read) and a tokenizer with a chat template;
    and episodes are scored by their environments, so a reward model would score nothing."""
    section = config.rollout.get("reward_model")
    if section is None or section.get("dir") is None or not isinstance(section.dir, str) or not section.dir.strip():
        return []  # off, or a bad value its own section names
    from jaxflow.models.classifier import check_classifier_files
    from jaxflow.models.config import ModelConfigError

    problems = []
    try:
        check_classifier_files(section.dir)
        if Tokenizer.from_dir(section.dir).chat_template is None:
            problems.append(f"rollout.reward_model.dir: the tokenizer of {section.dir} has no chat template to "
                            "render [prompt + response] with")
    except (ModelConfigError, OSError, ValueError) as e:
        problems.append(f"rollout.reward_model.dir: {e}")
    return problems + answer_scorer_problems(config, "rollout.reward_model")


def judge_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Why `rollout.judge` cannot score this run's samples: its directory must hold a causal LM the judge's engine
    serves (config.json: a family of `jaxflow.models` for the JAX engine, any for vLLM; no weights read) and a
    tokenizer with a chat template; its prompt_ref and parse_ref must import and name functions of (text, meta)
    (resolved here as the judge will, so a typo shows now, not as every sample failing); and episodes are
    scored by their environments, so a judge would score nothing."""
    section = config.rollout.get("judge")
    if section is None or section.get("dir") is None or not isinstance(section.dir, str) or not section.dir.strip():
        return []  # off, or a bad value its own section names
    from jaxflow import refs
    from jaxflow.models.config import ModelConfigError, from_hf_config, read_hf_config

    problems = []
    directory = pathlib.Path(section.dir)
    try:
        hf_config = read_hf_config(directory)
        if section.get("engine", "jax") == "jax":
            from_hf_config(hf_config, source=str(directory / "config.json"))
        if Tokenizer.from_dir(directory).chat_template is None:
            problems.append(f"rollout.judge.dir: the tokenizer of {directory} has no chat template to render the "
                            "judge's prompt with")
    except (ModelConfigError, OSError, ValueError) as e:
        problems.append(f"rollout.judge.dir: {e}")
    for key in ("prompt_ref", "parse_ref"):
        ref = section.get(key)
        if not isinstance(ref, str):
            continue  # its own section names it
        try:
            refs.resolve(ref, what=f"rollout.judge.{key}", expect="function", arity=2)
        except refs.RefError as e:
            problems.append(str(e))
    return problems + answer_scorer_problems(config, "rollout.judge")


def answer_scorer_problems(config: ml_collections.ConfigDict, section: str) -> list[str]:
    """Where a model that scores the answers in place of the task's reward (`section`: rollout.reward_model or
    rollout.judge) cannot run: it scores single answers (episodes are scored by their environments)."""
    env = config.rollout.get("env")
    if env is not None and env.get("ref") is not None:
        return [f"{section} scores single answers; episodes (rollout.env.ref) are scored by their environments: "
                f"set one of the two"]
    return []


def agent_problems(config: ml_collections.ConfigDict) -> list[str]:
    """Why agent episodes (rollout.env.kind "agent" or "command", `rollout_bridge.agent_engine`) cannot run
    with this config: an agent's episode cannot be moved to another engine (its agent talks to this one's
    endpoint and its state cannot be brought back), and the endpoint records no routes for replay."""
    env = config.rollout.get("env")
    if not runs_agents(env):
        return []
    problems, coordination = [], config.rollout.get("coordination", {})
    if config.rollout.get("num_engines", 1) > 1:
        if coordination.get("migrate", True):
            problems.append("rollout.coordination.migrate moves requests between engines; agent episodes "
                            f"(rollout.env.kind {env.kind!r}) cannot move: set it False")
        if coordination.get("stuck", "retry") == "retry":
            problems.append("rollout.coordination.stuck 'retry' moves stragglers to another engine; agent "
                            f"episodes (rollout.env.kind {env.kind!r}) cannot move: use 'release' or 'wait'")
    moe = config.trainer.get("moe")
    if moe is not None and moe.get("routing_replay", "off") != "off":
        problems.append(f"trainer.moe.routing_replay {moe.routing_replay!r}: agent episodes (rollout.env.kind "
                        f"{env.kind!r}) record no routes; set it 'off'")
    return problems


def distill_problems(config: ml_collections.ConfigDict, base_dir: pathlib.Path | None = None) -> list[str]:
    """Why `trainer.distill.teacher` cannot teach this run's policy (`distill.teacher_problems`: its files, its
    vocab size and tokenizer against the base model's). base_dir: the base model's
    directory once it exists; None: the teacher against `base.dir` if that already holds a model, else the
    teacher's own files alone."""
    teacher = (config.trainer.get("distill") or {}).get("teacher")
    if not isinstance(teacher, str) or not teacher.strip():  # none, or a bad value check_trainer_config names
        return []
    if base_dir is None and (pathlib.Path(config.base.dir) / "config.json").is_file():
        base_dir = pathlib.Path(config.base.dir)
    return teacher_problems(teacher, base_dir)


def _given_model(config) -> bool:
    """Whether base.dir holds an HF model the warm start did not build (then model.* does not apply)."""
    import pathlib

    from jaxflow.jobs.warm_start import read_info
    directory = pathlib.Path(config.base.dir)
    return (directory / "config.json").is_file() and read_info(directory) is None


def _task_problems(config: ml_collections.ConfigDict) -> list[str]:
    """The task's options (the task is built, its data read) and task.reward_ref, resolved here as a reward
    worker will (so a typo or an import error shows now, not as every sample failing)."""
    problems = []
    options = config.task.to_dict()
    ref = options.pop("reward_ref", None)
    if ref is not None:
        try:
            resolve(ref)
        except ValueError as e:
            problems.append(f"task.reward_ref: {e}")
        except Exception as e:  # noqa: BLE001 - whatever importing the user's module raises
            problems.append(f"task.reward_ref {ref!r} does not import: {type(e).__name__}: {e}")
    try:
        get_task(options.pop("name"), **options)
    except (ValueError, TypeError, OSError) as e:
        problems.append(f"task: {e}")
    return problems


def check_workdir(workdir: pathlib.Path) -> None:
    """Creates the workdir and writes a file in it, so that a path that cannot be written fails now, not
    after the base model is built and loaded."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise ConfigError(f"workdir {workdir} cannot be written ({e.strerror or e}); set --config.workdir "
                          f"to a directory this user can write") from None


def _make_engine(config, trainer: RLTrainer, base_dir: pathlib.Path):
    """An engine of rollout.engine at the trainer's version: JAX over the trainer's model, vLLM from the
    base model's directory with the trainer's weights pushed in (after a resume). It computes in
    rollout.compute_dtype (default model.compute_dtype), casting each version it takes, whatever the
    trainer computes in."""
    r = config.rollout
    jax_engine = r.engine == "jax"
    engine = make_engine(r.engine, trainer.model() if jax_engine else base_dir, r.max_len, r.max_slots,
                         seed=config.seed, decode_chunk=r.decode_chunk, kv_cache_gib=r.kv_cache_gib,
                         version=trainer.version if jax_engine else 0,
                         lora=None if jax_engine or not trainer.publish_adapters else trainer.lora,
                         episodes=runs_episodes(r.get("env")), weight_transport=weight_transport(config),
                         weight_bucket_bytes=r.weight_bucket_mb << 20, dtype=rollout_compute_dtype(config),
                         exact_logprobs=r.get("exact_logprobs", False),
                         logprob_chunk=trainer.step_config.logprob_chunk)
    if not jax_engine and trainer.version != 0:
        engine.update_weights(trainer.version, trainer.publish_tensors())
    return engine


def weight_transport(config) -> str:
    """`rollout.weight_transport` resolved for the run's engine kind and deployment
    (`rollout_bridge.weight_transport`); WeightTransportMismatch when it does not fit (LoRA adapters, which
    vLLM takes through add_lora, do not fit nccl)."""
    r, c = config.rollout, config.cluster
    transport = resolve_weight_transport(r.get("weight_transport", "auto"), r.engine,
                                         rollout_actors=c.rollout_actors, trainer_processes=c.trainer_processes)
    if transport == "nccl" and LoRASpec.from_config(config.trainer.get("lora")) is not None:
        raise WeightTransportMismatch("rollout.weight_transport 'nccl' does not fit trainer.lora: vLLM takes "
                                      "adapters through add_lora; use auto")
    return transport


def episodes(config, tokenizer):
    """engine -> the engine itself, or (rollout.env.ref set) an EpisodeEngine running the configured
    environment's episodes on it (`with_episodes`). ConfigError when rollout.env is bad."""
    return with_episodes(config.rollout.get("env"), tokenizer)


def run(config: ml_collections.ConfigDict) -> int:
    """Runs (or resumes) the RL job; see the module docstring. Returns the process exit code."""
    with contextlib.ExitStack() as cleanup:  # what `_place_services` started, stopped last
        return _run(config, cleanup)


def _place_services(config, service: TrajectoryService, cleanup: contextlib.ExitStack):
    """(the trajectory service or its stand-in, the parameter service (vLLM only) or its stand-in, where
    they run). cluster.mode "ray": both in one Ray actor of their own (the trajectory service moved there,
    the parameter service built there), with proxies standing in for them (the cluster at
    cluster.address joined, or a local one started and, at the end, stopped); "embedded": the objects."""
    # HF host tensors are for vLLM and for engines in rollout actors; JAX engines here take device arrays.
    vllm = config.rollout.engine == "vllm" or config.cluster.rollout_actors > 0
    if config.cluster.mode != "ray":
        return service, ParameterService(keep=2) if vllm else None, {"mode": "embedded"}
    from jaxflow.cluster import ray_actors
    ray = ray_actors.require_ray()
    if ray_actors.connect(config.cluster.address):
        cleanup.callback(ray.shutdown)
    on = ray_actors.start_host()
    cleanup.callback(ray.kill, on)
    proxy = ray_actors.host(service, ray_actors.TRAJECTORY_SERVICE_METHODS, on=on, name="trajectories")
    params = ray_actors.build(ParameterService, ray_actors.PARAMETER_SERVICE_METHODS, kwargs={"keep": 2},
                              on=on, name="parameters") if vllm else None
    where = ray.get(on.where.remote())
    print(f"jaxflow: the {'data services run' if vllm else 'trajectory service runs'} in a Ray actor "
          f"(pid {where['pid']}, node {where['node_id'][:12]})", flush=True)
    placed = {"mode": "ray", "trajectory_service": where}
    if vllm:
        placed["parameter_service"] = where
    return proxy, params, placed


def _run(config: ml_collections.ConfigDict, cleanup: contextlib.ExitStack) -> int:
    workdir = pathlib.Path(config.workdir)
    try:
        check_config(config)
        check_workdir(workdir)
        base_dir = warm_start.ensure_base_model(config)
        problems = distill_problems(config, base_dir)  # the teacher against the student the warm start made
        if problems:
            raise ConfigError("bad config: " + "; ".join(problems), problems)
    except (ValueError, warm_start.BaseModelMissing) as e:
        print(f"jaxflow: error: {e}", file=sys.stderr)
        return 2
    tokenizer = Tokenizer.from_dir(base_dir)
    try:
        episodes(config, tokenizer)  # rollout.env.turn_stop against the model's tokenizer
    except ConfigError as e:
        print(f"jaxflow: error: {e}", file=sys.stderr)
        return 2
    task = warm_start.make_task(config)
    records = train_records(config, task, tokenizer)
    if config.cluster.trainer_processes:  # the trainer as Ray actors: the cluster driver takes it from here
        from jaxflow.jobs import rl_cluster
        return rl_cluster.run(config, cleanup, base_dir, tokenizer, task, records)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    # JAX engines and the evaluator (this process) take each version on device; only vLLM needs the HF
    # host tensors of a parameter service (see `params` below). Two versions kept, as the parameter
    # service does, so that a driver pulling the version it just saw as latest still finds it.
    device_weights = DeviceParamSource(keep=2)
    model = hf_io.load_model(base_dir, mesh=mesh, lora=LoRASpec.from_config(config.trainer.get("lora")),
                             lora_seed=config.seed, param_dtype=config.trainer.param_dtype)
    route_spec = RouteSpec.of(model.config)  # what a mixture-of-experts policy's samples record per token
    trainer = RLTrainer(model, config.trainer, mesh, seq_len=config.rollout.max_len, device_weights=device_weights,
                        max_sequences=config.trainer.batch_groups * config.rollout.group_size,
                        compute_dtype=compute_dtype(config),
                        exact_logprobs=config.rollout.get("exact_logprobs", False))
    del model  # the trainer holds the policy now: keep no second reference to the loaded arrays
    print(f"jaxflow: train step compiled for batches of {' x '.join(map(str, trainer.batch_shape))} "
          f"(micro-batches x rows x tokens) in {trainer.compile_s:.1f}s; every step uses it", flush=True)
    if trainer.lora is not None:
        print(f"jaxflow: LoRA rank {trainer.lora.rank} (alpha {trainer.lora.alpha:g}) on "
              f"{', '.join(trainer.lora.targets)}: {trainer.trainable_params:,} trained parameters, the base's "
              f"{trainer.frozen_params:,} frozen", flush=True)
    t = config.trainer
    strategy = Coordination.from_config(config.rollout.coordination)
    service = TrajectoryService(prompt_source(config, records),
                                batch_groups=t.batch_groups, group_size=config.rollout.group_size, eta=t.eta,
                                batch_rule=t.batch_rule, lease_s=config.rollout.get("lease_s", 60.0),
                                reserve_groups=strategy.reserve_groups(t.batch_groups),
                                # What the trainer can train: ids the model embeds, sequences a row holds.
                                vocab_size=trainer.vocab_size, max_sequence_tokens=config.rollout.max_len,
                                route_spec=route_spec)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=config.checkpoint.max_to_keep)
    start_step, extra = 0, {}
    if ckpt.latest_step() is not None:
        try:
            state, extra = ckpt.restore(abstract_train_state(trainer.model(), trainer.tx, mesh),
                                        validate=ExtraCheck.for_service(service))
        except (CheckpointDamaged, ValueError) as e:
            ckpt.close()
            print(f"jaxflow: error: cannot resume {workdir}: {e}", file=sys.stderr)
            return 2
        for step, why in ckpt.damaged:  # kept for inspection, out of the way of the steps redone now
            print(f"jaxflow: {why}; kept as {ckpt.set_aside(step)}, not used", file=sys.stderr, flush=True)
        trainer.state = state
        service.restore(extra["trajectories"])
        start_step = trainer.version
        print(f"jaxflow: resuming {workdir} from step {start_step}", flush=True)
    if start_step >= t.steps:
        print(f"jaxflow: {workdir} already ran {start_step} of {t.steps} steps; nothing to do "
              f"(raise trainer.steps to train more, or use another workdir)")
        return 0

    service, params, placement = _place_services(config, service, cleanup)
    ledger = Ledger(workdir / "ledger.jsonl", start_step)
    run_log = RunLog(workdir, total_steps=t.steps, start_step=start_step, resume=start_step > 0)
    r = config.rollout
    # With LoRA, vLLM engines in this process take each version's adapters alone (a new vLLM adapter per
    # version); engines in rollout actors load the base without adapters and take merged weights.
    trainer.publish_adapters = trainer.lora is not None and config.cluster.rollout_actors == 0
    if trainer.lora is not None and params is not None:
        print(f"jaxflow: weight syncs to {'vLLM' if r.engine == 'vllm' else 'the JAX engines'} carry "
              f"{'the LoRA adapters alone' if trainer.publish_adapters else 'merged weights (rollout actors)'}",
              flush=True)
    trainer.publish_weights(params)
    # Where rollout engines pull new weights from (`latest()`, `pull(version)`).
    weights = params if params is not None else device_weights
    # A reward model or judge in place of the task's reward (the evals keep the task's reward, in the pool), and
    # a teacher beside the rollout: in this process, or in the scorers' Ray actor with rollout actors.
    scorers = start_scorers(config, cleanup, step=trainer.step_config,
                            param_dtype=config.trainer.param_dtype, in_ray=bool(config.cluster.rollout_actors),
                            rollout_actors=config.cluster.rollout_actors)
    if trainer.step_config.distill is not None:
        print_distillation(trainer.step_config.distill, scorers.teacher, trainer.teacher)
    reward_errors = RewardErrors(failed_value=0.0)
    pool = RewardPool(**reward_pool_options(config.rollout), on_failure=reward_errors)
    rewards, rollout_errors, reward_ref = ((pool, reward_errors, task.reward_ref) if scorers.answers is None else
                                           (scorers.answers, scorers.errors, scorers.reward_ref))
    evaluator = Evaluator(config, trainer, device_weights, task, tokenizer, pool)
    sampling = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature,
                              stop_token_ids=(tokenizer.eos_id,))
    engines: list = []
    coordinator = None
    result: dict[str, Any] = {"base_accuracy": extra.get("base_accuracy"), "cluster": placement}
    reward_fn = group_reward_fn(rewards, reward_ref, tokenizer.decode)
    never_worked = None
    try:
        if result["base_accuracy"] is None:
            eval_from = time.monotonic()
            result["base_accuracy"] = evaluator()
            run_log.log_eval(0, result["base_accuracy"], eval_s=time.monotonic() - eval_from, **evaluator.extra())
        with_env = episodes(config, tokenizer)
        for _ in range(r.num_engines if not config.cluster.rollout_actors else 0):
            engine = _make_engine(config, trainer, base_dir)
            if r.engine == "jax":  # each version is then copied straight onto the engine's layout
                device_weights.add_target(engine.param_shardings)
            engines.append(with_env(engine))
        if config.cluster.rollout_actors:
            from jaxflow.jobs.ray_rollout import start_fleet
            coordinator = start_fleet(config, service, params, base_dir, reward_ref, tokenizer.eos_id,
                                      rewards=scorers.answers, teacher=scorers.teacher, scoring_threads=scorers.threads)
            placement["rollout_actors"] = coordinator.placed
            if scorers.placed is not None:
                placement["scorers"] = scorers.placed
        else:
            # A reward model, a judge or a teacher takes a while a group: groups are scored on threads of their
            # own, together (sharing batches), while the coordinator goes on generating.
            coordinator = Coordinator("coord", engines, service, weights, strategy=strategy, eta=t.eta,
                                      sampling=sampling, reward_fn=reward_fn, trace_every_s=0.25,
                                      teacher_fn=None if scorers.teacher is None else scorers.teacher.score_group,
                                      scoring_threads=scorers.threads)
        parts = LoopParts(trainer=trainer, service=service, params=params, coordinator=coordinator, ckpt=ckpt,
                          ledger=ledger, run_log=run_log, evaluator=evaluator, rewards=rewards,
                          reward_errors=rollout_errors, reward_ref=reward_ref)
        try:
            result.update(train_loop(config, parts, start_step=start_step, base_accuracy=result["base_accuracy"]))
        except RewardNeverWorked as e:
            never_worked = str(e)
        result["coordination"] = {k: v for k, v in coordinator.stats().items() if k != "instances"}
        (workdir / "coordinator_trace.json").write_text(
            json.dumps({k: list(v) for k, v in coordinator.trace.items()}))
    finally:
        if coordinator is not None:
            coordinator.stop(abort_in_flight=True)
        for e in engines:
            e.close()
        evaluator.close()
        pool.close()
        if params is not None:
            params.close()
        device_weights.close()
        ckpt.close()
        ledger.close()
        run_log.close()
    def export():  # the merged HF model; with LoRA also the adapters alone, in PEFT's format
        hf_io.export_model(trainer.model(), workdir / "export", tokenizer_dir=base_dir, overwrite=True,
                           dtype=config.checkpoint.get("export_dtype"))
        if trainer.lora is not None:
            lora.write_adapter(workdir / "adapter", trainer.lora, lora.peft_tensors(trainer.model().layers),
                               base_model=str(base_dir.resolve()), overwrite=True)

    return conclude(config, result, parts, never_worked, export)
