"""The episode side of the soak (`benchmarks/soak.py`): a scripted inner engine and a character tokenizer under
`rollout_bridge.episodes.EpisodeEngine`, so episodes run through the real episode machinery without a model,
and the environments the soak mixes: a normal one, one that blocks its thread in `async def step`, one in a
process of its own that hangs that process, and the calculator fed a degenerate tool turn.

    episodes = Episodes(step_timeout_s=1.0)
    samples, rewards, failures = episodes.run_group("blocking", prompt=[1, 2], n=2, version=3, key="g7")

Not a benchmark of its own: imported by soak.py (and, by reference, by the isolated environment's process,
which imports `soak_episodes:HangingEnv`).
"""

from __future__ import annotations

import collections
import time

from jaxflow.data.records import Sample
from jaxflow.envs.base import Step
from jaxflow.envs.calculator import TOOL_OPEN, CalculatorEnv
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.episodes import EpisodeEngine
from rollout_bridge.scripted import CharTokenizer, ScriptedEngine

STOP = ord("#")  # the end-of-turn (tool-call) marker of every scripted model turn
TOOL_ID = 900  # the one token that decodes to "<tool>": a few thousand of them are a degenerate turn
TURN = [ord(c) for c in "hi"] + [STOP]
DEGENERATE_TOKENS = 3000
ENV_KINDS = ("normal", "blocking", "hanging", "degenerate")
HANGING_TIMEOUT_S = 8.0  # the isolated environment's step_timeout_s: its process starts within it
SLACK_TIMEOUT_S = 30.0  # the others' (they must never time out, even on a loaded machine)


def soak_turn(request: Request) -> list[int]:
    """Every scripted model turn: "hi#", or with meta["turn"] == "degenerate" DEGENERATE_TOKENS unterminated
    `<tool>` markers then "#"."""
    if (request.meta or {}).get("turn") == "degenerate":
        return [TOOL_ID] * DEGENERATE_TOKENS + [STOP]
    return TURN


class Answers:
    """Answers two turns with a short observation, reward 0.5 each; with meta["block_s"] its step first blocks
    its thread that long (a blocking call inside `async def step`)."""

    def __init__(self):
        self.k = 0

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        self.k += 1
        if self.meta.get("block_s"):
            time.sleep(self.meta["block_s"])
        return Step(observation=[{"role": "tool", "content": f"ok {self.k}"}], reward=0.5, done=self.k >= 2)

    async def close(self):
        pass


class HangingEnv:
    """Runs in the isolated environment process: with meta["hang"] its step blocks the process's event loop
    for good (a tool stuck in a blocking call); otherwise one turn, reward 1."""

    async def reset(self, meta):
        self.meta = meta

    async def step(self, action):
        if self.meta.get("hang"):
            time.sleep(3600)
        return Step(reward=1.0, done=True)

    async def close(self):
        pass


class Episodes:
    """One EpisodeEngine per environment kind (ENV_KINDS), each over its own ScriptedEngine.

    step_timeout_s: the blocking environment's episode engine's limit on one environment call, seconds (it
    blocks three times as long); the isolated one's limit is HANGING_TIMEOUT_S, the others' SLACK_TIMEOUT_S.
    The hanging kind's environments live in one process (`jaxflow.envs.isolated`), replaced after a hang;
    `isolated` is that factory (its `hung` and `restarts` count the replacements).
    """

    def __init__(self, step_timeout_s: float):
        from jaxflow.envs.isolated import isolated

        self.step_timeout_s = step_timeout_s
        self.tokenizer = CharTokenizer({TOOL_ID: TOOL_OPEN})
        self.isolated = isolated("soak_episodes:HangingEnv")
        factories = {"normal": lambda meta: Answers(), "blocking": lambda meta: Answers(),
                     "hanging": self.isolated, "degenerate": lambda meta: CalculatorEnv()}
        # Only the blocking environment's limit is short; the isolated environments' reset waits for their
        # process to start (seconds), and the others must not time out even on a loaded machine.
        limits = {"normal": SLACK_TIMEOUT_S, "blocking": step_timeout_s, "hanging": HANGING_TIMEOUT_S,
                  "degenerate": SLACK_TIMEOUT_S}
        self.engines = {kind: EpisodeEngine(ScriptedEngine(soak_turn), make, self.tokenizer, turn_stop_ids=[STOP],
                                            step_timeout_s=limits[kind], env_name=kind, max_turns=4)
                        for kind, make in factories.items()}
        self.failures: collections.Counter = collections.Counter()  # env_failure kind -> episodes
        self.hung_last = False  # whether the isolated environment's latest group hung its process

    def run_group(self, kind: str, prompt: list[int], n: int, version: int, key: str,
                  hang: bool = False) -> tuple[list[Sample], list[float], list[str | None]]:
        """Runs a group's n episodes on environment `kind` with the model at `version`; returns their samples,
        rewards (each episode's sum, 0.0 for a failed one, as the coordinator trains them) and failure kinds
        (None for an episode that finished). The first episode of a "blocking" group blocks its thread; with
        `hang`, the first episode of a "hanging" group hangs the environment process."""
        engine = self.engines[kind]
        engine.inner.version = version
        if kind == "hanging":
            self.hung_last = hang
        requests = []
        for i in range(n):
            meta = {"q": i, "answer": 3}
            if kind == "blocking" and i == 0:
                meta["block_s"] = 3 * self.step_timeout_s
            if kind == "hanging" and hang and i == 0:
                meta["hang"] = True
            if kind == "degenerate":
                meta["turn"] = "degenerate"
            requests.append(Request(f"{key}-{i}", list(prompt), SamplingParams(max_tokens=4000, temperature=0.0),
                                    meta=meta))
        done = engine.generate(requests, timeout=120)
        failures = [c.info.get("env_failure") for c in done]
        for f in failures:
            if f is not None:
                self.failures[f] += 1
        samples = [c.sample for c in done]
        return samples, [float(s.reward) for s in samples], failures

    def settle(self) -> None:
        """Runs one more episode on the isolated environment if its process hung last: the process is replaced
        (and counted in `isolated.hung`) when the next episode starts."""
        if self.hung_last:
            self.run_group("hanging", [1, 2], 1, self.engines["hanging"].inner.version, "settle")

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
