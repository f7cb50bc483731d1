"""Verifiers environments (`pip install 'jaxflow[envs]'`, verifiers' v1 API) as jaxflow agents: a verifiers
environment runs unmodified, its rollouts against jaxflow's OpenAI-compatible endpoint, and its own score is
the episode's reward.

`agent` is an agent function in `rollout_bridge.agent_engine`'s sense (a run's `rollout.env` of kind
"agent", ref "jaxflow.envs.verifiers_agent:agent", options {"env": ...}). Each episode:

1. loads the environment once per process and options (`vf.load_environment`, as `vf-eval` does): `env`
   names its taskset plugin, by verifiers id (an installed environment package, "gsm8k-v1") or by the
   dotted path of a plugin module inside a package ("jaxflow.envs.verifiers_examples.calculator");
   verifiers resolves ids as top-level modules, so such a module is registered under a top-level alias
   (its dots as underscores) in this process. The agent seat runs in the local subprocess runtime (no
   sandbox, no network) with the taskset's harness unless `agent_config` pins another; verifiers' retries
   stay off (a retried rollout would rerun in the same jaxflow episode);
2. makes the verifiers task from the jaxflow task's meta (see below);
3. runs one episode (`env.run_episode`) with a model context whose client is verifiers' eval client
   pointed at the episode's base URL and key, the model named `model`: verifiers' harness talks to its
   interception endpoint, which forwards each request to jaxflow's endpoint, where the tokens behind each
   reply are recorded (everything the harness sent in between, tool results included, is environment
   tokens);
4. returns the trace's reward (the sum of the task's weighted `@vf.reward`s, as verifiers reports it).

Where tasks come from: a jaxflow run draws its tasks from its own task source (`task.*`: the prompts the
coordinator admits, the eval split, the warm start's demonstrations); each episode's meta becomes the
data of the environment's task type, field by field. `task_fields` maps a data field to the meta key that
holds it (default: each field under its own name, and the prompt from "prompt", else "question"). A
verifiers taskset's own `load()` is not read in a jaxflow run; its tasks are the run's task source's.

Errors are named: the extra missing (ImportError naming the install) and an `env` that is not a verifiers
environment, or one with other than one agent seat (ValueError), before the run (the run's config check
loads the environment: `check_options`); a task the environment's task type cannot take (ValueError
naming the fields) and a verifiers episode that failed (RuntimeError with verifiers' error) fail their
episode alone.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["agent", "check_options", "load_env", "task_data"]

INSTALL = "verifiers environments need the verifiers package: pip install 'jaxflow[envs]' (from a checkout: " \
          "pip install -e '.[envs]')"

_envs: dict[str, Any] = {}  # the options' JSON -> the loaded environment
_lock = threading.Lock()


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ImportError(INSTALL) from None
    return vf


def plugin_id(env: str) -> str:
    """The verifiers id of `env`: itself, or for a dotted module path its top-level alias, registered."""
    if not isinstance(env, str) or not env.strip():
        raise ValueError(f"env must name a verifiers environment (its id or a dotted module path), got {env!r}")
    if "." not in env or "/" in env or "@" in env:
        return env
    try:
        module = importlib.import_module(env)
    except ImportError as e:
        raise ValueError(f"verifiers environment {env!r}: cannot import module {env!r}: {e}") from e
    alias = env.replace(".", "_")
    known = sys.modules.setdefault(alias, module)
    if known is not module:
        raise ValueError(f"verifiers environment {env!r}: its alias {alias!r} is another module "
                         f"({getattr(known, '__file__', known)!r})")
    return alias


def load_env(env: str, taskset: Mapping[str, Any] | None = None, agent_config: Mapping[str, Any] | None = None):
    """The verifiers environment `env` (see the module docstring) with taskset options `taskset` (its
    TasksetConfig's fields) and agent seat options `agent_config` (vf.AgentConfig's fields, e.g.
    {"harness": {"id": "null"}, "max_turns": 4}); loaded once per process and options."""
    vf = _verifiers()
    key = json.dumps([env, taskset or {}, agent_config or {}], sort_keys=True, default=str)
    with _lock:
        if key in _envs:
            return _envs[key]
        ident = plugin_id(env)
        seat = {"runtime": {"type": "subprocess"}, **dict(agent_config or {})}
        try:
            config = vf.resolve_env_config({"taskset": {**dict(taskset or {}), "id": ident}, "agent": seat})
            loaded = vf.load_environment(config)
        except (ImportError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{env!r} is not a verifiers environment jaxflow can run: {e}") from e
        retried = [name for name, retries in (("retries", config.retries), ("agent.retries", config.agent.retries))
                   if retries.max_retries]
        if retried:
            raise ValueError(f"verifiers environment {env!r}: {' and '.join(retried)} must be 0 in jaxflow: a "
                             f"retried rollout reruns in the same jaxflow episode, whose tokens it already holds")
        if not isinstance(loaded, vf.SingleAgentEnv):
            raise ValueError(f"verifiers environment {env!r} is a {type(loaded).__name__} (several agent seats); "
                             f"jaxflow trains one agent per episode: only single-agent environments run")
        _envs[key] = loaded
        return loaded


def task_data(env, meta: Mapping[str, Any], task_fields: Mapping[str, str] | None = None, name: str = "env"):
    """The verifiers task of `env`'s task type whose data is the jaxflow task's `meta`, field by field
    (`task_fields`: data field -> meta key; see the module docstring). ValueError naming what is missing."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = dict(task_fields or {})
    values = {}
    for field in data_cls.model_fields:
        key = fields.get(field, field)
        if key in meta:
            values[field] = meta[key]
        elif field == "prompt" and "prompt" not in fields and "question" in meta:
            values[field] = meta["question"]
    unknown = sorted(k for k in fields if k not in data_cls.model_fields)
    if unknown:
        raise ValueError(f"task_fields names {unknown}, not fields of {name}'s task data {data_cls.__name__} "
                         f"({', '.join(data_cls.model_fields)})")
    try:
        data = data_cls.model_validate(values)
    except Exception as e:  # pydantic's ValidationError lists each bad field
        raise ValueError(f"the task (meta keys {sorted(meta)}) is not a task of {name} ({data_cls.__name__}): "
                         f"{e}") from None
    return task_cls(data, env.taskset.config.task)


