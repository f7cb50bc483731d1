"""The calculator task as a verifiers environment: the tool demo's episodes, driven by verifiers' own rollout.

The environment is `jaxflow.envs.verifiers_examples.calculator`, written in verifiers' v1 API (a taskset
whose task scores the reply with the arithmetic task's reward, and a harness with the calculator as its
tool); the adapter `jaxflow.envs.verifiers_agent:agent` runs one verifiers episode per jaxflow episode
against the OpenAI-compatible endpoint jaxflow serves over its engine, and verifiers' score is the reward.
Each episode's task is the run's (the arithmetic task source's question and answer, as the data of the
environment's task type). Everything else, the warm-started base model included, is
configs/arithmetic_agent_tiny.py's, so the three tool demos learn from the same start (`:sync` for eta = 0).
Needs the `envs` extra (pip install -e '.[envs]').

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_verifiers_tiny.py
"""

import pathlib

import ml_collections

from jaxflow.config import base_config
from jaxflow.envs.config import env_section


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = base_config(pathlib.Path(__file__).with_name("arithmetic_agent_tiny.py"), arg or "async")
    variant = (arg or "async").split(",")[0]
    config.workdir = f"runs/arithmetic_verifiers_tiny_{variant}"
    # The adapter and its options: the verifiers environment (its id, or the dotted path of its module).
    config.rollout.env = env_section(kind="agent", ref="jaxflow.envs.verifiers_agent:agent",
                                     options={"env": "jaxflow.envs.verifiers_examples.calculator"},
                                     agent_timeout_s=120.0)
    return config
