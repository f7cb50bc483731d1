"""A SkyRL-gym text environment written against SkyRL-gym's public API only (no jaxflow import): two
turns, the second scored 1.0 when its <answer> is an even integer. Any policy learns it within a few
steps, so a short run shows whether episodes through the adapter learn at all."""

import re

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class EvenAnswerEnv(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = 2
        self.extras = dict(extras or {})

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        if self.turns < self.max_turns:
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "Final answer?"}], reward=0.0,
                                         done=False, metadata={})
        match = ANSWER.search(action)
        even = match is not None and int(match.group(1)) % 2 == 0
        return BaseTextEnvStepOutput(observations=[], reward=1.0 if even else 0.0, done=True, metadata={})
