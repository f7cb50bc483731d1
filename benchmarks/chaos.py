"""Kill the pieces of a cluster-mode RL run at random moments and check that nothing is lost or trained twice.

    .venv/bin/python benchmarks/chaos.py [--quick] [--json PATH] [--seed N]

A `ray.cluster_utils.Cluster` on this machine with three nodes: the head holds the data services' actor
(custom resource "data"), one node the trainer's processes ("trainer"), one the rollout actors ("rollout").
The tiny RL config (configs/arithmetic_tiny.py, shrunk to a 2-layer 64-wide model) runs on it as its own
process, joined to the cluster by `cluster.address`: 2 trainer processes with 4 CPU devices each (one
fsdp 4 x tensor 2 mesh), 2 rollout actors, a checkpoint every step. While it trains, this script kills,
in one shuffled schedule, a rollout actor 10 times, a trainer process 3 times and the data-services actor
twice (`--quick`: 3, 1 and 1), each at a random moment (a random wait after the run has trained a step
since the previous kill, so that each failure is recovered from before the next). The actors are found
by their Ray names (`jaxflow.cluster.names`) and killed with `ray.kill(..., no_restart=False)`: an actor
Ray may restart comes back, the others are replaced by the job.

After the run it reads the run's own records and reports:

  groups_lost           groups created but in no final state (created - consumed - in flight - failed -
                        surplus), plus groups the service counts as consumed that the ledger never trained
  groups_trained_twice  ledger entries beyond the distinct groups (ledger.jsonl: the groups of every step
                        whose parameters survive)
  staleness_violations  trained tokens generated more than eta versions before the step that trained them
                        (the per-token histograms of metrics.jsonl)
  recovery_s            per kind of failure: rollout actor = from the kill until the restarted actor answers
                        and holds weights again; trainer process and data-service actor = from the kill until
                        the run has trained a step again (the job's `recoveries` in result.json)

and `recovery_s_median` (over every failure) in the JSON, with the per-kind medians. All three counts must
be 0; the script exits 1 if one is not, or if a kill found nothing to kill.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import results_meta

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = "configs/arithmetic_tiny.py"
# The job's config: the tiny model shrunk as the tests shrink it, a checkpoint every step (a trainer or
# data-service failure rolls back to the newest one), short leases (a killed rollout actor's groups come back
# within seconds).
SMALL = {"model.hidden_size": 64, "model.intermediate_size": 128, "model.num_layers": 2,
         "base.steps": 300, "base.num_examples": 2000, "task.max_ops": 1, "trainer.batch_groups": 4,
         "rollout.group_size": 4, "rollout.max_slots": 16, "rollout.coordination.max_running": 16,
         "rollout.max_tokens": 48, "eval.num_prompts": 16, "eval.every": 1000, "checkpoint.every": 1,
         "data.train_prompts": 2000, "trainer.eta": 2, "rollout.lease_s": 5.0,
         "cluster.mode": "ray", "cluster.rollout_actors": 2, "cluster.trainer_processes": 2,
         "cluster.trainer_cpu_devices": 4, "cluster.trainer_mesh.fsdp": 4, "cluster.trainer_mesh.tensor": 2,
         "cluster.node_resource.data": "data", "cluster.node_resource.rewards": "data",
         "cluster.node_resource.trainer": "trainer", "cluster.node_resource.rollout": "rollout"}
FULL = {"rollout": 10, "trainer": 3, "data": 2}
QUICK = {"rollout": 3, "trainer": 1, "data": 1}
KINDS = ("rollout", "trainer", "data")


def _records(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _steps_trained(workdir: pathlib.Path) -> int:
    """Train steps recorded so far (a rollback rewrites metrics.jsonl without the redone steps)."""
    return sum("loss" in r for r in _records(workdir / "metrics.jsonl"))


class Chaos:
    """Kills actors of one run on a schedule; `kills` records each: kind, name, time, and for rollout actors
    the seconds until the restarted actor answered."""

    def __init__(self, ray, workdir: pathlib.Path, proc: subprocess.Popen, schedule: list[str],
                 rng: random.Random, max_wait_s: float):
        from jaxflow.cluster import names
        self.ray, self.workdir, self.proc, self.schedule, self.rng = ray, workdir, proc, schedule, rng
        self.max_wait_s, self.names = max_wait_s, names
        self.kills: list[dict] = []
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def _alive(self) -> bool:
        return self.proc.poll() is None

    def _wait_for_steps(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._alive() and time.monotonic() < deadline:
            if _steps_trained(self.workdir) >= n:
                return True
            time.sleep(0.2)
        return False

    def _actors(self, kind: str) -> list[tuple[str, str]]:
        """(name, namespace) of the run's live actors of `kind`."""
        pattern = re.compile(self.names.PATTERNS[kind])
        return sorted((a["name"], a["namespace"]) for a in self.ray.util.list_named_actors(all_namespaces=True)
                      if pattern.fullmatch(a["name"]))

    def _run(self) -> None:
        try:
            for i, kind in enumerate(self.schedule):
                # A step trained since the previous kill (the run recovered), then a random moment.
                if not self._wait_for_steps(_steps_trained(self.workdir) + 1, 600):
                    self.error = f"kill {i} ({kind}): the run trained no step for 600 s (or ended)"
                    return
                time.sleep(self.rng.uniform(0.0, self.max_wait_s))
                if not self._alive():
                    self.error = f"kill {i} ({kind}): the run ended before it"
                    return
                self._kill(kind)
        except Exception as e:  # noqa: BLE001 - reported as the benchmark's failure
            self.error = f"{type(e).__name__}: {e}"

    def _kill(self, kind: str) -> None:
        deadline = time.monotonic() + 120
        while not (found := self._actors(kind)) and time.monotonic() < deadline:
            time.sleep(0.5)  # e.g. the trainer group being re-formed
        if not found:
            raise RuntimeError(f"no live {kind} actor to kill (named like {self.names.PATTERNS[kind]!r})")
        name, namespace = self.rng.choice(found)
        handle = self.ray.get_actor(name, namespace=namespace)
        at = time.time()
        self.ray.kill(handle, no_restart=False)
        record = {"kind": kind, "name": name, "at": at, "steps_before": _steps_trained(self.workdir)}
        print(f"chaos: killed {kind} actor {name} at step {record['steps_before']}", flush=True)
        if kind == "rollout":
            record["recovery_s"] = self._rollout_back(handle, at)
        self.kills.append(record)

    def _rollout_back(self, handle, killed_at: float) -> float | None:
        """Seconds from the kill until the restarted rollout actor answers `report` with weights loaded."""
        time.sleep(0.5)  # let Ray see it die first (a call now could reach the dying process)
        deadline = time.monotonic() + 300
        while self._alive() and time.monotonic() < deadline:
            try:
                report = self.ray.get(handle.report.remote(), timeout=5)
                if all(i.get("version") is not None for i in report["stats"]["instances"]):
                    return time.time() - killed_at
            except Exception:  # noqa: BLE001 - restarting: Ray raises until the new process serves
                pass
            time.sleep(0.2)
        return None


