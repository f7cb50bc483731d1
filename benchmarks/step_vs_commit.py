"""The RL job's step time, this tree against an earlier commit of jaxflow, on this machine, runs alternated.

    .venv/bin/python benchmarks/step_vs_commit.py [--baseline 7348ee8] [--steps 101] [--runs 2]
        [--config configs/arithmetic_tiny.py] [--quick] [--json PATH]

A speed-up measured against a figure from another machine says little (a 2-core VM of one kind runs the
same code 1.2-1.4x slower than another), so this script runs both trees here, alternately (baseline,
current, baseline, current, ...), each as `python -m jaxflow.main` with the same config file name and
the same overrides (`--config.trainer.steps`, `--config.eval.every` past the last step, a fresh
workdir). The baseline's tree is the commit's files (`git archive`), kept in `--baseline-dir` (default
`runs/step_vs_commit/<commit>`), where its own first run builds its own base model by its own warm
start: both trees train the same task from their own warm start, so the table also gives what differs
in the work of a step (trained and generated tokens, response length). The baseline runs on this
checkout's `.venv`, so a commit whose dependencies differ from today's may not start (the script says
which run failed and shows its output).

From each run's metrics.jsonl: the median step (the loop's wall time between consecutive steps, over
steps `--skip` to the last, so that start-up compiles and the first batches' skew stay out), the median
update (`step_s`), trained tokens per step and the loop's trained tokens per second. The ratios are the
baseline's median step over the current tree's, per pair of runs and over the medians of all runs.

The default baseline, 7348ee8 (2026-11-22), is the tree before the component layout, the bounded train-step
compiles, packed rows attending in parts, shared prompts, micro-batches of 4 rows and the engine's decode
and prefill changes. --quick: 41 steps, one run each (plus the baseline's warm start on a first use).
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import results_meta

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = "7348ee8"
CONFIG = "configs/arithmetic_tiny.py"


def baseline_tree(commit: str, where: pathlib.Path) -> pathlib.Path:
    """The commit's files under `where` (extracted once; a later call reuses them and their runs/base)."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True,
                          text=True)
    if full.returncode != 0:
        raise SystemExit(f"--baseline {commit!r} is not a commit of this repository ({full.stderr.strip()}); "
                         "a shallow clone lacks the history: fetch it with `git fetch --unshallow`")
    marker = where / ".commit"
    if marker.exists() and marker.read_text().strip() == full.stdout.strip():
        return where
    if where.exists() and not marker.exists() and any(where.iterdir()):
        raise SystemExit(f"--baseline-dir {where} holds files this script did not extract (no .commit in it); "
                         "give a new or empty directory")
    if where.exists():  # empty, or a tree of another commit that this script extracted
        shutil.rmtree(where)
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", full.stdout.strip()], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(where, filter="data")
    marker.write_text(full.stdout.strip() + "\n")
    return where


