"""Asynchronous vs synchronous RL on the same hardware: one config, eta in {0, 1, 4}, same step count.

    .venv/bin/python benchmarks/async_vs_sync.py [--quick] [--json PATH] [--steps N] [--etas 0,1,4]
        [--config configs/arithmetic_tools_tiny.py] [--set rollout.env.options.latency_s=0.2 ...]

Each eta is a separate `python -m jaxflow.main` run of the RL job (eta = 0 is the synchronous baseline
through the same code), in a fresh workdir, sharing one base model. From each run's metrics.jsonl and
result.json it reports: effective throughput (trained tokens per second of the training loop, less the
time the loop spent on held-out evals, which every eta pays alike and which is not training), time
to a reward target (the first step where the train reward, averaged over the last `--window` steps,
reaches it: the first batches of an async run lean to the short problems that finish first, so a
short window fires early), final held-out accuracy, the idle fractions of trainer and rollout, the
cores the job kept busy (its CPU time over the loop, evals excluded, per second of the loop),
and the staleness histogram of trained tokens. It prints one table, writes one plot (reward vs time per
eta, and the staleness histograms) and, with --json, the figures including
`throughput_ratio_eta4_vs_eta0`, `final_accuracy_gap_points` and `throughput_ratio_cpu_bound_eta4_vs_eta0`:
eta = 4's trained tokens over its CPU time spread on every core, against eta = 0's throughput, i.e. the
most that overlapping eta = 4's work better could give on this machine. CPU time is the job process's and
its children's (embedded JAX engines and trainer, isolated environments and agents, reward workers).

--quick uses a shorter warm start, fewer steps and fewer eval prompts (under 5 minutes here); its
accuracies are not meaningful, its throughput ratio is. --config picks any config file (default
configs/arithmetic_tiny.py), --set adds overrides to every run (e.g. a tool's latency).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import results_meta

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/arithmetic_tiny.py"
QUICK = {"base.steps": 300, "eval.num_prompts": 64, "eval.every": 1000, "checkpoint.every": 1000}


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` items -> {dotted key: text} (a leading "config." dropped), the overrides a benchmark
    passes to every run; an item without "=" is an error naming it."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.param_dtype=bfloat16")
        overrides[key.removeprefix("config.")] = value
    return overrides


def run_one(eta: int, steps: int, workdir: pathlib.Path, overrides: dict, config: str = CONFIG) -> dict:
    shutil.rmtree(workdir, ignore_errors=True)
    args = {**overrides, "trainer.eta": eta, "trainer.steps": steps, "workdir": workdir}
    cmd = [sys.executable, "-m", "jaxflow.main", f"--config={config}",
           *[f"--config.{k}={v}" for k, v in args.items()]]
    print(f"eta={eta}: {' '.join(cmd[2:])}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"eta={eta} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    result = json.loads((workdir / "result.json").read_text())
    steps_ = [r for r in records if "loss" in r]
    staleness: dict[str, int] = {}
    for r in steps_:
        for k, n in r.get("staleness", {}).items():
            staleness[k] = staleness.get(k, 0) + n
    tokens = sum(r["trained_tokens"] for r in steps_)
    train_s = result["wall_s"] - result.get("eval_s", 0.0)
    # The job's own CPU time over the loop, evals excluded: how many cores the training kept busy, and the
    # throughput it would reach if that CPU work kept every core busy all the time (its floor).
    cpu_s, cores = result["cpu_s"] - result["eval_cpu_s"], result["cores"]
    return {"eta": eta, "steps": len(steps_), "wall_s": result["wall_s"], "eval_s": result.get("eval_s", 0.0),
            "train_s": train_s, "process_s": time.monotonic() - start,
            "trained_tokens": tokens, "trained_tokens_per_s": tokens / train_s,
            "cpu_s": cpu_s, "cores": cores, "cores_busy": cpu_s / train_s,
            "cpu_bound_tokens_per_s": tokens / (cpu_s / cores),
            "final_accuracy": result["final_accuracy"], "base_accuracy": result["base_accuracy"],
            "trainer_idle_frac": steps_[-1]["trainer_idle_frac"],
            "rollout_idle_frac": steps_[-1]["rollout_idle_frac"],
            "staleness_histogram": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
            "curve": [(r["time_s"], r["step"], r["reward_mean"]) for r in steps_]}


def time_to_target(curve, target: float, window: int) -> float | None:
    rewards = [c[2] for c in curve]
    for i in range(window - 1, len(curve)):
        if sum(rewards[i - window + 1:i + 1]) / window >= target:
            return curve[i][0] - curve[0][0]
    return None


def plot(runs: list[dict], path: pathlib.Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    ax, bx = fig.subplots(1, 2)
    for r in runs:
        t0 = r["curve"][0][0]
        ax.plot([c[0] - t0 for c in r["curve"]], [c[2] for c in r["curve"]], label=f"eta={r['eta']}")
        hist = r["staleness_histogram"]
        total = max(sum(hist.values()), 1)
        bx.bar([int(k) + 0.25 * runs.index(r) for k in hist], [n / total for n in hist.values()], width=0.25,
               label=f"eta={r['eta']}")
    ax.set(xlabel="training loop time (s)", ylabel="train reward", title="reward vs time")
    bx.set(xlabel="staleness (versions)", ylabel="fraction of trained tokens", title="staleness")
    ax.legend()
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests can parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few steps (< 5 min)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--steps", type=int, help="train steps per run (default 150, quick 25)")
    parser.add_argument("--etas", default="0,1,4")
    parser.add_argument("--reward-target", type=float, default=0.5)
    parser.add_argument("--window", type=int, help="steps averaged for the reward target (default steps // 6)")
    parser.add_argument("--workdir", type=pathlib.Path, default=ROOT / "runs" / "async_vs_sync")
    parser.add_argument("--config", default=CONFIG, help="the config file every run uses")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    steps = args.steps or (25 if args.quick else 150)
    stem = pathlib.Path(args.config).stem
    overrides = {**QUICK, "base.dir": f"runs/base/{stem}_quick"} if args.quick else {}
    overrides.update(parse_overrides(args.set))
    etas = [int(e) for e in args.etas.split(",")]
    runs = [run_one(eta, steps, args.workdir / f"eta{eta}", overrides, args.config) for eta in etas]
    window = args.window or max(steps // 6, 1)
    for r in runs:
        r["time_to_target_s"] = time_to_target(r["curve"], args.reward_target, window)
    print(f"\nasync vs sync, {steps} steps each ({'quick' if args.quick else 'full'}), reward target "
          f"{args.reward_target} ({window}-step mean)")
    print(f"{'eta':>4} {'tok/s':>9} {'loop s':>8} {'evals s':>8} {'to target s':>12} {'final acc':>10} "
          f"{'idle train':>11} {'idle roll':>10} {'cores busy':>11}  staleness (fraction of tokens)")
    for r in runs:
        hist = r["staleness_histogram"]
        total = max(sum(hist.values()), 1)
        target = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
        acc = "-" if r["final_accuracy"] is None else f"{r['final_accuracy']:.1%}"
        print(f"{r['eta']:>4} {r['trained_tokens_per_s']:>9.0f} {r['wall_s']:>8.0f} {r['eval_s']:>8.0f} "
              f"{target:>12} {acc:>10} {r['trainer_idle_frac']:>11.0%} {r['rollout_idle_frac']:>10.0%} "
              f"{r['cores_busy']:>6.2f} of {r['cores']:<2}  "
              + " ".join(f"{k}:{n / total:.0%}" for k, n in hist.items()))
    by_eta = {r["eta"]: r for r in runs}
    out = {"config": args.config, "overrides": overrides, "steps": steps, "quick": args.quick,
           "reward_target": args.reward_target, "window": window, "runs": runs}
    if 0 in by_eta and 4 in by_eta:
        out["throughput_ratio_eta4_vs_eta0"] = (by_eta[4]["trained_tokens_per_s"]
                                                / by_eta[0]["trained_tokens_per_s"])
        out["final_accuracy_gap_points"] = abs(by_eta[4]["final_accuracy"] - by_eta[0]["final_accuracy"]) * 100
        out["throughput_ratio_cpu_bound_eta4_vs_eta0"] = (by_eta[4]["cpu_bound_tokens_per_s"]
                                                          / by_eta[0]["trained_tokens_per_s"])
        print(f"\nthroughput eta=4 / eta=0: {out['throughput_ratio_eta4_vs_eta0']:.2f}x (goal >= 2); final "
              f"accuracy gap {out['final_accuracy_gap_points']:.1f} points (goal <= 3)")
        print(f"eta=4's CPU work on all {by_eta[4]['cores']} cores all the time: at most "
              f"{out['throughput_ratio_cpu_bound_eta4_vs_eta0']:.2f}x (more overlap cannot pass it; less work can)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    plot(runs, args.workdir / "async_vs_sync.png")
    print(f"plot: {args.workdir / 'async_vs_sync.png'}")
    if args.json:
        results_meta.write_json(args.json, out, meta_started)


if __name__ == "__main__":
    main()
