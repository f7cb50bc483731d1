"""The `rollout.env` section of a run's config: episodes with an environment instead of single answers.

    rollout.env.ref             None (single answers, scored by the task's reward) or "module:factory":
                                factory(**options) makes one episode's environment (jaxflow's protocol,
                                `jaxflow.envs.base`), e.g. "jaxflow.envs.calculator:CalculatorEnv"
    rollout.env.options         keyword arguments of the factory (a dict)
    rollout.env.turn_stop       text that ends a model turn besides the end-of-turn token (a tool-call
                                marker such as "</tool>"): it must be one token of the model's tokenizer
    rollout.env.step_timeout_s  seconds an environment call may take before its episode fails
    rollout.env.max_turns       model turns per episode at most
    rollout.env.isolate         run the environments in a process of their own (`jaxflow.envs.isolated`):
                                a tool that crashes its process fails its episodes, not the run

`env_section()` is the section with its defaults, for config files; `env_problems` returns one message
per bad key (the RL job's `check_config` joins them); `environment_factory` and `turn_stop_ids` read a
checked section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections
from ml_collections.config_dict import placeholder

from jaxflow import refs
from jaxflow.config import check_float, check_int

__all__ = ["env_problems", "env_section", "environment_factory", "turn_stop_ids"]


def env_section(**overrides: Any) -> ml_collections.ConfigDict:
    """The `rollout.env` section: episodes off (ref None) unless `overrides` say otherwise."""
    section = ml_collections.ConfigDict({"ref": placeholder(str), "options": {}, "turn_stop": placeholder(str),
                                         "step_timeout_s": 30.0, "max_turns": 4, "isolate": False})
    section.update(overrides)
    return section


def _resolve(ref: str) -> Callable[..., Any]:
    return refs.resolve(ref, what="environment reference")


def env_problems(section: ml_collections.ConfigDict, tokenizer: Any = None) -> list[str]:
    """What is wrong with `rollout.env` (with `tokenizer`, also whether turn_stop is one token). Every key is
    checked, episodes on or off (ref None), so a bad value never waits for the run that turns them on."""
    problems: list[str] = []
    check_float(problems, "rollout.env.step_timeout_s", section.step_timeout_s, 0.0, open_low=True)
    check_int(problems, "rollout.env.max_turns", section.max_turns, 1)
    if not isinstance(section.get("isolate", False), bool):
        problems.append(f"rollout.env.isolate must be True or False, got {section.isolate!r}")
    options = section.options.to_dict() if isinstance(section.options, ml_collections.ConfigDict) else section.options
    if not isinstance(options, dict):
        problems.append(f"rollout.env.options must be a dict of the factory's keyword arguments, got {options!r}")
    if section.ref is not None:
        if not isinstance(section.ref, str):
            return problems + [f"rollout.env.ref must be None or 'module:factory', got {section.ref!r}"]
        try:
            factory = _resolve(section.ref)
        except refs.RefError as e:
            return problems + [f"rollout.env.ref: {e}"]
        if isinstance(options, dict):
            try:  # built once here, so that a bad option fails now and not in the first episode
                factory(**options)
            except Exception as e:  # noqa: BLE001 - whatever the user's factory raises names the problem
                problems.append(f"rollout.env: {section.ref}(**{options}) failed: {type(e).__name__}: {e}")
    if section.turn_stop is not None:
        if not isinstance(section.turn_stop, str) or not section.turn_stop:
            problems.append(f"rollout.env.turn_stop must be None or a non-empty string, got {section.turn_stop!r}")
        elif tokenizer is not None and len(tokenizer.encode(section.turn_stop)) != 1:
            problems.append(f"rollout.env.turn_stop {section.turn_stop!r} is {len(tokenizer.encode(section.turn_stop))} "
                            f"tokens of the model's tokenizer; a turn can only stop at one token")
    return problems


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