def _summary(workdir: pathlib.Path, kills: list[dict], eta: int) -> dict:
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    ledger = [g for r in _records(workdir / "ledger.jsonl") for g in r["groups"]]
    steps = [r for r in _records(workdir / "metrics.jsonl") if "loss" in r]
    violations = sum(n for r in steps for lag, n in r.get("staleness", {}).items() if int(lag) > eta)
    unaccounted = a["created"] - a["consumed"] - a["in_flight"] - a["failed"] - a["surplus"]
    lost = abs(unaccounted) + max(a["consumed"] - len(set(ledger)), 0)
    # The job's own record of each trainer / data-service recovery, matched to the kills in order.
    recoveries = {k: [r for r in result.get("recoveries", []) if r["kind"] == k] for k in ("trainer", "data")}
    for kind in ("trainer", "data"):
        for kill in (k for k in kills if k["kind"] == kind):
            later = [r for r in recoveries[kind] if r["detected_at"] >= kill["at"] - 1.0]
            if later:
                r = recoveries[kind].pop(recoveries[kind].index(later[0]))
                kill["recovery_s"] = r["detected_at"] + r["recovered_s"] - kill["at"]
    by_kind = {k: [x["recovery_s"] for x in kills if x["kind"] == k and x.get("recovery_s") is not None]
               for k in KINDS}
    every = [s for v in by_kind.values() for s in v]
    return {
        "groups_lost": lost, "groups_trained_twice": len(ledger) - len(set(ledger)),
        "staleness_violations": violations, "accounting": a, "ledger_groups": len(ledger),
        "steps": len(steps), "final_accuracy": result.get("final_accuracy"),
        "base_accuracy": result.get("base_accuracy"),
        "kills": kills, "kills_by_kind": {k: sum(x["kind"] == k for x in kills) for k in KINDS},
        "recovered_by_kind": {k: len(v) for k, v in by_kind.items()},
        "recovery_s_median": statistics.median(every) if every else None,
        "recovery_s_median_by_kind": {k: statistics.median(v) if v else None for k, v in by_kind.items()},
        "recovery_s_by_kind": {k: [round(s, 2) for s in v] for k, v in by_kind.items()},
        "job_recoveries": result.get("recoveries", []),
    }


