"""Docs true to the code: docstring examples run, the README's layout matches the tree, its links resolve, and
nothing points at a file outside the repository."""

import ast
import doctest
import importlib
import importlib.util
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
    """Every path the README's layout tree names (the first ```text block under "## Layout"): entries by
    their indentation (0: top level, 2: inside the last top-level folder), and the `name.py` files
    mentioned in an entry's description, inside that entry when it is a folder."""
    paths, top, entry = set(), None, None
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    for line in block.splitlines():
        m = re.match(r"^( {0,2})(\S+)", line)
        if m and not m.group(1):
            top, entry = m.group(2), None
            paths.add(top)
        elif m:
            entry = top + m.group(2)
            paths.add(entry)
        owner = entry if entry and entry.endswith("/") else (top if entry is None else None)
        description = line[m.end():] if m else line
        for name in re.findall(r"\b(\w+\.py)\b", description):
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


def test_readme_links_name_real_files():
    """Relative links of the README (to docs/ pages, notebooks) point at files that exist."""
    text = (ROOT / "README.md").read_text()
    targets = {m.split("#", 1)[0] for m in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in m}
    missing = sorted(t for t in targets if t and not (ROOT / t).exists())
    assert not missing, f"the README links to files that do not exist: {missing}"


def test_readme_how_it_works_names_real_files():
    """Each stage of "How it works" is "`file` — one sentence", and the files exist."""
    section = (ROOT / "README.md").read_text().split("## How it works", 1)[1].split("\n## ", 1)[0]
    stages = re.findall(r"^\d+\. `([^`]+)` — ", section, re.MULTILINE)
    assert len(stages) >= 8, f"How it works lists {len(stages)} stages as `file` — sentence"
    named = set(stages) | set(re.findall(r"`((?:jaxflow|rollout_bridge)/[\w/]+\.py)`", section))
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"How it works names files that do not exist: {missing}"


DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_snippets_parse_and_import_what_exists(page):
    """Every ```python block of the README and docs/ is valid Python, and what it imports from jaxflow exists."""
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "jaxflow":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"{page.name}: `from {node.module} import {alias.name}`: no such name"


def test_docs_name_real_paths():
    """Every repository path the README and docs/ quote (`jaxflow/...`, `tests/...`, `benchmarks/...`) exists."""
    quoted = {m for page in DOC_PAGES for m in re.findall(
        r"`((?:jaxflow|rollout_bridge|tests|benchmarks|configs|colabs)/[\w/.]*)`", page.read_text())}
    missing = sorted(p for p in quoted if not (ROOT / p).exists())
    assert not missing, f"the docs quote paths that do not exist: {missing}"


def _leaf_keys(tree: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in tree.items():
        keys += _leaf_keys(value, f"{prefix}{name}.") if isinstance(value, dict) and value else [prefix + name]
    return keys


@pytest.mark.parametrize("config_file", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_the_configs_page_names_every_key(config_file, monkeypatch):
    """docs/configs.md names every key of every config file: as `section.key`, or by its name in its
    section's table."""
    from jaxflow.config import load_config

    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "configs.md").read_text()
    keys = _leaf_keys(load_config(str(config_file.relative_to(ROOT))).to_dict())
    missing = [k for k in keys if f"`{k}`" not in text
               and not re.search(rf"`[^`]*\b{re.escape(k.rsplit('.', 1)[-1])}\b[^`]*`", text)]
    assert not missing, f"docs/configs.md does not describe {config_file.name}'s keys {missing}"


def test_nothing_points_outside_the_repository():
    texts = {p: p.read_text() for p in [*SOURCES, *(ROOT / "tests").rglob("*.py"), ROOT / "README.md",
                                        *(ROOT / "docs").rglob("*.md"), ROOT / "pyproject.toml"]
             if p != pathlib.Path(__file__)}
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
    # cluster extra), pyarrow (parquet datasets; its absence is a clear error), skyrl_gym and verifiers (the
    # envs extra), fastapi, starlette and uvicorn (the agents extra: rollout_bridge.openai_endpoint), openai
    # (the agents extra: the demo's agent program, jaxflow.envs.calculator_agent).
    optional = {"vllm", "torch", "ray", "pyarrow", "skyrl_gym", "verifiers", "fastapi", "starlette", "uvicorn",
                "openai"}
    undeclared = sorted(m for m in third_party - optional
                        if not {canon(d) for d in dists_of.get(m, [m])} & declared)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = sorted(declared - imported_dists)
    assert not unused, f"declared in pyproject.toml but imported nowhere in the package: {unused}"
