"""Black-box agents, the learning check: the tool demo written as an agent program against the native tool demo.

    .venv/bin/python benchmarks/agent_learning.py --json benchmarks/results/agent_learning.json
    .venv/bin/python benchmarks/agent_learning.py --quick

`python -m jaxflow.main` runs (`async_vs_sync.run_one`) at eta = 4 for the same number of steps, each in a
fresh workdir, once per seed of `--seeds` (the run's `seed`: its prompts and sampling), from the one base model
both configs share (the tool demo's warm start):

    native  configs/arithmetic_tools_tiny.py: the calculator as a jaxflow environment (`CalculatorEnv`)
    agent   configs/arithmetic_agent_tiny.py: the same task as a plain agent program with the `openai` client
            (`jaxflow.envs.calculator_agent:agent`), trained through the OpenAI-compatible endpoint

Held-out evals are the same in both (the evaluator runs each config's own episodes: the agent's through its
endpoint). Reported per run: the held-out accuracy curve (evals every `--eval-every` steps, the base's first),
the final held-out accuracy and seconds a step (the training loop less its evals). The headline: each
config's final accuracy (the mean over seeds), their gap in points, the noise of that difference and
`same_within_noise` (a gap of at most 2 of them), as `moe_learning` reports it; the agent's seconds a step
over the native's. A plot of the curves goes to the workdir (and `--plot PATH`).

--quick runs a shorter warm start, fewer steps and fewer eval prompts: it checks the plumbing, not the accuracy.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

import results_meta
from async_vs_sync import QUICK, parse_overrides, run_one
from moe_learning import mean_curves, plot_curves, print_runs, run_parser, save, seeds_of
from precision import difference_noise, eval_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = {"native": "configs/arithmetic_tools_tiny.py", "agent": "configs/arithmetic_agent_tiny.py"}
ETA = 4


def one_run(name: str, seed: int, steps: int, workdir: pathlib.Path, overrides: dict) -> dict:
    run_dir = workdir / f"{name}_seed{seed}"
    run = run_one(ETA, steps, run_dir, {**overrides, "seed": seed}, RUNS[name])
    return {"run": name, "seed": seed, "config": RUNS[name], "steps": run["steps"], "train_s": run["train_s"],
            "step_s": run["train_s"] / max(run["steps"], 1), "trained_tokens_per_s": run["trained_tokens_per_s"],
            "base_accuracy": run["base_accuracy"], "final_accuracy": run["final_accuracy"],
            "eval_curve": eval_curve(run_dir)}


def summarise(runs: list[dict], n: int) -> dict:
    """The headline figures (module docstring) from every run of both configs; n: held-out prompts an eval."""
    by = {name: [r for r in runs if r["run"] == name] for name in RUNS}
    finals = {name: [r["final_accuracy"] for r in rs] for name, rs in by.items()}
    final = {name: statistics.mean(values) for name, values in finals.items()}
    if all(len(values) > 1 for values in finals.values()):
        noise = math.sqrt(sum(statistics.variance(values) / len(values) for values in finals.values()))
    else:
        noise = difference_noise(final["native"], final["agent"], n)
    gap = abs(final["agent"] - final["native"])
    step_s = {name: statistics.mean(r["step_s"] for r in rs) for name, rs in by.items()}
    return {"native_final_accuracy": final["native"], "agent_final_accuracy": final["agent"],
            "native_final_accuracies": finals["native"], "agent_final_accuracies": finals["agent"],
            "gap_points": gap * 100, "noise_points": noise * 100, "same_within_noise": gap <= 2 * noise,
            "agent_step_s_vs_native": step_s["agent"] / step_s["native"], "curves": mean_curves(by)}


# The plot's legend label of each variant.
NAMES = {"native": "native environment", "agent": "agent program"}


def plot(runs: list[dict], curves: list[dict], path: pathlib.Path) -> None:
    plot_curves(runs, curves, path, names=NAMES, title='tool demo: native environment vs agent program')


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    return run_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "agent_learning")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 10)
    overrides = {**(QUICK if args.quick else {}), "eval.every": every, **parse_overrides(args.set)}
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    from jaxflow.jobs import rl

    configs = {name: load_config(str(ROOT / path), {k: str(v) for k, v in overrides.items()})
               for name, path in RUNS.items()}
    for config in configs.values():  # every config checked before the first run starts
        rl.check_config(config)
    if configs["native"].base.dir != configs["agent"].base.dir:
        raise SystemExit(f"the two configs must share a base model: native {configs['native'].base.dir!r}, "
                         f"agent {configs['agent'].base.dir!r}")
    n = int(configs["native"].eval.num_prompts)
    seeds = seeds_of(args)
    runs = [one_run(name, seed, steps, args.workdir, overrides) for seed in seeds for name in RUNS]
    headline = summarise(runs, n)
    print_runs(runs)
    print(f"final accuracy, mean over seeds {seeds}: native {headline['native_final_accuracy']:.1%}, agent "
          f"{headline['agent_final_accuracy']:.1%}; gap {headline['gap_points']:.1f} points, noise "
          f"{headline['noise_points']:.1f} points: {'within' if headline['same_within_noise'] else 'outside'} 2x "
          f"noise; the agent's step takes {headline['agent_step_s_vs_native']:.2f}x the native's")
    save(args, "agent_learning", runs, headline, plot, started, eta=ETA, steps=steps, eval_every=every,
         eval_prompts=n, seeds=seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
