"""What the simulated fleet generates: prompts and the response length of every sample.

A response length is a function of (seed, prompt index, sample index) only, so a simulation gives the
same lengths whatever order (and on whichever engine) the samples are generated in, and a resumed sample
keeps its target length.

Parametric lengths are log-normal with a per-prompt and a per-sample part:

    log L = log(median) + sigma_prompt * z_p + sigma_sample * z_s

z_p is drawn once per prompt (its difficulty, shared by the samples of its group), z_s once per sample.
L is clipped to [min_tokens, max_tokens] and rounded up to a multiple of `block_tokens`, the unit the
simulated engines generate in (see `jaxflow.sim.fleet`). The empirical mode instead resamples a whole
observed group per prompt, which keeps any correlation structure the observed groups had.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

# Prompts whose group lengths Workload keeps cached (a small LRU: samples of a group arrive together).
_CACHE_PROMPTS = 8192
# Samples per prompt computed at once on a cache miss (a group's samples share one draw).
_CACHE_GROUP = 16


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """Response lengths in tokens with a long tail (see the module docstring).

    groups: set by `empirical`; when given, the parametric fields (median, sigmas) are unused.
    """

    median: float = 1500.0
    sigma_prompt: float = 0.7
    sigma_sample: float = 0.6
    min_tokens: int = 1
    max_tokens: int = 32768
    block_tokens: int = 256
    seed: int = 0
    groups: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        if not self.median > 0:
            raise ValueError(f"median must be > 0, got {self.median}")
        for name in ("sigma_prompt", "sigma_sample"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got min_tokens={self.min_tokens}, "
                             f"max_tokens={self.max_tokens}")
        if self.max_tokens % self.block_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a multiple of block_tokens "
                             f"({self.block_tokens})")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.groups is not None and not (self.groups and all(g and min(g) >= 1 for g in self.groups)):
            raise ValueError("groups must be a non-empty list of non-empty groups of positive lengths")

    @classmethod
    def empirical(cls, lengths_by_group: list[list[int]], *, block_tokens: int = 256, seed: int = 0,
                  min_tokens: int = 1, max_tokens: int | None = None) -> LengthModel:
        """Lengths resampled from observed groups: each prompt index draws one whole group (uniformly,
        with replacement) and its sample i takes element i mod len(group). max_tokens defaults to the
        longest observed length rounded up to a block."""
        groups = tuple(tuple(int(x) for x in g) for g in lengths_by_group)
        if max_tokens is None:
            longest = max((max(g) for g in groups if g), default=block_tokens)
            max_tokens = max(1, math.ceil(longest / block_tokens)) * block_tokens
        return cls(min_tokens=min_tokens, max_tokens=max_tokens, block_tokens=block_tokens, seed=seed,
                   groups=groups)

    def group_lengths(self, prompt_index: int, n: int) -> np.ndarray:
        """Lengths (int64 tokens) of samples 0..n-1 of prompt `prompt_index`. Sample i's length does not
        depend on n: the draws come from one stream seeded by (seed, prompt_index), read in order."""
        if prompt_index < 0 or n < 0:
            raise ValueError(f"need prompt_index >= 0 and n >= 0, got {prompt_index}, {n}")
        # What np.random.default_rng([seed, prompt_index]) builds, without its argument dispatch.
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, prompt_index])))
        if self.groups is not None:
            group = self.groups[int(rng.integers(len(self.groups)))]
            raw = np.array([group[i % len(group)] for i in range(n)], dtype=np.float64)
        else:
            z = rng.standard_normal(n + 1)
            raw = np.exp(math.log(self.median) + self.sigma_prompt * z[0] + self.sigma_sample * z[1:])
        # np.clip's values, without its per-call overhead (raw holds no NaN).
        clipped = np.minimum(np.maximum(raw, self.min_tokens), self.max_tokens)
        return (np.ceil(clipped / self.block_tokens) * self.block_tokens).astype(np.int64)

    def length(self, prompt_index: int, sample_index: int) -> int:
        """The length in tokens of one sample (a multiple of block_tokens)."""
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        return int(self.group_lengths(prompt_index, sample_index + 1)[sample_index])


def reasoning_lengths(block_tokens: int = 256, seed: int = 0) -> LengthModel:
    """A reasoning-model-like distribution: median ~1.5k tokens, p99 ~13k, tail clipped at 32k."""
    return LengthModel(median=1500.0, sigma_prompt=0.7, sigma_sample=0.6, min_tokens=1, max_tokens=32768,
                       block_tokens=block_tokens, seed=seed)


def describe(model: LengthModel, n: int = 20000, group: int = 8) -> dict[str, float]:
    """Summary of n lengths (n // group prompts of `group` samples): median, p90, p99, max, mean."""
    prompts = max(1, n // group)
    x = np.concatenate([model.group_lengths(p, group) for p in range(prompts)])
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": float(x.max()), "mean": float(x.mean())}


class Workload:
    """The simulated task: prompts of a constant `prompt_tokens` and lengths from a LengthModel.

    Each prompt is one token carrying its index (`records`), so a simulated engine can look up the
    lengths of its samples from the request alone.
    """

    def __init__(self, lengths: LengthModel, *, prompt_tokens: int = 256):
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        self.lengths = lengths
        self.prompt_tokens = int(prompt_tokens)
        self._cache: dict[int, np.ndarray] = {}

    @property
    def block_tokens(self) -> int:
        return self.lengths.block_tokens

    def length(self, prompt_index: int, sample_index: int) -> int:
        """The target length in tokens of sample `sample_index` of prompt `prompt_index`."""
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        got = self._cache.pop(prompt_index, None)
        if got is None or len(got) <= sample_index:
            got = self.lengths.group_lengths(prompt_index, max(_CACHE_GROUP, 2 * (sample_index + 1)))
        self._cache[prompt_index] = got  # re-inserted: most recently used last
        if len(self._cache) > _CACHE_PROMPTS:
            del self._cache[next(iter(self._cache))]
        return int(got[sample_index])

    def records(self, num_prompts: int, start: int = 0) -> list[dict[str, Any]]:
        """Records for `jaxflow.data.prompt_source.PromptSource`: prompt [i] with meta {"prompt_index": i}."""
        return [{"prompt": [i], "meta": {"prompt_index": i}} for i in range(start, start + num_prompts)]
