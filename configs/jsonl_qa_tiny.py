"""Asynchronous RL on your own data: a JSONL (or parquet) file of questions with numeric answers.

Everything but the task is configs/arithmetic_tiny.py (same variants, same model, same RL settings): the
task is `jsonl_qa` on `task.path` (GSM8K-style rows {"question": ..., "answer": "... #### 72"}; see
jaxflow.tasks.jsonl_qa), and the base model is built from that file's worked solutions by the warm start,
unless `base.dir` holds an HF model of your own (then used as given). `task.reward_ref` swaps in a reward
function of your own ("module:function", importable from where you run the job).

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/jsonl_qa_tiny.py --config.task.path=data/train.jsonl
  .venv/bin/python -m jaxflow.main --config=configs/jsonl_qa_tiny.py --config.task.path=data/train.jsonl \
      --config.base.dir=path/to/hf_model --config.task.reward_ref=my_reward:reward
"""

import pathlib

import ml_collections
from ml_collections.config_dict import placeholder

from jaxflow.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = base_config(pathlib.Path(__file__).with_name("arithmetic_tiny.py"), arg)
    variant = arg or "async"
    config.workdir = f"runs/jsonl_qa_tiny_{variant}"
    config.task = ml_collections.ConfigDict()
    # A registered task (jaxflow.tasks.TASKS) and its options.
    config.task.name = "jsonl_qa"
    # The data file (required): one {"question": ..., "answer": ...} object per line, or parquet.
    config.task.path = placeholder(str)
    # A separate held-out file; None: hold out a hash-chosen eval_fraction of task.path's questions.
    config.task.eval_path = placeholder(str)
    config.task.eval_fraction = 0.1
    # "tag": the answer is the number in <answer>...</answer>; "last_number": the last number written.
    config.task.answer_mode = "tag"
    # No system turn: on a tiny model the instructions are dozens of tokens it never reads but pays for.
    config.task.system_prompt = ""
    # A reward of your own, "module:function" with fn(response: str, meta: dict) -> float, instead of the
    # task's (RL rewards and evals; not part of the base model's cache key). None: the task's own.
    config.task.reward_ref = placeholder(str)
    config.base.dir = "runs/base/jsonl_qa_tiny"
    return config
