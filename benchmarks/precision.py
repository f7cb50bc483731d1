"""bfloat16 against float32 compute on the main job: the same run, from the same base model, in each dtype.

    .venv/bin/python benchmarks/precision.py --json benchmarks/results/precision.json
    .venv/bin/python benchmarks/precision.py --quick

Each compute dtype is one `python -m jaxflow.main` run of configs/arithmetic_tools_tiny.py (the README's
main job: asynchronous GRPO at eta = 4, multi-turn episodes with a calculator tool) for the same number of
steps, in a fresh workdir, sharing one base model, with `model.compute_dtype` set: the update and the JAX
engine compute in it, over float32 master weights and AdamW state (`trainer.param_dtype`'s default). Held-out
evals every `--eval-every` steps give each run's accuracy curve.

Reported: both curves; each run's final held-out accuracy; the eval's noise, the standard error of the
difference of two accuracies measured on n held-out prompts each, sqrt(2 p (1 - p) / n) at their mean p;
`same_within_noise`: the final accuracies differ by at most 2 of those standard errors; and seconds a step
in each dtype (`step_s_ratio_bf16_vs_f32`: a CPU without bfloat16 matmul units computes bfloat16 slower).

--quick runs a shorter warm start, fewer steps and fewer eval prompts (under 5 minutes here): its curves
check the plumbing, not the accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import results_meta
from async_vs_sync import QUICK, run_one

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tools_tiny.py"
DTYPES = ("float32", "bfloat16")
ETA = 4


def eval_curve(workdir: pathlib.Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every eval of a run, the base model's (step 0) first."""
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]


def difference_noise(p_a: float, p_b: float, n: int) -> float:
    """Standard error of the difference of two accuracies on n prompts each, at their mean accuracy."""
    p = (p_a + p_b) / 2
    return math.sqrt(2 * p * (1 - p) / n)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short warm start, few steps (< 5 min)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--steps", type=int, help="train steps per run (default 100, quick 10)")
    parser.add_argument("--eval-every", type=int, help="steps between held-out evals (default 20, quick 5)")
    parser.add_argument("--workdir", type=pathlib.Path, default=ROOT / "runs" / "precision")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    steps = args.steps or (10 if args.quick else 100)
    every = args.eval_every or (5 if args.quick else 20)
    stem = pathlib.Path(CONFIG).stem
    overrides = {**QUICK, "base.dir": f"runs/base/{stem}_quick"} if args.quick else {}
    overrides["eval.every"] = every
    runs = {}
    for dtype in DTYPES:
        workdir = args.workdir / dtype
        run = run_one(ETA, steps, workdir, {**overrides, "model.compute_dtype": dtype}, CONFIG)
        curve = eval_curve(workdir)
        runs[dtype] = {"compute_dtype": dtype, "steps": run["steps"], "train_s": run["train_s"],
                       "step_s": run["train_s"] / max(run["steps"], 1), "base_accuracy": run["base_accuracy"],
                       "final_accuracy": run["final_accuracy"], "eval_curve": curve,
                       "trained_tokens_per_s": run["trained_tokens_per_s"]}
    n = int(overrides.get("eval.num_prompts") or _eval_prompts())
    f32, bf16 = runs["float32"], runs["bfloat16"]
    noise = difference_noise(f32["final_accuracy"], bf16["final_accuracy"], n)
    gap = abs(bf16["final_accuracy"] - f32["final_accuracy"])
    out = {"config": CONFIG, "eta": ETA, "steps": steps, "eval_every": every, "eval_prompts": n, "quick": args.quick,
           "runs": runs, "final_accuracy_gap_points": gap * 100, "difference_noise_points": noise * 100,
           "same_within_noise": gap <= 2 * noise,
           "step_s_ratio_bf16_vs_f32": bf16["step_s"] / f32["step_s"],
           # One row per eval step: the two curves side by side (the docs' table).
           "curves": [{"step": s, "float32": a, "bfloat16": b}
                      for (s, a), (_, b) in zip(f32["eval_curve"], bf16["eval_curve"])]}
    print(f"\nbfloat16 vs float32 compute, {CONFIG} at eta = {ETA}, {steps} steps each "
          f"({'quick' if args.quick else 'full'}); held-out accuracy on {n} prompts")
    print(f"{'step':>6} {'float32':>9} {'bfloat16':>9}")
    for row in out["curves"]:
        print(f"{row['step']:>6} {row['float32']:>9.1%} {row['bfloat16']:>9.1%}")
    print(f"final gap {out['final_accuracy_gap_points']:.1f} points; standard error of the difference "
          f"{out['difference_noise_points']:.1f} points: {'within' if out['same_within_noise'] else 'NOT within'} "
          f"2 of them")
    print(f"s a step: float32 {f32['step_s']:.3f}, bfloat16 {bf16['step_s']:.3f} "
          f"({out['step_s_ratio_bf16_vs_f32']:.2f}x)")
    if args.json:
        results_meta.write_json(args.json, out, started)


def _eval_prompts() -> int:
    """The config's held-out prompt count (when no override sets it)."""
    sys.path.insert(0, str(ROOT))
    from jaxflow.config import load_config
    return int(load_config(str(ROOT / CONFIG)).eval.num_prompts)


if __name__ == "__main__":
    main()
