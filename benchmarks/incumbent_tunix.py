"""Tunix's GRPOLearner on the side-by-side's setup: run by `vs_incumbents.py` with Tunix's own Python.

    /path/to/tunix-env/bin/python benchmarks/incumbent_tunix.py --setup SETUP_DIR --out OUT_DIR --seed 0

This file runs in an environment of its own that has google-tunix (with jax, flax, optax) and transformers
(for the HF tokenizer); of jaxflow it uses only `jaxflow.tasks` (standard library only) for the reward,
through incumbent_io.py. SETUP_DIR/setup.json (written by
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

import functools
import json
import os
import pathlib

from incumbent_io import Run


def main() -> None:
    run = Run(__doc__.split("\n\n")[0])
    s = run.settings
    # CPU only, on `threads` cores: XLA's CPU client sizes its thread pools from the cores it may run on.
    os.environ["JAX_PLATFORMS"] = "cpu"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > s["threads"]:
        os.sched_setaffinity(0, cores[:s["threads"]])

    import flax
    import jax
    import numpy as np
    import optax
    import transformers
    import tunix
    from flax import nnx
    from tunix.generate import sampler as sampler_lib
    from tunix.generate import tokenizer_adapter
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    model_dir = run.model_dir
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts, held_out = run.prompts, run.held_out
    # Tunix's sampler tokenizes the prompt text itself (Sampler.tokenize: the adapter's encode, a BOS in front
    # if the tokenizer has one): it must give the very ids jaxflow samples from.
    adapter = tokenizer_adapter.TokenizerAdapter(tokenizer)
    run.check_tokenizer(lambda text: adapter.dedup_bos_ids(([adapter.bos_id()] if adapter.bos_id() else [])
                                                           + adapter.encode(text)), "Tunix")

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
        max_tokens_to_generate=T, temperature=s["temperature"], top_p=1.0, top_k=None, seed=run.seed,
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

    batch = {"reward": None, "tokens": 0}

    def reward_fn(prompts, completions, meta, **_):
        scores = [run.reward(c, str(m)) for c, m in zip(completions, meta)]
        batch["reward"] = sum(scores) / len(scores)
        return scores

    # The completions' token counts: from the rollout's own output (the reward function sees only text).
    generate = cluster.generate

    def counted_generate(*a, **kw):
        out = generate(*a, **kw)
        batch["tokens"] = int(sum(len(t) for t in out.tokens))
        return out
    cluster.generate = counted_generate

    # A step ends when the actor's update on its batch is done: log it there.
    update_actor = cluster.update_actor

    def timed_update_actor(*a, **kw):
        update_actor(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        run.log_step(batch["reward"], batch["tokens"])
    cluster.update_actor = timed_update_actor

    def batches():
        """The prompts in jaxflow's order, B a step; ends (so GRPOLearner stops) once the time limit has
        passed: the next batch is asked for only after the previous step's update."""
        for i in range(steps_in_data):
            if i and run.elapsed() >= s["time_limit_s"]:
                return
            # Tunix's sampler takes one PRNG seed per call (PRNGKey(0) if none): a fresh one per step.
            rollout_config.seed = run.seed * 1_000_003 + i
            chunk = prompts[i * B:(i + 1) * B]
            yield {"prompts": np.array([p["text"] for p in chunk]),
                   "meta": np.array([json.dumps(p["meta"]) for p in chunk])}

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward_fn])
    run.begin()
    learner.train(batches())

    # Held-out accuracy: greedy with Tunix's sampler on the trained model, the same problems and new-token
    # limit as jaxflow's evals, stopping at EOS.
    evaluator = sampler_lib.Sampler(cluster.actor_trainer.model, tokenizer, sampler_lib.CacheConfig(
        cache_size=max_prompt + T, num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim))

    def greedy(chunk):
        out = evaluator([p["text"] for p in chunk], max_generation_steps=T, max_prompt_length=max_prompt,
                        temperature=0.0, top_p=None, eos_tokens=[tokenizer.eos_token_id])
        return [tokenizer.decode(t.tolist(), skip_special_tokens=True) for t in out.tokens]

    run.finish("tunix", run.accuracy(greedy),
               {"tunix": _version("google-tunix", tunix), "jax": jax.__version__, "flax": flax.__version__,
                "optax": optax.__version__, "transformers": transformers.__version__},
               {"loss_agg_mode": algo.loss_agg_mode, "advantage_estimator": algo.advantage_estimator,
                "epsilon": algo.epsilon, "beta": algo.beta, "num_iterations": algo.num_iterations,
                "reference_model": None,
                "rollout": "Tunix vanilla rollout (its JAX sampler, padded batch, top_p=1.0 mode), "
                           "sharing weights with the actor; synchronous",
                "sampler_seed": "a fresh PRNG seed per step (Tunix's default is one fixed seed)",
                "eos_in_loss": "no (Tunix's rollout cuts each completion before its EOS)",
                "optimizer": "adamw(b1 0.9, b2 0.999, wd 0) after clip_by_global_norm(1.0)",
                "rope_theta_patch": (f"apply_rope given the config's rope_theta {int(rope_theta)} "
                                     "(Tunix ignores it)") if rope_fixed else None,
                "cpu_cores": len(os.sched_getaffinity(0))})


def _version(dist: str, module) -> str:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return getattr(module, "__version__", "unknown")


if __name__ == "__main__":
    main()
