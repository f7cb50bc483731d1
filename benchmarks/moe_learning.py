"""Mixture of experts, the learning check: the tool demo's `:moe` variant against its dense model.

    .venv/bin/python benchmarks/moe_learning.py --json benchmarks/results/moe_learning.json
    .venv/bin/python benchmarks/moe_learning.py --quick

`python -m jaxflow.main` runs (`async_vs_sync.run_one`) of configs/arithmetic_tools_tiny.py at eta = 4 for the
same number of steps, each in a fresh workdir, once per seed of `--seeds` (the run's `seed`: its prompts and
sampling; the base models are each variant's one warm start):

    dense           the demo as it is (its dense tiny model)
    moe             the `:moe` variant: a tiny Qwen3-MoE (4 experts, top-2, each half the dense MLP's width;
                    its first layer's MLP dense, its second sparse) from its own warm start (with the
                    routers' load-balancing loss), trained with routing replay
                    (`trainer.moe.routing_replay = "rollout"`)
    moe_all_sparse  the same with both layers sparse (`model.mlp_only_layers = ()`, its own warm start)

Reported per run: the held-out accuracy curve (evals every `--eval-every` steps, the base's first), the final
held-out accuracy and seconds a step; for the MoE runs, the router's per-step metrics from metrics.jsonl
(`route_flip_frac`: tokens whose trainer top-k differs from the engine's recorded one; `expert_load_max`: the
busiest expert's load over the mean) with their means. The headline: each variant's final accuracy (the mean
over seeds), their gap in points, the noise of that difference and `same_within_noise` (a gap of at most 2 of
them). The noise is the standard error of the difference of the two means from the seeds' spread (which holds
the eval's sampling noise and the runs' own), or with one seed the eval's alone
(`precision.difference_noise`). `moe_all_sparse_final_accuracy` and its gap to the dense model come beside
them. A plot of the curves goes to the workdir (and `--plot PATH`).

--quick runs a shorter warm start, fewer steps and fewer eval prompts: it checks the plumbing, not the accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys

import results_meta
from async_vs_sync import QUICK, parse_overrides, run_one
from mismatch_learning import learning_parser
from precision import difference_noise, eval_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tools_tiny.py"
# Each variant: its config file and the overrides that make it (one warm start per variant).
RUNS = {"dense": (CONFIG, {}), "moe": (CONFIG + ":moe", {}),
        "moe_all_sparse": (CONFIG + ":moe", {"model.mlp_only_layers": "()",
                                             "base.dir": "runs/base/arithmetic_tools_tiny_moe_all_sparse"})}
ETA = 4
ROUTER_METRICS = ("route_flip_frac", "expert_load_max", "router_aux_loss")


def router_curves(workdir: pathlib.Path) -> list[dict]:
    """{"step", and each of ROUTER_METRICS the step reported} for every train step of a run."""
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [{"step": r["step"], **{k: r[k] for k in ROUTER_METRICS if k in r}} for r in records if "loss" in r]


def one_run(name: str, seed: int, steps: int, workdir: pathlib.Path, overrides: dict) -> dict:
    run_dir = workdir / f"{name}_seed{seed}"
    config, own = RUNS[name]
    run = run_one(ETA, steps, run_dir, {**overrides, **own, "seed": seed}, config)
    curves = router_curves(run_dir)
    means = {}
    for key in ROUTER_METRICS:
        values = [c[key] for c in curves if key in c]
        if values:
            means[f"{key}_mean"] = sum(values) / len(values)
    return {"run": name, "seed": seed, "config": config, "overrides": own, "steps": run["steps"],
            "train_s": run["train_s"], "step_s": run["train_s"] / max(run["steps"], 1),
            "base_accuracy": run["base_accuracy"], "final_accuracy": run["final_accuracy"],
            "eval_curve": eval_curve(run_dir), "router_curves": curves, **means}


def summarise(runs: list[dict], n: int) -> dict:
    """The headline figures (module docstring) from every run of both variants; n: held-out prompts an eval."""
    by = {name: [r for r in runs if r["run"] == name] for name in RUNS}
    final = {name: statistics.mean(r["final_accuracy"] for r in rs) for name, rs in by.items()}
    if len(by["dense"]) > 1 and len(by["moe"]) > 1:
        noise = math.sqrt(sum(statistics.variance([r["final_accuracy"] for r in by[name]]) / len(by[name])
                              for name in ("dense", "moe")))
    else:
        noise = difference_noise(final["dense"], final["moe"], n)
    gap = abs(final["moe"] - final["dense"])

    def mean_of(name, key):
        values = [r[key] for r in by[name] if r.get(key) is not None]
        return statistics.mean(values) if values else None

    return {"dense_final_accuracy": final["dense"], "moe_final_accuracy": final["moe"],
            "dense_final_accuracies": [r["final_accuracy"] for r in by["dense"]],
            "moe_final_accuracies": [r["final_accuracy"] for r in by["moe"]],
            "moe_all_sparse_final_accuracy": final["moe_all_sparse"],
            "moe_all_sparse_final_accuracies": [r["final_accuracy"] for r in by["moe_all_sparse"]],
            "moe_all_sparse_gap_points": abs(final["moe_all_sparse"] - final["dense"]) * 100,
            "gap_points": gap * 100, "noise_points": noise * 100, "same_within_noise": gap <= 2 * noise,
            "moe_route_flip_frac_mean": mean_of("moe", "route_flip_frac_mean"),
            "moe_expert_load_max_mean": mean_of("moe", "expert_load_max_mean"),
            "moe_step_s_vs_dense": mean_of("moe", "step_s") / mean_of("dense", "step_s"),
            "curves": mean_curves(by)}


def mean_curves(by: dict[str, list[dict]]) -> list[dict]:
    """{"step", and each variant's held-out accuracy at it, the mean over its seeds} per eval step."""
    steps = sorted({s for rs in by.values() for r in rs for s, _ in r["eval_curve"]})
    out = []
    for step in steps:
        row = {"step": step}
        for name, rs in by.items():
            values = [a for r in rs for s, a in r["eval_curve"] if s == step]
            row[name] = statistics.mean(values) if values else None
        out.append(row)
    return out


def seeds_of(args: argparse.Namespace) -> list[int]:
    """The run seeds of `--seeds` (only seed 0 under --quick, unless --seeds names others)."""
    return [int(x) for x in ("0" if args.quick and args.seeds == "0,1,2" else args.seeds).split(",") if x.strip()]


def print_runs(runs: list[dict]) -> None:
    """One line a run: its name, seed, base and final held-out accuracy, seconds a step and eval curve."""
    width = max(len(r["run"]) for r in runs) + 2
    print(f"\n{'run':<{width}}{'seed':>5}{'base':>8}{'final':>8}{'s/step':>8}   eval curve")
    for run in runs:
        curve = " ".join(f"{s}:{a:.2f}" for s, a in run["eval_curve"])
        print(f"{run['run']:<{width}}{run['seed']:>5}{run['base_accuracy']:>8.1%}{run['final_accuracy']:>8.1%}"
              f"{run['step_s']:>8.2f}   {curve}")


def save(args: argparse.Namespace, name: str, runs: list[dict], headline: dict, plot_fn, started, **extra) -> None:
    """The plot to the workdir (NAME.png) and to --plot, and with --json the headline, `extra` and the runs."""
    plot_fn(runs, headline["curves"], args.workdir / f"{name}.png")
    if args.plot:
        plot_fn(runs, headline["curves"], args.plot)
    if args.json:
        results_meta.write_json(str(args.json), {**headline, **extra, "quick": args.quick, "runs": runs}, started)
        print(f"wrote {args.json}")


def plot_curves(runs: list[dict], curves: list[dict], path: pathlib.Path, *, names: dict[str, str], title: str,
                target: float | None = None) -> None:
    """One panel of held-out accuracy against step: each run's curve faint, each variant's mean over seeds
    marked (`names`: variant -> its legend label), and a dotted line at `target` if given."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    acc = fig.subplots()
    for i, (name, label) in enumerate(names.items()):
        color = f"C{i}"
        for run in (r for r in runs if r["run"] == name):
            if run["eval_curve"]:
                acc.plot(*zip(*run["eval_curve"]), color=color, alpha=0.3, linewidth=1)
        mean = [(c["step"], c[name]) for c in curves if c.get(name) is not None]
        if mean:
            acc.plot(*zip(*mean), color=color, marker="o", label=f"{label} (mean over seeds)")
    if target is not None:
        acc.axhline(target, color="grey", linestyle=":", linewidth=1)
    acc.set(title=title, xlabel="step", ylabel="held-out accuracy")
    acc.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_parser(description: str, workdir: pathlib.Path) -> argparse.ArgumentParser:
    """`learning_parser`'s arguments and those of a benchmark of several seeded runs: --seeds (default 0,1,2;
    quick 0), --workdir, --plot and repeatable --set KEY=VALUE overrides."""
    parser = learning_parser(description)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (default 0,1,2; quick 0)")
    parser.add_argument("--workdir", type=pathlib.Path, default=workdir)
    parser.add_argument("--plot", type=pathlib.Path, help="also save the plot here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    return parser


def plot(runs: list[dict], curves: list[dict], path: pathlib.Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    acc, flips = fig.subplots(1, 2)
    for i, name in enumerate(RUNS):
        color = f"C{i}"
        for run in (r for r in runs if r["run"] == name):
            if run["eval_curve"]:
                acc.plot(*zip(*run["eval_curve"]), color=color, alpha=0.3, linewidth=1)
            points = [(c["step"], c["route_flip_frac"]) for c in run["router_curves"]
                      if "route_flip_frac" in c and name == "moe"]
            if points:
                flips.plot(*zip(*points), color=f"C{2 + run['seed'] % 8}", linewidth=1, label=f"seed {run['seed']}")
        mean = [(c["step"], c[name]) for c in curves if c.get(name) is not None]
        if mean:
            acc.plot(*zip(*mean), color=color, marker="o", label=f"{name} (mean over seeds)")
    acc.set(title="tool demo: held-out accuracy", xlabel="step", ylabel="accuracy")
    flips.set(title="moe: tokens whose update top-k differs from the rollout's", xlabel="step", ylabel="fraction")
    for ax in (acc, flips):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    return run_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "moe_learning")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 10)
    overrides = {**(QUICK if args.quick else {}), "eval.every": every, **parse_overrides(args.set)}
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    from jaxflow.jobs import rl

    for config, own in RUNS.values():  # every config checked before the first run starts
        rl.check_config(load_config(str(ROOT / config), {k: str(v) for k, v in {**overrides, **own}.items()}))
    n = int(load_config(str(ROOT / CONFIG), {k: str(v) for k, v in overrides.items()}).eval.num_prompts)
    seeds = seeds_of(args)
    runs = [one_run(name, seed, steps, args.workdir, overrides) for seed in seeds for name in RUNS]
    headline = summarise(runs, n)
    print_runs(runs)
    print(f"final accuracy, mean over seeds {seeds}: dense {headline['dense_final_accuracy']:.1%}, moe "
          f"{headline['moe_final_accuracy']:.1%}; gap {headline['gap_points']:.1f} points, noise "
          f"{headline['noise_points']:.1f} points: {'within' if headline['same_within_noise'] else 'outside'} 2x "
          f"noise; route flips {headline['moe_route_flip_frac_mean']:.2%} a step; both layers sparse "
          f"{headline['moe_all_sparse_final_accuracy']:.1%}")
    save(args, "moe_learning", runs, headline, plot, started, eta=ETA, steps=steps, eval_every=every, eval_prompts=n,
         seeds=seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
