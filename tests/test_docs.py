"""Docs true to the code: docstring examples run, the README's layout matches the tree, and nothing
points at a file outside the repository."""

import ast
import doctest
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "jaxflow").rglob("*.py"), *(ROOT / "rollout_bridge").rglob("*.py"),
                  *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "configs").glob("*.py")])


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


WITH_EXAMPLES = [p for p in SOURCES if ">>> " in p.read_text() and p.parts[-2] not in ("benchmarks", "configs")]


def test_some_docstrings_have_examples():
    assert WITH_EXAMPLES, "no docstring examples found: the doctest below would test nothing"


@pytest.mark.parametrize("path", WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docstring_examples_run(path):
    module = importlib.import_module(_module_name(path))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


def _layout_paths() -> set[str]:
    """Every path the README's layout tree names: entries by their indentation, and the `name.py`
    files mentioned in an entry's description, inside that entry."""
    paths, top, entry = set(), None, None
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("\nLayers,", 1)[0]
    for line in block.splitlines():
        m = re.match(r"^(    |      )(\S+)", line)
        if m and len(m.group(1)) == 4:
            top, entry = m.group(2), None
            paths.add(top)
        elif m:
            entry = top + m.group(2)
            paths.add(entry)
        if not line.startswith("    "):
            continue
        owner = entry if entry and entry.endswith("/") else (top if entry is None else None)
        for name in re.findall(r"\b(\w+\.py)\b", line[line.find(" ", 6) if m else 0:]):
            if owner:
                paths.add(owner + name)
    return paths


def test_readme_layout_names_real_paths():
    paths = _layout_paths()
    assert {"jaxflow/", "jaxflow/trainer/", "jaxflow/trainer/step.py", "rollout_bridge/jax_engine.py"} <= paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"the README's layout names paths that do not exist: {missing}"


def test_readme_layout_covers_the_package():
    paths = _layout_paths()
    pkg = ROOT / "jaxflow"
    present = {f"jaxflow/{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").exists()}
    present |= {f"jaxflow/{p.name}" for p in pkg.glob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(present - paths)
    assert not unlisted, f"the README's layout does not mention: {unlisted}"


def test_nothing_points_outside_the_repository():
    texts = {p: p.read_text() for p in [*SOURCES, *(ROOT / "tests").rglob("*.py"), ROOT / "README.md",
                                        ROOT / "pyproject.toml"] if p != pathlib.Path(__file__)}
    bad = [str(p.relative_to(ROOT)) for p, t in texts.items() if re.search(r"DESIGN\.md|\.\./shared", t)]
    assert not bad, f"references to files outside the repository in {bad}"


def _imported_top_modules() -> set[str]:
    names = set()
    for path in [p for p in SOURCES if p.parts[-2] not in ("benchmarks", "configs")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.slow  # imports every dependency
def test_declared_dependencies_are_imported_and_imports_declared():
    import importlib.metadata as md
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    declared = {canon(re.match(r"[A-Za-z0-9_.-]+", d).group(0)) for d in project["dependencies"]}
    dists_of = md.packages_distributions()
    imported_dists = {canon(d) for m in _imported_top_modules() for d in dists_of.get(m, [])}
    third_party = {m for m in _imported_top_modules()
                   if m not in sys.stdlib_module_names and m not in ("jaxflow", "rollout_bridge")}
    # Optional, imported only where used: vllm and torch (the rollout extras, where vLLM runs), ray (the
    # cluster extra), pyarrow (parquet datasets; its absence is a clear error), skyrl_gym (the envs extra).
    optional = {"vllm", "torch", "ray", "pyarrow", "skyrl_gym"}
    undeclared = sorted(m for m in third_party - optional
                        if not {canon(d) for d in dists_of.get(m, [m])} & declared)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = sorted(declared - imported_dists)
    assert not unused, f"declared in pyproject.toml but imported nowhere in the package: {unused}"
