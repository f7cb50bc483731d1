"""The RL job's prompts: the train prompts in the order the run draws them, and the held-out problems of
every eval. The embedded job, the cluster driver and the benchmarks against the incumbents all take them
from here, so they train and evaluate on the same problems."""

from __future__ import annotations

import ml_collections

from jaxflow.data.prompt_source import PromptSource

__all__ = ["eval_records", "prompt_source", "train_records"]


def train_records(config: ml_collections.ConfigDict, task, tokenizer) -> list[dict]:
    """The RL prompts as prompt records: train-split problems drawn with a seed apart from the warm
    start's, so that RL samples from problems the base model has not seen."""
    return task.to_prompt_records(task.examples("train", config.data.train_prompts, seed=config.seed + 1000),
                                  tokenizer)


def prompt_source(config: ml_collections.ConfigDict, records: list[dict]) -> PromptSource:
    """`records` in the order the run draws them (reshuffled at each pass over them)."""
    return PromptSource(records, seed=config.seed, num_epochs=None)


def eval_records(config: ml_collections.ConfigDict, task, tokenizer) -> list[dict]:
    """The held-out problems of every eval: the same `eval.num_prompts` eval-split ones for every seed."""
    return task.to_prompt_records(task.examples("eval", config.eval.num_prompts, seed=0), tokenizer)
