"""Test setup: a fake 8-device CPU mesh and the JAX persistent compilation cache.

Both must be in place before JAX initialises its backend, so this runs before any test module imports jax.
"""
import os
import pathlib
import sys

import pytest
from compile_level import SUITE_OPT_LEVEL  # why level 0: tests/compile_level.py

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + f" --xla_backend_optimization_level={SUITE_OPT_LEVEL}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Ray with token authentication, as jaxflow requires, also for the multi-node clusters tests start
# (`ray.cluster_utils.Cluster` does not turn it on by itself); read when ray is imported.
os.environ.setdefault("RAY_AUTH_MODE", "token")

import jax  # noqa: E402

# vLLM's structured-output backend (xgrammar) loads tvm_ffi, which installs fatal-signal handlers that print a
# native backtrace by unwinding the stack. A fault inside the unwinder itself (seen while jaxlib threw from a
# compile or a cache write) then deadlocks on the unwinder's own lock, and the test hangs instead of failing.
# Load it first, drop its handlers (the default action: the process ends), and put Python's fault handler in
# front: a fault then prints the Python stacks and ends the worker in seconds, the test named as crashed.
try:
    import tvm_ffi  # noqa: E402, F401
except ImportError:
    pass
import faulthandler  # noqa: E402
import signal  # noqa: E402

faulthandler.disable()
for _fatal in (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL):
    signal.signal(_fatal, signal.SIG_DFL)
faulthandler.enable(file=sys.__stderr__)

_CACHE = pathlib.Path(os.environ.get("JAXFLOW_CACHE", pathlib.Path.home() / ".cache" / "jaxflow"))
jax.config.update("jax_compilation_cache_dir", str(_CACHE / "jax_compilation"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# A compiled XLA:CPU program holds three memory mappings of its machine code while JAX's caches keep it, and a
# worker that runs a large share of the suite compiles thousands: past the kernel's vm.max_map_count (65,530 by
# default) mmap fails, a compile raises from deep in jaxlib, and the worker dies. After any module that leaves
# more than this many mappings, the caches are cleared (later modules reload their programs from the persistent
# compilation cache).
MAPPINGS_HIGH = 20_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Clears JAX's compiled-program caches after a module once the worker's memory mappings pass
    `MAPPINGS_HIGH`, so the suite never reaches the kernel's limit."""
    yield
    if _mappings() > MAPPINGS_HIGH:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _ray_shutdown():
    """Shuts down the local Ray cluster that the "ray" service placement started, if any, at session end."""
    yield
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@pytest.fixture(scope="session")
def shared_base(tmp_path_factory):
    """`shared_base(config, into)`: a copy at `into` of the base model `config` warm-starts, built once per
    test run (tests/shared_bases.py)."""
    import shared_bases
    root = shared_bases.shared_root(tmp_path_factory)
    return lambda config, into: shared_bases.shared_base(config, into, root)


SLOW_MODULE_MARK = "\npytestmark = pytest.mark.slow"

# Modules whose module-scoped fixtures start expensive processes: a vLLM engine (about 50 s on 2 cores), a
# 3-node Ray cluster. Collected first, they go whole to the head of the first xdist worker's queue, which
# `--dist worksteal` never moves (a worker that runs dry steals the tail of the other's queue); elsewhere, a
# module that straddles a split starts its processes on both workers.
RUN_FIRST = ("tests/rollout_bridge/test_vllm_engine.py", "tests/cluster/test_ray_rl.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in RUN_FIRST)  # a stable sort: order kept


def pytest_ignore_collect(collection_path, config):
    """Under `-m "not slow"` (the fast tier, pyproject.toml), a test module marked slow as a whole is not even
    imported: all of its tests would be deselected, and importing it (torch, vLLM, Ray) costs the fast tier
    more than a minute of its collection on 2 cores. Any other selection collects everything."""
    if config.getoption("markexpr", "").strip() != "not slow":
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return SLOW_MODULE_MARK in collection_path.read_text() or None
    return None
