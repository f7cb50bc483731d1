"""RL tasks with answers checked exactly by code: the registry, the task interface, and answer parsing.

A task makes problems, renders them as chat prompts, writes a correct response for the supervised warm start
(its *demonstration*), and scores responses. Every task's responses end with `<answer>...</answer>`; the
reward looks only at what that tag holds (or, where a task allows it, the last number in the response).

    task = get_task("countdown", max_numbers=4)
    train = task.examples("train", n=2000, seed=0)
    records = task.to_prompt_records(train, tokenizer)    # for jaxflow.data.prompt_source.PromptSource
    sft = task.to_sft_records(train, tokenizer)           # prompt + demonstration ids, for the warm start
    task.reward(response_text, records[0]["meta"])        # 1.0 or 0.0

Rewards are module-level functions named by `task.reward_ref` ("module:function"), so a
`jaxflow.rewards.RewardPool` can run them in worker processes; `reward_ref = "jaxflow.tasks:reward"` scores
the records of any registered task, dispatching on `meta["task"]`. A reward is a pure function of the response
text and the record's meta: everything it needs (the answer, the numbers, the reward options) is in the meta.

The "train" and "eval" splits of a task never share a problem: each problem is assigned to a split by a hash
of its canonical form (`split_of`), so the held-out accuracy measures generalisation, not recall.
"""

from __future__ import annotations

import decimal
import hashlib
import inspect
import random
import re
from fractions import Fraction
from typing import Any

from jaxflow import refs

# name -> "module:Class". Imported on first use, so `import jaxflow.tasks` stays cheap in reward workers.
TASKS: dict[str, str] = {
    "arithmetic": "jaxflow.tasks.arithmetic:ArithmeticTask",
    "countdown": "jaxflow.tasks.countdown:CountdownTask",
    "jsonl_qa": "jaxflow.tasks.jsonl_qa:JsonlQATask",
}

SPLITS = ("train", "eval")

# Short on purpose: a tiny model's context is a few hundred tokens, and every prompt carries this.
SYSTEM_PROMPT = "Show your work, then give the final answer in <answer> </answer> tags."

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# Answers longer than this are garbage, not answers; refusing them bounds the parsing work per response.
MAX_ANSWER_CHARS = 200

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def get_task(name: str, **options: Any) -> Task:
    """Builds the task registered as `name` with keyword `options` (each task's constructor documents them).

    Raises:
      ValueError: `name` is not registered, or an option is not one the task takes; the message lists the
        valid names.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    cls = refs.resolve(TASKS[name], what=f"task {name!r}: class reference", expect="class")
    valid = _options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"task {name!r} has no option(s) {', '.join(unknown)}; valid options: {', '.join(valid)}")
    return cls(**options)


def _options(cls: type) -> list[str]:
    """The keyword options of a task class: its constructor's, and its bases' where it passes **options on."""
    valid: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        valid += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return valid


def reward(response: str, meta: dict) -> float:
    """Scores a response to a record of any registered task, by the reward of `meta["task"]`.

    Raises:
      ValueError: `meta` names no registered task (a wiring bug, not a bad response).
    """
    name = meta.get("task") if isinstance(meta, dict) else None
    if name not in TASKS:
        raise ValueError(f"reward meta names task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    module, _ = refs.parse(TASKS[name])
    return refs.resolve(f"{module}:reward", what=f"task {name!r}: reward reference")(response, meta)


def split_of(key: str, eval_fraction: float) -> str:
    """The split ("train" or "eval") a problem belongs to, from a hash of its canonical text `key`.

    Stable across processes and Python versions (sha256, not `hash`), so the same problem always lands in
    the same split whatever the seed or the number of examples asked for.
    """
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "eval" if h < eval_fraction * 2.0 ** 64 else "train"


def check_split(split: str) -> None:
    """Raises ValueError unless `split` is one of SPLITS."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")


