"""jaxflow's command line.

    python -m jaxflow.main --config=configs/<experiment>.py[:variant] [--config.<key>=<value> ...]

The config's `job` field picks what runs; the logic lives in importable modules so notebooks can call
the same functions.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import sys

from jaxflow.config import ConfigError, load_config

# config.job -> module whose `run(config) -> int` does the work.
JOBS = {
    "model_check": "jaxflow.jobs.model_check",
    "rl": "jaxflow.jobs.rl",
    "warm_start": "jaxflow.jobs.warm_start",
}

USAGE = "usage: python -m jaxflow.main --config=PATH[:VARIANT] [--config.KEY=VALUE ...]"


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


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> None:
    """Turns on JAX's persistent compilation cache (shared with the tests) so reruns skip compiles."""
    import jax

    directory = directory or os.environ.get("JAXFLOW_CACHE", pathlib.Path.home() / ".cache" / "jaxflow")
    jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(directory) / "jax_compilation"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def main(argv: list[str] | None = None) -> int:
    try:
        spec, overrides = parse_args(sys.argv[1:] if argv is None else argv)
        config = load_config(spec, overrides)
        if config.job not in JOBS:
            raise ConfigError(f"config.job {config.job!r} is not a known job; known: {', '.join(JOBS)}")
    except ConfigError as e:
        print(f"jaxflow: error: {e}", file=sys.stderr)
        return 2
    enable_compilation_cache()
    job = importlib.import_module(JOBS[config.job])
    return int(job.run(config) or 0)


if __name__ == "__main__":
    sys.exit(main())
