"""The import contracts in pyproject.toml's `[tool.importlinter]` hold (the layers, and no cycle between the
modules of jaxflow.jobs), and a wrong import breaks them."""
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


def _lint_with(tmp_path: pathlib.Path, module: str, line: str) -> subprocess.CompletedProcess:
    """lint-imports over a copy of the packages in which `module` (a path under the root) ends with `line`."""
    for name in ("jaxflow", "rollout_bridge"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    return _lint(tmp_path)


def test_the_contracts_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"jaxflow layers KEPT", done.stdout)
    assert re.search(r"jaxflow\.jobs acyclic KEPT", done.stdout)


def test_a_service_importing_the_transport_breaks_the_contract(tmp_path):
    done = _lint_with(tmp_path, "jaxflow/data/trajectory_service.py", "from jaxflow.transport import rpc")
    assert done.returncode != 0
    assert "jaxflow layers BROKEN" in done.stdout
    assert "jaxflow.data.trajectory_service -> jaxflow.transport.rpc" in done.stdout


def test_a_cycle_between_jobs_breaks_the_contract(tmp_path):
    # rl hands over to rl_cluster; rl_cluster importing rl back closes a cycle.
    done = _lint_with(tmp_path, "jaxflow/jobs/rl_cluster.py", "from jaxflow.jobs import rl")
    assert done.returncode != 0
    assert "jaxflow.jobs acyclic BROKEN" in done.stdout
    assert "jaxflow layers KEPT" in done.stdout
    assert "No cycles are allowed in jaxflow.jobs" in done.stdout
