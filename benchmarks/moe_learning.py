"""Mixture of experts, the learning check: the tool demo's `:moe` variant against its dense model.

    .venv/bin/python benchmarks/moe_learning.py --json benchmarks/results/moe_learning.json
    .venv/bin/python benchmarks/moe_learning.py --quick

Two `python -m jaxflow.main` runs (`async_vs_sync.run_one`) of configs/arithmetic_tools_tiny.py at eta = 4 for
the same number of steps, each in a fresh workdir with the same seed:

    dense   the demo as it is (its dense tiny model)
    moe     the `:moe` variant: a tiny Qwen3-MoE (4 experts a layer, top-2, each half the dense MLP's width)
            from its own warm start, trained with routing replay (`trainer.moe.routing_replay = "rollout"`)

Reported per run: the held-out accuracy curve (evals every `--eval-every` steps, the base's first), the final
held-out accuracy and seconds a step; for the MoE run, the router's per-step metrics from metrics.jsonl
(`route_flip_frac`: tokens whose trainer top-k differs from the engine's recorded one; `expert_load_max`: the
busiest expert's load over the mean) with their means. The headline: the final accuracies, their gap in
points, the eval noise of that difference (`precision.difference_noise`) and `same_within_noise` (a gap of at
most 2 of them). A plot of both curves goes to the workdir (and `--plot PATH`).

--quick runs a shorter warm start, fewer steps and fewer eval prompts: it checks the plumbing, not the accuracy.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import results_meta
from async_vs_sync import QUICK, parse_overrides, run_one
from precision import difference_noise, eval_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tools_tiny.py"
RUNS = {"dense": CONFIG, "moe": CONFIG + ":moe"}
ETA = 4
ROUTER_METRICS = ("route_flip_frac", "expert_load_max", "router_aux_loss")


def router_curves(workdir: pathlib.Path) -> list[dict]:
    """{"step", and each of ROUTER_METRICS the step reported} for every train step of a run."""
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [{"step": r["step"], **{k: r[k] for k in ROUTER_METRICS if k in r}} for r in records if "loss" in r]


def one_run(name: str, steps: int, workdir: pathlib.Path, overrides: dict) -> dict:
    run_dir = workdir / name
    run = run_one(ETA, steps, run_dir, overrides, RUNS[name])
    curves = router_curves(run_dir)
    means = {}
    for key in ROUTER_METRICS:
        values = [c[key] for c in curves if key in c]
        if values:
            means[f"{key}_mean"] = sum(values) / len(values)
    return {"run": name, "config": RUNS[name], "steps": run["steps"], "train_s": run["train_s"],
            "step_s": run["train_s"] / max(run["steps"], 1), "base_accuracy": run["base_accuracy"],
            "final_accuracy": run["final_accuracy"], "eval_curve": eval_curve(run_dir), "router_curves": curves,
            **means}


def plot(runs: dict[str, dict], path: pathlib.Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    acc, flips = fig.subplots(1, 2)
    for name, run in runs.items():
        if run["eval_curve"]:
            acc.plot(*zip(*run["eval_curve"]), marker="o", label=name)
        points = [(c["step"], c["route_flip_frac"]) for c in run["router_curves"] if "route_flip_frac" in c]
        if points:
            flips.plot(*zip(*points), label=name)
    acc.set(title="tool demo: held-out accuracy", xlabel="step", ylabel="accuracy")
    flips.set(title="moe: tokens whose update top-k differs from the rollout's", xlabel="step", ylabel="fraction")
    for ax in (acc, flips):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short warm start, few steps (plumbing only)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--steps", type=int, help="train steps per run (default 40, quick 6)")
    parser.add_argument("--eval-every", type=int, help="steps between held-out evals (default 10, quick 3)")
    parser.add_argument("--workdir", type=pathlib.Path, default=ROOT / "runs" / "moe_learning")
    parser.add_argument("--plot", type=pathlib.Path, help="also save the plot here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs (repeatable)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 10)
    overrides = {**(QUICK if args.quick else {}), "eval.every": every, **parse_overrides(args.set)}
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    from jaxflow.jobs import rl

    for config in RUNS.values():  # every config checked before the first run starts
        rl.check_config(load_config(str(ROOT / config), {k: str(v) for k, v in overrides.items()}))
    n = int(load_config(str(ROOT / CONFIG), {k: str(v) for k, v in overrides.items()}).eval.num_prompts)
    runs = {name: one_run(name, steps, args.workdir, overrides) for name in RUNS}
    dense, moe = runs["dense"]["final_accuracy"], runs["moe"]["final_accuracy"]
    noise = difference_noise(dense, moe, n)
    gap = abs(moe - dense)
    headline = {"dense_final_accuracy": dense, "moe_final_accuracy": moe, "gap_points": gap * 100,
                "noise_points": noise * 100, "same_within_noise": gap <= 2 * noise,
                "moe_route_flip_frac_mean": runs["moe"].get("route_flip_frac_mean"),
                "moe_expert_load_max_mean": runs["moe"].get("expert_load_max_mean"),
                "moe_step_s_vs_dense": runs["moe"]["step_s"] / runs["dense"]["step_s"]}
    print(f"\n{'run':<8}{'base':>8}{'final':>8}{'s/step':>8}   eval curve")
    for name, run in runs.items():
        curve = " ".join(f"{s}:{a:.2f}" for s, a in run["eval_curve"])
        print(f"{name:<8}{run['base_accuracy']:>8.1%}{run['final_accuracy']:>8.1%}{run['step_s']:>8.2f}   {curve}")
    print(f"gap {gap * 100:.1f} points, eval noise {noise * 100:.1f} points: "
          f"{'within' if headline['same_within_noise'] else 'outside'} 2x noise; "
          f"route flips {headline['moe_route_flip_frac_mean']}")
    path = args.workdir / "moe_learning.png"
    plot(runs, path)
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        results_meta.write_json(str(args.json), {**headline, "eta": ETA, "steps": steps, "eval_every": every,
                                                 "eval_prompts": n, "quick": args.quick, "runs": runs}, started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
