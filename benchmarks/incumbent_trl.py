"""TRL's GRPOTrainer on the side-by-side's setup: run by `vs_incumbents.py` with TRL's own Python.

    /path/to/trl-env/bin/python benchmarks/incumbent_trl.py --setup SETUP_DIR --out OUT_DIR --seed 0

This file runs in an environment of its own that has torch, transformers, datasets and trl; it imports
nothing of jaxflow's but `jaxflow.tasks` (standard library only) for the reward, so every system scores
the same responses the same way. SETUP_DIR/setup.json (written by vs_incumbents.py) names the base model
(an HF directory), the train prompts in the order jaxflow draws them, the held-out problems and the
settings (prompts per step, samples per prompt, new tokens, learning rate, warmup, time limit). Writes
OUT_DIR/metrics.jsonl (a line per step: time since training began, the sampled reward's mean, completion
tokens) and OUT_DIR/result.json (steps, first step's time, held-out greedy accuracy, versions, settings).
"""

from __future__ import annotations

import argparse
import json
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

    import datasets
    import torch
    import transformers
    import trl

    sys.path.insert(0, str(ROOT))
    from jaxflow.tasks import reward as task_reward  # standard library only

    setup = json.loads((args.setup / "setup.json").read_text())
    s = setup["settings"]
    torch.set_num_threads(s["threads"])
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(setup["model_dir"])
    prompts = [json.loads(line) for line in pathlib.Path(setup["prompts"]).read_text().splitlines()]
    held_out = [json.loads(line) for line in pathlib.Path(setup["eval"]).read_text().splitlines()]
    # TRL tokenizes the prompt text itself: it must give the very ids jaxflow samples from.
    for p in prompts[:200] + held_out:
        ids = tokenizer(text=p["text"])["input_ids"]
        if ids != p["prompt"]:
            raise SystemExit(f"TRL's tokenizer gives {ids[:12]}... for prompt {p['text']!r}, jaxflow {p['prompt'][:12]}...")

    model = transformers.AutoModelForCausalLM.from_pretrained(setup["model_dir"], dtype=torch.float32)
    metrics = open(args.out / "metrics.jsonl", "w")
    clock = {"start": None, "reward": None, "tokens": 0}

    def reward_fn(prompts, completions, completion_ids, meta, **_):
        scores = [task_reward(c, json.loads(m)) for c, m in zip(completions, meta)]
        clock["reward"] = sum(scores) / len(scores)
        clock["tokens"] = sum(len(c) for c in completion_ids)
        return scores

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            clock["start"] = time.monotonic()

        def on_step_end(self, targs, state, control, **kw):
            elapsed = time.monotonic() - clock["start"]
            metrics.write(json.dumps({"step": state.global_step - 1, "time_s": round(elapsed, 3),
                                      "reward_mean": clock["reward"], "completion_tokens": clock["tokens"]}) + "\n")
            metrics.flush()
            if elapsed >= s["time_limit_s"]:
                control.should_training_stop = True

    rows = s["batch_prompts"] * s["group_size"]
    config = trl.GRPOConfig(
        output_dir=str(args.out / "trl"), seed=args.seed, data_seed=args.seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=s["group_size"], max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=1.0, learning_rate=s["lr"], warmup_steps=s["warmup_steps"],
        lr_scheduler_type="constant_with_warmup", adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=s["eps"], max_steps=len(prompts) // s["batch_prompts"],
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True)
    train = datasets.Dataset.from_list([{"prompt": p["text"], "meta": json.dumps(p["meta"])} for p in prompts])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=train,
                              processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    metrics.close()
    steps = [json.loads(line) for line in (args.out / "metrics.jsonl").read_text().splitlines()]

    # Held-out accuracy: greedy, the same problems and new-token limit as jaxflow's evals.
    model.eval()
    correct, batch = 0, 64
    with torch.no_grad():
        for i in range(0, len(held_out), batch):
            chunk = held_out[i:i + batch]
            enc = tokenizer([p["text"] for p in chunk], return_tensors="pt", padding=True, padding_side="left")
            out = model.generate(**enc, do_sample=False, max_new_tokens=s["max_new_tokens"],
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(task_reward(t, p["meta"]) >= 1.0 for t, p in zip(texts, chunk))
    result = {"system": "trl", "seed": args.seed, "steps": len(steps),
              "first_step_s": steps[0]["time_s"] if steps else None,
              "train_s": steps[-1]["time_s"] if steps else None,
              "eval_accuracy": correct / len(held_out),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__},
              "settings": {"loss_type": config.loss_type, "scale_rewards": config.scale_rewards,
                           "epsilon": config.epsilon, "beta": config.beta, "num_iterations": config.num_iterations,
                           "generation": "transformers generate (padded batch, no paged cache)",
                           "torch_threads": torch.get_num_threads()}}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("steps", "first_step_s", "train_s", "eval_accuracy")}))


if __name__ == "__main__":
    main()
