"""On-policy distillation against RL from the same base: steps and seconds to a held-out accuracy target.

    .venv/bin/python benchmarks/distill_learning.py --json benchmarks/results/distill_learning.json
    .venv/bin/python benchmarks/distill_learning.py --quick

The tool demo (configs/arithmetic_tools_tiny.py) at eta = 4 throughout, every run in a fresh workdir:

    teacher  RL from the warm-started base for `--teacher-steps` steps (once; its exported policy is reused
             while its run directory holds it): the trained tool-demo policy
    distill  the same base as student, `trainer.distill.teacher` = the teacher's export, pure distillation
             (coef 1, task_coef 0: the task's rewards are computed and reported but do not move the policy)
    rl       the same base, RL on the task's reward, as the teacher was trained

`distill` and `rl` run once per seed of `--seeds` for the same number of steps, with held-out evals every
`--eval-every` steps (the base's first). Reported per run: the eval curve, the first eval step at or above
`--target` held-out accuracy and the training seconds until then (the loop's wall time less its evals), the
final accuracy and seconds a step. The headline: each method's median steps and seconds to the target over
seeds (a run that never reaches it counts as not reached), and distillation's over RL's. A plot of the curves
goes to the workdir (and `--plot PATH`).

--quick runs a shorter warm start, a short teacher and few steps: it checks the plumbing, not the figures.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import results_meta
from async_vs_sync import QUICK, parse_overrides, run_one
from moe_learning import mean_curves, plot_curves, print_runs, run_parser, save, seeds_of
from precision import eval_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tools_tiny.py"
METHODS = ("distill", "rl")
ETA = 4


def records_of(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def train_seconds(records: list[dict]) -> dict[int, float]:
    """{step: training seconds from the first step's start to that step's end}: the record's clock less the
    base's eval (before step 0) and every eval run after an earlier step."""
    evals = [r for r in records if "eval_accuracy" in r]
    start = next((r["time_s"] for r in evals if r["step"] == 0), 0.0)
    out = {}
    for r in records:
        if "loss" in r:
            eval_s = sum(e.get("eval_s", 0.0) for e in evals if 0 < e["step"] < r["step"])
            out[r["step"]] = r["time_s"] - start - eval_s
    return out


def to_target(curve: list[tuple[int, float]], seconds: dict[int, float],
              target: float) -> tuple[int | None, float | None]:
    """(the first eval step whose held-out accuracy is at least `target`, the training seconds to its end);
    (None, None) if no eval reaches it. An eval at step s follows train step s, so it took s + 1 updates."""
    for step, accuracy in curve:
        if step > 0 and accuracy >= target:
            return step + 1, seconds.get(step)
    return None, None


def teacher_export(steps: int, workdir: pathlib.Path, overrides: dict) -> tuple[pathlib.Path, dict]:
    """The teacher's exported policy: RL from the base for `steps` steps, reused while its run holds it."""
    run_dir = workdir / f"teacher_{steps}"
    export, result = run_dir / "export", run_dir / "result.json"
    if not (export / "config.json").exists() or not result.exists():
        run_one(ETA, steps, run_dir, {**overrides, "seed": 100}, CONFIG)
    summary = json.loads(result.read_text())
    return export, {"steps": steps, "base_accuracy": summary["base_accuracy"],
                    "final_accuracy": summary["final_accuracy"], "dir": str(run_dir)}


def one_run(method: str, seed: int, steps: int, workdir: pathlib.Path, overrides: dict, teacher: pathlib.Path,
            target: float) -> dict:
    run_dir = workdir / f"{method}_seed{seed}"
    more = {"trainer.distill.teacher": teacher, "trainer.distill.coef": 1.0,
            "trainer.distill.task_coef": 0.0} if method == "distill" else {}
    run = run_one(ETA, steps, run_dir, {**overrides, **more, "seed": seed}, CONFIG)
    records = records_of(run_dir)
    curve = eval_curve(run_dir)
    steps_to, seconds_to = to_target(curve, train_seconds(records), target)
    kl = [r["distill_kl"] for r in records if "distill_kl" in r]
    return {"run": method, "seed": seed, "steps": run["steps"], "train_s": run["train_s"],
            "step_s": run["train_s"] / max(run["steps"], 1), "base_accuracy": run["base_accuracy"],
            "final_accuracy": run["final_accuracy"], "eval_curve": curve, "steps_to_target": steps_to,
            "seconds_to_target": seconds_to, "target": target, "distill_kl_first": kl[0] if kl else None,
            "distill_kl_last": kl[-1] if kl else None}


