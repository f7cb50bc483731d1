"""Multi-step integer arithmetic: "Compute 7 + 5 * 3 - 2." answered one operation per line.

The demonstration rewrites the expression after each operation, multiplications and divisions first (left to
right), then additions and subtractions (left to right):

    = 7 + 15 - 2
    = 22 - 2
    = 20
    <answer>20</answer>

so the response length grows quadratically with the number of operations. That number is drawn from a skewed
distribution (mostly 1-2, rarely `max_ops`), which gives the long tail of response lengths asynchronous RL is
built for. Operands are drawn from [min_number, max_number]; division appears only where it is exact, and a
product never exceeds `max_value`, so every value is an integer of a few digits.
"""

from __future__ import annotations

import hashlib
import operator
import random

from jaxflow.tasks import Task, answer_tagged, extract_answer, parse_number, sample_skewed, scored

NAME = "arithmetic"
OPERATORS = "+-*/"


def reward(response: str, meta: dict) -> float:
    """1.0 if the `<answer>` of `response` is the integer meta["answer"], else 0.0 (or meta's format score)."""
    value = parse_number(extract_answer(response))
    return scored(value is not None and value == meta["answer"], value is not None, meta)


def evaluation_steps(tokens: list) -> list[list]:
    """The expression after each operation, in the order the demonstration performs them.

    Args:
      tokens: [number, operator, number, ..., number], operators from "+-*/" (divisions exact).

    Returns:
      one token list per operation; the last is [value].
    """
    tokens = list(tokens)
    steps = []
    while len(tokens) > 1:
        ops = tokens[1::2]
        # Precedence: the first * or / if any, else the first + or -; both left-associative.
        i = next((k for k, op in enumerate(ops) if op in "*/"), 0)
        a, op, b = tokens[2 * i:2 * i + 3]
        value = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}[op](a, b)
        tokens[2 * i:2 * i + 3] = [value]
        steps.append(list(tokens))
    return steps


def render(tokens: list) -> str:
    """Tokens as text: "7 + 15 - 2"."""
    return " ".join(str(t) for t in tokens)


