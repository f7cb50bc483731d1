"""The `rollout.reward_model` section of a run's config: a reward model in place of the task's reward function.

`RewardModelConfig` is the section (its docstring says what each key means); `reward_model_options` turns a
checked section into `jaxflow.rewards.model.RewardModel` arguments. This module imports no JAX, so config
checks stay cheap; the directory itself is checked by the RL job (`jaxflow.jobs.rl.reward_model_problems`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxflow.config import Section, check_float, check_int

__all__ = ["RewardModelConfig", "reward_model_options"]


@dataclasses.dataclass(frozen=True)
class RewardModelConfig(Section):
    """The `rollout.reward_model` section: score samples with a reward model instead of `task.reward_ref`.

    dir: None (off: the task's reward function scores) or an HF `...ForSequenceClassification` directory with
      one label (Llama, Qwen2, Qwen3 or Qwen3-MoE backbone) and a tokenizer with a chat template; it scores each
      sample's [prompt + response] conversation (`jaxflow.rewards.model`). Evals keep the task's reward.
    batch_size: samples per forward pass at most (they may come from several groups).
    max_len: tokens of a rendered [prompt + response] at most; a longer sample scores failed_value.
    timeout_s: seconds one batch's forward pass may take; past it, its samples score failed_value.
    compile_timeout_s: the same for the first batch of each padded shape, which compiles its program.
    failed_value: the score of a sample the reward model could not score (a non-finite score, a timeout, a
      sample too long or without a prompt); each is counted in the metrics as reward_<kind>.
    """

    SECTION: ClassVar[str] = "rollout.reward_model"

    dir: str | None = None
    batch_size: int = 8
    max_len: int = 2048
    timeout_s: float = 30.0
    compile_timeout_s: float = 600.0
    failed_value: float = 0.0

    def problems(self) -> list[str]:
        """Every key, the reward model on or off (dir None), so a bad value never waits for the run that uses it."""
        problems: list[str] = []
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir.strip()):
            problems.append(f"{self.key('dir')} must be None or a directory, got {self.dir!r}")
        check_int(problems, self.key("batch_size"), self.batch_size, 1)
        check_int(problems, self.key("max_len"), self.max_len, 2)
        for name in ("timeout_s", "compile_timeout_s"):
            check_float(problems, self.key(name), getattr(self, name), 0.0, open_low=True)
        check_float(problems, self.key("failed_value"), self.failed_value, -float("inf"))
        return problems


def reward_model_options(section: RewardModelConfig) -> dict:
    """The `RewardModel` keyword arguments of a checked section (its directory is `section.dir`)."""
    return {"batch_size": section.batch_size, "max_len": section.max_len, "timeout_s": section.timeout_s,
            "compile_timeout_s": section.compile_timeout_s, "failed_value": section.failed_value}
