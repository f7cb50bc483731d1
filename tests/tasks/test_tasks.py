"""The RL tasks: deterministic disjoint splits, demonstrations the rewards accept, rewards that refuse wrong,
garbage and malicious answers quickly, long-tailed response lengths, prompts that fit the tiny model."""

import json
import random
import statistics
import time

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from jaxflow import tasks
from jaxflow.data.prompt_source import PromptSource
from jaxflow.models.tiny import IM_START, write_tiny_tokenizer
from jaxflow.tasks import arithmetic, countdown, get_task, jsonl_qa
from jaxflow.tasks.arithmetic import length_parity_reward

GENERATED = ("arithmetic", "countdown")
ALL = GENERATED + ("jsonl_qa",)


def gsm8k_rows(n, seed=0):
    """GSM8K-shaped rows: a word problem, a worked solution with <<calculator>> annotations, '#### N'."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        value = rng.randint(2, 40)
        question = f"Problem {i}: Tom has {value} apples."
        lines = []
        # Mostly one or two steps, sometimes many: user data has long-tailed solutions too.
        for _ in range(rng.choice([1, 1, 1, 2, 2, 3, 5, 9])):
            b = rng.randint(2, 12)
            op, new = rng.choice([("+", value + b), ("*", value * b)])
            question += f" He {'gets' if op == '+' else 'multiplies them by'} {b}."
            lines.append(f"Now he has {value}{op}{b} = <<{value}{op}{b}={new}>>{new} apples.")
            value = new
        rows.append({"question": question + " How many apples does he have?",
                     "answer": "\n".join(lines) + f"\n#### {value:,}"})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def qa_path(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("qa") / "gsm8k_like.jsonl", gsm8k_rows(800))


@pytest.fixture(scope="module")
def made(qa_path):
    """name -> task, with jsonl_qa reading the GSM8K-like file."""
    return {"arithmetic": get_task("arithmetic"), "countdown": get_task("countdown"),
            "jsonl_qa": get_task("jsonl_qa", path=qa_path)}


def problem_key(name, example):
    if name == "countdown":
        return (tuple(sorted(example["numbers"])), example["target"])
    return example.get("expression", example["question"])


# ---- registry ----

def test_get_task_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="arithmetic, countdown, jsonl_qa"):
        get_task("sudoku")
    with pytest.raises(ValueError, match="max_opz.*valid options: .*max_ops"):
        get_task("arithmetic", max_opz=3)
    with pytest.raises(ValueError, match="unknown split"):
        get_task("arithmetic").examples("test", 3, 0)
    with pytest.raises(ValueError, match="meta names task"):
        tasks.reward("<answer>1</answer>", {"task": "nope"})


# ---- all tasks ----

@pytest.mark.parametrize("name", ALL)
def test_examples_are_deterministic(made, name):
    task = made[name]
    first = task.examples("train", 50, seed=3)
    assert first == task.examples("train", 50, seed=3)
    assert len(first) == 50
    assert first != task.examples("train", 50, seed=4)
    assert json.loads(json.dumps(first)) == first


@pytest.mark.parametrize("name", ALL)
def test_train_and_eval_are_disjoint(made, name):
    task = made[name]
    train = {problem_key(name, e) for e in task.examples("train", 3000, seed=0)}
    held_out = {problem_key(name, e) for e in task.examples("eval", 300, seed=0)}
    assert held_out and not train & held_out


@pytest.mark.parametrize("name", GENERATED)
def test_eval_problems_are_distinct(made, name):
    keys = [problem_key(name, e) for e in made[name].examples("eval", 500, seed=0)]
    assert len(set(keys)) == len(keys)
    # A split too small for the request is an error, not an endless search.
    with pytest.raises(ValueError, match="found only"):
        get_task("arithmetic", max_ops=1, max_number=3).examples("eval", 50, seed=0)


@pytest.mark.parametrize("name", ALL)
def test_demonstrations_score_one(made, tokenizer, name):
    task = made[name]
    examples = task.examples("train", 500, seed=1)
    records = task.to_prompt_records(examples, tokenizer)
    for example, record in zip(examples, records):
        demo = task.demonstration(example)
        assert task.reward(demo, record["meta"]) == 1.0, demo
        # The generic reward used by a pool for mixed-task runs dispatches to the same function.
        assert tasks.reward(demo, record["meta"]) == 1.0
    assert task.reward_ref.startswith(f"jaxflow.tasks.{name}:")


@pytest.mark.parametrize("name", ALL)
def test_prompts_render_with_the_chat_template_and_fit(made, tokenizer, name):
    task = made[name]
    examples = task.examples("eval", 200, seed=0)
    records = task.to_prompt_records(examples, tokenizer)
    for example, record in zip(examples, records):
        text = tokenizer.apply_chat_template(task.prompt_messages(example))
        assert text.startswith(f"{IM_START}system\n") and text.endswith(f"{IM_START}assistant\n")
        assert example["question"] in text
        assert record["prompt"] == tokenizer.encode(text)
        if name in GENERATED:  # user data is as long as the user wrote it
            assert len(record["prompt"]) <= 128
    # Records go over the wire (msgpack) and into checkpoints (JSON) unchanged, and feed a PromptSource.
    assert msgpack.unpackb(msgpack.packb(records)) == records
    assert json.loads(json.dumps(records)) == records
    assert PromptSource(records).next()["prompt"] in [r["prompt"] for r in records]


@pytest.mark.parametrize("name", ALL)
def test_sft_records_end_with_eos(made, tokenizer, name):
    task = made[name]
    example = task.examples("train", 1, seed=0)[0]
    record = task.to_sft_records([example], tokenizer)[0]
    assert record["completion"][-1] == tokenizer.eos_id
    assert tokenizer.decode(record["completion"]) == task.demonstration(example)


@pytest.mark.parametrize("name", GENERATED)
def test_demonstration_lengths_have_a_long_tail(made, tokenizer, name):
    task = made[name]
    demos = [task.demonstration(e) for e in task.examples("train", 1000, seed=0)]
    lengths = sorted(len(ids) + 1 for ids in tokenizer.encode_batch(demos))  # + the end-of-turn token
    median, p95 = statistics.median(lengths), lengths[int(0.95 * len(lengths))]
    print(f"{name}: demonstration tokens median {median}, p95 {p95}, max {lengths[-1]}")
    assert p95 >= 2.5 * median
    assert lengths[-1] <= 448  # prompt + response within a 512-token context


GARBAGE = [None, "", "no tags at all", "<answer></answer>", "<answer>", "</answer><answer>",
           "<answer>" * 100_000, "x" * 1_000_000, "<answer>" + "9" * 100_000 + "</answer>", "\x00\xff\ud800",
           "<answer>__import__('os').system('echo pwned')</answer>", "<answer>9**9**9</answer>",
           "<answer>" + "(" * 150 + "1" + ")" * 150 + "</answer>"]


@pytest.mark.parametrize("name", ALL)
def test_rewards_refuse_garbage_quickly(made, name):
    task = made[name]
    meta = task.meta(task.examples("train", 1, seed=0)[0])
    for response in GARBAGE:
        start = time.perf_counter()
        assert task.reward(response, meta) == 0.0
        # The danger is unbounded work (evaluating 9**9**9, a backtracking regex on 100k characters): hours,
        # not the milliseconds a bounded parse takes; the bound tells them apart on any machine.
        assert time.perf_counter() - start < 5.0, f"{response[:40]!r} took too long"


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text().map(lambda t: f"<answer>{t}</answer>"),
                 st.text(alphabet="0123456789+-*/() =.,", max_size=60).map(lambda t: f"<answer>{t}</answer>")))
def test_rewards_never_raise_on_any_text(response):
    metas = [{"task": "arithmetic", "answer": 7}, {"task": "countdown", "numbers": [1, 2, 4], "target": 7},
             {"task": "jsonl_qa", "answer": "7"}, {"task": "jsonl_qa", "answer": "7", "answer_mode": "last_number"}]
    for meta in metas:
        assert tasks.reward(response, meta) in (0.0, 1.0)


# ---- arithmetic ----

def test_arithmetic_steps_follow_precedence():
    task = get_task("arithmetic", operators="+-*/", max_ops=8)
    for example in task.examples("train", 300, seed=0):
        # Our own generated expressions, not untrusted text: eval is the reference for precedence here.
        assert eval(example["expression"]) == example["answer"]  # noqa: S307
        lines = task.demonstration(example).splitlines()
        assert len(lines) == example["num_ops"] + 1
        assert all(eval(line[2:]) == example["answer"] for line in lines[:-1])  # noqa: S307
    assert arithmetic.evaluation_steps([7, "+", 5, "*", 3, "-", 2]) == [[7, "+", 15, "-", 2], [22, "-", 2], [20]]


def test_arithmetic_demonstration_format():
    example = {"question": "Compute 7 + 5 * 3 - 2.", "answer": 20, "expression": "7 + 5 * 3 - 2", "num_ops": 3}
    assert get_task("arithmetic").demonstration(example) == (
        "= 7 + 15 - 2\n= 22 - 2\n= 20\n<answer>20</answer>")


def test_arithmetic_reward():
    meta = {"task": "arithmetic", "answer": 1200}
    for good in ("<answer>1200</answer>", "<answer> 1,200 </answer>", "work\n<answer>1200.0</answer>",
                 "<answer>5</answer> no wait <answer>1200</answer>"):
        assert arithmetic.reward(good, meta) == 1.0, good
    for bad in ("<answer>1201</answer>", "<answer>1200</answer> oops <answer>3</answer>", "1200",
                "<answer>1200 apples</answer>", "<answer>12e2</answer>"):
        assert arithmetic.reward(bad, meta) == 0.0, bad


def test_format_score_is_off_by_default_and_documented_when_on():
    task = get_task("arithmetic", format_score=0.1)
    meta = task.meta(task.examples("train", 1, seed=0)[0])
    assert task.reward("<answer>-99999</answer>", meta) == pytest.approx(0.1)
    assert task.reward("<answer>what</answer>", meta) == 0.0
    assert get_task("arithmetic").meta(task.examples("train", 1, seed=0)[0])["format_score"] == 0.0
    with pytest.raises(ValueError, match="format_score"):
        get_task("arithmetic", format_score=1.0)


def test_difficulty_knob_changes_length(made, tokenizer):
    easy = get_task("arithmetic", max_ops=2).examples("train", 300, seed=0)
    hard = get_task("arithmetic", max_ops=10, ops_decay=0.9).examples("train", 300, seed=0)
    assert max(e["num_ops"] for e in easy) == 2
    assert statistics.mean(e["num_ops"] for e in hard) > 2 * statistics.mean(e["num_ops"] for e in easy)


# ---- countdown ----

def test_countdown_problems_are_solvable_and_use_every_number(made):
    task = get_task("countdown", min_numbers=3, max_numbers=4)
    examples = task.examples("train", 300, seed=0)
    assert {len(e["numbers"]) for e in examples} == {3, 4}
    for e in examples:
        value, used = countdown.evaluate_equation(e["answer"])
        assert value == e["target"] and sorted(used) == sorted(e["numbers"])
        assert 1 <= e["target"] <= 100
    with pytest.raises(ValueError, match="never reached"):
        get_task("countdown", max_number=2, min_numbers=3, max_numbers=3, min_target=500,
                 max_target=600).examples("train", 1, 0)


def test_countdown_reward_rules():
    meta = {"task": "countdown", "numbers": [3, 7, 25], "target": 46}
    assert countdown.reward("<answer>(25 - 7) * 3 - 8</answer>", meta) == 0.0  # 8 is not given
    meta = {"task": "countdown", "numbers": [3, 7, 25, 8], "target": 46}
    for good in ("<answer>(25 - 7) * 3 - 8</answer>", "<answer> 3 * (25 - 7) - 8 </answer>",
                 "<answer>(25 - 7) * 3 - 8 = 46</answer>", "<answer>((25-7)*3)-8</answer>"):
        assert countdown.reward(good, meta) == 1.0, good
    for bad in ("<answer>(25 - 7) * 3 - 8 = 45</answer>",  # a false equation
                "<answer>(25 - 7) * 3</answer>",  # 8 unused
                "<answer>(25 - 7) * 3 - 8 + 0</answer>",  # an extra number
                "<answer>(25 - 7) * 3 - 8 + 7 - 7</answer>",  # a number used twice
                "<answer>-(8 - (25 - 7) * 3)</answer>",  # unary minus
                "<answer>(25 - 7) * 3 - 2 ** 3</answer>",  # a power
                "<answer>(25 // 7) * 3 - 8</answer>", "<answer>(25.0 - 7) * 3 - 8</answer>",
                "<answer>(25 - 7) * 3 - 8 = 46 = 46</answer>", "<answer>abs(25 - 7) * 3 - 8</answer>",
                "<answer>(25 - 7) * 3 - 8; import os</answer>", "<answer>3 / (7 - 7) + 25 + 8</answer>"):
        assert countdown.reward(bad, meta) == 0.0, bad
    # Repeated given numbers may each be used once; division is exact, not floored.
    assert countdown.reward("<answer>2 * 2 + 5</answer>", {"numbers": [2, 5, 2], "target": 9}) == 1.0
    assert countdown.reward("<answer>2 * 5 - 1</answer>", {"numbers": [2, 5, 2], "target": 9}) == 0.0
    assert countdown.reward("<answer>7 / 2 * 2 + 1</answer>", {"numbers": [7, 2, 2, 1], "target": 8}) == 1.0
    assert countdown.reward("<answer>7 / 2 + 1</answer>", {"numbers": [7, 2, 1], "target": 4}) == 0.0


def test_countdown_demonstration_format():
    example = {"question": "Using the numbers [12, 5, 3], make 45.", "answer": "(12 - 3) * 5",
               "numbers": [12, 5, 3], "target": 45,
               "search": [[[12, "+", 5, 17], [17, "*", 3, 51]], [[12, "-", 3, 9], [9, "*", 5, 45]]]}
    assert get_task("countdown").demonstration(example) == (
        "12 + 5 = 17, 17 * 3 = 51. No.\n12 - 3 = 9, 9 * 5 = 45. Yes.\n<answer>(12 - 3) * 5</answer>")


def test_countdown_evaluator_never_executes_code(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.chdir(tmp_path)
    for text in (f"__import__('os').system('touch {marker}')", "open('pwned', 'w')", "().__class__",
                 "[1, 2]", "lambda: 1", "1 if 1 else 2", "x", "1 + 1j", "True + 1"):
        assert countdown.evaluate_equation(text) is None, text
    assert not marker.exists()


# ---- jsonl_qa ----

def test_jsonl_qa_loads_gsm8k_answers(qa_path):
    rows = jsonl_qa.load_qa(qa_path)
    assert len(rows) == 800
    raw = [json.loads(line) for line in qa_path.read_text().splitlines()]
    big = next(i for i, r in enumerate(raw) if "," in r["answer"].rpartition("####")[2])
    assert rows[big]["answer"] == raw[big]["answer"].rpartition("#### ")[2].replace(",", "")
    assert "<<" not in rows[0]["solution"] and rows[0]["solution"].startswith("Now he has")
    assert rows[0]["source"] == f"{qa_path}:1"


def test_jsonl_qa_answers_and_demonstration():
    assert jsonl_qa.parse_reference("She pays 3*4 = <<3*4=12>>12.\n#### 1,012") == ("1012", "She pays 3*4 = 12.")
    assert jsonl_qa.parse_reference(42) == ("42", None)
    assert jsonl_qa.parse_reference(2.50) == ("2.5", None)
    assert jsonl_qa.parse_reference("#### -7.0") == ("-7", None)
    assert jsonl_qa.parse_reference("18") == ("18", None)
    for bad in ("#### many", "", True, None, [3], "no number here", "#### 1/3"):
        assert jsonl_qa.parse_reference(bad) is None, bad


def test_jsonl_qa_reward_is_a_numeric_match():
    meta = {"task": "jsonl_qa", "answer": "1200"}
    for good in ("<answer>1200</answer>", "<answer>1,200</answer>", "<answer>$1,200.00</answer>",
                 "<answer> 1200. </answer>"):
        assert jsonl_qa.reward(good, meta) == 1.0, good
    for bad in ("<answer>120</answer>", "<answer>1200 dollars</answer>", "The answer is 1200.", "1200"):
        assert jsonl_qa.reward(bad, meta) == 0.0, bad
    last = {**meta, "answer_mode": "last_number"}
    assert jsonl_qa.reward("so 3 + 4 = 7, and the total is 1,200.", last) == 1.0
    assert jsonl_qa.reward("the total is 1,200, not 7", last) == 0.0
    assert jsonl_qa.reward("no numbers", last) == 0.0
    assert jsonl_qa.reward("<answer>-2.5</answer>", {"answer": "-2.50"}) == 1.0


def test_jsonl_qa_eval_path_and_answer_mode(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"q": "What is 2 + 2?", "a": 4}, {"q": "And 3 * 7?", "a": "21"}])
    held = write_jsonl(tmp_path / "test.jsonl", [{"q": "What is 10 - 3?", "a": "#### 7"}])
    task = get_task("jsonl_qa", path=train, eval_path=held, question_field="q", answer_field="a",
                    answer_mode="last_number")
    assert task.size("train") == 2 and task.size("eval") == 1
    assert len(task.examples("train", 10, seed=0)) == 2  # all of them when fewer than asked
    (example,) = task.examples("eval", 5, seed=0)
    assert example["question"] == "What is 10 - 3?"
    meta = task.meta(example)
    assert meta["answer_mode"] == "last_number" and task.demonstration(example) == "<answer>7</answer>"
    assert task.reward("10 - 3 = 7", meta) == 1.0
    with pytest.raises(ValueError, match="answer_mode"):
        get_task("jsonl_qa", path=train, question_field="q", answer_field="a", answer_mode="first")


@pytest.mark.parametrize("line, message", [
    ('{"question": "ok?", "answer": "#### 3"', r"invalid JSON"),
    ('["question", "answer"]', r"expected a JSON object, got list"),
    ('{"question": "ok?"}', r"missing field 'answer'"),
    ('{"answer": "#### 3"}', r"missing field 'question'"),
    ('{"question": 17, "answer": "#### 3"}', r"'question' must be a non-empty string"),
    ('{"question": "   ", "answer": "#### 3"}', r"'question' must be a non-empty string"),
    ('{"question": "ok?", "answer": "#### three"}', r"'answer' has no final number"),
    ('{"question": "ok?", "answer": null}', r"'answer' has no final number"),
])
def test_jsonl_qa_bad_rows_name_the_line(tmp_path, line, message):
    good = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
    path = tmp_path / "bad.jsonl"
    # Line 3 is bad; the blank line 2 is skipped but still counted.
    path.write_text(f"{good}\n\n{line}\n{good}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: {message}"):
        jsonl_qa.load_qa(path)


@pytest.mark.parametrize("bad, column", [(b"\xff", 15), (b"\xc3(", 15), (b"\xe2\x82", 15)],
                         ids=["ff", "bad-continuation", "cut-sequence"])
def test_jsonl_qa_non_utf8_byte_names_the_line(tmp_path, bad, column):
    good = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}).encode()
    path = tmp_path / "latin.jsonl"
    bad_line = b'{"question": "' + bad + b'?", "answer": "#### 3"}\n'
    path.write_bytes(good + b"\n" + good + b"\n" + bad_line + good + b"\n")
    with pytest.raises(ValueError,
                       match=rf"latin\.jsonl:3: not valid UTF-8 \(byte 0x{bad[0]:02x} at column {column}\)"):
        jsonl_qa.load_qa(path)


def test_jsonl_qa_deeply_nested_line_names_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    good = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
    path.write_text(good + "\n" + '{"question": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"deep\.jsonl:2: invalid JSON \(nested too deeply\)"):
        jsonl_qa.load_qa(path)


def test_jsonl_qa_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        jsonl_qa.load_qa(tmp_path / "empty.jsonl")


def test_jsonl_qa_parquet(tmp_path):
    rows = gsm8k_rows(20)
    path = tmp_path / "data.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match=r"data\.parquet: reading parquet needs pyarrow"):
            jsonl_qa.load_qa(path)
        return
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = jsonl_qa.load_qa(path)
    assert [r["question"] for r in loaded] == [r["question"] for r in rows]
    assert loaded[3]["source"] == f"{path}: row 4"
    pq.write_table(pa.Table.from_pylist(rows[:2] + [{"question": "ok?", "answer": "#### ?"}]), path)
    with pytest.raises(ValueError, match=r"data\.parquet: row 3: 'answer' has no final number"):
        jsonl_qa.load_qa(path)
    with pytest.raises(ValueError, match="no column"):
        jsonl_qa.load_qa(path, answer_field="solution")


def test_length_parity_reward_varies_with_any_output():
    assert [length_parity_reward(text, {}) for text in ("", "a", "ab", "abc")] == [1.0, 0.0, 1.0, 0.0]