def split_rng(task_name: str, split: str, seed: int) -> random.Random:
    """A generator private to (task, split, seed): the splits draw independent streams of problems."""
    digest = hashlib.sha256(f"{task_name}:{split}:{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def sample_skewed(rng: random.Random, low: int, high: int, decay: float) -> int:
    """An integer in [low, high] with P(k) proportional to decay ** (k - low): mostly `low`, a long tail up.

    This is how tasks get response lengths with a long tail, the regime where asynchronous RL pays off: most
    responses are short and a few are several times longer.
    """
    weights = [decay ** (k - low) for k in range(low, high + 1)]
    return rng.choices(range(low, high + 1), weights=weights)[0]


def extract_answer(response: Any) -> str | None:
    """The text inside the last complete `<answer>...</answer>` of `response`, stripped; None if there is none.

    Linear time in the response length whatever it holds (no backtracking regex), and None for answers
    longer than MAX_ANSWER_CHARS or for a response that is not a string.
    """
    if not isinstance(response, str):
        return None
    end = response.rfind(ANSWER_CLOSE)
    if end < 0:
        return None
    start = response.rfind(ANSWER_OPEN, 0, end)
    if start < 0:
        return None
    answer = response[start + len(ANSWER_OPEN):end].strip()
    return answer if len(answer) <= MAX_ANSWER_CHARS else None


def parse_number(text: Any) -> Fraction | None:
    """The exact value of a number written as text ("42", "-3.50", "1,234", "$1,234.00", "7."), or None.

    Tolerates surrounding whitespace, a leading "$", thousands commas and a sentence-ending ".". Returns None
    for anything else: an empty string, units or "%" ("50%" and "50" are different answers), scientific
    notation, or text longer than MAX_ANSWER_CHARS.
    """
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    text = text.strip()
    if text.startswith("$"):
        text = text[1:].lstrip()
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1]
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(decimal.Decimal(text.replace(",", "")))
    except (decimal.InvalidOperation, ValueError):
        return None


def last_number(text: Any) -> Fraction | None:
    """The value of the last number written in `text` (thousands commas allowed), or None if it has none."""
    if not isinstance(text, str):
        return None
    matches = _NUMBER_IN_TEXT.findall(text)
    return parse_number(matches[-1]) if matches else None


