"""Imports a run's user code in a short child process before the run starts, so that code which misbehaves
while it imports is named instead of ending or hanging the run with nothing said.

User code is the config file and every "module:attr" reference in the config under a key named `ref` or
ending in `_ref` (`task.reward_ref`, `rollout.env.ref`). In the run's own process `jaxflow.refs.resolve`
already turns an exception, a `sys.exit` or a hang at import into a named error; what only another process
can see is a module calling `os._exit` (or crashing the interpreter) while it imports. So `jaxflow.main`
first runs `check` here: the child announces each import on its stdout before it starts it, and the parent
names the last one announced when the child vanishes, stops on an error the child reports, and kills the
child when one import takes longer than the time limit (`jaxflow.refs.import_timeout_s`). The child
imports only the config's dependencies and the user modules: about a second on top of those.
"""

from __future__ import annotations

import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

import ml_collections

from jaxflow import refs
from jaxflow.config import ConfigError, load_config

# Prefix of the child's protocol lines on its stdout; other lines are the user code's own output.
MARK = "jaxflow-preflight:"
# Seconds the child may take to start (Python and jaxflow.config) before it announces its first import.
START_S = 120.0
# Seconds the parent waits beyond the import limit before it kills the child (which reports a reference's
# hang itself, naming the module).
GRACE_S = 5.0


def user_refs(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, reference) of every string in `config` under a key named `ref` or ending in `_ref`."""
    found = []
    for key in config.keys():
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            found += user_refs(value, f"{prefix}{key}.")
        elif isinstance(value, str) and (key == "ref" or key.endswith("_ref")):
            found.append((f"{prefix}{key}", value))
    return found


def check(spec: str, overrides: dict[str, str], *, timeout_s: float | None = None) -> str | None:
    """Loads config `spec` with `overrides` and imports its user code in a child process; None when all of it
    imported, else the error that names what failed (the file or `key 'ref'`, and how).

    timeout_s: the time limit on each import, seconds (default `refs.import_timeout_s()`).
    """
    timeout_s = refs.import_timeout_s() if timeout_s is None else timeout_s
    root = str(pathlib.Path(__file__).resolve().parents[1])  # the child imports this jaxflow, wherever it is
    env = {**os.environ, refs.TIMEOUT_ENV: repr(timeout_s),
           "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # The child searches this process's sys.path first (a notebook or test may have added to it).
    child = subprocess.Popen([sys.executable, "-m", "jaxflow.preflight", json.dumps([spec, overrides, sys.path])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    stderr: list[str] = []
    threading.Thread(target=_pump, args=(child.stdout, lines.put, True), daemon=True).start()
    threading.Thread(target=_pump, args=(child.stderr, stderr.append, False), daemon=True).start()
    current, wait_s = None, START_S
    try:
        while True:
            try:
                line = lines.get(timeout=wait_s)
            except queue.Empty:
                child.kill()
                if current is None:
                    return f"the import check of {spec} did not start within {START_S:g}s"
                return f"{current} did not finish importing within {timeout_s:g}s (set --import_timeout_s)"
            if line is None:  # the child's stdout closed: it ended
                break
            if not line.startswith(MARK):
                sys.stdout.write(line)  # what the user code printed
                continue
            kind, _, text = line[len(MARK):].strip().partition(" ")
            if kind == "import":  # the child's own limit on a reference says more: let it answer first
                current, wait_s = text, timeout_s + GRACE_S
            elif kind == "error":
                child.wait()
                return json.loads(text)
            elif kind == "ok":
                child.wait()
                return None
        rc = child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    tail = "".join(stderr).strip().splitlines()[-3:]
    said = f"; it wrote: {' | '.join(tail)}" if tail else ""
    what = current or f"the import check of {spec}"
    return f"{what} ended the process while importing, exit code {rc} (os._exit or a crash){said}"


def _pump(stream, put, end: bool) -> None:
    """Hands each line of `stream` to `put`, then None when `end` (the stream closed)."""
    for line in stream:
        put(line)
    if end:
        put(None)


def _say(kind: str, text: str) -> None:
    print(f"{MARK} {kind} {text}", flush=True)


def _child(spec: str, overrides: dict[str, str], path: list[str]) -> int:
    """The child's side: load the config, import each user reference, report each step on stdout."""
    sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
    _say("import", f"config file {spec.partition(':')[0]}")
    try:
        config = load_config(spec, overrides)
        for key, ref in user_refs(config):
            _say("import", f"{key} {ref!r}")
            refs.resolve(ref, what=key, expect="any")
    except (ConfigError, refs.RefError) as e:
        _say("error", json.dumps(str(e)))
        sys.stdout.flush()
        os._exit(2)  # an ImportHung's thread would keep a normal exit waiting
    _say("ok", "")
    return 0


if __name__ == "__main__":
    sys.exit(_child(*json.loads(sys.argv[1])))
