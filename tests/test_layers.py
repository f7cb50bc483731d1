"""The import layers in pyproject.toml's `[tool.importlinter]` contract hold, and a wrong import breaks them."""
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT = pathlib.Path(sys.executable).with_name("lint-imports")


def _lint(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    # PYTHONPATH puts `cwd`'s packages ahead of any installed copy, so a copied tree is what gets checked.
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)})


def test_the_layers_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"jaxflow layers KEPT", done.stdout)


def test_a_service_importing_the_transport_breaks_the_contract(tmp_path):
    for name in ("jaxflow", "rollout_bridge"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    service = tmp_path / "jaxflow" / "data" / "trajectory_service.py"
    service.write_text(service.read_text() + "\nfrom jaxflow.transport import rpc  # noqa: E402,F401\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "jaxflow layers BROKEN" in done.stdout
    assert "jaxflow.data.trajectory_service -> jaxflow.transport.rpc" in done.stdout
