"""Held-out evaluation: greedy answers from a rollout engine, scored by the task's verifiable reward.

The same engine kinds that generate rollouts generate eval answers, so an eval measures the policy as it
is served. Scoring runs in a `RewardPool` when one is given (a crashing or hanging reward counts as wrong,
never stops the run), else inline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rollout_bridge.engine import Engine, Request, SamplingParams


@dataclasses.dataclass(frozen=True)
class EvalResult:
    accuracy: float  # fraction of prompts whose greedy answer scores 1.0
    mean_reward: float
    mean_response_tokens: float
    num_prompts: int
    errors: int  # requests the engine refused (e.g. longer than its context); scored 0
    env_frac: float = 0.0  # episodes: the fraction in which the environment answered (a tool was called)

    def as_metrics(self, prefix: str = "eval_") -> dict[str, float]:
        return {f"{prefix}accuracy": self.accuracy, f"{prefix}mean_reward": self.mean_reward,
                f"{prefix}response_tokens": self.mean_response_tokens, f"{prefix}env_frac": self.env_frac}


def evaluate(engine: Engine, records: Sequence[dict], *, decode, reward_ref: str, max_tokens: int,
             stop_token_ids: Sequence[int], pool=None, tag: str = "eval",
             timeout: float = 1800.0) -> EvalResult:
    """Greedy-decodes every record's prompt on `engine` and scores the decoded responses.

    records: {"prompt": ids, "meta": ...} as `Task.to_prompt_records` makes them. decode: token ids ->
    text. reward_ref: "module:function" of the reward (`Task.reward_ref`). pool: a RewardPool, or None
    to score inline.
    """
    if not records:
        raise ValueError("evaluate needs at least one record")
    from jaxflow import rewards

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
    requests = [Request(f"{tag}:{i}", list(r["prompt"]), params, meta=r["meta"]) for i, r in enumerate(records)]
    completions = engine.generate(requests, timeout=timeout)
    if all(c.sample.reward is not None for c in completions):  # episodes: scored by their environments
        scores = [c.sample.reward for c in completions]
    else:
        texts = [decode(c.sample.tokens) for c in completions]
        if pool is not None:
            futures = [pool.submit(reward_ref, text, r["meta"]) for text, r in zip(texts, records)]
            scores = [f.result() for f in futures]
        else:
            scores = [rewards.score_inline(reward_ref, text, r["meta"]) for text, r in zip(texts, records)]
    errors = sum(c.sample.finish_reason == "error" for c in completions)
    scores = [0.0 if c.sample.finish_reason == "error" else s for c, s in zip(completions, scores)]
    n = len(records)
    return EvalResult(accuracy=sum(s >= 1.0 for s in scores) / n, mean_reward=sum(scores) / n,
                      mean_response_tokens=sum(len(c.sample.tokens) for c in completions) / n,
                      num_prompts=n, errors=errors, env_frac=sum(bool(c.sample.env_spans) for c in completions) / n)
