"""Question answering on the user's own data: GSM8K-style JSONL or parquet with a numeric final answer.

Each row has a question and an answer (field names configurable). The answer is either a number (a JSON number
or its text) or a worked solution ending in GSM8K's "#### <number>":

    {"question": "Natalia sold clips to 48 friends in April, and half as many in May. ...",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n... 48+24 = <<48+24=72>>72 clips.\\n#### 72"}

The final number is the reference answer; the text before "####" (with GSM8K's "<<48/2=24>>" calculator
annotations removed) is the worked solution the demonstration shows before `<answer>72</answer>`. A reward
compares numbers exactly, tolerant of thousands commas, "$" and trailing zeros ("1,000.0" is 1000).

Rows are validated as they load; a bad one (invalid JSON, not an object, a missing field, a question that is
not a non-empty string, an answer with no final number) raises ValueError naming the file and its 1-based
line (JSONL) or row (parquet). Parquet needs pyarrow, imported only when a parquet file is read.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

from jaxflow.tasks import (
    Task,
    answer_tagged,
    canonical_number,
    check_split,
    extract_answer,
    last_number,
    parse_number,
    scored,
    split_of,
    split_rng,
)

NAME = "jsonl_qa"
ANSWER_MODES = ("tag", "last_number")
FORMATS = ("jsonl", "parquet")

_GSM8K_CALCULATOR = re.compile(r"<<[^<>]*>>")
_FINAL_MARK = "####"


def reward(response: str, meta: dict) -> float:
    """1.0 if the response's answer equals meta["answer"] as a number, else 0.0 (or meta's format score).

    meta["answer_mode"] picks the answer: "tag" (default) the number in the last `<answer>...</answer>`,
    "last_number" the last number anywhere in the response.
    """
    if meta.get("answer_mode", "tag") == "last_number":
        value = last_number(response)
    else:
        value = parse_number(extract_answer(response))
    return scored(value is not None and value == parse_number(meta["answer"]), value is not None, meta)


def parse_reference(answer: Any) -> tuple[str, str | None] | None:
    """(canonical final number, worked solution or None) of a dataset answer, or None if it has no number.

    A number, or text that is a number, is the answer itself; text with "####" is a GSM8K solution whose final
    number follows the last "####".
    """
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return str(answer), None
    if isinstance(answer, float):
        text = repr(answer)
        value = parse_number(text)
        return (canonical_number(value), None) if value is not None else None
    if not isinstance(answer, str):
        return None
    solution, mark, final = answer.rpartition(_FINAL_MARK)
    value = parse_number(final if mark else answer)
    if value is None:
        return None
    solution = _GSM8K_CALCULATOR.sub("", solution).strip() if mark else ""
    try:
        return canonical_number(value), solution or None
    except ValueError:
        return None


def _jsonl_rows(path: pathlib.Path):
    """(1-based line number, parsed row) for each non-blank line. Lines are decoded one by one, so that a
