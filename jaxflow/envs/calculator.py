"""A calculator tool for the arithmetic task: the model writes `<tool>7*8</tool>`, the environment answers
`<result>56</result>`; a turn without a tool call is the final answer, scored by the task's reward.

    env = CalculatorEnv(latency_s=0.2, max_calls=4)     # latency: stands in for a remote tool
    await env.reset(meta)                               # the task's meta (meta["answer"] scores the episode)
    step = await env.step("I need 7*8: <tool>7*8</tool>")    # Step(observation=[tool: <result>56</result>])
    step = await env.step("<answer>56</answer>")        # Step(reward=1.0, done=True)

A turn's tool calls are found by one left-to-right scan (`tool_calls`), so finding them costs time linear in
the turn's length however the model writes it (a regex with a lazy `.*?` rescans the rest of the turn from
every unterminated `<tool>`: a turn of many of them took minutes).

The expression is evaluated exactly (integers and fractions; `+ - * /`, parentheses, unary minus; no
names, no powers, at most `max_chars` characters and values of at most `max_digits` digits), never with
Python's `eval`. A malformed expression or a division by zero is answered as `<result>error: ...</result>`
(the model's mistake, part of the episode), not raised. After `max_calls` tool calls the next call
ends the episode unanswered, with the reward of the turn's text.
"""

from __future__ import annotations

import ast
import asyncio
import fractions
import re
import threading
from typing import Any

from jaxflow.envs.base import Step

__all__ = ["CalculatorEnv", "TOOL_CLOSE", "TOOL_OPEN", "evaluate", "tool_calls", "tool_result", "written_turn"]

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
"""The tags around a tool call in a model turn: `<tool>EXPRESSION</tool>` (the last call in a turn is run)."""

_ARITHMETIC_TEXT = re.compile(r"[0-9+\-*/().\s]*")
_NOT_ARITHMETIC = "only integers, + - * / and parentheses are allowed"
# One parse at a time in this process: CPython 3.11's AST constructor keeps its recursion depth in state the
# threads share, so parses on two threads (episodes' environments run on threads of their own) can fail with
# "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905), failing a well-formed call.
_PARSE_LOCK = threading.Lock()
_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b}


def tool_calls(text: str) -> list[str]:
    """The expressions of the tool calls in `text`, in order: what lies between each `<tool>` and the first
    `</tool>` after it (the same calls as the regex `<tool>(.*?)</tool>` finds).

    One pass: each search starts where the previous one ended, so every character is looked at a bounded
    number of times, and a `<tool>` with no `</tool>` after it ends the scan (no later call can close).
    """
    calls, at = [], 0
    while True:
        start = text.find(TOOL_OPEN, at)
        if start < 0:
            return calls
        end = text.find(TOOL_CLOSE, start + len(TOOL_OPEN))
        if end < 0:
            return calls
        calls.append(text[start + len(TOOL_OPEN):end])
        at = end + len(TOOL_CLOSE)


def tool_result(expression: str) -> str:
    """The calculator's answer to a call, as the model reads it: `<result>56</result>`, or
    `<result>error: ...</result>` naming what is wrong with the expression."""
    try:
        answer = evaluate(expression)
    except (ValueError, ZeroDivisionError) as e:
        answer = f"error: {'division by zero' if isinstance(e, ZeroDivisionError) else e}"
    return f"<result>{answer}</result>"


def written_turn(text: str, finish_reason: str | None) -> str:
    """The model turn as written, from a chat reply's text and finish reason: the API leaves a stop sequence
    out of the text, so a turn that stopped at `</tool>` after opening a call gets it back."""
    called = finish_reason == "stop" and TOOL_OPEN in text and not text.endswith(TOOL_CLOSE)
    return text + TOOL_CLOSE if called else text


def evaluate(expression: str, max_chars: int = 200, max_digits: int = 30) -> str:
    """The exact value of an arithmetic `expression` as text ("56", "-3", "7/2"). ValueError saying what
    is wrong (too long, not arithmetic, too large), ZeroDivisionError on a division by zero."""
    if len(expression) > max_chars:
        raise ValueError(f"expression longer than {max_chars} characters")
    # Only these characters reach Python's parser: it warns on some other text as it parses ("1or 2":
    # invalid decimal literal, printed into the run's log), and a warnings filter is not thread-safe.
    if not _ARITHMETIC_TEXT.fullmatch(expression):
        raise ValueError(_NOT_ARITHMETIC)
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    limit = 10 ** max_digits

    def value(node: ast.AST) -> fractions.Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            out = fractions.Fraction(node.value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            out = _OPERATORS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(_NOT_ARITHMETIC)
        if abs(out.numerator) >= limit or out.denominator >= limit:
            raise ValueError(f"a value has more than {max_digits} digits")
        return out

    result = value(tree.body)
    return str(result.numerator) if result.denominator == 1 else f"{result.numerator}/{result.denominator}"


class CalculatorEnv:
    """The calculator environment of one episode (jaxflow's protocol, `jaxflow.envs.base`).

    reward_ref: "module:function" scoring the final turn (text, meta); default the arithmetic task's.
    latency_s: seconds each tool call waits before answering (asyncio: no CPU). max_calls: tool calls
    answered per episode. role: the chat role of the tool's answers.
    """

    def __init__(self, *, reward_ref: str = "jaxflow.tasks.arithmetic:reward", latency_s: float = 0.0,
                 max_calls: int = 4, role: str = "tool"):
        from jaxflow.rewards import resolve

        if isinstance(latency_s, bool) or not isinstance(latency_s, (int, float)) or not latency_s >= 0:
            raise ValueError(f"latency_s must be a number of seconds >= 0, got {latency_s!r}")
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 0:
            raise ValueError(f"max_calls must be an int >= 0, got {max_calls!r}")
        self.score = resolve(reward_ref)
        self.latency_s, self.max_calls, self.role = float(latency_s), max_calls, role
        self.meta: dict[str, Any] = {}
        self.calls = 0

    async def reset(self, meta: dict) -> None:
        self.meta, self.calls = dict(meta), 0
        return None

    async def step(self, action: str) -> Step:
        calls = tool_calls(action)
        if not calls or self.calls >= self.max_calls:
            return Step(reward=float(self.score(action, self.meta)), done=True,
                        info={"tool_calls": self.calls})
        self.calls += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return Step(observation=[{"role": self.role, "content": tool_result(calls[-1])}],
                    info={"tool_calls": self.calls})

    async def close(self) -> None:
        return None
