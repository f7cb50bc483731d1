"""The supervised warm start: a tiny base model that sometimes solves the task, built locally.

RL needs a policy that already succeeds now and then, and there is no model hub here. `build_base_model`
writes a tiny tokenizer and a random model, trains it briefly by next-token cross-entropy on the task's
demonstrations (prompt tokens are not trained), measures its held-out greedy accuracy with jaxflow's JAX
engine, and exports it as an HF directory with `base_info.json` beside it. The directory is a cache:
`ensure_base_model` reuses it when its recorded settings match, so the RL job pays for the warm start
once per machine.

A directory that holds an HF model the warm start did not build (config.json, safetensors weights and
tokenizer.json, but no `base_info.json`: a downloaded checkpoint, or an export) is used as given: the RL
job starts from it, and nothing here ever writes into it. config.model and config.base then do not apply.

The warm start is deliberately short: a base model at roughly 10-40% accuracy leaves RL room to show
what it does.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from jaxflow import sharding
from jaxflow.models import hf_io
from jaxflow.models.config import from_hf_config, read_hf_config
from jaxflow.models.safetensors_io import INDEX_FILE_NAME, SINGLE_FILE_NAME
from jaxflow.models.tiny import write_tiny_model
from jaxflow.tasks import Task, get_task
from jaxflow.tokenizer import Tokenizer
from jaxflow.trainer.batch import Trajectory, make_batch
from jaxflow.trainer.step import router_metrics, token_logprobs

INFO_FILE = "base_info.json"


class BaseModelMissing(FileNotFoundError):
    """The RL job's base model is not where the config says, and building it was not asked for."""


# Task options that do not shape the base model: the reward scores RL samples and evals, not demonstrations.
_NOT_FINGERPRINTED_TASK_KEYS = ("reward_ref",)
# Model options that do not either: the RL run's compute dtype (the warm start computes in float32).
_NOT_FINGERPRINTED_MODEL_KEYS = ("compute_dtype",)
# Base keys that say where the model is or how a missing one is made, not what the warm start builds.
_NOT_FINGERPRINTED_BASE_KEYS = ("dir", "build_if_missing", "random_preset")


