"""Rollout coordination at pod scale, simulated: synchronous vs AReaL-style vs jaxflow's strategies.

    .venv/bin/python benchmarks/simulate.py [--quick] [--json PATH] [--plot PATH] [--eta 4,1]

--quick: 10 train steps per simulated run instead of 16, 20-step calibration runs instead of 60, eta 4
only and one workload seed (a smoke check: its ratios vary by about 10%).

Three parts, one run:

1. Calibration. Runs the real CPU job (configs/arithmetic_tiny.py:coordinated: two JAX engines, one
   coordinator, the real trainer) for a few steps, fits the simulator's engine, trainer and length
   models to that run's trace (`jaxflow.sim.presets.from_trace`), simulates the same config, and
   compares steady-state consumed tokens/s. Twice: with 64 requests per engine (the trainer is the
   bottleneck) and with 6 (the engines are). calibration_error = the larger |simulated - measured| /
   measured of the two.
2. Scale. The reasoning preset (`jaxflow.sim.presets.reasoning`: ~8B model, H100-class instances,
   lengths with median ~1.5k and a tail to 32k) at 8, 64 and 512 instances, the same eta for all:
   - sync: eta = 0, every instance syncs each version;
   - areal: eta-bounded admission (Reserve), least-loaded placement in arrival order, every instance
     syncs each version, partial rollouts kept across syncs; no other coordination;
   - jaxflow: `Coordination()` defaults (throughput routing, oldest-first queue, migration, selective
     sync, stuck retry), which drop no data;
   - jaxflow+release: the same with stuck buffers released (their slowest groups are dropped as
     surplus, a bias toward short responses; the table says how many).
   The simulator runs the real trajectory service and the real coordinator; only engines and trainer
   are modelled. Up to 64 instances each figure is the median over 3 workload seeds (`--seeds`): with
   few groups per step the long tail makes single runs vary by about 10%.

3. The tail floor (`jaxflow.sim.bounds`) per size and eta: the shortest mean step any strategy that
   trains every sample can reach under the staleness bound, beside the simulated steps; AReaL-style's
   step over the floor is the most such a strategy can gain ("ceiling vs areal").

Prints the tables; --json writes every figure, with ratio_vs_areal_64 and ratio_vs_sync_64 (jaxflow at
the first eta given, 4 by default: the arithmetic config's own), the same for every eta in ratios_64,
calibration_error, the floors, and keep_all_ceiling_vs_areal_64.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import results_meta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxflow.coordination import Coordination
from jaxflow.sim import describe
from jaxflow.sim.bounds import keep_all_floor
from jaxflow.sim.loop import simulate
from jaxflow.sim.presets import from_trace, reasoning

CONFIG = "configs/arithmetic_tiny.py:coordinated"


def systems(max_running: int) -> dict[str, tuple[Coordination, bool]]:
    """name -> (strategy, synchronous)."""
    return {
        "sync": (Coordination.areal_like(max_running=max_running), True),
        "areal": (Coordination.areal_like(max_running=max_running), False),
        "jaxflow": (Coordination(max_running=max_running), False),
        "jaxflow+release": (Coordination(max_running=max_running, stuck="release"), False),
    }


def _load_config():
    from jaxflow.config import load_config
    return load_config(CONFIG)


def _prompt_tokens(config) -> int:
    """Mean prompt length of the task's train prompts, in tokens."""
    from jaxflow.jobs import warm_start
    from jaxflow.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(warm_start.ensure_base_model(config))
    task = warm_start.make_task(config)
    records = task.to_prompt_records(task.examples("train", 200, seed=1), tokenizer)
    return round(sum(len(r["prompt"]) for r in records) / len(records))


