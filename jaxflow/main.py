"""jaxflow's command line.

    python -m jaxflow.main --config=configs/<experiment>.py[:variant] [--config.<key>=<value> ...]
                           [--import_timeout_s=SECONDS]

The config's `job` field picks what runs; the logic lives in importable modules so notebooks can call
the same functions.

Before anything starts, the config file and the user code it names ("module:attr" references such as
`task.reward_ref`) are imported in a short child process (`jaxflow.preflight`): a module that raises, exits
(`sys.exit`, `os._exit`) or does not finish importing within --import_timeout_s (default 60; also
$JAXFLOW_IMPORT_TIMEOUT_S, which every process of the run reads) stops the run with exit code 2 and an
error naming it.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

from jaxflow import preflight, refs
from jaxflow.config import ConfigError, load_config

# config.job -> module whose `run(config) -> int` does the work.
JOBS = {
    "model_check": "jaxflow.jobs.model_check",
    "rl": "jaxflow.jobs.rl",
    "warm_start": "jaxflow.jobs.warm_start",
}

USAGE = "usage: python -m jaxflow.main --config=PATH[:VARIANT] [--config.KEY=VALUE ...] [--import_timeout_s=S]"
TIMEOUT_FLAG = "--import_timeout_s"


def parse_args(argv: list[str]) -> tuple[str, dict[str, str]]:
    """Splits argv into the config spec and its `{dotted key: text}` overrides."""
    spec, overrides = None, {}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            raise SystemExit(f"{USAGE}\n\n{__doc__}")
        if not arg.startswith("--config"):
            raise ConfigError(f"unexpected argument {arg!r}; {USAGE}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ConfigError(f"{arg} needs a value; {USAGE}")
            value = args.pop(0)
        if key == "config":
            spec = value
        elif key.startswith("config."):
            overrides[key[len("config."):]] = value
        else:
            raise ConfigError(f"unexpected argument {arg!r}; {USAGE}")
    if spec is None:
        raise ConfigError(f"no --config given; {USAGE}")
    return spec, overrides


def import_timeout_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --import_timeout_s value or None, argv without it)."""
    value, rest, args = None, [], list(argv)
    while args:
        arg = args.pop(0)
        if arg == TIMEOUT_FLAG or arg.startswith(TIMEOUT_FLAG + "="):
            _, eq, value = arg.partition("=")
            if not eq:
                if not args:
                    raise ConfigError(f"{TIMEOUT_FLAG} needs a value; {USAGE}")
                value = args.pop(0)
        else:
            rest.append(arg)
    return value, rest


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> None:
    """Turns on JAX's persistent compilation cache (shared with the tests) so reruns skip compiles."""
    import jax

    directory = directory or os.environ.get("JAXFLOW_CACHE", pathlib.Path.home() / ".cache" / "jaxflow")
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory) / "jax_compilation"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def main(argv: list[str] | None = None, *, check_imports: bool = True) -> int:
    """Runs the job the config names; its exit code (2 for a bad config or user code that does not import).

    check_imports: import the config's user code in a child process first (`jaxflow.preflight`).
    """
    try:
        timeout, argv = import_timeout_flag(sys.argv[1:] if argv is None else argv)
        if timeout is not None:
            refs.parse_timeout(timeout, TIMEOUT_FLAG)  # a RefError naming the flag
            os.environ[refs.TIMEOUT_ENV] = timeout  # the run's other processes (reward workers, ...) too
        spec, overrides = parse_args(argv)
        refs.import_timeout_s()  # a bad $JAXFLOW_IMPORT_TIMEOUT_S is named before anything imports
        problem = preflight.check(spec, overrides) if check_imports else None
        if problem is not None:
            raise ConfigError(problem)
        config = load_config(spec, overrides)
        if config.job not in JOBS:
            raise ConfigError(f"config.job {config.job!r} is not a known job; known: {', '.join(JOBS)}")
    except (ConfigError, refs.RefError) as e:
        print(f"jaxflow: error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    job = importlib.import_module(JOBS[config.job])
    return int(job.run(config) or 0)


def _exit(code: int) -> None:
    """Exits with `code`; with an import thread still hung (refs.ImportHung), at once after flushing, since a
    normal exit could wait on it."""
    if refs.hung_imports():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