byte that is not UTF-8 is reported with its line and column (not as a codec error at a file offset)."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                 f"{len(raw[:e.start].decode('utf-8')) + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: invalid JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:  # json recurses per nesting level
                raise ValueError(f"{path}:{number}: invalid JSON (nested too deeply)") from None


def _parquet_rows(path: pathlib.Path, columns: list[str]):
    """(1-based row number, row dict) for each row of the columns."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading parquet needs pyarrow, which is not installed "
                          "(pip install pyarrow), or convert the file to JSONL") from None
    schema = pq.read_schema(path)
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise ValueError(f"{path}: no column(s) {', '.join(missing)}; the file has {', '.join(schema.names)}")
    yield from enumerate(pq.read_table(path, columns=columns).to_pylist(), start=1)


def load_qa(path: str | os.PathLike, *, question_field: str = "question", answer_field: str = "answer",
            file_format: str | None = None) -> list[dict]:
    """Loads and validates a question/answer file.

    Args:
      path: a .jsonl (one JSON object per line; blank lines skipped) or .parquet file.
      question_field, answer_field: the names of the question and answer fields.
      file_format: "jsonl" or "parquet"; None picks by suffix (.parquet / .pq, else JSONL).

    Returns:
      one example per row: {"question", "answer": canonical number text, "solution": str or None,
      "source": "file:line"}.

    Raises:
      ValueError: a bad row, named by file and 1-based line or row number; or an empty file.
      ImportError: a parquet file without pyarrow installed.
    """
    path = pathlib.Path(path)
    if file_format is None:
        file_format = "parquet" if path.suffix.lower() in (".parquet", ".pq") else "jsonl"
    if file_format not in FORMATS:
        raise ValueError(f"{path}: unknown file_format {file_format!r}; valid: {', '.join(FORMATS)}")
    if file_format == "parquet":
        rows, where = _parquet_rows(path, [question_field, answer_field]), "row"
    else:
        rows, where = _jsonl_rows(path), "line"
    examples = []
    for number, row in rows:
        at = f"{path}:{number}" if where == "line" else f"{path}: row {number}"
        if not isinstance(row, dict):
            raise ValueError(f"{at}: expected a JSON object, got {type(row).__name__}")
        for field in (question_field, answer_field):
            if field not in row:
                raise ValueError(f"{at}: missing field {field!r} (has {', '.join(map(repr, row)) or 'no fields'})")
        question = row[question_field]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{at}: {question_field!r} must be a non-empty string, got {question!r:.80}")
        reference = parse_reference(row[answer_field])
        if reference is None:
            raise ValueError(f"{at}: {answer_field!r} has no final number (a number, or a solution ending in "
                             f"'#### <number>'): {row[answer_field]!r:.80}")
        answer, solution = reference
        examples.append({"question": question.strip(), "answer": answer, "solution": solution, "source": at})
    if not examples:
        raise ValueError(f"{path}: no rows")
    return examples


def _question_key(row: dict) -> str:
    # Case and spacing differences should not put a duplicated question in both splits.
    return NAME + ":" + " ".join(row["question"].lower().split())


class JsonlQATask(Task):
    """Questions with numeric answers from the user's JSONL or parquet file(s).

    Args:
      path: the data file (see `load_qa`).
      eval_path: a separate held-out file for the "eval" split; without one, `path` is split by a hash of each
        question (a question is in "eval" with probability `eval_fraction`).
      question_field, answer_field: the field (column) names.
      file_format: "jsonl", "parquet", or None to pick by suffix.
      answer_mode: "tag" scores the number in `<answer>...</answer>`; "last_number" the last number written.
      system_prompt, format_score, eval_fraction, reward_ref: as for `Task`.
    """

    name = NAME
    reward_ref = "jaxflow.tasks.jsonl_qa:reward"

    def __init__(self, *, path: str | os.PathLike, eval_path: str | os.PathLike | None = None,
                 question_field: str = "question", answer_field: str = "answer", file_format: str | None = None,
                 answer_mode: str = "tag", **task_options):
        super().__init__(**task_options)
        if path is None:
            raise ValueError("jsonl_qa: no data file given (set task.path to a .jsonl or .parquet file)")
        if answer_mode not in ANSWER_MODES:
            raise ValueError(f"jsonl_qa: unknown answer_mode {answer_mode!r}; valid: {', '.join(ANSWER_MODES)}")
        self.answer_mode = answer_mode
        load = dict(question_field=question_field, answer_field=answer_field, file_format=file_format)
        rows = load_qa(path, **load)
        if eval_path is None:
            self._splits = {split: [r for r in rows if split_of(_question_key(r), self.eval_fraction) == split]
                            for split in ("train", "eval")}
        else:
            self._splits = {"train": rows, "eval": load_qa(eval_path, **load)}

    def size(self, split: str) -> int:
        """How many problems `split` holds."""
        check_split(split)
        return len(self._splits[split])

    def examples(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` problems of `split` in an order shuffled by `seed`; all of them if the split holds fewer."""
        check_split(split)
        rows = list(self._splits[split])
        split_rng(self.name, split, seed).shuffle(rows)
        return [dict(r) for r in rows[:n]]

    def meta(self, example: dict) -> dict:
        return {**super().meta(example), "answer_mode": self.answer_mode}

    def demonstration(self, example: dict) -> str:
        """The dataset's worked solution (if any), then the final answer in tags."""
        return answer_tagged(example.get("solution") or "", example["answer"])

