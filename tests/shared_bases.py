"""Warm-started base models built once per test session and copied to each test that asks for one.

Several modules train on the same tiny base (the same warm-start fingerprint); each building its own cost
30-110 s on a 2-core machine. `shared_base(config, into)` builds the base for `config` once, under a file
lock so that pytest-xdist workers wait for each other instead of building it twice, and copies it into
`into` (a few hundred KiB): a test that rebuilds or writes into its copy leaves the others' alone.

The shared folder is the run's base temp folder, which xdist's workers share (one per run, never reused
by a later run, so a base built by older code is never served).
"""

import fcntl
import os
import pathlib
import shutil

from jaxflow.jobs import warm_start


def shared_root(tmp_path_factory) -> pathlib.Path:
    """The folder this test run's workers share: the parent of a worker's base temp under xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_base(config, into: str | os.PathLike, root: pathlib.Path) -> pathlib.Path:
    """A copy at `into` of the base model `config` warm-starts (built under `root` on first use)."""
    # The fingerprint names what shapes the weights but for the demonstrations' row length, which packs
    # the warm start's batches: both name a shared base.
    key = f"{warm_start.fingerprint(config)}-len{config.rollout.max_len}"
    cache = root / "shared-bases" / key
    cache.parent.mkdir(parents=True, exist_ok=True)
    cached = config.copy_and_resolve_references()
    with cached.unlocked():
        cached.base.dir, cached.base.build_if_missing = str(cache), True
    with open(cache.parent / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        warm_start.ensure_base_model(cached, log=lambda *_: None)  # built unless this run built it already
    into = pathlib.Path(into)
    shutil.copytree(cache, into)
    return into