def _key_variable(api_key: str) -> str:
    """The environment variable verifiers' client reads the endpoint's key from: one per key, so episodes
    of endpoints with different keys never read each other's. Its name holds "API_KEY", which verifiers'
    subprocess runtime keeps from the programs it starts."""
    name = "JAXFLOW_ENDPOINT_API_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    os.environ[name] = api_key
    return name


async def agent(base_url: str, task: dict, episode: str, *, api_key: str = "none", env: str,
                model: str = "policy", taskset: dict | None = None, agent_config: dict | None = None,
                task_fields: dict | None = None) -> float:
    """Runs one rollout of the verifiers environment `env` on the task `task` (its meta) against the
    endpoint at `base_url`; returns verifiers' reward. See the module docstring for the options."""
    vf = _verifiers()
    loaded = load_env(env, taskset, agent_config)
    vtask = task_data(loaded, task, task_fields, name=env)
    client = vf.EvalClientConfig(base_url=base_url, api_key_var=_key_variable(api_key))
    result = await loaded.run_episode(vtask, vf.ModelContext(model=model, client=client))
    if not result.ok:
        errors = [e for t in result.traces for e in t.errors] + list(result.errors)
        what = "; ".join(f"{e.type}: {e.message}" for e in errors[-3:]) or "no error recorded"
        raise RuntimeError(f"verifiers environment {env!r} failed episode {episode}: {what}")
    if len(result.traces) != 1:
        raise RuntimeError(f"verifiers environment {env!r} ran {len(result.traces)} agents in episode "
                           f"{episode}; jaxflow trains one")
    [trace] = result.traces
    missing = [name for name, r in trace.rewards.items() if r is None]
    if missing:
        raise RuntimeError(f"verifiers environment {env!r} did not score episode {episode}: reward(s) "
                           f"{missing} did not run")
    return float(trace.reward)


def check_options(options: dict) -> list[str]:
    """What is wrong with the options of a run's `agent` (its config check, before the run): the extra
    missing, an `env` that is not a verifiers environment, `task_fields` naming no field of its task data."""
    try:
        env = load_env(options.get("env"), options.get("taskset"), options.get("agent_config"))
    except (ImportError, ValueError) as e:
        return [str(e)]
    data_cls = type(env.taskset).task_type().data_type()
    unknown = sorted(k for k in options.get("task_fields") or {} if k not in data_cls.model_fields)
    return [f"task_fields names {unknown}, not fields of {options.get('env')}'s task data {data_cls.__name__} "
            f"({', '.join(data_cls.model_fields)})"] if unknown else []


agent.check_options = check_options
