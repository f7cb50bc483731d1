"""`ruff check` (lint and import order, configured in pyproject.toml's `[tool.ruff]`) is clean on the whole
repository, and the configuration is the one that runs: a planted finding fails it."""
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    done = _ruff(".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_uses_the_project_settings(tmp_path):
    # A copy of the configuration beside a file with an unsorted import, an unused name and a 121-character
    # line: each is one of the rules the project selects, so each must be reported.
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "bad.py").write_text("import sys\nimport os\n\nx = 1\n" + "y = " + "1" * 117 + "\n")
    done = _ruff("bad.py", "--output-format", "concise", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    for rule in ("I001", "F401", "E501"):
        assert rule in done.stdout, (rule, done.stdout)
