"""Reward computation in worker processes that a bad reward function cannot take down.

`RewardPool` (jaxflow.rewards.pool) scores responses with reward functions named by "module:function"
references.
"""

from jaxflow.rewards.pool import (MARKER_ENV, STAT_KEYS, RewardPool, group_reward_fn, resolve,
                                  score_inline)

__all__ = ["MARKER_ENV", "STAT_KEYS", "RewardPool", "group_reward_fn", "resolve", "score_inline"]
