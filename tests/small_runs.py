"""The small RL run the job and cluster tests share: configs/arithmetic_tiny.py with its `small` option (a
few-minute run on a CPU), the records a run writes, and the check that every step and group ran once.

A test that needs another value than the small run's overrides that key in its own call, where a reader
sees it.
"""

import json
import os
import pathlib
import subprocess
import sys

import ml_collections
from waiting import wait_until

from jaxflow.config import load_config

CONFIG = "configs/arithmetic_tiny.py"
SMALL = f"{CONFIG}:async,small"


def small_config(tmp_path: pathlib.Path, base_dir, **more) -> ml_collections.ConfigDict:
    """The small run with its base model in `base_dir`, its workdir `tmp_path / "run"`, and the `more`
    overrides ({dotted key: value}, values as text or anything whose str() parses)."""
    overrides = {"base.dir": str(base_dir), "workdir": str(tmp_path / "run"), **more}
    return load_config(SMALL, {k: str(v) for k, v in overrides.items()})


def records(workdir: pathlib.Path, name: str = "metrics.jsonl") -> list[dict]:
    """The JSON lines of a run's `name` (metrics.jsonl, ledger.jsonl)."""
    return [json.loads(line) for line in (workdir / name).read_text().splitlines() if line.strip()]


def job_command(base_dir, workdir, **more) -> tuple[list[str], dict[str, str]]:
    """The RL job's command line on the small config, and an environment with unbuffered output."""
    args = {"base.dir": base_dir, "workdir": workdir, "eval.every": 100, **more}
    cmd = [sys.executable, "-m", "jaxflow.main", f"--config={SMALL}", *[f"--config.{k}={v}" for k, v in args.items()]]
    return cmd, {**os.environ, "PYTHONUNBUFFERED": "1"}


def start_until_step(cmd, env, workdir: pathlib.Path, steps: int, **popen) -> subprocess.Popen:
    """Starts the job and returns its process once metrics.jsonl holds `steps` train steps (or it ended)."""
    proc = subprocess.Popen(cmd, env=env, **popen)
    metrics = workdir / "metrics.jsonl"

    def reached():
        return proc.poll() is not None or (
            metrics.exists() and sum('"loss"' in ln for ln in metrics.read_text().splitlines()) >= steps)
    try:
        wait_until(reached, 300, f"the job to train {steps} steps", interval=0.1)
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc


def check_each_step_once(workdir: pathlib.Path, steps: int, groups_per_step: int) -> None:
    """Every step once, in order, in the metrics; each trained group once in the ledger; accounting closes."""
    assert [r["step"] for r in records(workdir) if "loss" in r] == list(range(steps))
    ledger = [g for r in records(workdir, "ledger.jsonl") for g in r["groups"]]
    assert len(ledger) == steps * groups_per_step and len(set(ledger)) == len(ledger)
    a = json.loads((workdir / "result.json").read_text())["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert a["consumed"] == len(ledger)
