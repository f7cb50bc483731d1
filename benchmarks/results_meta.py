"""Where, when and from what a benchmark's figures came: the `meta` block of every `--json` file.

A benchmark calls `begin()` before it measures and `write_json(path, figures, started)` at the end. The file
then holds its figures and

    meta: {machine: {cpu, cores, memory_gb, accelerator}, date (UTC ISO 8601), commit, dirty, command,
           jax, jaxlib, python, load_1min_start, load_1min_end, load_1min_max, wall_s}

The load averages are there because these machines are shared: a figure measured at load 3 on 2 cores is
not one measured on an idle machine. `benchmarks/results_tables.py` reads the block into the docs' tables.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The keys every meta block holds (tests/test_benchmark_results.py checks them).
META_KEYS = ("machine", "date", "commit", "dirty", "command", "jax", "jaxlib", "python",
             "load_1min_start", "load_1min_end", "wall_s")
MACHINE_KEYS = ("cpu", "cores", "memory_gb", "accelerator")


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return None


def _accelerator() -> str | None:
    """The accelerator JAX uses, or None on a CPU-only machine.

    Asked of JAX only when the benchmark has already imported it (importing it here would start a backend in
    processes that only drive subprocesses); otherwise read from nvidia-smi or the TPU device files.
    """
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        try:
            if jax.default_backend() != "cpu":
                devices = jax.devices()
                return f"{len(devices)} x {devices[0].device_kind}"
            return None
        except RuntimeError:
            pass
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = [ln.split(":", 1)[1].split("(")[0].strip() for ln in proc.stdout.splitlines() if ln.startswith("GPU")]
        if gpus:
            return f"{len(gpus)} x {gpus[0]}"
    if list(pathlib.Path("/dev").glob("accel*")) or list(pathlib.Path("/dev").glob("vfio/[0-9]*")):
        return "TPU"
    return None


def machine() -> dict:
    """This machine: CPU model, logical cores, memory in GB, and the accelerator (None when CPU only)."""
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gb": _memory_gb(), "accelerator": _accelerator()}


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    # rstrip only: `status --porcelain` lines start with a space ("XY path"), the first one too.
    return proc.stdout.rstrip() if proc.returncode == 0 else ""


def _dirty() -> bool:
    """Whether code that may run differs from the commit: tracked files changed, less prose (*.md), tests and
    result files (the docs and other results being regenerated meanwhile do not change what was measured)."""
    changed = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return any(not (path.endswith(".md") or path.startswith(("tests/", "benchmarks/results/")))
               for path in changed)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def begin(argv: list[str] | None = None) -> dict:
    """What is known before a benchmark measures: the command, the tree, the load. Pass it to `write_json`.

    argv: the benchmark's arguments (default sys.argv[1:]), recorded as the command that reproduces the run.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    script = pathlib.Path(sys.argv[0]).resolve()
    try:
        script_name = str(script.relative_to(ROOT))
    except ValueError:
        script_name = sys.argv[0]
    commit = _git("rev-parse", "HEAD") or None
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit,
            "dirty": _dirty() if commit else None,
            "command": shlex.join([".venv/bin/python", script_name, *args]),
            "jax": _version("jax"), "jaxlib": _version("jaxlib"), "python": platform.python_version(),
            "load_1min_start": round(os.getloadavg()[0], 2), "_start": time.monotonic(), "_load": _LoadWatch()}


class _LoadWatch:
    """The highest 1-minute load average seen while a benchmark runs (sampled every few seconds): a run
    whose start and end were quiet may have shared the machine in between."""

    def __init__(self, every_s: float = 5.0):
        self.max = os.getloadavg()[0]
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(every_s,), daemon=True, name="load-watch").start()

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.max = max(self.max, os.getloadavg()[0])

    def stop(self) -> float:
        self._stop.set()
        return round(max(self.max, os.getloadavg()[0]), 2)


def finish(started: dict) -> dict:
    """The complete meta block: `started` (from `begin`) with the machine, the load now and the wall time."""
    meta = {k: v for k, v in started.items() if not k.startswith("_")}
    meta["machine"] = machine()
    meta["load_1min_end"] = round(os.getloadavg()[0], 2)
    meta["load_1min_max"] = started["_load"].stop()
    meta["wall_s"] = round(time.monotonic() - started["_start"], 1)
    return {k: meta[k] for k in (*META_KEYS, "load_1min_max")}


def write_json(path: str | os.PathLike, figures: dict, started: dict) -> dict:
    """Writes `figures` and their meta block (under "meta") to `path` as indented JSON; returns what it wrote."""
    if "meta" in figures:
        raise ValueError("a benchmark's figures may not have a 'meta' key: write_json adds it")
    out = {**figures, "meta": finish(started)}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=float) + "\n")
    return out
