"""Train-rollout mismatch, the learning check: bfloat16 rollouts under a float32 update, with no correction and
with each mismatch correction of the loss, against float32 rollouts.

    .venv/bin/python benchmarks/mismatch_learning.py --json benchmarks/results/mismatch_learning.json
    .venv/bin/python benchmarks/mismatch_learning.py --quick --corrections none

Each run is one `python -m jaxflow.main` run (`async_vs_sync.run_one`) at eta = 4 for the same number of
steps, in a fresh workdir, with the same seed and, per task, one shared base model. Two tasks: the tool demo
(configs/arithmetic_tools_tiny.py, `tools`) and the single-turn task (configs/arithmetic_tiny.py,
`single_turn`). The update always computes in float32 (`model.compute_dtype`) with pi_prox recomputed by the
trainer at the step's starting weights (`trainer.prox = "recompute"`), so that the behaviour weight
pi_prox / mu carries the engine's mismatch. Per task:

    reference   rollouts in float32 (`rollout.compute_dtype = "float32"`), no correction
    none        rollouts in bfloat16, no correction
    tis, mis, icepop, seq_mask
                rollouts in bfloat16, `trainer.loss.mismatch` set to that correction (its bounds
                `trainer.loss.mismatch_low` / `mismatch_high` at their defaults, or as --set gives them)

The evaluator's engine computes in the rollout dtype, so a bfloat16 run's held-out evals are bfloat16 greedy
answers: the policy as its rollouts serve it.

Reported per run: the held-out accuracy curve (evals every `--eval-every` steps, the base's first), the final
held-out accuracy, the per-step mismatch metrics of metrics.jsonl as curves (`mismatch_masked_frac`,
`mismatch_truncated_frac`, `mismatch_kl`, `mismatch_ratio_max`, where the loss reports them, and the
behaviour weight's `behav_weight_mean`, `behav_weight_max`, `behav_capped_frac`) with their means, and
seconds a step (the training loop's wall time less its evals, per step). Per task and run: the
final accuracy's gap to the reference in points, the eval's noise (`precision.difference_noise`: the standard
error of the difference of two accuracies on n held-out prompts each) and `same_within_noise` (the gap is at
most 2 of them). The headline figures are flat keys (`tools_none_final_accuracy`,
`single_turn_icepop_gap_points`, ...); `runs`, `curves` and `summary` hold the detail. A plot of the
accuracy and mismatch curves goes to the workdir.

Every run's config goes through the job's config check before the first run starts (a bad --set is named
then, not after an hour of runs).

--quick runs a shorter warm start, fewer steps and fewer eval prompts: its curves check the plumbing, not the
accuracy. `--quick --corrections none` (4 runs) takes about 5 minutes on 2 cores once the quick bases are
built; all 12 runs about three times that.
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
TASKS = {"tools": "configs/arithmetic_tools_tiny.py", "single_turn": "configs/arithmetic_tiny.py"}
CORRECTIONS = ("none", "tis", "mis", "icepop", "seq_mask")
ETA = 4
# What metrics.jsonl holds per step about the mismatch (the loss's corrections write them).
MISMATCH_METRICS = ("mismatch_masked_frac", "mismatch_truncated_frac", "mismatch_kl", "mismatch_ratio_max")
# The behaviour weight pi_prox / mu (staleness and mismatch together), which every run reports.
BEHAVIOUR_METRICS = ("behav_weight_mean", "behav_weight_max", "behav_capped_frac")


class RunRefused(SystemExit):
    """A run's config does not pass the job's config check (a bad --set, say): named before any run starts."""


def run_overrides(correction: str | None) -> dict:
    """The overrides of one run: correction None is the float32-rollout reference, else bfloat16 rollouts
    with that correction."""
    return {"model.compute_dtype": "float32", "trainer.prox": "recompute",
            "rollout.compute_dtype": "float32" if correction is None else "bfloat16",
            "trainer.loss.mismatch": correction or "none"}


def check_configs(tasks: list[str], corrections: list[str], base: dict) -> dict[str, dict]:
    """Loads and checks every run's config before any run starts; per task {"eval_prompts": n}. RunRefused
    names the run a config check refuses."""
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import ConfigError, load_config
    from jaxflow.jobs import rl

    info = {}
    for task in tasks:
        path = str(ROOT / TASKS[task])
        plain = load_config(path, {k: str(v) for k, v in base.items()})
        for correction in (None, *corrections):
            overrides = {**base, **run_overrides(correction)}
            try:
                rl.check_config(load_config(path, {k: str(v) for k, v in overrides.items()}))
            except ConfigError as e:
                what = "the reference" if correction is None else f"trainer.loss.mismatch={correction}"
                raise RunRefused(f"mismatch_learning: {TASKS[task]} refuses {what}: {e}") from None
        info[task] = {"eval_prompts": int(plain.eval.num_prompts)}
    return info


def mismatch_curves(workdir: pathlib.Path) -> list[dict]:
    """{"step", and each of MISMATCH_METRICS and BEHAVIOUR_METRICS the step reported} for every train step of
    a run."""
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [{"step": r["step"], **{k: r[k] for k in (*MISMATCH_METRICS, *BEHAVIOUR_METRICS) if k in r}}
            for r in records if "loss" in r]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def one_run(task: str, name: str, correction: str | None, steps: int, workdir: pathlib.Path,
            overrides: dict) -> dict:
    """Runs one of a task's runs (`name`: "reference" or a correction) and reads its figures."""
    run_dir = workdir / task / name
    run = run_one(ETA, steps, run_dir, {**overrides, **run_overrides(correction)}, TASKS[task])
    curves = mismatch_curves(run_dir)
    return {"task": task, "run": name, "config": TASKS[task],
            "rollout_compute_dtype": "float32" if correction is None else "bfloat16",
            "mismatch": correction or "none",
            "steps": run["steps"], "train_s": run["train_s"], "step_s": run["train_s"] / max(run["steps"], 1),
            "process_s": run["process_s"], "base_accuracy": run["base_accuracy"],
            "final_accuracy": run["final_accuracy"], "eval_curve": eval_curve(run_dir),
            "mismatch_curves": curves,
            **{f"{k}_mean": _mean(curves, k) for k in (*MISMATCH_METRICS, *BEHAVIOUR_METRICS)}}


