"""The figures the docs quote come from committed result files: benchmarks/results/*.json parse and carry a
complete meta block, the generated blocks in README.md and docs/benchmarks.md are what
benchmarks/results_tables.py makes of them, and no result-like figure is typed into the docs by hand."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_meta  # noqa: E402
import results_tables  # noqa: E402

RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

# Number + unit shapes that measured results take. A match outside a generated block and outside code is a
# figure typed by hand.
_NUM = r"\d[\d,]*(?:\.\d+)?"
FIGURE_PATTERNS = [
    rf"{_NUM}\s*(?:trained\s+)?(?:tok/s|tokens/s|tokens per second|tokens a second)",
    rf"(?<![\w.]){_NUM}x\b(?!\s*\d)",  # a ratio: "2.3x", "1.37x" (not "2x2"-style shapes)
    rf"{_NUM}\s*%\s*(?:MFU|of (?:the )?peak|held-out|accuracy)",
    r"\bMFU\s*(?:of\s*)?" + _NUM,
    rf"{_NUM}\s*(?:GB/s|GiB/s|MB/s|GFLOP/s|TFLOP/s)",
    rf"{_NUM}\s*(?:s|ms) (?:a|per) step",
    rf"(?:accuracy|held-out)[^.\n|]{{0,40}}?{_NUM}\s*%",
    rf"{_NUM}\s*ms\b",
]
FIGURE = re.compile("|".join(f"(?:{p})" for p in FIGURE_PATTERNS), re.IGNORECASE)
# Numbers of that shape that are not results: (file name, exact matched text).
ALLOWED: set[tuple[str, str]] = set()


def _prose(text: str) -> str:
    """`text` without generated blocks, fenced or indented code blocks, inline code and HTML comments."""
    text = results_tables.MARKER.sub("", text)
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    kept, prev_blank = [], True
    in_indented = False
    for line in text.splitlines():
        if line.startswith("    ") and (prev_blank or in_indented) and not line.lstrip().startswith(("-", "*")):
            in_indented = True
            continue
        in_indented = in_indented and not line.strip() == "" and line.startswith("    ")
        prev_blank = not line.strip()
        kept.append(line)
    return re.sub(r"`[^`\n]*`", "", "\n".join(kept))


def hand_typed_figures(path: pathlib.Path) -> list[str]:
    """The result-like figures in `path`'s prose, outside generated blocks and code, less ALLOWED."""
    found = []
    for line in _prose(path.read_text()).splitlines():
        for m in FIGURE.finditer(line):
            if (path.name, m.group(0)) not in ALLOWED:
                found.append(f"{path.relative_to(ROOT)}: {m.group(0)!r} in: {line.strip()[:120]}")
    return found


def test_there_are_result_files():
    assert RESULT_FILES, "benchmarks/results/ holds no result file"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.stem)
def test_result_file_parses_with_a_complete_meta_block(path):
    result = json.loads(path.read_text())
    meta = result.get("meta")
    assert isinstance(meta, dict), f"{path.name}: no meta block (write it with results_meta.write_json)"
    missing = [k for k in results_meta.META_KEYS if k not in meta]
    assert not missing, f"{path.name}: meta lacks {missing}"
    missing = [k for k in results_meta.MACHINE_KEYS if k not in meta["machine"]]
    assert not missing, f"{path.name}: meta.machine lacks {missing}"
    assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"] or ""), f"{path.name}: commit {meta['commit']!r}"
    script, mode = results_tables.WRITTEN_BY.get(path.stem, (path.stem, ""))
    words = meta["command"].split()
    assert words[1] == f"benchmarks/{script}.py" and (not mode or f" {mode} " in f" {' '.join(words)} "), \
        f"{path.name}: written by {meta['command']!r}, not by benchmarks/{script}.py {mode}"
    assert path.stem in results_tables.HEADLINES, f"results_tables.HEADLINES has no entry for {path.stem}"
    for figure in results_tables.HEADLINES[path.stem]:
        figure.text(result)  # every headline field is there and formats


def test_generated_blocks_match_the_result_files():
    proc = subprocess.run([sys.executable, "benchmarks/results_tables.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"generated blocks out of date:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_every_result_file_has_its_block():
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    names = {m["name"] for m in results_tables.MARKER.finditer(docs)}
    assert {p.stem for p in RESULT_FILES} <= names
    assert "glance" in {m["name"] for m in results_tables.MARKER.finditer((ROOT / "README.md").read_text())}


def test_glance_names_headline_figures():
    assert len(results_tables.GLANCE) <= results_tables.GLANCE_ROWS
    for name, label, _ in results_tables.GLANCE:
        assert label in [f.label for f in results_tables.HEADLINES[name]], (name, label)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_figure_is_quoted_outside_the_generated_blocks(path):
    found = hand_typed_figures(path)
    assert not found, ("figures typed by hand (quote them from a generated block: benchmarks/results_tables.py; "
                       "or add a non-result number to ALLOWED):\n" + "\n".join(found[:40])
                       + (f"\n... and {len(found) - 40} more" if len(found) > 40 else ""))


@pytest.mark.parametrize("text,expected", [
    ("eta = 4 trains 1.37x as many tokens", ["1.37x"]),
    ("reached 5,248 tokens/s on two cores", ["5,248 tokens/s"]),
    ("MFU 12% here, and 31.6% held-out", ["MFU 12", "31.6% held-out"]),
    ("read bandwidth 17.7 GB/s", ["17.7 GB/s"]),
    ("the step takes 0.47 s a step", ["0.47 s a step"]),
    ("a 2-layer model, 64 wide, eta = 4, 32 groups of 8", []),
])
def test_the_scanner_finds_results_and_only_results(text, expected):
    assert [m.group(0) for m in FIGURE.finditer(text)] == expected


def test_the_scanner_skips_code_and_generated_blocks():
    text = ("prose 2.5x\n\n    .venv/bin/python x.py  # 9.9x\n\n```\n7.7x\n```\n`3.3x` inline\n"
            "<!-- results:x:begin -->\n| 4.4x |\n<!-- results:x:end -->\n")
    assert FIGURE.findall(_prose(text)) == ["2.5x"]