def median_or_none(values: list) -> float | None:
    """The median over seeds, a seed that never reached the target counting as infinitely late: None (not
    reached) when that median is one of them."""
    median = statistics.median([float("inf") if v is None else v for v in values])
    return None if median == float("inf") else median


def summarise(runs: list[dict], target: float) -> dict:
    by = {m: [r for r in runs if r["run"] == m] for m in METHODS}
    out: dict = {"target": target, "curves": mean_curves(by)}
    for m, rs in by.items():
        out[f"{m}_steps_to_target"] = median_or_none([r["steps_to_target"] for r in rs])
        out[f"{m}_seconds_to_target"] = median_or_none([r["seconds_to_target"] for r in rs])
        out[f"{m}_reached"] = sum(r["steps_to_target"] is not None for r in rs)
        out[f"{m}_final_accuracy"] = statistics.mean(r["final_accuracy"] for r in rs)
        out[f"{m}_step_s"] = statistics.median(r["step_s"] for r in rs)
    for unit in ("steps", "seconds"):
        d, r = out[f"distill_{unit}_to_target"], out[f"rl_{unit}_to_target"]
        out[f"distill_{unit}_vs_rl"] = d / r if d is not None and r else None
    out["distill_step_s_vs_rl"] = out["distill_step_s"] / out["rl_step_s"]
    return out


# The plot's legend label of each variant.
NAMES = {"distill": "on-policy distillation", "rl": "RL (the task's reward)"}


def plot(runs: list[dict], curves: list[dict], path: pathlib.Path) -> None:
    plot_curves(runs, curves, path, names=NAMES, title='tool demo: distilling the trained policy vs RL, same base',
                target=runs[0]["target"] if runs else None)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = run_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "distill_learning")
    parser.add_argument("--teacher-steps", type=int, help="the teacher's RL steps (default 60, quick 6)")
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy target (default 0.95)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.target <= 1:
        raise SystemExit(f"--target must be in (0, 1], got {args.target}")
    started = results_meta.begin(argv)
    steps = args.steps or (6 if args.quick else 40)
    every = args.eval_every or (3 if args.quick else 4)
    teacher_steps = args.teacher_steps or (6 if args.quick else 60)
    overrides = {**(QUICK if args.quick else {}), "eval.every": every, **parse_overrides(args.set)}
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    from jaxflow.jobs import rl

    config = load_config(str(ROOT / CONFIG), {k: str(v) for k, v in overrides.items()})
    rl.check_config(config)
    teacher, teacher_summary = teacher_export(teacher_steps, args.workdir, {**overrides, "eval.every": 1000})
    print(f"teacher: {teacher} ({teacher_steps} RL steps, held-out accuracy {teacher_summary['base_accuracy']:.1%} "
          f"-> {teacher_summary['final_accuracy']:.1%})", flush=True)
    seeds = seeds_of(args)
    runs = [one_run(m, seed, steps, args.workdir, overrides, teacher, args.target) for seed in seeds for m in METHODS]
    headline = summarise(runs, args.target)
    print_runs(runs)

    def show(value, fmt):
        return "not reached" if value is None else format(value, fmt)

    print(f"\n{'method':<10}{'steps to ' + format(args.target, '.0%'):>14}{'seconds to it':>15}{'s/step':>8}"
          f"{'final':>8}  (medians over seeds {seeds})")
    for m in METHODS:
        print(f"{m:<10}{show(headline[f'{m}_steps_to_target'], 'g'):>14}"
              f"{show(headline[f'{m}_seconds_to_target'], '.1f'):>15}{headline[f'{m}_step_s']:>8.2f}"
              f"{headline[f'{m}_final_accuracy']:>8.1%}")
    print(f"distillation over RL: steps to the target {show(headline['distill_steps_vs_rl'], '.2f')}, seconds "
          f"{show(headline['distill_seconds_vs_rl'], '.2f')}, seconds a step {headline['distill_step_s_vs_rl']:.2f}")
    save(args, "distill_learning", runs, headline, plot, started, eta=ETA, steps=steps, eval_every=every,
         eval_prompts=int(config.eval.num_prompts), seeds=seeds, teacher=teacher_summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