def compare(runs: dict[str, dict], n: int) -> None:
    """Adds each run's gap to its task's reference (points), the eval noise of that difference and
    `same_within_noise` to the run's figures."""
    ref = runs["reference"]["final_accuracy"]
    for run in runs.values():
        if run["run"] == "reference":
            continue
        noise = difference_noise(ref, run["final_accuracy"], n)
        gap = abs(run["final_accuracy"] - ref)
        run.update(gap_points=gap * 100, noise_points=noise * 100, same_within_noise=gap <= 2 * noise)


def flat_figures(runs: dict[str, dict[str, dict]]) -> dict:
    """The headline figures as flat keys: `<task>_<run>_<figure>`."""
    out = {}
    for task, by_run in runs.items():
        for name, run in by_run.items():
            for key in ("final_accuracy", "step_s", "gap_points", "noise_points", "same_within_noise",
                        "mismatch_kl_mean", "mismatch_masked_frac_mean", "mismatch_truncated_frac_mean",
                        "behav_weight_max_mean"):
                if key in run:
                    out[f"{task}_{name}_{key}"] = run[key]
    return out


SUMMARY_KEYS = ("task", "run", "rollout_compute_dtype", "mismatch", "final_accuracy", "gap_points", "noise_points",
                "same_within_noise", "step_s", "mismatch_masked_frac_mean", "mismatch_truncated_frac_mean",
                "mismatch_kl_mean", "behav_weight_max_mean")


def summary(runs: dict[str, dict[str, dict]]) -> list[dict]:
    """One row per task and run (SUMMARY_KEYS; None where a run has no such figure): the docs' table."""
    return [{k: run.get(k) for k in SUMMARY_KEYS} for by_run in runs.values() for run in by_run.values()]


