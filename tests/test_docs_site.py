"""The documentation site in docs/ builds with mkdocs in strict mode: a broken link, a missing anchor or a
page left out of the navigation fails it, and so does any other warning."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "mkdocs" / "mkdocs.yml"


def test_the_docs_site_builds_strictly(tmp_path):
    mkdocs = pathlib.Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # a banner about the theme's future, not about our pages
    run = subprocess.run([str(mkdocs), "build", "--strict", "-f", str(CONFIG), "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "mkdocs warned:\n" + "\n".join(warnings)
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")} | {"index"}
    assert pages <= built, f"pages not in the site: {sorted(pages - built)}"


def test_the_docs_have_every_page_the_readme_points_to():
    expected = {"index", "install", "design", "algorithms", "environments", "cluster", "reliability", "configs",
                "benchmarks"}
    present = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert expected <= present, f"missing pages: {sorted(expected - present)}"
