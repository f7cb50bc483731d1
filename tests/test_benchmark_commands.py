"""Every benchmark script accepts `--quick --json PATH`, and its command line parses every command the docs
give for it (README.md and docs/*.md code blocks, docs/benchmarks.md's above all), without running a
benchmark: each script's `build_parser()` is imported and asked."""

from __future__ import annotations

import importlib
import pathlib
import re
import shlex
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# Modules under benchmarks/ that are not benchmarks: the shared pieces (soak_episodes: the soak's episodes;
# hlo_stats: the pod planner's HLO reader) and the table generator.
NOT_BENCHMARKS = {"hlo_stats", "incumbent_io", "results_meta", "results_tables", "soak_episodes"}
# The incumbent runners' command line is incumbent_io's (they run in TRL's and Tunix's own environments).
RUNNERS = {"incumbent_trl", "incumbent_tunix"}
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_BENCHMARKS)
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
COMMAND = re.compile(r"benchmarks/(?P<name>\w+)\.py(?P<args>[^\n]*)")


def parser_of(name: str):
    if name in RUNNERS:
        return importlib.import_module("incumbent_io").build_parser(name)
    module = importlib.import_module(name)
    assert hasattr(module, "build_parser"), f"benchmarks/{name}.py has no build_parser()"
    return module.build_parser()


def parse(name: str, argv: list[str]):
    try:
        return parser_of(name).parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"benchmarks/{name}.py does not parse {shlex.join(argv)!r}") from e


def _code_lines(text: str) -> list[str]:
    """The lines of fenced and indented code blocks, with backslash continuations joined."""
    lines, out, fence, prev_blank, indented = text.splitlines(), [], False, True, False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
            continue
        indented = line.startswith("    ") and (prev_blank or indented) and not fence
        if fence or indented:
            out.append(line)
        prev_blank = not line.strip()
    return re.sub(r"\s*\\\n\s*", " ", "\n".join(out)).splitlines()


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, script name, argv) for every benchmark command in the docs' code blocks."""
    found = []
    for path in DOC_FILES:
        for line in _code_lines(path.read_text()):
            line = line.split(" # ")[0]
            for m in COMMAND.finditer(line):
                args = re.sub(r"\[[^\]]*\]", " ", m["args"])  # usage lines: "[--quick]" is optional
                found.append((f"{path.relative_to(ROOT)}", m["name"], shlex.split(args)))
    return found


def test_every_script_is_checked():
    assert len(SCRIPTS) >= 15, SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_takes_quick_and_json(name, tmp_path):
    extra = ["--setup", str(tmp_path), "--out", str(tmp_path)] if name in RUNNERS else []
    args = parse(name, [*extra, "--quick", "--json", str(tmp_path / "r.json")])
    assert args.quick is True
    assert str(args.json) == str(tmp_path / "r.json")


COMMANDS = documented_commands()


@pytest.mark.parametrize("where,name,argv", COMMANDS,
                         ids=[f"{w}:{n}:{i}" for i, (w, n, _) in enumerate(COMMANDS)])
def test_documented_command_parses(where, name, argv):
    assert (ROOT / "benchmarks" / f"{name}.py").exists(), f"{where} runs benchmarks/{name}.py, which is absent"
    if name in NOT_BENCHMARKS:
        return
    parse(name, argv)


def test_code_lines_join_continuations():
    text = "prose benchmarks/x.py --no\n\n    .venv/bin/python benchmarks/a.py --x 1 \\\n        --y 2\n"
    assert _code_lines(text) == ["    .venv/bin/python benchmarks/a.py --x 1 --y 2"]
