"""The Ray names of a cluster-mode run's actors, so that an operator (or `benchmarks/chaos.py`) can find them.

Every named actor of a run carries the run's tag (from its workdir), so two runs on one cluster never
share a name:

    jaxflow-<tag>-data          the data services' host actor (trajectory and parameter service)
    jaxflow-<tag>-trainer-<i>   trainer process i of the group (of a group re-formed after a failure:
                                jaxflow-<tag>-trainer-<i>-r<n>, the n-th re-formed group)
    jaxflow-<tag>-rollout-<i>   rollout actor i
    jaxflow-<tag>-rewards       the reward pool's actor
    jaxflow-<tag>-scorers       the reward model, LLM judge or teacher that rollout actors share

in the Ray namespace `NAMESPACE`. `ray list actors` shows them; `ray.get_actor(name, namespace=NAMESPACE)`
returns a handle.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["NAMESPACE", "PATTERNS", "data", "rewards", "rollout", "run_tag", "scorers", "trainer"]

NAMESPACE = "jaxflow"
# Regular expressions matching each kind's names, whatever the run.
PATTERNS = {"data": r"jaxflow-[0-9a-f]{8}-data", "trainer": r"jaxflow-[0-9a-f]{8}-trainer-\d+(-r\d+)?",
            "rollout": r"jaxflow-[0-9a-f]{8}-rollout-\d+", "rewards": r"jaxflow-[0-9a-f]{8}-rewards",
            "scorers": r"jaxflow-[0-9a-f]{8}-scorers"}


def run_tag(workdir: str | os.PathLike) -> str:
    """8 hex digits naming the run whose workdir is `workdir` (the same path gives the same tag)."""
    return hashlib.sha1(os.path.abspath(os.fspath(workdir)).encode()).hexdigest()[:8]


def data(tag: str) -> str:
    return f"jaxflow-{tag}-data"


def trainer(tag: str, i: int, generation: int = 0) -> str:
    return f"jaxflow-{tag}-trainer-{i}" + (f"-r{generation}" if generation else "")


def rollout(tag: str, i: int) -> str:
    return f"jaxflow-{tag}-rollout-{i}"


def rewards(tag: str) -> str:
    return f"jaxflow-{tag}-rewards"


def scorers(tag: str) -> str:
    return f"jaxflow-{tag}-scorers"
