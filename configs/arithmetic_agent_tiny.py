"""The calculator task as a black-box agent: the tool demo's episodes, driven by a plain agent program.

The agent (`jaxflow.envs.calculator_agent:agent`) uses the `openai` client against the OpenAI-compatible
endpoint jaxflow serves over its engine for the run: it sends the question, runs the calculator on a
`<tool>...</tool>` turn and sends the result back as a tool message, and scores the final answer with the
arithmetic task's reward. jaxflow records the tokens behind each reply at the endpoint: the sampled tokens
are trained as they were sampled, and everything the agent sent (the question, the tool's results, the
chat template's headers) is environment tokens. Everything else, the warm-started base model included, is
configs/arithmetic_tools_tiny.py's, so the two demos learn from the same start (`:sync` for eta = 0).

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_agent_tiny.py
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_agent_tiny.py --config.rollout.env.options.latency_s=0.3
"""

import pathlib

import ml_collections

from jaxflow.config import base_config
from jaxflow.envs.config import env_section


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = base_config(pathlib.Path(__file__).with_name("arithmetic_tools_tiny.py"), arg or "async")
    variant = (arg or "async").split(",")[0]
    config.workdir = f"runs/arithmetic_agent_tiny_{variant}"
    # The agent function and its options (its keyword arguments besides base_url, task, episode, api_key).
    # The agents run in a process of their own (isolate): their HTTP client's work stays off the engine's
    # and trainer's interpreter lock.
    config.rollout.env = env_section(kind="agent", ref="jaxflow.envs.calculator_agent:agent",
                                     options={"latency_s": 0.0, "max_calls": 2}, agent_timeout_s=120.0,
                                     isolate=True)
    return config
