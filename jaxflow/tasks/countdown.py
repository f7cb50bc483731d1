"""Countdown: "Using the numbers [3, 7, 25], make 46." answered with an equation, each number used exactly once.

The rule follows TinyZero (Jiayi Pan's reproduction of DeepSeek-R1-Zero on countdown): the answer must use
every given number exactly once (a repeated given number may be used as many times as it is given), combined
with binary + - * / and parentheses, and evaluate exactly (rational arithmetic, so 7 / 2 * 2 is 7) to the
target. Unary minus, powers, floor division, decimals and anything else are refused. An optional trailing
"= target" is accepted ("(25 - 7) * 3 - 8 = 46"), since models often write the equation out.

Answers are never `eval`-ed: the reward parses them with `ast` and walks only the allowed nodes, after a
character whitelist and a length cap, so `__import__('os').system('x')` or `9**9**9` score 0 at once.

Targets are reachable by construction: a problem is a random left-to-right chain over a permutation of its
numbers ((a op b) op c ...), with non-negative integer intermediate values. The demonstration shows a short
search, a variable number of wrong chains then the right one (the count is drawn from a skewed distribution,
which gives a long tail of response lengths), then the answer:

    12 + 5 = 17, 17 * 3 = 51. No.
    12 - 3 = 9, 9 * 5 = 45. Yes.
    <answer>(12 - 3) * 5</answer>
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction

from jaxflow.tasks import MAX_ANSWER_CHARS, Task, answer_tagged, extract_answer, sample_skewed, scored

NAME = "countdown"

_ALLOWED_CHARS = re.compile(r"[0-9+\-*/()\s]+")
_BINARY_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
               ast.Div: lambda a, b: a / b}
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}

# Draws of numbers (and of ops over them) before giving up on reaching a target in range; generous, since a
# miss only costs a retry.
_MAX_DRAWS = 200


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of an allowed expression node, appending each integer literal to `used`.

    Raises:
      ValueError: a node that is not a binary + - * / or a non-negative integer literal.
      ZeroDivisionError: a division by zero.
    """
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left = _evaluate(node.left, used)
        return _BINARY_OPS[type(node.op)](left, _evaluate(node.right, used))
    # bool is an int subclass, but True cannot be written with the allowed characters anyway.
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"{type(node).__name__} is not allowed")


def evaluate_equation(text: str, target: int | None = None) -> tuple[Fraction, list[int]] | None:
    """Safely evaluates a countdown answer: (exact value, the integers it uses in order), or None if malformed.

    Args:
      text: the answer, e.g. "(25 - 7) * 3 - 8"; with `target` given, "... = target" is accepted too.
      target: the target a trailing "= N" must name.
    """
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return None
    if "=" in text and target is not None:
        text, _, rhs = text.rpartition("=")
        if rhs.strip() != str(target) or "=" in text:
            return None
    if not _ALLOWED_CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
        used: list[int] = []
        return _evaluate(tree.body, used), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def reward(response: str, meta: dict) -> float:
    """1.0 if the `<answer>` equation uses meta["numbers"] exactly once each and equals meta["target"].

    A well-formed but wrong equation scores meta's "format_score" (default 0.0).
    """
    result = evaluate_equation(extract_answer(response), meta["target"])
    if result is None:
        return scored(False, False, meta)
    value, used = result
    return scored(value == meta["target"] and Counter(used) == Counter(meta["numbers"]), True, meta)


def _random_chain(rng: random.Random, numbers: list[int]) -> list[list]:
    """A random chain over a permutation of `numbers`: [[a, op, b, a op b], ...], integral and non-negative."""
    order = rng.sample(numbers, len(numbers))
    value, steps = order[0], []
    for n in order[1:]:
        ops = ["+", "*"] + (["-"] if value >= n else []) + (["/"] if n > 0 and value % n == 0 else [])
        op = rng.choice(ops)
        result = _APPLY[op](value, n)
        steps.append([value, op, n, result])
        value = result
    return steps


def chain_expression(steps: list[list]) -> str:
    """The chain as one expression, parenthesised only where precedence needs it: "(12 - 3) * 5"."""
    # `additive`: the text's top-level operator is + or -, so a following * or / must not bind into it. The
    # right operand is always a single number and all four operators associate left, so nothing else needs them.
    text, additive = str(steps[0][0]), False
    for _, op, n, _ in steps:
        if op in "*/" and additive:
            text = f"({text})"
        text = f"{text} {op} {n}"
        additive = op in "+-"
    return text