def plot(runs: dict[str, dict[str, dict]], path: pathlib.Path) -> None:
    """Per task (a column): held-out accuracy, the masked (or truncated) fraction, mismatch_kl and the largest
    behaviour weight per step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(runs), 13))
    axes = fig.subplots(4, len(runs), squeeze=False)
    for col, (task, by_run) in enumerate(runs.items()):
        acc, frac, kl, weight = (axes[row][col] for row in range(4))
        for name, run in by_run.items():
            steps, values = zip(*run["eval_curve"]) if run["eval_curve"] else ((), ())
            acc.plot(steps, values, marker="o", label=name)
            key = "mismatch_truncated_frac" if name == "tis" else "mismatch_masked_frac"
            for ax, metric in ((frac, key), (kl, "mismatch_kl"), (weight, "behav_weight_max")):
                points = [(r["step"], r[metric]) for r in run["mismatch_curves"] if r.get(metric) is not None]
                if points:
                    ax.plot(*zip(*points), label=name)
        acc.set(title=f"{task}: held-out accuracy", xlabel="step", ylabel="accuracy")
        frac.set(title=f"{task}: tokens masked (tis: truncated)", xlabel="step", ylabel="fraction")
        kl.set(title=f"{task}: mismatch KL", xlabel="step", ylabel="KL(rollout || trainer)")
        weight.set(title=f"{task}: largest behaviour weight pi_prox / mu", xlabel="step", ylabel="weight")
        for ax in (acc, frac, kl, weight):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def learning_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every learning check takes: --quick, --json, --steps (default 40, quick 6) and
    --eval-every (default 10, quick 3)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="short warm start, few steps (plumbing only)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--steps", type=int, help="train steps per run (default 40, quick 6)")
    parser.add_argument("--eval-every", type=int, help="steps between held-out evals (default 10, quick 3)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = learning_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {', '.join(TASKS)}")
    parser.add_argument("--corrections", default=",".join(CORRECTIONS),
                        help=f"comma-separated subset of {', '.join(CORRECTIONS)} (the reference always runs)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable), e.g. trainer.loss.mismatch_high=5.0")
    parser.add_argument("--workdir", type=pathlib.Path, default=ROOT / "runs" / "mismatch_learning")
    return parser


def _subset(parser, flag: str, text: str, valid) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in chosen if s not in valid]
    if bad or not chosen:
        parser.error(f"{flag} takes a comma-separated subset of {', '.join(valid)}; got {text!r}")
    return list(dict.fromkeys(chosen))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    tasks = _subset(parser, "--tasks", args.tasks, TASKS)
    corrections = _subset(parser, "--corrections", args.corrections, CORRECTIONS)
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 10)
    base: dict = {"eval.every": every}
    base.update(parse_overrides(args.set))
    info = check_configs(tasks, corrections, {**QUICK, **base} if args.quick else base)
    runs: dict[str, dict[str, dict]] = {}
    for task in tasks:
        stem = pathlib.Path(TASKS[task]).stem
        overrides = {**QUICK, "base.dir": f"runs/base/{stem}_quick", **base} if args.quick else dict(base)
        runs[task] = {"reference": one_run(task, "reference", None, steps, args.workdir, overrides)}
        for correction in corrections:
            runs[task][correction] = one_run(task, correction, correction, steps, args.workdir, overrides)
        compare(runs[task], info[task]["eval_prompts"])

    out = {"tasks": {t: TASKS[t] for t in tasks}, "eta": ETA, "steps": steps, "eval_every": every,
           "eval_prompts": {t: info[t]["eval_prompts"] for t in tasks}, "quick": args.quick,
           "corrections": corrections, "overrides": base, **flat_figures(runs),
           "summary": summary(runs),
           # One row per task and eval step: every run's held-out accuracy side by side.
           "curves": [{"task": task, "step": step,
                       **{name: dict(run["eval_curve"]).get(step) for name, run in by_run.items()}}
                      for task, by_run in runs.items() for step, _ in by_run["reference"]["eval_curve"]],
           "runs": runs}

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"\nbfloat16 rollouts, float32 update, eta = {ETA}, {steps} steps a run "
          f"({'quick' if args.quick else 'full'}); gap: final held-out accuracy against float32 rollouts")
    print(f"{'task':<12} {'run':<10} {'final acc':>9} {'gap pts':>8} {'noise':>6} {'within':>7} {'masked':>7} "
          f"{'trunc':>7} {'mm KL':>9} {'w max':>7} {'s/step':>7}")
    for row in out["summary"]:
        within = "-" if row["same_within_noise"] is None else ("yes" if row["same_within_noise"] else "NO")
        print(f"{row['task']:<12} {row['run']:<10} {pct(row['final_accuracy']):>9} "
              f"{num(row['gap_points'], '.1f'):>8} {num(row['noise_points'], '.1f'):>6} {within:>7} "
              f"{pct(row['mismatch_masked_frac_mean']):>7} {pct(row['mismatch_truncated_frac_mean']):>7} "
              f"{num(row['mismatch_kl_mean'], '.2e'):>9} {num(row['behav_weight_max_mean'], '.2f'):>7} "
              f"{row['step_s']:>7.2f}")
    for task, by_run in runs.items():
        names = list(by_run)
        print(f"\n{task}: held-out accuracy ({info[task]['eval_prompts']} prompts)")
        print(f"{'step':>6} " + " ".join(f"{n:>10}" for n in names))
        for row in (r for r in out["curves"] if r["task"] == task):
            print(f"{row['step']:>6} " + " ".join(f"{pct(row[n]):>10}" for n in names))
    args.workdir.mkdir(parents=True, exist_ok=True)
    plot(runs, args.workdir / "mismatch_learning.png")
    print(f"plot: {args.workdir / 'mismatch_learning.png'}")
    if args.json:
        results_meta.write_json(args.json, out, started)


if __name__ == "__main__":
    main()
