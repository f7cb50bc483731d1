"""Reward computation in worker processes that a bad reward function cannot take down.

A reward function is named by reference, "module:function" (e.g. "jaxflow.tasks:reward"), and called as
`fn(response: str, meta: dict) -> float`.

- `pool`: `RewardPool`, which runs such calls in spawned worker processes and survives raises, hangs and
  crashes, and `group_reward_fn`, a rollout worker's reward function scoring with a pool.
- `worker`: the worker process's loop, and calling a reward function here (`resolve`, `score_inline`).
- `reaper`: killing a worker with every process its reward functions started.
- `model`: `RewardModel`, a scalar-head reward model (an HF `...ForSequenceClassification` directory) behind
  the pool's interface; `model_config`: its config section, `rollout.reward_model`. Neither is imported here:
  reward workers import this package and must not pull in JAX.
- `judging`: what a reward model or an LLM judge reads of a sample (`prompt_messages`), and the judge's default
  prompt and verdict parser; `judge_config`: the judge's config section, `rollout.judge`. The judge itself
  generates on a rollout engine, so it lives with them: `rollout_bridge.judge`.
"""

from jaxflow.rewards.pool import STAT_KEYS, RewardPool, group_reward_fn
from jaxflow.rewards.reaper import MARKER_ENV
from jaxflow.rewards.worker import resolve, score_inline

__all__ = ["MARKER_ENV", "STAT_KEYS", "RewardPool", "group_reward_fn", "resolve", "score_inline"]
