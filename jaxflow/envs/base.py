"""The environment side of a multi-turn episode: jaxflow's protocol, the checks on what an environment
returns, and one environment call under a time limit.

An episode alternates turns: the model acts (generates until a stop or tool-call marker), the
environment answers, until the environment says it is done. The environment sees the model's turn as
text (decoded for it; the model's token ids go to the trainer untouched) and answers with chat messages,
which the episode renders through the chat template and appends as token ids masked out of the loss.
Rewards come per turn, and the episode's reward is their sum.

An environment is any object with these async methods (jaxflow's protocol; `Environment` types it):

    async def reset(self, meta: dict) -> list[dict] | str | None   # the task's meta; extra first messages
    async def step(self, action: str) -> Step | dict                # the model's turn, decoded
    async def close(self) -> None

`step` may return a `Step` or a dict with its fields. What it returns is checked (`check_step`): the
observation must be None, a string (one message of role `default_role`) or a list of {"role": str,
"content": str} messages; the reward None or a finite real number (not a bool); done a bool; info a
dict. `call` runs one method under a time limit and turns a timeout, an exception or a malformed answer
into `EnvironmentFailed`, naming the environment, the episode and what went wrong: the episode is then
scored as failed and counted by `kind`, and the run goes on. Environments written for other libraries
run through `jaxflow.envs.adapters`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["Environment", "EnvironmentFailed", "FAILURE_KINDS", "Step", "call", "check_messages", "check_step"]

FAILURE_KINDS = ("timeout", "error", "malformed", "oversized")
"""How an environment call can fail (`EnvironmentFailed.kind`); "oversized": an observation of more tokens
than the episode allows (`rollout_bridge.episodes`)."""

# Bounds on what one environment answer may carry, checked before anything is tokenized; the episode then
# caps the observation in tokens (`max_observation_tokens`).
MAX_MESSAGES = 64
MAX_CONTENT_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to one model turn.

    observation: chat messages to append before the model's next turn ([] for none).
    reward: this turn's reward, or None. done: whether the episode ends here. info: free-form metrics.
    """
    observation: list[dict[str, str]] = dataclasses.field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    async def reset(self, meta: dict) -> list[dict] | str | None: ...

    async def step(self, action: str) -> Step | dict: ...

    async def close(self) -> None: ...


class EnvironmentFailed(RuntimeError):
    """An environment call timed out, raised or answered something malformed. kind: one of
    FAILURE_KINDS; env and episode: the names the message gives."""

    def __init__(self, kind: str, env: str, episode: Any, what: str):
        super().__init__(f"environment {env!r}, episode {episode}: {what}")
        self.kind, self.env, self.episode = kind, env, episode


def check_messages(value: Any, where: str, default_role: str) -> list[dict[str, str]]:
    """`value` (None, a string, or a list of {"role", "content"} string messages) as a list of messages.
    ValueError saying what is wrong, prefixed by `where`."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [{"role": default_role, "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"{where}: the observation must be None, a string or a list of messages, got "
                         f"{type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"{where}: {len(value)} messages in one observation (at most {MAX_MESSAGES})")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {i} must be a dict with string 'role' and 'content', got "
                             f"{message!r:.200}")
        if not message["role"]:
            raise ValueError(f"{where}: message {i} has an empty role")
        if len(message["content"]) > MAX_CONTENT_CHARS:
            raise ValueError(f"{where}: message {i} has {len(message['content'])} characters (at most "
                             f"{MAX_CONTENT_CHARS})")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def check_step(value: Any, where: str, default_role: str = "tool") -> Step:
    """A `step` answer (a Step, or a mapping with its fields) checked and normalised; ValueError saying
    what is wrong, prefixed by `where`."""
    if isinstance(value, Step):  # its fields as they are (check_messages and dict(info) copy them below)
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"observation", "reward", "done", "info"})
        if unknown:
            raise ValueError(f"{where}: unknown step field(s) {unknown}; a step has observation, reward, done, "
                             f"info")
        fields = dict(value)
    else:
        raise ValueError(f"{where}: step must return a Step or a dict, got {type(value).__name__}")
    reward = fields.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
                               or not math.isfinite(float(reward))):
        raise ValueError(f"{where}: the reward must be None or a finite number, got {reward!r:.100}")
    done = fields.get("done", False)
    if not isinstance(done, bool):
        raise ValueError(f"{where}: done must be a bool, got {done!r:.100}")
    info = fields.get("info") or {}
    if not isinstance(info, Mapping):
        raise ValueError(f"{where}: info must be a dict, got {type(info).__name__}")
    observation = check_messages(fields.get("observation"), where, default_role)
    return Step(observation, None if reward is None else float(reward), done, dict(info))


async def call(env: Any, method: str, *args: Any, timeout_s: float | None, env_name: str, episode: Any,
               default_role: str = "tool") -> Any:
    """`await env.<method>(*args)` within `timeout_s` seconds (None: no limit), its answer checked
    (`step`: a Step; `reset`: a list of messages). Raises EnvironmentFailed on a timeout, an exception
    or a malformed answer. The limit fires only when the caller's loop runs: an environment that may block
    its thread is called through `jaxflow.envs.threaded.ThreadedEnv` (the episode engine does)."""
    try:
        async with asyncio.timeout(timeout_s):  # in this task: no task of its own per call, as wait_for makes
            answer = await getattr(env, method)(*args)
    except TimeoutError:
        raise EnvironmentFailed("timeout", env_name, episode, f"{method} took more than {timeout_s} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of user code is the episode's, not the run's
        raise EnvironmentFailed("error", env_name, episode, f"{method} raised {type(e).__name__}: {e}") from e
    where = f"{method} returned a malformed answer"
    try:
        if method == "step":
            return check_step(answer, where, default_role)
        if method == "reset":
            return check_messages(answer, where, default_role)
        return answer
    except ValueError as e:
        raise EnvironmentFailed("malformed", env_name, episode, str(e)) from None
