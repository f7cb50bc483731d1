"""The `rollout.judge` section of a run's config: an LLM judge in place of the task's reward function.

`JudgeConfig` is the section (its docstring says what each key means); `judge_options` turns a checked section
into `rollout_bridge.judge.Judge` arguments. This module imports no JAX, so config checks stay cheap; the
directory and the references themselves are checked by the RL job (`jaxflow.jobs.rl.judge_problems`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxflow import refs
from jaxflow.config import Section, check_choice, check_float, check_int
from jaxflow.rewards.judging import DEFAULT_PARSE_REF, DEFAULT_PROMPT_REF

__all__ = ["JUDGE_ENGINES", "JudgeConfig", "judge_options"]

# The engines a judge generates on (`rollout_bridge.factory.make_engine`).
JUDGE_ENGINES = ("jax", "vllm")


@dataclasses.dataclass(frozen=True)
class JudgeConfig(Section):
    """The `rollout.judge` section: score samples with an LLM judge instead of `task.reward_ref`.

    dir: None (off: the task's reward function scores) or an HF causal LM directory (a family the engines
      serve) with a tokenizer that has a chat template: the judge (`rollout_bridge.judge`). Evals keep the task's
      reward. Not with rollout.reward_model.
    engine: "jax" (jaxflow's engine, in the job's process) or "vllm" (its own processes) for the judge.
    prompt_ref: "module:function", fn(response: str, meta: dict) -> chat messages: the judge's prompt for one
      sample, rendered with the judge's chat template (default: the question, the reference answer if the meta
      has one, the response, and "reply <score>1</score> or <score>0</score>").
    parse_ref: "module:function", fn(verdict: str, meta: dict) -> float: the sample's score from the judge's
      completion (default: the number in its last <score>...</score>).
    max_tokens: tokens of one verdict at most.
    temperature: the judge's sampling temperature (0: greedy).
    max_len: the judge engine's context (prompt + verdict); a longer judge prompt scores failed_value.
    max_slots: verdicts generated at once (the judge engine's slots), from any groups.
    kv_cache_gib: vllm only: GiB of KV cache of the judge's engine.
    timeout_s: seconds one verdict may take from when the engine takes it to its parsed score; past it the
      request is aborted and its sample scores failed_value.
    failed_value: the score of a sample the judge could not score (a prompt function that raised, an engine
      error, a timeout, a verdict the parse function could not read); each is counted in the metrics as
      reward_<kind>.
    """

    SECTION: ClassVar[str] = "rollout.judge"

    dir: str | None = None
    engine: str = "jax"
    prompt_ref: str = DEFAULT_PROMPT_REF
    parse_ref: str = DEFAULT_PARSE_REF
    max_tokens: int = 256
    temperature: float = 0.0
    max_len: int = 2048
    max_slots: int = 16
    kv_cache_gib: float = 0.5
    timeout_s: float = 60.0
    failed_value: float = 0.0

    def problems(self) -> list[str]:
        """Every key, the judge on or off (dir None), so a bad value never waits for the run that uses it."""
        problems: list[str] = []
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir.strip()):
            problems.append(f"{self.key('dir')} must be None or a directory, got {self.dir!r}")
        check_choice(problems, self.key("engine"), self.engine, JUDGE_ENGINES)
        for name in ("prompt_ref", "parse_ref"):
            try:
                refs.parse(getattr(self, name), what=self.key(name), expect="function")
            except refs.RefError as e:
                problems.append(str(e))
        before = len(problems)
        check_int(problems, self.key("max_tokens"), self.max_tokens, 1)
        check_int(problems, self.key("max_len"), self.max_len, 2)
        if len(problems) == before and self.max_tokens >= self.max_len:
            problems.append(f"{self.key('max_tokens')} ({self.max_tokens}) must be below {self.key('max_len')} "
                            f"({self.max_len}): the verdict and its prompt share the context")
        check_int(problems, self.key("max_slots"), self.max_slots, 1)
        check_float(problems, self.key("temperature"), self.temperature, 0.0)
        for name in ("kv_cache_gib", "timeout_s"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, open_low=True)
        check_float(problems, self.key("failed_value"), self.failed_value, -float("inf"))
        return problems


def judge_options(section: JudgeConfig) -> dict:
    """The `Judge` keyword arguments of a checked section (its engine is built from `section.dir` by
    `rollout_bridge.judge.build_judge`)."""
    return {"max_tokens": section.max_tokens, "temperature": section.temperature, "timeout_s": section.timeout_s,
            "failed_value": section.failed_value, "max_in_flight": section.max_slots}
