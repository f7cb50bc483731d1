"""The `rollout.env` section of a run's config: episodes with an environment instead of single answers.

`EnvConfig` is the section (its docstring says what each key means; `env_section(**overrides)` generates it
for config files); `env_problems` returns one message per bad key (the RL job's `check_config` joins them);
`environment_factory` and `turn_stop_ids` read a checked section.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from collections.abc import Callable
from typing import Any, ClassVar

import ml_collections

from jaxflow import refs
from jaxflow.config import Section, check_bool, check_choice, check_float, check_int

__all__ = ["ENV_KINDS", "EnvConfig", "env_problems", "env_section", "environment_factory", "runs_agents",
           "turn_stop_ids"]

ENV_KINDS = ("env", "agent", "command")
"""What drives an episode (`rollout.env.kind`): jaxflow's environment protocol, an agent function, or an agent
program run as a subprocess."""


@dataclasses.dataclass(frozen=True)
class EnvConfig(Section):
    """The `rollout.env` section: episodes, where an environment answers between model turns, or where an
    agent program drives the model through an OpenAI-compatible endpoint.

    kind: "env" (jaxflow's environment protocol), "agent" (an agent function) or "command" (an agent
      program run as a subprocess); both agent kinds run through `rollout_bridge.agent_engine`.
    ref: None (single answers, scored by the task's reward) or "module:attr". kind "env": factory(**options)
      makes one episode's environment (`jaxflow.envs.base`), e.g. "jaxflow.envs.calculator:CalculatorEnv".
      kind "agent": `async def agent(base_url, task, episode, *, api_key, **options) -> reward`, e.g.
      "jaxflow.envs.calculator_agent:agent"; an agent with a `check_options(options) -> list[str]`
      attribute has its options checked by it before the run (the problems it names).
    command: kind "command": the program and its arguments (a list of strings); it finds the endpoint in
      OPENAI_BASE_URL and OPENAI_API_KEY, the task in JAXFLOW_TASK (JSON), and prints its reward last.
    options: keyword arguments of the factory or the agent function (a dict).
    agent_timeout_s: kind "agent"/"command": seconds an agent may run before its episode fails.
    turn_stop: text that ends a model turn besides the end-of-turn token (a tool-call marker such as
      "</tool>"): it must be one token of the model's tokenizer.
    step_timeout_s: seconds an environment call (reset, step, close) may take before its episode fails; it
      holds even for an environment that blocks its thread (each runs on a thread of its own).
    max_turns: model turns per episode at most.
    isolate: run the environments in a process of their own (`jaxflow.envs.isolated`): a tool that crashes
      or hangs its process fails its episodes, not the run, and the process is replaced. With kind "agent",
      the agent functions run there (their HTTP client's work off the engine's and trainer's interpreter).
    max_observation_tokens: the most tokens one environment answer may add to an episode (None: the
      episode's max_tokens); a longer answer fails its episode (counted as env_oversized).
    """

    SECTION: ClassVar[str] = "rollout.env"

    kind: str = "env"
    ref: str | None = None
    command: tuple[str, ...] = ()
    options: dict = dataclasses.field(default_factory=dict)
    agent_timeout_s: float = 300.0
    turn_stop: str | None = None
    step_timeout_s: float = 30.0
    max_turns: int = 4
    isolate: bool = False
    max_observation_tokens: int | None = None

    def problems(self) -> list[str]:
        """Every key, episodes on or off (ref None), so a bad value never waits for the run that turns them on."""
        problems: list[str] = []
        check_choice(problems, self.key("kind"), self.kind, ENV_KINDS)
        check_float(problems, self.key("step_timeout_s"), self.step_timeout_s, 0.0, open_low=True)
        check_float(problems, self.key("agent_timeout_s"), self.agent_timeout_s, 0.0, open_low=True)
        if not isinstance(self.command, (list, tuple)) or not all(isinstance(a, str) for a in self.command):
            problems.append(f"rollout.env.command must be a list of strings (a program and its arguments), "
                            f"got {self.command!r}")
        elif self.kind == "command" and not self.command:
            problems.append("rollout.env.kind 'command' needs rollout.env.command (a program and its arguments)")
        if self.kind == "command" and self.ref is not None:
            problems.append(f"rollout.env.kind 'command' runs rollout.env.command; unset rollout.env.ref "
                            f"(got {self.ref!r})")
        check_int(problems, self.key("max_turns"), self.max_turns, 1)
        check_bool(problems, self.key("isolate"), self.isolate)
        if self.kind == "command" and self.isolate is True:
            problems.append("rollout.env.isolate applies to environments and agent functions; kind 'command' "
                            "already runs each agent in a process of its own (unset isolate)")
        check_int(problems, self.key("max_observation_tokens"), self.max_observation_tokens, 1, optional=True)
        if not isinstance(self.options, dict):
            problems.append(f"rollout.env.options must be a dict of the factory's keyword arguments, "
                            f"got {self.options!r}")
        if self.ref is not None and not isinstance(self.ref, str):
            problems.append(f"rollout.env.ref must be None or 'module:factory', got {self.ref!r}")
        if self.turn_stop is not None and (not isinstance(self.turn_stop, str) or not self.turn_stop):
            problems.append(f"rollout.env.turn_stop must be None or a non-empty string, got {self.turn_stop!r}")
        return problems


def env_section(**overrides: Any) -> ml_collections.ConfigDict:
    """The `rollout.env` section: episodes off (ref None) unless `overrides` say otherwise (`EnvConfig.section`)."""
    return EnvConfig.section(**overrides)


def _resolve(ref: str) -> Callable[..., Any]:
    return refs.resolve(ref, what="environment reference")


def env_problems(section: ml_collections.ConfigDict, tokenizer: Any = None) -> list[str]:
    """What is wrong with `rollout.env`: its keys and values (`EnvConfig`), whether `ref` imports and builds
    with `options`, and (with `tokenizer`) whether turn_stop is one token."""
    problems = EnvConfig.config_problems(section)
    if problems:
        return problems
    env = EnvConfig.from_config(section)
    if env.kind == "command":
        if shutil.which(env.command[0]) is None:
            problems.append(f"rollout.env.command: program {env.command[0]!r} is not found")
        return problems
    if env.kind == "agent":
        if env.ref is None:
            return ["rollout.env.kind 'agent' needs rollout.env.ref, the agent function ('module:function')"]
        try:
            agent = refs.resolve(env.ref, what="agent reference", expect="function")
        except refs.RefError as e:
            return [f"rollout.env.ref: {e}"]
        if not inspect.iscoroutinefunction(agent):
            return [f"rollout.env.ref {env.ref!r} must name an async function (async def agent(base_url, task, "
                    f"episode, *, api_key, ...) -> reward)"]
        try:  # checked here, so that a bad option fails now and not in the first episode
            inspect.signature(agent).bind("url", {}, "episode", api_key="key", **env.options)
        except TypeError as e:
            problems.append(f"rollout.env: agent {env.ref} does not take (base_url, task, episode, api_key=..., "
                            f"**{env.options}): {e}")
            return problems
        check = getattr(agent, "check_options", None)  # an agent that can say more about its options now
        if callable(check):
            problems += [f"rollout.env.options: {p}" for p in check(dict(env.options))]
        return problems
    if env.ref is not None:
        try:
            factory = _resolve(env.ref)
        except refs.RefError as e:
            return [f"rollout.env.ref: {e}"]
        try:  # built once here, so that a bad option fails now and not in the first episode
            factory(**env.options)
        except Exception as e:  # noqa: BLE001 - whatever the user's factory raises names the problem
            problems.append(f"rollout.env: {env.ref}(**{env.options}) failed: {type(e).__name__}: {e}")
    if env.turn_stop is not None and tokenizer is not None and len(tokenizer.encode(env.turn_stop)) != 1:
        problems.append(f"rollout.env.turn_stop {env.turn_stop!r} is {len(tokenizer.encode(env.turn_stop))} "
                        f"tokens of the model's tokenizer; a turn can only stop at one token")
    return problems


def runs_agents(section) -> bool:
    """Whether the `rollout.env` section (a ConfigDict, its dict, or None) runs agents (kind "agent" or
    "command") rather than jaxflow's environments."""
    return section is not None and section.get("kind", "env") in ("agent", "command")


def environment_factory(section: ml_collections.ConfigDict) -> Callable[[dict], Any]:
    """make_env(meta) -> a new environment, from a checked section (the meta reaches it at reset)."""
    options = section.options.to_dict() if isinstance(section.options, ml_collections.ConfigDict) else section.options
    if section.get("isolate", False):
        from jaxflow.envs.isolated import isolated
        return isolated(section.ref, options)
    factory = _resolve(section.ref)
    return lambda meta: factory(**options)


def turn_stop_ids(section: ml_collections.ConfigDict, tokenizer: Any) -> tuple[int, ...]:
    return () if section.turn_stop is None else tuple(tokenizer.encode(section.turn_stop))