def calibrate(steps: int, workdir: pathlib.Path, warmup: int, max_running: int) -> dict:
    """Runs the real job with `max_running` requests per engine, fits the simulator to it, simulates it;
    returns both throughputs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "jaxflow.main", f"--config={CONFIG}", f"--config.workdir={workdir}",
           f"--config.trainer.steps={steps}", f"--config.eval.every={10 * steps}", "--config.eval.num_prompts=16",
           f"--config.checkpoint.every={10 * steps}", f"--config.rollout.coordination.max_running={max_running}"]
    print(f"calibration: running the real job for {steps} steps ({CONFIG}, two engines, {max_running} "
          f"requests each)", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the real run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(f"calibration: real run took {time.perf_counter() - t0:.0f}s", flush=True)
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    metrics = [m for m in metrics if "consumed_tokens" in m]
    trace = json.loads((workdir / "coordinator_trace.json").read_text())
    config = _load_config()
    r, t = config.rollout, config.trainer
    # The last step also runs the final eval; measure up to the step before it.
    last = len(metrics) - 2
    span = metrics[last]["time_s"] - metrics[warmup - 1]["time_s"]
    measured = sum(m["consumed_tokens"] for m in metrics[warmup:last + 1]) / span
    scenario, fitted = from_trace(trace, metrics, instances=r.num_engines,
                                  max_running=max_running, kv_capacity=r.max_slots * r.max_len,
                                  batch_groups=t.batch_groups, group_size=r.group_size, max_tokens=r.max_tokens,
                                  prompt_tokens=_prompt_tokens(config), steps=last + 1, warmup_steps=warmup)
    strategy = dataclasses.replace(Coordination.from_config(r.coordination), max_running=max_running)
    sim = simulate(scenario, strategy, eta=t.eta)
    error = abs(sim["tokens_per_s"] - measured) / measured
    return {"max_running": max_running, "measured_tokens_per_s": measured,
            "simulated_tokens_per_s": sim["tokens_per_s"],
            "calibration_error": error, "fitted": fitted, "steps": steps, "warmup_steps": warmup,
            "measured_trainer_idle_frac": metrics[last]["trainer_idle_frac"],
            "simulated_trainer_idle_frac": sim["trainer_idle_frac"],
            "measured_rollout_idle_frac": metrics[last]["rollout_idle_frac"],
            "simulated_rollout_idle_frac": sim["rollout_idle_frac"]}


def scale(sizes: list[int], etas: list[int], steps: int, seeds: int) -> list[dict]:
    """One row per (size, eta, system): the run with the median tokens/s over `seeds` workload seeds
    (one seed above 64 instances, where a step averages over thousands of groups)."""
    rows = []
    for n in sizes:
        scenarios = [reasoning(n, steps=steps, seed=seed) for seed in range(seeds if n <= 64 else 1)]
        for eta in etas:
            for name, (strategy, synchronous) in systems(max_running=128).items():
                if synchronous and any(r["system"] == "sync" and r["instances"] == n for r in rows):
                    continue  # one sync run per size (eta 0 whatever the eta being compared)
                t0 = time.perf_counter()
                runs = sorted((simulate(sc, strategy, eta=0 if synchronous else eta, seed=seed)
                               for seed, sc in enumerate(scenarios)), key=lambda r: r["tokens_per_s"])
                r = runs[(len(runs) - 1) // 2]
                r.update(system=name, compared_eta=eta, seeds_tokens_per_s=[x["tokens_per_s"] for x in runs])
                rows.append(r)
                print(f"  {n:4d} instances  {name:16s} eta={r['eta']}  {r['tokens_per_s']:10.0f} tok/s (median of "
                      f"{len(runs)} seeds)  ({time.perf_counter() - t0:.0f}s)", flush=True)
    return rows


def table(rows: list[dict], etas: list[int]) -> str:
    head = (f"| instances | eta | system | tokens/s | vs areal | vs sync | step s | rollout idle | stall | "
            f"trainer idle | max stale | mean stale | dropped groups |\n|{'---:|' * 13}")
    lines = [head]
    for eta in etas:
        for r in rows:
            if r["compared_eta"] != eta and r["system"] != "sync":
                continue
            n = r["instances"]
            base = {x["system"]: x["tokens_per_s"] for x in rows if x["instances"] == n
                    and (x["compared_eta"] == eta or x["system"] == "sync")}
            st = r["group_staleness"]
            mean_stale = sum(k * v for k, v in st.items()) / sum(st.values())
            lines.append(f"| {n} | {r['eta']} | {r['system']} | {r['tokens_per_s']:.0f} | "
                         f"{r['tokens_per_s'] / base['areal']:.2f}x | {r['tokens_per_s'] / base['sync']:.2f}x | "
                         f"{r['step_s_mean']:.0f} | {r['rollout_idle_frac']:.0%} | {r['rollout_stall_frac']:.0%} | "
                         f"{r['trainer_idle_frac']:.0%} | {r['max_staleness']} | {mean_stale:.2f} | "
                         f"{r['groups_surplus']} of {r['groups_consumed'] + r['groups_surplus']} |")
    return "\n".join(lines)


def floors(rows: list[dict], sizes: list[int], etas: list[int]) -> list[dict]:
    """Per (size, eta): the tail floor on the step (`jaxflow.sim.bounds`) beside the simulated steps, and
    the most any strategy that trains every sample could gain over AReaL-style (its step / the floor)."""
    out = []
    for n in sizes:
        f = keep_all_floor(reasoning(n), 0)  # the cohort draws do not depend on eta; the floor divides by eta + 1
        for eta in etas:
            floor = f["step_s"] / (eta + 1)
            step = {r["system"]: r["step_s_mean"] for r in rows if r["instances"] == n and r["compared_eta"] == eta}
            out.append({"instances": n, "eta": eta, "floor_step_s": floor, "solo_tail_s": f["solo_tail_s"],
                        "train_s": f["train_s"], "cap_share": f["cap_share"],
                        "areal_step_s": step["areal"], "jaxflow_step_s": step["jaxflow"],
                        "ceiling_vs_areal": step["areal"] / floor})
    return out


def floor_table(rows: list[dict]) -> str:
    lines = ["| instances | eta | floor step s | longest alone s | train s | areal step s | jaxflow step s | "
             "ceiling vs areal |", f"|{'---:|' * 8}"]
    for f in rows:
        lines.append(f"| {f['instances']} | {f['eta']} | {f['floor_step_s']:.0f} | {f['solo_tail_s']:.0f} | "
                     f"{f['train_s']:.0f} | {f['areal_step_s']:.0f} | {f['jaxflow_step_s']:.0f} | "
                     f"{f['ceiling_vs_areal']:.2f}x |")
    return "\n".join(lines)


def plot(rows: list[dict], etas: list[int], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(etas), figsize=(6 * len(etas), 4), squeeze=False)
    for ax, eta in zip(axes[0], etas):
        for name in systems(1):
            pts = sorted((r["instances"], r["tokens_per_s"] / r["instances"]) for r in rows
                         if r["system"] == name and (r["compared_eta"] == eta or name == "sync"))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("instances")
        ax.set_ylabel("trained tokens/s per instance")
        ax.set_title(f"eta = {eta} (sync: eta = 0)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (under 5 minutes)")
    ap.add_argument("--json", type=pathlib.Path, help="write every figure here")
    ap.add_argument("--plot", type=pathlib.Path, default=ROOT / "runs" / "simulate.png")
    ap.add_argument("--eta", default=None, help="staleness bounds to compare at; the first is the headline "
                    "(default 4,1; 4 with --quick)")
    ap.add_argument("--sizes", default="8,64,512")
    ap.add_argument("--seeds", type=int, default=None, help="workload seeds per run up to 64 instances, the "
                    "median is reported (default 3; 1 with --quick)")
    ap.add_argument("--skip-calibration", action="store_true", help="only the simulated part")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    meta_started = results_meta.begin(argv)
    etas = [int(x) for x in (args.eta or ("4" if args.quick else "4,1")).split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    steps = 10 if args.quick else 16
    out: dict = {"quick": args.quick, "etas": etas, "sizes": sizes, "steps": steps,
                 "lengths": describe(reasoning(8).lengths)}
    started = time.perf_counter()
    if not args.skip_calibration:
        out["calibration"] = []
        for max_running in (64, 6):
            with tempfile.TemporaryDirectory() as tmp:
                out["calibration"].append(calibrate(steps=20 if args.quick else 60, warmup=5,
                                                    workdir=pathlib.Path(tmp) / "run", max_running=max_running))
        out["calibration_error"] = max(c["calibration_error"] for c in out["calibration"])
    print(f"scale: reasoning preset, {steps} train steps per run", flush=True)
    rows = scale(sizes, etas, steps, args.seeds or (1 if args.quick else 3))
    out["runs"] = rows
    out["floors"] = floors(rows, sizes, etas)
    by = {(r["instances"], r["system"], r["compared_eta"] if r["system"] != "sync" else None): r["tokens_per_s"]
          for r in rows}
    if 64 in sizes:
        out["ratios_64"] = {e: {f"{name}_vs_{base}": by[(64, name, e)] / by[(64, base, e if base == "areal" else None)]
                                for name in ("jaxflow", "jaxflow+release") for base in ("areal", "sync")}
                            for e in etas}
        out["ratio_vs_areal_64"] = out["ratios_64"][etas[0]]["jaxflow_vs_areal"]
        out["ratio_vs_sync_64"] = out["ratios_64"][etas[0]]["jaxflow_vs_sync"]
        out["keep_all_ceiling_vs_areal_64"] = next(f["ceiling_vs_areal"] for f in out["floors"]
                                                   if f["instances"] == 64 and f["eta"] == etas[0])
    print()
    for c in out.get("calibration", []):
        print(f"calibration ({c['steps']} real steps, two engines, {c['max_running']} requests each): measured "
              f"{c['measured_tokens_per_s']:.0f} consumed tokens/s, simulated {c['simulated_tokens_per_s']:.0f}: "
              f"error {c['calibration_error']:.1%}; trainer idle {c['measured_trainer_idle_frac']:.0%} measured, "
              f"{c['simulated_trainer_idle_frac']:.0%} simulated; rollout idle {c['measured_rollout_idle_frac']:.0%} "
              f"vs {c['simulated_rollout_idle_frac']:.0%}")
    print(f"lengths (reasoning preset): {json.dumps({k: round(v) for k, v in out['lengths'].items()})}\n")
    print(table(rows, etas))
    print("\nTail floor (jaxflow.sim.bounds): a group dispatched at version v must be trained by buffer v + eta, so "
          "eta + 1 step intervals less one update must cover its slowest sample; even alone on an instance the "
          "longest sample of a cohort takes 'longest alone s'. No strategy that trains every sample steps faster "
          "than the floor on average; 'ceiling vs areal' is the most such a strategy can gain.\n")
    print(floor_table(out["floors"]))
    for e, r in out.get("ratios_64", {}).items():
        print(f"at 64 instances, eta {e}: jaxflow {r['jaxflow_vs_areal']:.2f}x areal, {r['jaxflow_vs_sync']:.2f}x "
              f"sync; with release {r['jaxflow+release_vs_areal']:.2f}x areal, "
              f"{r['jaxflow+release_vs_sync']:.2f}x sync")
    if "keep_all_ceiling_vs_areal_64" in out:
        print(f"at 64 instances, eta {etas[0]}: no strategy that trains every sample can exceed "
              f"{out['keep_all_ceiling_vs_areal_64']:.2f}x areal (tail floor)")
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, etas, args.plot)
    out["wall_s"] = time.perf_counter() - started
    print(f"plot: {args.plot}; {out['wall_s']:.0f}s in all")
    if args.json:
        results_meta.write_json(args.json, out, meta_started)
        print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
