"""A learned reward model in place of the exact reward: its agreement with the exact reward, and RL with it.

    .venv/bin/python benchmarks/reward_model_learning.py --json benchmarks/results/reward_model_learning.json
    .venv/bin/python benchmarks/reward_model_learning.py --quick

On single-turn arithmetic (configs/arithmetic_tiny.py; a reward model replaces a reward function on single
answers, episodes are scored by their environments):

1. Labelled answers: the warm-started base policy samples `--samples` answers (temperature 1) to each of
   `--train-prompts` train-split problems (drawn apart from the RL run's) and to `--eval-prompts` held-out
   problems (the eval split); the task's exact reward labels each correct or not. The train set also holds one
   worked demonstration per train problem (correct by construction), since the base is mostly wrong.
2. The reward model: the base policy's backbone with a fresh scalar head, trained for `--rm-steps` steps of
   the pairwise (Bradley-Terry) loss on pairs of a correct and a wrong answer to the same problem (so it
   learns to rank one problem's answers, which is all a GRPO group's advantages use, rather than which
   problems are easy), written as an HF `Qwen3ForSequenceClassification` directory
   (`jaxflow.models.classifier.export_sequence_classifier`) and read back through `RewardModel`, as the job
   reads it.
3. Agreement on the held-out answers, from the scores `RewardModel` returns: the share of (correct, wrong)
   pairs of one problem's answers the model ranks as the exact reward does, and the ranking AUC over all
   answers (the chance a correct answer outscores a wrong one).
4. RL from the same base at eta = 4 for `--steps` steps, once with `rollout.reward_model.dir` (the rollouts'
   reward is the model's score) and once with the exact reward, per seed; both runs' held-out evals use the
   exact reward. Reported: the eval curves and final held-out accuracies.

--quick runs a short warm start, few answers, a short reward-model fit and few RL steps: the plumbing only.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np
import results_meta
from async_vs_sync import QUICK, parse_overrides, run_one
from moe_learning import mean_curves, plot_curves, print_runs, run_parser, save, seeds_of
from precision import eval_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tiny.py"
METHODS = ("reward_model", "exact")
ETA = 4


def sample_answers(base_dir: pathlib.Path, records: list[dict], samples: int, max_tokens: int, eos: int,
                   seed: int) -> list[list[list[int]]]:
    """Per record, `samples` completions (token ids) of the base policy at temperature 1."""
    from rollout_bridge.engine import Request, SamplingParams
    from rollout_bridge.jax_engine import JaxEngine

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=(eos,))
    engine = JaxEngine(str(base_dir), max_slots=128, seed=seed)
    try:
        requests = [Request(f"s{i}:{k}", list(r["prompt"]), params) for i, r in enumerate(records)
                    for k in range(samples)]
        completions = engine.generate(requests, timeout=3600)
    finally:
        engine.close()
    tokens = [c.sample.tokens for c in completions]
    return [tokens[i * samples:(i + 1) * samples] for i in range(len(records))]


def labelled(task, tokenizer, records: list[dict], answers: list[list[list[int]]]) -> list[tuple[str, dict, float]]:
    """(response text, meta, exact label 0/1) of every sampled answer."""
    out = []
    for record, group in zip(records, answers):
        for tokens in group:
            text = tokenizer.decode(tokens)
            out.append((text, record["meta"], float(task.reward(text, record["meta"]) >= 1.0)))
    return out


def preference_pairs(data: list[tuple[str, dict, float]]) -> list[tuple[int, int]]:
    """(a correct answer, a wrong answer) index pairs of `data`, every such pair of the same problem: the
    reward model learns to rank answers to one problem, not which problems are easy (a GRPO group's
    advantages depend only on that ranking)."""
    by_problem: dict[str, tuple[list[int], list[int]]] = {}
    for i, (_, meta, label) in enumerate(data):
        right, wrong = by_problem.setdefault(meta["question"], ([], []))
        (right if label > 0 else wrong).append(i)
    return [(c, w) for right, wrong in by_problem.values() for c in right for w in wrong]


def fit_reward_model(base_dir: pathlib.Path, tokenizer, data: list[tuple[str, dict, float]], steps: int,
                     batch: int, lr: float, seed: int, out_dir: pathlib.Path) -> dict:
    """Trains the base backbone plus a zero scalar head on `data`'s labels by the pairwise (Bradley-Terry) loss
    log(1 + exp(s_wrong - s_correct)) over pairs of one problem's answers; writes it to `out_dir` as an HF
    sequence classifier. Returns the fit's losses and seconds."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxflow.models import hf_io
    from jaxflow.models.classifier import SequenceClassifier, export_sequence_classifier
    from jaxflow.rewards.model import bucket_of, buckets, prompt_messages

    rows = [tokenizer.encode_chat(prompt_messages(meta) + [{"role": "assistant", "content": text}],
                                  add_generation_prompt=False) for text, meta, _ in data]
    labels = np.asarray([y for _, _, y in data], np.float32)
    width = max(len(r) for r in rows)
    tokens = np.full((len(rows), width), tokenizer.eos_id, np.int32)
    lengths = np.asarray([len(r) for r in rows], np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    backbone = hf_io.load_model(str(base_dir))
    model = SequenceClassifier(backbone, jnp.zeros((backbone.config.hidden_size, 1), jnp.float32),
                               tokenizer.eos_id)
    pairs = preference_pairs(data)
    if not pairs:
        raise SystemExit("no problem has both a correct and a wrong answer to fit the reward model on")
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps), weight_decay=0.0)
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens_bt, lengths_b):
        def loss_fn(p):  # rows [:k] the correct answers, [k:] the wrong ones of the same problems
            scores = nnx.merge(graphdef, p)(tokens_bt, lengths_b)
            k = scores.shape[0] // 2
            return jnp.mean(jax.nn.softplus(scores[k:] - scores[:k]))
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses, start = [], time.monotonic()
    for i in range(steps):
        chosen = [pairs[k] for k in rng.choice(len(pairs), size=batch // 2, replace=len(pairs) < batch // 2)]
        idx = np.asarray([c for c, _ in chosen] + [w for _, w in chosen])
        used = min(bucket_of(int(lengths[idx].max()), buckets(width, 32)), width)  # a few shapes, a few compiles
        params, opt_state, loss = step(params, opt_state, tokens[idx, :used], lengths[idx])
        losses.append(float(loss))
        if (i + 1) % max(steps // 10, 1) == 0:
            print(f"reward model fit: step {i + 1}/{steps}, loss {statistics.mean(losses[-max(steps // 10, 1):]):.3f}",
                  flush=True)
    nnx.update(model, params)
    export_sequence_classifier(model, out_dir, tokenizer_dir=base_dir, overwrite=True)
    return {"steps": steps, "batch": batch, "lr": lr, "pairs": len(pairs), "first_loss": losses[0],
            "final_loss": statistics.mean(losses[-max(steps // 10, 1):]), "fit_s": time.monotonic() - start,
            "answers": len(rows), "correct_share": float(labels.mean())}


def agreement(rm_dir: pathlib.Path, data: list[tuple[str, dict, float]]) -> dict:
    """The reward model's agreement with the exact labels on `data`, scored through `RewardModel` as the job
    scores rollouts: for every pair of a correct and a wrong answer to the same problem, whether the correct
    one scores higher (ties count half), and the same over all answers (the ranking AUC)."""
    from jaxflow.rewards.model import RewardModel

    with RewardModel(str(rm_dir), batch_size=64, max_len=512) as rm:
        futures = [rm.submit(rm.name, text, meta) for text, meta, _ in data]
        scores = np.asarray([f.result() for f in futures], np.float64)
        stats = rm.stats()
    labels = np.asarray([y for _, _, y in data]) > 0

    def ranked(pos, neg) -> float:
        return float(((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])).mean())

    pairs = preference_pairs(data)
    within = (float(np.mean([(scores[c] > scores[w]) + 0.5 * (scores[c] == scores[w]) for c, w in pairs]))
              if pairs else None)
    return {"answers": len(data), "correct_share": float(labels.mean()), "pairs": len(pairs),
            "problems_with_a_pair": len({data[c][1]["question"] for c, _ in pairs}),
            "pairwise_accuracy": within,
            "auc": ranked(scores[labels], scores[~labels]) if labels.any() and (~labels).any() else None,
            "failed": int(stats["invalid"] + stats["timed_out"] + stats["raised"])}


def one_run(method: str, seed: int, steps: int, workdir: pathlib.Path, overrides: dict,
            rm_dir: pathlib.Path) -> dict:
    run_dir = workdir / f"{method}_seed{seed}"
    more = {"rollout.reward_model.dir": rm_dir} if method == "reward_model" else {}
    run = run_one(ETA, steps, run_dir, {**overrides, **more, "seed": seed}, CONFIG)
    return {"run": method, "seed": seed, "steps": run["steps"], "train_s": run["train_s"],
            "step_s": run["train_s"] / max(run["steps"], 1), "base_accuracy": run["base_accuracy"],
            "final_accuracy": run["final_accuracy"], "eval_curve": eval_curve(run_dir),
            "reward_curve": [(step, reward) for _, step, reward in run["curve"]]}


# The plot's legend label of each variant.
NAMES = {"reward_model": "reward: the learned reward model", "exact": "reward: the exact answer check"}


def plot(runs: list[dict], curves: list[dict], path: pathlib.Path) -> None:
    plot_curves(runs, curves, path, names=NAMES,
                title="arithmetic: RL on a learned reward model vs the exact reward")


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = run_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "reward_model_learning")
    parser.add_argument("--train-prompts", type=int, help="train problems answered (default 768, quick 32)")
    parser.add_argument("--eval-prompts", type=int, help="held-out problems answered (default 256, quick 16)")
    parser.add_argument("--samples", type=int, default=4, help="answers sampled per problem (default 4)")
    parser.add_argument("--rm-steps", type=int, help="reward model fit steps (default 600, quick 20)")
    parser.add_argument("--rm-lr", type=float, default=3e-4, help="reward model fit peak learning rate")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 10)
    train_prompts = args.train_prompts or (32 if args.quick else 768)
    eval_prompts = args.eval_prompts or (16 if args.quick else 256)
    rm_steps = args.rm_steps or (20 if args.quick else 600)
    overrides = {**(QUICK if args.quick else {}), "eval.every": every, **parse_overrides(args.set)}
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    from jaxflow.jobs import rl, warm_start
    from jaxflow.tokenizer import Tokenizer

    config = load_config(str(ROOT / CONFIG), {k: str(v) for k, v in overrides.items()})
    rl.check_config(config)
    base_dir = pathlib.Path(warm_start.ensure_base_model(config))
    if not base_dir.is_absolute():
        base_dir = ROOT / base_dir
    task = warm_start.make_task(config)
    tokenizer = Tokenizer.from_dir(base_dir)
    train_examples = task.examples("train", train_prompts, seed=config.seed + 2000)
    eval_examples = task.examples("eval", eval_prompts, seed=0)
    train_records = task.to_prompt_records(train_examples, tokenizer)
    eval_records = task.to_prompt_records(eval_examples, tokenizer)
    max_tokens = int(config.rollout.max_tokens)
    print(f"sampling {args.samples} answers to {train_prompts} train and {eval_prompts} held-out problems from "
          f"the base {base_dir}", flush=True)
    train = labelled(task, tokenizer, train_records,
                     sample_answers(base_dir, train_records, args.samples, max_tokens, tokenizer.eos_id, 1))
    train += [(task.demonstration(e), r["meta"], 1.0) for e, r in zip(train_examples, train_records)]
    held_out = labelled(task, tokenizer, eval_records,
                        sample_answers(base_dir, eval_records, args.samples, max_tokens, tokenizer.eos_id, 2))
    rm_dir = args.workdir / "reward_model"
    fit = fit_reward_model(base_dir, tokenizer, train, rm_steps, 32, args.rm_lr, 0, rm_dir)
    agree = agreement(rm_dir, held_out)
    train_agree = agreement(rm_dir, [x for x in train[:len(held_out) * 2]])
    print(f"reward model {rm_dir}: fit on {fit['answers']} answers ({fit['correct_share']:.0%} correct), loss "
          f"{fit['first_loss']:.3f} -> {fit['final_loss']:.3f} in {fit['fit_s']:.0f} s", flush=True)
    print(f"held-out agreement with the exact reward ({agree['answers']} answers, {agree['correct_share']:.0%} "
          f"correct): a problem's correct answer outscores its wrong one in {agree['pairwise_accuracy']:.1%} of "
          f"{agree['pairs']} pairs; AUC {agree['auc']:.3f}; on train answers {train_agree['pairwise_accuracy']:.1%}",
          flush=True)
    seeds = seeds_of(args)
    runs = [one_run(m, seed, steps, args.workdir, overrides, rm_dir) for seed in seeds for m in METHODS]
    by = {m: [r for r in runs if r["run"] == m] for m in METHODS}
    headline = {"agreement": agree, "train_agreement": train_agree, "fit": fit, "curves": mean_curves(by),
                **{f"{m}_final_accuracy": statistics.mean(r["final_accuracy"] for r in rs) for m, rs in by.items()},
                "base_accuracy": runs[0]["base_accuracy"]}
    headline["reward_model_vs_exact_points"] = 100 * (headline["reward_model_final_accuracy"]
                                                      - headline["exact_final_accuracy"])
    print_runs(runs)
    print(f"final held-out accuracy, mean over seeds {seeds}: base {headline['base_accuracy']:.1%}; RL on the reward "
          f"model {headline['reward_model_final_accuracy']:.1%}, RL on the exact reward "
          f"{headline['exact_final_accuracy']:.1%}")
    save(args, "reward_model_learning", runs, headline, plot, started, eta=ETA, steps=steps, eval_every=every,
         seeds=seeds, train_prompts=train_prompts, eval_prompts=eval_prompts, samples=args.samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