def run(quick: bool, seed: int, workdir: pathlib.Path, steps: int | None) -> dict:
    from jaxflow.cluster import ray_actors
    ray_actors.ensure_auth_token()  # before ray is imported: the cluster and this process use one token

    import ray
    from ray.cluster_utils import Cluster

    counts = QUICK if quick else FULL
    schedule = [k for k in KINDS for _ in range(counts[k])]
    rng = random.Random(seed)
    rng.shuffle(schedule)
    # Steps: the failures' steps plus room for every rollback and a few after the last kill.
    steps = steps or 4 * len(schedule) + 6
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"data": 2}})
    cluster.add_node(num_cpus=2, resources={"trainer": 2})
    cluster.add_node(num_cpus=2, resources={"rollout": 2})
    try:
        ray_actors.connect(cluster.address)
        overrides = {**SMALL, "trainer.steps": steps, "workdir": workdir / "run", "base.dir": workdir / "base",
                     "cluster.address": cluster.address, "seed": seed}
        cmd = [sys.executable, "-m", "jaxflow.main", f"--config={CONFIG}",
               *[f"--config.{k}={v}" for k, v in overrides.items()]]
        log_path = workdir / "job.log"
        print(f"chaos: {len(schedule)} kills ({', '.join(f'{counts[k]} {k}' for k in KINDS)}) in a run of "
              f"{steps} steps; the job's output: {log_path}", flush=True)
        start = time.monotonic()
        with log_path.open("w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            chaos = Chaos(ray, workdir / "run", proc, schedule, rng, max_wait_s=3.0 if quick else 6.0)
            chaos.thread.start()
            try:
                code = proc.wait(timeout=3600)
            finally:
                if proc.poll() is None:
                    proc.kill()
            chaos.thread.join(timeout=30)
        wall_s = time.monotonic() - start
        if code != 0:
            raise SystemExit(f"the run failed (exit {code}); its output:\n{log_path.read_text()[-4000:]}")
        if chaos.error or len(chaos.kills) != len(schedule):
            raise SystemExit(f"chaos: {chaos.error or 'the run ended before every kill'} "
                             f"({len(chaos.kills)} of {len(schedule)} kills done)")
        out = _summary(workdir / "run", chaos.kills, SMALL["trainer.eta"])
        out.update(quick=quick, seed=seed, wall_s=round(wall_s, 1), schedule=schedule, trainer_steps=steps)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def print_table(out: dict) -> None:
    print(f"\n{'failure':<16}{'kills':>7}{'recovered':>11}{'median s':>10}{'max s':>8}")
    for k in KINDS:
        v = out["recovery_s_by_kind"][k]
        print(f"{k:<16}{out['kills_by_kind'][k]:>7}{len(v):>11}"
              f"{(statistics.median(v) if v else float('nan')):>10.1f}{(max(v) if v else float('nan')):>8.1f}")
    print(f"\ngroups_lost {out['groups_lost']}   groups_trained_twice {out['groups_trained_twice']}   "
          f"staleness_violations {out['staleness_violations']}   recovery_s_median "
          f"{out['recovery_s_median']:.1f}")
    a = out["accounting"]
    print(f"accounting: created {a['created']} = consumed {a['consumed']} + in flight {a['in_flight']} + failed "
          f"{a['failed']} + surplus {a['surplus']}; ledger {out['ledger_groups']} groups over {out['steps']} steps; "
          f"run {out['wall_s']:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rollout, 1 trainer, 1 data-service kill")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="train steps (default: from the kill count)")
    parser.add_argument("--workdir", type=pathlib.Path, default=None,
                        help="where the run writes (default: a new temporary directory)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    meta_started = results_meta.begin(argv)
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="jaxflow-chaos-"))
    out = run(args.quick, args.seed, workdir, args.steps)
    print_table(out)
    if args.json:
        results_meta.write_json(args.json, out, meta_started)
    bad = [k for k in ("groups_lost", "groups_trained_twice", "staleness_violations") if out[k]]
    if bad:
        print(f"chaos: FAILED: {', '.join(f'{k}={out[k]}' for k in bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