def step_stats(metrics_path: pathlib.Path, skip: int) -> dict:
    """Medians of one run from its metrics.jsonl (train records only: the ones with a loss)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = {r["step"]: r for r in rows if "loss" in r}
    steps = sorted(s for s in train if s >= skip)
    timed = [s for s in steps if s - 1 in train]  # steps whose loop time is known (the one before is logged)
    gaps = [train[s]["time_s"] - train[s - 1]["time_s"] for s in timed]
    if len(gaps) < 5:
        raise SystemExit(f"{metrics_path}: only {len(gaps)} steps after step {skip}; use more --steps")
    kept = [train[s] for s in steps]
    tokens = [r["trained_tokens"] for r in kept]
    return {"median_step_s": statistics.median(gaps), "mean_step_s": statistics.fmean(gaps),
            "median_update_s": statistics.median(r["step_s"] for r in kept),
            "trained_tokens_per_step": statistics.median(tokens),
            "consumed_tokens_per_step": statistics.median(r["consumed_tokens"] for r in kept),
            "response_tokens_mean": statistics.fmean(r["response_tokens_mean"] for r in kept),
            "trained_tokens_per_s": sum(train[s]["trained_tokens"] for s in timed) / sum(gaps),
            "steps_measured": len(gaps)}


def run_one(tree: pathlib.Path, config: str, steps: int, workdir: pathlib.Path, skip: int) -> dict:
    cmd = [sys.executable, "-m", "jaxflow.main", f"--config={config}", f"--config.trainer.steps={steps}",
           f"--config.eval.every={10 * steps}", f"--config.workdir={workdir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run in {tree} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return {**step_stats(workdir / "metrics.jsonl", skip), "wall_s": time.perf_counter() - start}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the earlier commit to compare against")
    parser.add_argument("--baseline-dir", default=None, help="where its files go (default runs/step_vs_commit/C)")
    parser.add_argument("--config", default=CONFIG, help="config file, the same path in both trees")
    parser.add_argument("--steps", type=int, default=101)
    parser.add_argument("--runs", type=int, default=2, help="runs of each tree, alternated")
    parser.add_argument("--skip", type=int, default=20, help="steps left out of the medians at the start")
    parser.add_argument("--quick", action="store_true", help="41 steps, one run each")
    parser.add_argument("--json", default=None, help="write the figures to this path")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    if args.quick:
        args.steps, args.runs = 41, 1
    if args.steps < args.skip + 6 or args.runs < 1:
        parser.error(f"--steps must be at least --skip + 6 ({args.skip + 6}) and --runs at least 1")
    if not (ROOT / args.config).is_file():
        parser.error(f"--config {args.config} is not a file of this tree")
    where = pathlib.Path(args.baseline_dir or ROOT / "runs" / "step_vs_commit" / args.baseline).resolve()
    old = baseline_tree(args.baseline, where)
    if not (old / args.config).is_file():
        raise SystemExit(f"the baseline {args.baseline} has no {args.config}")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxflow-step-vs-commit-"))
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    try:
        for i in range(args.runs):
            for name, tree in (("baseline", old), ("current", ROOT)):
                print(f"run {i + 1}/{args.runs}: {name} ({tree}), {args.steps} steps ...", flush=True)
                r = run_one(tree, args.config, args.steps, scratch / f"{name}-{i}", args.skip)
                runs[name].append(r)
                print(f"  median step {r['median_step_s']:.3f} s, update {r['median_update_s']:.3f} s, "
                      f"{r['trained_tokens_per_step']:.0f} trained tokens a step ({r['wall_s']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    pair_ratios = [b["median_step_s"] / c["median_step_s"] for b, c in zip(runs["baseline"], runs["current"])]
    med = {name: statistics.median(r["median_step_s"] for r in rs) for name, rs in runs.items()}
    ratio = med["baseline"] / med["current"]
    tok = {name: statistics.median(r["trained_tokens_per_s"] for r in rs) for name, rs in runs.items()}
    print(f"\n{args.config}, {args.steps} steps, medians over steps {args.skip}-{args.steps - 1}, "
          f"{args.runs} run(s) each, alternated")
    print(f"{'tree':<22}{'run':>4}{'step s':>9}{'update s':>10}{'trained tok/step':>18}{'response':>10}"
          f"{'trained tok/s':>15}")
    for name, label in (("baseline", f"{args.baseline} (baseline)"), ("current", "this tree")):
        for i, r in enumerate(runs[name]):
            print(f"{label:<22}{i + 1:>4}{r['median_step_s']:>9.3f}{r['median_update_s']:>10.3f}"
                  f"{r['trained_tokens_per_step']:>18.0f}{r['response_tokens_mean']:>10.1f}"
                  f"{r['trained_tokens_per_s']:>15.0f}")
    print(f"step: this tree {ratio:.2f}x faster (medians {med['baseline']:.3f} / {med['current']:.3f} s; "
          f"per pair {', '.join(f'{x:.2f}x' for x in pair_ratios)}); "
          f"trained tokens/s {tok['current'] / tok['baseline']:.2f}x")
    if args.json:
        out = {"baseline": args.baseline, "config": args.config, "steps": args.steps, "skip": args.skip,
               "runs": runs, "median_step_s": med, "step_ratio_baseline_vs_current": ratio,
               "step_ratio_per_pair": pair_ratios,
               "trained_tokens_per_s_ratio_current_vs_baseline": tok["current"] / tok["baseline"]}
        results_meta.write_json(args.json, out, meta_started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
