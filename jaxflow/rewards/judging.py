"""What a reward model or an LLM judge reads of a sample, and the judge's default prompt and verdict parser.

- `prompt_messages(meta)`: the chat messages of a sample's prompt (meta["messages"], else meta["question"]);
  the reward model scores [these + the response] (`jaxflow.rewards.model`).
- `judge_prompt(response, meta)`: the judge's default prompt (`rollout.judge.prompt_ref`): the question, the
  reference answer when the meta has one, the response, and the instruction to answer `<score>1</score>` or
  `<score>0</score>`.
- `score_verdict(verdict, meta)`: the judge's default parser (`rollout.judge.parse_ref`): the number in the
  verdict's last `<score>...</score>`.

A judge (`rollout_bridge.judge.Judge`) calls a prompt function as `fn(response: str, meta: dict) -> list of
{"role", "content"} messages` and a parse function as `fn(verdict: str, meta: dict) -> float`; these two are
the defaults, and examples of such functions. This module imports no JAX: config checks resolve it.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_PARSE_REF", "DEFAULT_PROMPT_REF", "judge_prompt", "prompt_messages", "score_verdict"]

DEFAULT_PROMPT_REF = "jaxflow.rewards.judging:judge_prompt"
DEFAULT_PARSE_REF = "jaxflow.rewards.judging:score_verdict"

# A decimal number, signed, with an optional exponent: what `score_verdict` reads inside <score>...</score>.
_SCORE = re.compile(r"<score>\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*</score>")


def prompt_messages(meta: dict) -> list[dict]:
    """The prompt's chat messages for a sample with `meta`: meta["messages"] when present (a list of
    {"role", "content"} dicts), else one user turn holding meta["question"] (every built-in task's meta has it).

    Raises:
      ValueError: meta has neither, or its messages are malformed (names what it has).
    """
    messages = meta.get("messages") if isinstance(meta, dict) else None
    if messages is not None:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError(f"meta['messages'] must be a list of {{'role': str, 'content': str}} dicts, got "
                             f"{str(messages)[:200]}")
        return list(messages)
    if isinstance(meta, dict) and isinstance(meta.get("question"), str):
        return [{"role": "user", "content": meta["question"]}]
    keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
    raise ValueError(f"the sample's meta has no prompt to score against: neither 'messages' nor a 'question' "
                     f"string (it has {keys})")


def judge_prompt(response: str, meta: dict) -> list[dict]:
    """The default judge prompt: one user turn asking whether `response` answers the sample's question
    correctly. The question is the prompt's user turns (`prompt_messages`); meta["answer"], when present, is
    given as the reference answer. The judge is told to end with <score>1</score> (correct) or
    <score>0</score> (not), which `score_verdict` reads.

    Raises:
      ValueError: the meta holds no prompt (`prompt_messages`).
    """
    question = "\n\n".join(m["content"] for m in prompt_messages(meta) if m["role"] == "user")
    parts = [f"Question:\n{question}"]
    if isinstance(meta, dict) and meta.get("answer") is not None:
        parts.append(f"Reference answer:\n{meta['answer']}")
    parts.append(f"Response:\n{response}")
    parts.append("Does the response answer the question correctly? Reply with <score>1</score> if it does and "
                 "<score>0</score> if it does not.")
    return [{"role": "user", "content": "\n\n".join(parts)}]


def score_verdict(verdict: str, meta: dict) -> float:
    """The default verdict parser: the number in the last `<score>x</score>` of `verdict` (x a decimal
    number, e.g. 1, 0, 0.5, -2e-1), whatever the judge wrote around it.

    Raises:
      ValueError: the verdict holds no such tag (its start is quoted).
    """
    found = _SCORE.findall(verdict)
    if not found:
        raise ValueError(f"no <score>number</score> in the verdict {verdict[:200]!r}")
    return float(found[-1])
