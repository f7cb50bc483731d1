"""A scripted model for the agent session and endpoint tests: each turn's tokens come from a script, with
log-probs and versions that differ per token, so a test can tell exactly which tokens were sampled."""

from __future__ import annotations

import dataclasses

from jaxflow.data.records import Sample
from jaxflow.models.tiny import CHATML_TEMPLATE
from rollout_bridge.engine import SamplingParams

TOOL_END = "</tool>"  # one token of the test tokenizer (extra_tokens), a turn's stop besides end of sequence
# The tiny tokenizer's ChatML template, with the request's tools in a system turn first.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                  + CHATML_TEMPLATE)


@dataclasses.dataclass
class Call:
    episode_id: str
    prompt: list[int]
    prefix: Sample
    params: SamplingParams
    new: list[int]  # the tokens the call sampled
    logprobs: list[float]
    versions: list[int]


class ScriptedModel:
    """`generate(episode_id, prompt, prefix, params)` (the `SessionBackend` callable, async) and `turn(...)`
    (the same, synchronous) answer with the next of `turns` (token id lists), cut at the params' max_tokens
    and at the first stop token, as an engine would: finish_reason "stop" at a stop token, "length" when
    cut, else "stop". The i-th token sampled overall has log-prob -(i + 1) / 64 and version 3 + its turn's index."""

    def __init__(self, turns: list[list[int]] | None = None):
        self.turns = list(turns or [])
        self.calls: list[Call] = []
        self._sampled = 0

    def turn(self, episode_id: str, prompt: list[int], prefix: Sample, params: SamplingParams) -> Sample:
        script = self.turns.pop(0)
        room = params.max_tokens - len(prefix.tokens)
        new, finish = [], "stop"
        for t in script:
            if len(new) == room:
                finish = "length"
                break
            new.append(t)
            if t in params.stop_token_ids:
                break
        logprobs = [-(self._sampled + i + 1) / 64 for i in range(len(new))]
        versions = [3 + len(self.calls)] * len(new)
        self._sampled += len(new)
        self.calls.append(Call(episode_id, list(prompt), prefix, params, new, logprobs, versions))
        return Sample(tokens=prefix.tokens + new, logprobs=prefix.logprobs + logprobs,
                      versions=prefix.versions + versions, env_spans=[list(s) for s in prefix.env_spans],
                      finish_reason=finish)

    async def generate(self, episode_id: str, prompt: list[int], prefix: Sample, params: SamplingParams) -> Sample:
        return self.turn(episode_id, prompt, prefix, params)

    def sampled(self) -> list[tuple[int, float, int]]:
        """(token, log-prob, version) of every token sampled, in order."""
        return [x for c in self.calls for x in zip(c.new, c.logprobs, c.versions)]


def model_tokens(sample: Sample) -> list[tuple[int, float, int]]:
    """(token, log-prob, version) of every token a sample marks as the model's (trainable), in order."""
    mask = sample.model_mask()
    return [(t, lp, v) for t, lp, v, m in zip(sample.tokens, sample.logprobs, sample.versions, mask) if m]


def env_tokens_are_context(sample: Sample) -> bool:
    """Every environment token has log-prob 0."""
    mask = sample.model_mask()
    return all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if not m)
