"""Environments written for other libraries, run unmodified through jaxflow's protocol (`jaxflow.envs.base`).

SkyRL-gym (`pip install skyrl-gym`, the `envs` extra): a `BaseTextEnv` has synchronous `init(prompt)`
-> (prompt, metadata), `step(action)` -> {"observations": messages, "reward", "done", "metadata"} and
`close()`. `SkyRLEnv(env)` wraps an instance: each call runs on a worker thread (`asyncio.to_thread`), so
a slow or blocking environment overlaps the episodes around it, and its answers get the same checks as a
native environment's. `skyrl_env(id, extras=..., env_config=...)` makes one from SkyRL-gym's registry
(`skyrl_gym.make`), the way SkyRL builds its environments.

The episode hands `reset` the task's meta; the SkyRL environment's `init` receives meta["prompt"] (the
chat messages of the task's prompt) when there is one, else an empty conversation. SkyRL environments
are given their task at construction (`extras`, e.g. {"reward_spec": {"ground_truth": ...}}): build one
per episode.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jaxflow.envs.base import Step

__all__ = ["SkyRLEnv", "skyrl_env"]


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