class ArithmeticTask(Task):
    """Integer expressions with 1..max_ops operations; answer: the value.

    Args:
      max_ops: the most operations in a problem (the difficulty knob); the response grows ~ max_ops ** 2.
      min_ops: the fewest operations.
      ops_decay: P(k operations) is proportional to ops_decay ** (k - min_ops); smaller is shorter on average.
      min_number, max_number: the operand range (non-negative).
      operators: the operators to use: a subset of "+-*/" that includes + or -.
      max_value: the largest product or dividend allowed, bounding the digits of every intermediate value.
      tool_fraction: the fraction of warm-start demonstrations that use a calculator (`jaxflow.envs.calculator`)
        instead of working the problem out: `<tool>EXPRESSION</tool>`, the tool's `<result>VALUE</result>`,
        then `<answer>VALUE</answer>` (which problems: a hash of the problem, so the same ones every build).
      system_prompt, format_score, eval_fraction, reward_ref: as for `Task`.
    """

    name = NAME
    reward_ref = "jaxflow.tasks.arithmetic:reward"

    def __init__(self, *, max_ops: int = 6, min_ops: int = 1, ops_decay: float = 0.6, min_number: int = 0,
                 max_number: int = 20, operators: str = "+-*", max_value: int = 400, tool_fraction: float = 0.0,
                 **task_options):
        super().__init__(**task_options)
        if not 1 <= min_ops <= max_ops:
            raise ValueError(f"arithmetic: need 1 <= min_ops <= max_ops, got {min_ops}, {max_ops}")
        if not 0 <= min_number < max_number:
            raise ValueError(f"arithmetic: need 0 <= min_number < max_number, got {min_number}, {max_number}")
        # + or - can always extend an expression; * and / alone may find no operand that keeps it bounded and exact.
        if set(operators) - set(OPERATORS) or not set(operators) & set("+-"):
            raise ValueError(f"arithmetic: operators must be a subset of {OPERATORS!r} with + or -, got {operators!r}")
        if not 0.0 < ops_decay <= 1.0:
            raise ValueError(f"arithmetic: ops_decay must be in (0, 1], got {ops_decay}")
        if max_value < max_number:
            raise ValueError(f"arithmetic: max_value {max_value} is below max_number {max_number}")
        self.max_ops, self.min_ops, self.ops_decay = max_ops, min_ops, ops_decay
        self.min_number, self.max_number = min_number, max_number
        if isinstance(tool_fraction, bool) or not isinstance(tool_fraction, (int, float)) \
                or not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"arithmetic: tool_fraction must be in [0, 1], got {tool_fraction!r}")
        self.operators, self.max_value, self.tool_fraction = operators, max_value, float(tool_fraction)

    def _problem(self, rng: random.Random) -> list:
        """A random expression as [number, op, number, ...] whose evaluation stays integral and bounded."""
        n_ops = sample_skewed(rng, self.min_ops, self.max_ops, self.ops_decay)
        tokens = [rng.randint(self.min_number, self.max_number)]
        term = tokens[0]  # the value of the multiplicative run the next operator would extend
        for _ in range(n_ops):
            while True:
                op = rng.choice(self.operators)
                if op == "/":
                    divisors = [d for d in range(max(1, self.min_number), self.max_number + 1) if term % d == 0]
                    if not divisors:
                        continue
                    b = rng.choice(divisors)
                    term //= b
                else:
                    b = rng.randint(self.min_number, self.max_number)
                    if op == "*":
                        if term * b > self.max_value:
                            continue
                        term *= b
                    else:
                        term = b
                break
            tokens += [op, b]
        return tokens

    def examples(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` problems of `split`, each {"question", "answer": int, "expression": str, "num_ops": int}."""
        def draw(rng):
            tokens = self._problem(rng)
            expression = render(tokens)
            return expression, {"question": f"Compute {expression}.", "answer": evaluation_steps(tokens)[-1][0],
                                "expression": expression, "num_ops": len(tokens) // 2}
        return self.draw_examples(split, n, seed, draw)

    def demonstration(self, example: dict) -> str:
        """One line per operation, "= <expression so far>", then the answer in tags."""
        tokens = [t if t in OPERATORS else int(t) for t in example["expression"].split()]
        body = "\n".join("= " + render(step) for step in evaluation_steps(tokens))
        return answer_tagged(body, str(example["answer"]))

    def demonstration_turns(self, example: dict) -> list[tuple[str, object]]:
        """The calculator demonstration for a `tool_fraction` of problems (see the class doc), else the
        worked one."""
        if not _uses_tool(example["expression"], self.tool_fraction):
            return [("model", self.demonstration(example))]
        value = str(example["answer"])
        return [("model", f"<tool>{example['expression']}</tool>"),
                ("env", [{"role": "tool", "content": f"<result>{value}</result>"}]),
                ("model", answer_tagged("", value))]


def _uses_tool(expression: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"tool:{expression}".encode()).digest()[:8], "big")
    return h / 2 ** 64 < fraction


def length_parity_reward(response: str, meta: dict) -> float:
    """1.0 if the response has an even number of characters, else 0.0, whatever the question: a plumbing
    reward for runs whose model cannot answer (a real-size model with random weights), under which every
    group still has varied rewards, so the update's gradient is not zero and the weights move."""
    return float(len(response) % 2 == 0)


def even_answer_reward(response: str, meta: dict) -> float:
    """1.0 if the response's `<answer>` is an even integer, else 0.0, whatever the question: a sanity-check
    reward that any policy learns within a few steps (one token's distribution moves), so a short run shows
    whether an RL set-up learns at all; the cluster tests use it (`task.reward_ref`)."""
    value = parse_number(extract_answer(response))
    return float(value is not None and value == int(value) and int(value) % 2 == 0)