def canonical_number(value: Fraction | int) -> str:
    """A number as the shortest exact decimal text: 72, -3.5, 0.125 (never 72.0 or 1E+2).

    Raises:
      ValueError: the value has no finite decimal expansion (e.g. 1/3).
    """
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d != 1:
        raise ValueError(f"{value} has no finite decimal expansion")
    text = format(decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def answer_tagged(body: str, answer: str) -> str:
    """A response: `body` (the work, may be empty) then the answer in tags on its own line."""
    return f"{body}\n{ANSWER_OPEN}{answer}{ANSWER_CLOSE}" if body else f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def scored(correct: bool, formatted: bool, meta: dict) -> float:
    """1.0 for a correct answer; else meta's "format_score" (default 0.0) if the answer tag was well formed."""
    if correct:
        return 1.0
    return float(meta.get("format_score", 0.0)) if formatted else 0.0


class Task:
    """The interface every task implements; subclasses set `name` and `reward_ref` and the methods below.

    Examples are dicts {"question": str, "answer": ..., ...task fields}; JSON-serialisable.

    Options every task takes: system_prompt (None or "" for no system turn), format_score (the score of a
    wrong answer in well-formed tags), eval_fraction (the share of problems held out), and reward_ref
    ("module:function" of a reward of the user's, `fn(response, meta) -> float`, used instead of the
    task's own for RL rewards and evals; it must import in a spawned reward worker, which gets this
    process's sys.path).
    """

    name: str = ""
    # "module:function" of the module-level reward, importable in a reward worker process.
    reward_ref: str = ""

    def __init__(self, *, system_prompt: str = SYSTEM_PROMPT, format_score: float = 0.0,
                 eval_fraction: float = 0.1, reward_ref: str | None = None):
        if reward_ref is not None:
            refs.parse(reward_ref, what=f"{self.name}: reward_ref")
            # The user's reward replaces the task's own, for RL samples and evals alike.
            self.reward_ref = reward_ref
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"{self.name}: eval_fraction must be in (0, 1), got {eval_fraction}")
        if not 0.0 <= format_score < 1.0:
            raise ValueError(f"{self.name}: format_score must be in [0, 1), got {format_score}")
        self.system_prompt = system_prompt
        self.format_score = float(format_score)
        self.eval_fraction = float(eval_fraction)

    def examples(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` problems of `split` ("train" or "eval"); the same arguments always give the same list."""
        raise NotImplementedError

    def draw_examples(self, split: str, n: int, seed: int, draw) -> list[dict]:
        """`examples` for a task that generates problems: `draw(rng) -> (canonical key, example)`.

        Problems go to the split their key hashes to (`split_of`). The eval split holds each problem once, so
        held-out accuracy is not inflated by repeats of the few shortest problems; the train split may repeat
        them, since its stream can be longer than the number of distinct short problems.

        Raises:
          ValueError: the split has fewer than `n` distinct problems under the task's options.
        """
        check_split(split)
        rng = split_rng(self.name, split, seed)
        out, seen = [], set()
        for _ in range(1000 + 200 * n):
            if len(out) == n:
                return out
            key, example = draw(rng)
            if split_of(f"{self.name}:{key}", self.eval_fraction) != split or (split == "eval" and key in seen):
                continue
            seen.add(key)
            out.append(example)
        if len(out) == n:
            return out
        raise ValueError(f"{self.name}: found only {len(out)} distinct {split} problems of the {n} asked for; "
                         "ask for fewer or widen the task's options")

    def user_prompt(self, example: dict) -> str:
        """The user turn for `example` (the question, with whatever instructions the task needs)."""
        return example["question"]

    def prompt_messages(self, example: dict) -> list[dict]:
        """The chat for `example`: a short system turn and the user turn."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": self.user_prompt(example)}]

    def demonstration(self, example: dict) -> str:
        """A correct assistant response for the supervised warm start, in the format `reward` checks."""
        raise NotImplementedError

    def demonstration_turns(self, example: dict) -> list[tuple[str, Any]]:
        """The warm start's demonstration as an episode: ("model", text) turns and ("env", messages)
        answers between them. Default: the single model turn `demonstration`."""
        return [("model", self.demonstration(example))]

    def meta(self, example: dict) -> dict:
        """What `reward` needs to score a response to `example`: JSON/msgpack-serialisable."""
        return {"task": self.name, "question": example["question"], "answer": example["answer"],
                "format_score": self.format_score}

    def reward(self, response: str, meta: dict) -> float:
        """1.0 if `response` answers the record with this `meta` correctly, else 0.0 (or the format score)."""
        fn = refs.resolve(self.reward_ref, what=f"{self.name}: reward_ref", expect="function", arity=2)
        return fn(response, meta)

    def to_prompt_records(self, examples: list[dict], tokenizer) -> list[dict]:
        """{"prompt": token ids of the chat-templated prompt, "meta": `meta(example)`} per example.

        The prompt ends with the assistant header (generation prompt), ready for sampling.
        """
        return [{"prompt": tokenizer.encode_chat(self.prompt_messages(e)), "meta": self.meta(e)}
                for e in examples]

    def to_sft_records(self, examples: list[dict], tokenizer) -> list[dict]:
        """{"prompt": ids, "completion": ids, "meta": ...} per example, for the supervised warm start.

        The completion is the demonstration's ids followed by the tokenizer's eos id (the end-of-turn token
        in chat tokenizers), the sequence a policy must sample to answer and stop. The prompt ids are the
        ones `to_prompt_records` gives, so the warm start trains on exactly the prompts RL samples from.
        """
        records = self.to_prompt_records(examples, tokenizer)
        for record, example in zip(records, examples):
            record["completion"] = tokenizer.encode(self.demonstration(example)) + [tokenizer.eos_id]
        return records