def fingerprint(config: ml_collections.ConfigDict) -> str:
    """A short hash of everything that shapes the base model (task, model, warm-start settings)."""
    task = {k: v for k, v in config.task.to_dict().items() if k not in _NOT_FINGERPRINTED_TASK_KEYS}
    model = {k: v for k, v in config.model.to_dict().items() if k not in _NOT_FINGERPRINTED_MODEL_KEYS}
    parts = {"task": task, "model": model, "base": {
        k: v for k, v in config.base.to_dict().items() if k not in _NOT_FINGERPRINTED_BASE_KEYS}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def make_task(config: ml_collections.ConfigDict) -> Task:
    options = config.task.to_dict()
    return get_task(options.pop("name"), **options)


def _sft_step(graphdef, tx, aux_coef: float = 0.0):
    """The warm start's jit-compiled step: the demonstrations' mean token NLL, plus for a mixture of experts
    `aux_coef` times the routers' load-balancing loss (the mean over sparse layers), as MoE models are
    pretrained: without it a warm start leaves some experts busy and others all but idle."""
    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            mb = jax.tree.map(lambda x: x[0], batch)  # one micro-batch
            model = nnx.merge(graphdef, p)
            logp, _, stats = token_logprobs(model, mb, router=True)
            mask = mb.loss_mask
            nll = -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)
            if stats is None or not aux_coef:
                return nll, nll
            cfg = model.config
            aux, _, _ = router_metrics(stats, None, cfg.num_experts, cfg.num_experts_per_tok)
            return nll + aux_coef * aux, nll

        (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, nll

    return step


def _packed(trajs: list[Trajectory], seq_len: int):
    """The demonstrations packed into rows of seq_len tokens; the row count is rounded up to a power of
    two so that only a few shapes ever compile."""
    need = -(-sum(len(t.prompt) + len(t.completion) for t in trajs) // seq_len)
    rows = 1 << max(0, need - 1).bit_length()
    while True:
        try:
            return make_batch(trajs, num_rows=rows, seq_len=seq_len, pack=True)[0]
        except ValueError:
            if rows >= len(trajs):
                raise
            rows *= 2


def sft_records(task: Task, examples: list[dict], tokenizer) -> list[dict]:
    """{"prompt", "completion", "env_spans", "meta"} per example: the task's demonstration as an episode
    (`Task.demonstration_turns`), its environment answers rendered as the RL episodes render them
    (`jaxflow.envs.render`, after a turn that stopped at its tool-call marker) and masked out of the loss
    by `env_spans`; the completion ends with the eos id, as `Task.to_sft_records` does."""
    from jaxflow.envs.render import ObservationRenderer

    records, renderer = task.to_prompt_records(examples, tokenizer), None
    for record, example in zip(records, examples):
        ids, spans = [], []
        for kind, value in task.demonstration_turns(example):
            if kind == "model":
                ids += tokenizer.encode(value)
                continue
            renderer = renderer or ObservationRenderer(tokenizer)
            answer = renderer.ids(value, turn_closed=False)
            spans.append([len(ids), len(ids) + len(answer)])
            ids += answer
        record["completion"], record["env_spans"] = ids + [tokenizer.eos_id], spans
    return records


def build_base_model(config: ml_collections.ConfigDict, directory: str | pathlib.Path, *,
                     log=print) -> dict[str, Any]:
    """Writes, warm-starts, evaluates and exports the base model into `directory`; returns its info.

    Uses config.task, config.model (tiny architecture), config.base (steps, batch_size, lr,
    num_examples, seed) and config.rollout (max_len, eval prompts), config.eval.num_prompts.
    """
    from jaxflow.jobs.evaluation import evaluate
    from rollout_bridge.jax_engine import JaxEngine

    start = time.monotonic()
    directory = pathlib.Path(directory)
    if (directory / "config.json").exists() and read_info(directory) is None:
        raise FileExistsError(f"{directory} holds a model that no warm start built (it has no {INFO_FILE}); "
                              f"set config.base.dir to another directory, or remove this one")
    # Marks the directory as the warm start's before anything else is written: a build that dies half way
    # leaves a stale cache entry (rebuilt next time), never what looks like a user's model.
    directory.mkdir(parents=True, exist_ok=True)
    (directory / INFO_FILE).write_text(json.dumps({"fingerprint": None, "building": True}) + "\n")
    m, b = config.model, config.base
    write_tiny_model(directory, architecture=m.architecture, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
                     num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                     tie_word_embeddings=m.tie_word_embeddings, vocab_size=m.vocab_size, seed=b.seed,
                     overwrite=True, extra_tokens=tuple(m.get("extra_tokens", ())),
                     num_experts=m.get("num_experts", 0), num_experts_per_tok=m.get("num_experts_per_tok", 2),
                     moe_intermediate_size=m.get("moe_intermediate_size", 0),
                     mlp_only_layers=tuple(m.get("mlp_only_layers", ())))
    tokenizer = Tokenizer.from_dir(directory)
    task = make_task(config)
    records = sft_records(task, task.examples("train", b.num_examples, seed=b.seed), tokenizer)
    seq_len = config.rollout.max_len
    too_long = [i for i, r in enumerate(records) if len(r["prompt"]) + len(r["completion"]) > seq_len]
    if too_long:
        raise ValueError(f"{len(too_long)} of {len(records)} demonstrations are longer than "
                         f"rollout.max_len={seq_len} tokens (e.g. example {too_long[0]}); raise "
                         f"rollout.max_len or make the task easier")
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    model = hf_io.load_model(directory, mesh=mesh)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(0.0, b.lr, min(50, b.steps // 10 + 1),
                                                                    b.steps, b.lr * 0.1),
                                 weight_decay=0.0))
    opt_state = tx.init(params)
    step_fn = _sft_step(graphdef, tx, float(m.get("router_aux_loss_coef", 0.0)) if m.get("num_experts", 0) else 0.0)
    rng = np.random.default_rng(b.seed)
    losses = []
    for step in range(1, b.steps + 1):
        picks = rng.choice(len(records), b.batch_size, replace=False)
        trajs = [Trajectory(records[i]["prompt"], records[i]["completion"],
                            [0.0] * len(records[i]["completion"]), [0] * len(records[i]["completion"]),
                            advantage=1.0, env_spans=records[i]["env_spans"]) for i in picks]
        batch = _packed(trajs, seq_len)
        params, opt_state, loss = step_fn(params, opt_state, batch)
        losses.append(float(loss))
        if step % max(1, b.steps // 10) == 0 or step == b.steps:
            log(f"warm start: step {step}/{b.steps}, loss {np.mean(losses[-20:]):.3f}, "
                f"{time.monotonic() - start:.0f}s")
    model = nnx.merge(graphdef, params, nnx.state(model, nnx.Not(nnx.Param)))
    hf_io.export_model(model, directory, overwrite=True)

    eval_records = task.to_prompt_records(task.examples("eval", config.eval.num_prompts, seed=0), tokenizer)
    engine = JaxEngine(model, max_slots=config.rollout.max_slots, max_len=seq_len,
                       decode_chunk=config.rollout.decode_chunk)
    try:
        # The task's own reward, not task.reward_ref: the base model's recorded accuracy must not depend on
        # a reward that is not part of its fingerprint (nor fail the build if that reward raises).
        result = evaluate(engine, eval_records, decode=tokenizer.decode, reward_ref=type(task).reward_ref,
                          max_tokens=config.rollout.max_tokens, stop_token_ids=[tokenizer.eos_id])
    finally:
        engine.close()
    info = {"fingerprint": fingerprint(config), "eval_accuracy": result.accuracy,
            "eval_prompts": result.num_prompts, "final_loss": float(np.mean(losses[-20:])),
            "steps": b.steps, "seconds": round(time.monotonic() - start, 1), "task": config.task.to_dict()}
    (directory / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    log(f"warm start: base model at {directory}: held-out accuracy {result.accuracy:.1%} on "
        f"{result.num_prompts} prompts ({info['seconds']:.0f}s)")
    return info


def read_info(directory: str | pathlib.Path) -> dict[str, Any] | None:
    path = pathlib.Path(directory) / INFO_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _model_files_missing(directory: pathlib.Path) -> list[str]:
    """What an HF model directory lacks for the RL job: config.json, weights, tokenizer.json."""
    missing = [] if (directory / "config.json").is_file() else ["config.json"]
    if not any((directory / name).is_file() for name in (SINGLE_FILE_NAME, INDEX_FILE_NAME)):
        missing.append(f"weights ({SINGLE_FILE_NAME} or {INDEX_FILE_NAME})")
    if not (directory / "tokenizer.json").is_file():
        missing.append("tokenizer.json (the fast-tokenizer file)")
    return missing


def _given_model(directory: pathlib.Path, log) -> pathlib.Path:
    """`directory`, an HF model the warm start did not build, checked and used as given (never written)."""
    missing = _model_files_missing(directory)
    if missing:
        present = sorted(p.name for p in directory.iterdir())
        raise BaseModelMissing(
            f"base.dir {directory} holds no complete HF model: it has no {', no '.join(missing)} "
            f"(it has: {', '.join(present[:8]) or 'nothing'}{' ...' if len(present) > 8 else ''}). Point "
            f"config.base.dir at a directory with config.json, safetensors weights and tokenizer.json, "
            f"or at an empty or new one for the warm start to build a model in")
    cfg = from_hf_config(read_hf_config(directory), source=str(directory / "config.json"))
    Tokenizer.from_dir(directory)
    log(f"jaxflow: base model {directory}: an HF model the warm start did not build (no {INFO_FILE}); "
        f"using it as given ({cfg.architecture}, {cfg.num_layers} layers, hidden size {cfg.hidden_size}); "
        f"config.model and config.base do not apply")
    return directory


def ensure_base_model(config: ml_collections.ConfigDict, *, log=print) -> pathlib.Path:
    """The base model directory (config.base.dir), ready for the RL job.

    - A directory the warm start built (it has base_info.json) is a cache: reused when its recorded
      settings match this config, rebuilt in place when they do not and config.base.build_if_missing.
    - A directory with an HF model and no base_info.json (a downloaded checkpoint, an export) is used as
      given and never written; one line says so. It must hold config.json, safetensors weights and
      tokenizer.json.
    - A missing or empty directory is built when config.base.build_if_missing: with random weights of the
      published shape config.base.random_preset names when set (then used as given on later runs), else by
      the warm start.

    Raises:
      BaseModelMissing: the model is missing (or stale) and building it was not asked for, or the
        directory holds an incomplete model (the message names what it lacks).
      ValueError: a given model's config.json or tokenizer is malformed.
    """
    directory = pathlib.Path(config.base.dir)
    info = read_info(directory)
    if info is not None and info.get("fingerprint") == fingerprint(config):
        return directory
    if info is None and directory.is_dir() and any(directory.iterdir()):
        return _given_model(directory, log)
    if not config.base.build_if_missing:
        why = ("was built with other settings" if info is not None
               else "does not exist" if not directory.exists() else "is empty")
        raise BaseModelMissing(
            f"base model {directory} {why}. Build it with: python -m jaxflow.main --config=<this config> "
            f"--config.job=warm_start  (or set --config.base.build_if_missing=True)")
    preset = config.base.get("random_preset")
    if preset is not None:
        from jaxflow.models.random_hf import make_random_hf_model

        log(f"base model: {directory} is missing; writing a randomly initialised {preset} there (base.random_preset)")
        make_random_hf_model(directory, preset, log=log)
        return directory
    log(f"warm start: building the base model in {directory} (cached for later runs)")
    build_base_model(config, directory, log=log)
    return directory


def run(config: ml_collections.ConfigDict) -> int:
    """The `warm_start` job: (re)builds the base model, whatever the cache holds."""
    build_base_model(config, config.base.dir)
    return 0
