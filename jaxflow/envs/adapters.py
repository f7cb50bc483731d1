"""Environments written for other libraries, run unmodified through jaxflow's protocol (`jaxflow.envs.base`).

SkyRL-gym (`pip install skyrl-gym`, the `envs` extra): a `BaseTextEnv` has synchronous `init(prompt)`
-> (prompt, metadata), `step(action)` -> {"observations": messages, "reward", "done", "metadata"} and
`close()`. `SkyRLEnv(env)` wraps an instance: each call runs on a worker thread (`asyncio.to_thread`), so
a slow or blocking environment overlaps the episodes around it, and its answers get the same checks as a
native environment's. `skyrl_env(id, extras=..., env_config=...)` makes one from SkyRL-gym's registry
(`skyrl_gym.make`), the way SkyRL builds its environments. `SkyRLGymEnv(env, ...)` is the form a run's
config names (`rollout.env.ref = "jaxflow.envs.adapters:SkyRLGymEnv"`, options {"env": ...}): it makes
the SkyRL environment at each episode's reset, from a registered id or a "module:Class", with the
task's meta as its `extras`.

The episode hands `reset` the task's meta; the SkyRL environment's `init` receives meta["prompt"] (the
chat messages of the task's prompt) when there is one, else an empty conversation. SkyRL environments
are given their task at construction (`extras`, e.g. {"reward_spec": {"ground_truth": ...}}): build one
per episode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jaxflow import refs
from jaxflow.envs.base import Step

__all__ = ["SkyRLEnv", "SkyRLGymEnv", "skyrl_env"]


class SkyRLEnv:
    """A SkyRL-gym `BaseTextEnv` instance (or anything with its `init` / `step` / `close`) behind jaxflow's
    environment protocol."""

    def __init__(self, env: Any):
        missing = [m for m in ("init", "step", "close") if not callable(getattr(env, m, None))]
        if missing:
            raise TypeError(f"{type(env).__name__} is not a SkyRL-gym text environment: no {', '.join(missing)}")
        self.env = env
        self.metadata: dict[str, Any] = {}

    async def reset(self, meta: dict) -> list[dict] | None:
        prompt = list(meta.get("prompt") or [])
        _, self.metadata = await asyncio.to_thread(self.env.init, prompt)
        return None  # the task's prompt is already the episode's start

    async def step(self, action: str) -> Step | dict:
        out = await asyncio.to_thread(self.env.step, action)
        if not isinstance(out, dict):
            return out  # the checks name what is wrong with it
        return {"observation": out.get("observations"), "reward": out.get("reward"),
                "done": out.get("done", False), "info": out.get("metadata") or {}}

    async def close(self) -> None:
        await asyncio.to_thread(self.env.close)


def skyrl_env(env_id: str, *, extras: dict[str, Any] | None = None, env_config: Any = None) -> SkyRLEnv:
    """SkyRL-gym's registered environment `env_id` (e.g. "gsm8k_multi_turn"), made with `env_config` and
    `extras` as SkyRL makes it, behind jaxflow's protocol. ImportError naming the extra when SkyRL-gym
    is not installed."""
    try:
        import skyrl_gym
    except ImportError:
        raise ImportError("SkyRL-gym environments need the skyrl-gym package: pip install -e '.[envs]'") from None
    return SkyRLEnv(skyrl_gym.make(env_id, env_config=env_config, extras=dict(extras or {})))


class SkyRLGymEnv:
    """A SkyRL-gym environment made per episode behind jaxflow's protocol (a run's `rollout.env.ref`).

    env: a SkyRL-gym registered id ("gsm8k_multi_turn") or "module:Class" of a `BaseTextEnv` subclass,
    made as SkyRL makes it: Class(env_config, extras). env_config: its env_config. extras_key: the key of
    the task's meta holding the extras (None: the whole meta).
    """

    def __init__(self, env: str, env_config: Any = None, extras_key: str | None = None):
        if not isinstance(env, str) or not env:
            raise ValueError(f"env must be a SkyRL-gym id or 'module:Class', got {env!r}")
        if ":" in env:
            make = refs.resolve(env, what="SkyRL-gym environment")  # a bad reference fails here, not per episode
            self._make = lambda extras: SkyRLEnv(make(env_config, extras))
        else:
            self._make = lambda extras: skyrl_env(env, extras=extras, env_config=env_config)
        self.env_name, self.extras_key = env, extras_key
        self._inner: SkyRLEnv | None = None

    async def reset(self, meta: dict) -> list[dict] | None:
        extras = meta if self.extras_key is None else meta.get(self.extras_key)
        if not isinstance(extras, dict):
            raise ValueError(f"the task's meta has no dict at {self.extras_key!r} for {self.env_name}'s extras")
        self._inner = self._make(dict(extras))
        return await self._inner.reset(meta)

    async def step(self, action: str) -> Step | dict:
        return await self._inner.step(action)

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()
