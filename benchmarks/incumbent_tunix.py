"""Tunix's GRPOLearner on the side-by-side's setup: run by `vs_incumbents.py` with Tunix's own Python.

    /path/to/tunix-env/bin/python benchmarks/incumbent_tunix.py --setup SETUP_DIR --out OUT_DIR --seed 0

This file runs in an environment of its own that has google-tunix (with jax, flax, optax) and transformers
(for the HF tokenizer); it imports nothing of jaxflow's but `jaxflow.tasks` (standard library only) for the
reward, so every system scores the same responses the same way. SETUP_DIR/setup.json (written by
vs_incumbents.py) names the base model (an HF directory, loaded with Tunix's own Qwen3 safetensors loader),
the train prompts in the order jaxflow draws them, the held-out problems and the settings (prompts per step,
samples per prompt, new tokens, learning rate, warmup, time limit). Training is Tunix's synchronous
GRPOLearner on an RLCluster whose actor and rollout share one CPU mesh (its "vanilla" rollout: Tunix's own
JAX sampler); it stops after the step during which the time limit passed (the prompt iterator ends there).
Writes OUT_DIR/metrics.jsonl (a line per step: time since training began, the sampled reward's mean,
completion tokens) and OUT_DIR/result.json (steps, first step's time, held-out greedy accuracy, versions,
settings).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    setup = json.loads((args.setup / "setup.json").read_text())
    s = setup["settings"]
    # CPU only, on `threads` cores: XLA's CPU client sizes its thread pools from the cores it may run on.
    os.environ["JAX_PLATFORMS"] = "cpu"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > s["threads"]:
        os.sched_setaffinity(0, cores[:s["threads"]])

    import jax
    import numpy as np
    import optax
    import transformers
    import flax
    from flax import nnx
    import tunix
    from tunix.generate import sampler as sampler_lib
    from tunix.generate import tokenizer_adapter
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    sys.path.insert(0, str(ROOT))
    from jaxflow.tasks import reward as task_reward  # standard library only

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = setup["model_dir"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line) for line in pathlib.Path(setup["prompts"]).read_text().splitlines()]
    held_out = [json.loads(line) for line in pathlib.Path(setup["eval"]).read_text().splitlines()]
    # Tunix's sampler tokenizes the prompt text itself (Sampler.tokenize: the adapter's encode, a BOS in front
    # if the tokenizer has one): it must give the very ids jaxflow samples from.
    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer)
    for p in prompts[:200] + held_out:
        ids = ([adapter.bos_id()] if adapter.bos_id() else []) + adapter.encode(p["text"])
        ids = adapter.dedup_bos_ids(ids)
        if ids != p["prompt"]:
            raise SystemExit(f"Tunix's tokenizer gives {ids[:12]}... for prompt {p['text']!r}, "
                             f"jaxflow {p['prompt'][:12]}...")

    # The base model through Tunix's Qwen3 code: its ModelConfig built from the HF config.json.
    hf = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    rope_theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000)
    config = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(rope_theta), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)))
    # Tunix 0.1.7's Qwen3 attention calls apply_rope without the config's rope_theta, so RoPE always runs at
    # its default 1e6 (right for released Qwen3, not for this base); the one fix made to Tunix here.
    rope_fixed = int(rope_theta) != 1_000_000
    if rope_fixed:
        qwen3_model.apply_rope = functools.partial(qwen3_model.apply_rope, rope_theta=int(rope_theta))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model = qwen3_params.create_model_from_safe_tensors(model_dir, config, mesh=mesh)

    B, G, T = s["batch_prompts"], s["group_size"], s["max_new_tokens"]
    max_prompt = max(len(p["prompt"]) for p in prompts + held_out)
    steps_in_data = len(prompts) // B
    schedule = optax.warmup_constant_schedule(0.0, s["lr"], s["warmup_steps"])
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=0.0))
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=T, temperature=s["temperature"], top_p=1.0, top_k=None, seed=args.seed,
        max_prompt_length=max_prompt, kv_cache_size=max_prompt + T, eos_tokens=[tokenizer.eos_token_id])
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout_config,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps_in_data,
            mini_batch_size=B, checkpoint_root_directory=None, metrics_logging_options=None,
            pbar_description=None))
    # No reference model: with beta = 0 Tunix's GRPO neither needs one nor computes reference log-probs.
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                       cluster_config=cluster_config)
    algo = grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.0, epsilon=s["eps"])

    metrics = open(args.out / "metrics.jsonl", "w")
    clock = {"start": None, "step": 0, "reward": None, "tokens": 0}

    def reward_fn(prompts, completions, meta, **_):
        scores = [task_reward(c, json.loads(str(m))) for c, m in zip(completions, meta)]
        clock["reward"] = sum(scores) / len(scores)
        return scores

    # The completions' token counts: from the rollout's own output (the reward function sees only text).
    generate = cluster.generate

    def counted_generate(*a, **kw):
        out = generate(*a, **kw)
        clock["tokens"] = int(sum(len(t) for t in out.tokens))
        return out
    cluster.generate = counted_generate

    # A step ends when the actor's update on its batch is done: log it there.
    update_actor = cluster.update_actor

    def timed_update_actor(*a, **kw):
        update_actor(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        elapsed = time.monotonic() - clock["start"]
        metrics.write(json.dumps({"step": clock["step"], "time_s": round(elapsed, 3),
                                  "reward_mean": clock["reward"], "completion_tokens": clock["tokens"]}) + "\n")
        metrics.flush()
        clock["step"] += 1
    cluster.update_actor = timed_update_actor

    def batches():
        """The prompts in jaxflow's order, B a step; ends (so GRPOLearner stops) once the time limit has
        passed: the next batch is asked for only after the previous step's update."""
        for i in range(steps_in_data):
            if i and time.monotonic() - clock["start"] >= s["time_limit_s"]:
                return
            # Tunix's sampler takes one PRNG seed per call (PRNGKey(0) if none): a fresh one per step.
            rollout_config.seed = args.seed * 1_000_003 + i
            chunk = prompts[i * B:(i + 1) * B]
            yield {"prompts": np.array([p["text"] for p in chunk]),
                   "meta": np.array([json.dumps(p["meta"]) for p in chunk])}

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward_fn])
    clock["start"] = time.monotonic()
    learner.train(batches())
    metrics.close()
    steps = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines()]

    # Held-out accuracy: greedy with Tunix's sampler on the trained model, the same problems and new-token
    # limit as jaxflow's evals, stopping at EOS.
    evaluator = sampler_lib.Sampler(cluster.actor_trainer.model, tokenizer, sampler_lib.CacheConfig(
        cache_size=max_prompt + T, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim))
    correct, batch = 0, 64
    for i in range(0, len(held_out), batch):
        chunk = held_out[i:i + batch]
        out = evaluator([p["text"] for p in chunk], max_generation_steps=T, max_prompt_length=max_prompt,
                        temperature=0.0, top_p=None, eos_tokens=[tokenizer.eos_token_id])
        texts = [tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in out.tokens]
        correct += sum(task_reward(t, p["meta"]) >= 1.0 for t, p in zip(texts, chunk))

    result = {"system": "tunix", "seed": args.seed, "steps": len(steps),
              "first_step_s": steps[0]["time_s"] if steps else None,
              "train_s": steps[-1]["time_s"] if steps else None,
              "eval_accuracy": correct / len(held_out),
              "versions": {"tunix": _version("google-tunix", tunix), "jax": jax.__version__,
                           "flax": flax.__version__, "optax": optax.__version__,
                           "transformers": transformers.__version__},
              "settings": {"loss_agg_mode": algo.loss_agg_mode, "advantage_estimator": algo.advantage_estimator,
                           "epsilon": algo.epsilon, "beta": algo.beta, "num_iterations": algo.num_iterations,
                           "reference_model": None,
                           "rollout": "Tunix vanilla rollout (its JAX sampler, padded batch, top_p=1.0 mode), "
                                      "sharing weights with the actor; synchronous",
                           "sampler_seed": "a fresh PRNG seed per step (Tunix's default is one fixed seed)",
                           "eos_in_loss": "no (Tunix's rollout cuts each completion before its EOS)",
                           "optimizer": "adamw(b1 0.9, b2 0.999, wd 0) after clip_by_global_norm(1.0)",
                           "rope_theta_patch": (f"apply_rope given the config's rope_theta {int(rope_theta)} "
                                                "(Tunix ignores it)") if rope_fixed else None,
                           "cpu_cores": len(os.sched_getaffinity(0))}}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("steps", "first_step_s", "train_s", "eval_accuracy")}))


def _version(dist: str, module) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return getattr(module, "__version__", "unknown")


if __name__ == "__main__":
    main()