def _chain_line(steps: list[list], verdict: str) -> str:
    return ", ".join(f"{a} {op} {b} = {c}" for a, op, b, c in steps) + f". {verdict}."


class CountdownTask(Task):
    """Make the target from the given numbers, each exactly once, with + - * / and parentheses.

    Args:
      min_numbers, max_numbers: how many numbers a problem gives (the difficulty knob; 3-4 by default).
      max_number: numbers are drawn from [1, max_number].
      min_target, max_target: the range of targets.
      max_tries: the most wrong chains a demonstration tries before the right one.
      tries_decay: P(k wrong tries) is proportional to tries_decay ** k; smaller is shorter on average.
      system_prompt, format_score, eval_fraction, reward_ref: as for `Task`.
    """

    name = NAME
    reward_ref = "jaxflow.tasks.countdown:reward"

    def __init__(self, *, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 20, min_target: int = 1,
                 max_target: int = 100, max_tries: int = 8, tries_decay: float = 0.55, **task_options):
        super().__init__(**task_options)
        if not 2 <= min_numbers <= max_numbers:
            raise ValueError(f"countdown: need 2 <= min_numbers <= max_numbers, got {min_numbers}, {max_numbers}")
        if max_number < 2:
            raise ValueError(f"countdown: max_number must be >= 2, got {max_number}")
        if not 0 <= min_target <= max_target:
            raise ValueError(f"countdown: need 0 <= min_target <= max_target, got {min_target}, {max_target}")
        if max_tries < 0 or not 0.0 < tries_decay <= 1.0:
            raise ValueError(f"countdown: need max_tries >= 0 and tries_decay in (0, 1], got {max_tries}, "
                             f"{tries_decay}")
        self.min_numbers, self.max_numbers, self.max_number = min_numbers, max_numbers, max_number
        self.min_target, self.max_target = min_target, max_target
        self.max_tries, self.tries_decay = max_tries, tries_decay

    def _problem(self, rng: random.Random) -> tuple[list[int], list[list]]:
        """Numbers (in prompt order) and a solution chain whose value is a target in range."""
        for _ in range(_MAX_DRAWS * 10):
            count = rng.randint(self.min_numbers, self.max_numbers)
            numbers = [rng.randint(1, self.max_number) for _ in range(count)]
            for _ in range(_MAX_DRAWS // 10):
                steps = _random_chain(rng, numbers)
                if self.min_target <= steps[-1][3] <= self.max_target:
                    return numbers, steps
        raise ValueError(f"countdown: targets in [{self.min_target}, {self.max_target}] are (almost) never reached "
                         f"with {self.min_numbers}-{self.max_numbers} numbers up to {self.max_number}")

    def _wrong_tries(self, rng: random.Random, numbers: list[int], target: int) -> list[list[list]]:
        """A skewed-random number of distinct chains over `numbers` that miss `target`."""
        wanted = sample_skewed(rng, 0, self.max_tries, self.tries_decay)
        tries, seen = [], set()
        for _ in range(_MAX_DRAWS):
            if len(tries) >= wanted:
                break
            steps = _random_chain(rng, numbers)
            key = _chain_line(steps, "")
            if steps[-1][3] != target and key not in seen:
                seen.add(key)
                tries.append(steps)
        return tries

    def examples(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` problems of `split`, each {"question", "answer": a solution expression, "numbers", "target",
        "search": the demonstration's chains, wrong ones first, the solution last}."""
        def draw(rng):
            numbers, solution = self._problem(rng)
            target = solution[-1][3]
            # The problem is the multiset of numbers and the target: their order in the prompt does not matter.
            return f"{sorted(numbers)}:{target}", {
                "question": f"Using the numbers {numbers}, make {target}.", "answer": chain_expression(solution),
                "numbers": numbers, "target": target, "search": self._wrong_tries(rng, numbers, target) + [solution]}
        return self.draw_examples(split, n, seed, draw)

    def user_prompt(self, example: dict) -> str:
        return f"{example['question']} Use each number exactly once, with + - * / and parentheses."

    def meta(self, example: dict) -> dict:
        return {**super().meta(example), "numbers": list(example["numbers"]), "target": example["target"]}

    def demonstration(self, example: dict) -> str:
        """The search, one chain per line ("No." / "Yes."), then the solution in tags."""
        *wrong, solution = example["search"]
        lines = [_chain_line(steps, "No") for steps in wrong] + [_chain_line(solution, "Yes")]
        return answer_tagged("\n".join(lines), chain_expression(solution))
