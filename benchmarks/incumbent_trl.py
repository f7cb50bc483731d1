"""TRL's GRPOTrainer on the side-by-side's setup: run by `vs_incumbents.py` with TRL's own Python.

    /path/to/trl-env/bin/python benchmarks/incumbent_trl.py --setup SETUP_DIR --out OUT_DIR --seed 0

This file runs in an environment of its own that has torch, transformers, datasets and trl; of jaxflow it
uses only `jaxflow.tasks` (standard library only) for the reward, through incumbent_io.py. SETUP_DIR/setup.json
(written by vs_incumbents.py) names the base model (an HF directory), the train prompts in the order
jaxflow draws them, the held-out problems and the settings (prompts per step, samples per prompt, new
tokens, learning rate, warmup, time limit). Writes OUT_DIR/metrics.jsonl (a line per step: time since
training began, the sampled reward's mean, completion tokens) and OUT_DIR/result.json (steps, first
step's time, held-out greedy accuracy, versions, settings).
"""

from __future__ import annotations

import json

from incumbent_io import Run


def main() -> None:
    run = Run(__doc__.split("\n\n")[0])
    s = run.settings

    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(s["threads"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.model_dir)
    # TRL tokenizes the prompt text itself: it must give the very ids jaxflow samples from.
    run.check_tokenizer(lambda text: tokenizer(text=text)["input_ids"], "TRL")
    model = transformers.AutoModelForCausalLM.from_pretrained(run.model_dir, dtype=torch.float32)
    batch = {"reward": None, "tokens": 0}

    def reward_fn(prompts, completions, completion_ids, meta, **_):
        scores = [run.reward(c, m) for c, m in zip(completions, meta)]
        batch["reward"], batch["tokens"] = sum(scores) / len(scores), sum(len(c) for c in completion_ids)
        return scores

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            run.begin()

        def on_step_end(self, targs, state, control, **kw):
            if run.log_step(batch["reward"], batch["tokens"]) >= s["time_limit_s"]:
                control.should_training_stop = True

    rows = s["batch_prompts"] * s["group_size"]
    config = trl.GRPOConfig(
        output_dir=str(run.out / "trl"), seed=run.seed, data_seed=run.seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=s["group_size"], max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=1.0, learning_rate=s["lr"], warmup_steps=s["warmup_steps"],
        lr_scheduler_type="constant_with_warmup", adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=s["eps"], max_steps=len(run.prompts) // s["batch_prompts"],
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True)
    train = datasets.Dataset.from_list([{"prompt": p["text"], "meta": json.dumps(p["meta"])} for p in run.prompts])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=train,
                              processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()

    # Held-out accuracy: greedy, the same problems and new-token limit as jaxflow's evals.
    model.eval()

    def generate(chunk):
        enc = tokenizer([p["text"] for p in chunk], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=s["max_new_tokens"],
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)

    run.finish("trl", run.accuracy(generate),
               {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
               {"loss_type": config.loss_type, "scale_rewards": config.scale_rewards, "epsilon": config.epsilon,
                "beta": config.beta, "num_iterations": config.num_iterations,
                "generation": "transformers generate (padded batch, no paged cache)",
                "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
