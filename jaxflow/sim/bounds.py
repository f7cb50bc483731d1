"""How short a train step can be under a hard staleness bound when every sample is trained: the
tail floor.

A group dispatched at version v may be trained no later than from buffer v + eta. It can be
dispatched no earlier than when version v is published, at the end of the update on buffer v - 1.
Between the two the trainer does eta + 1 step intervals (consume to consume) less one update:

    window(v) = consume(v + eta) - publish(v) = T(v - 1) + ... + T(v + eta - 1) - train(v - 1)

and the window must cover the latency of the slowest sample of every group dispatched at v, which is at
least the time that sample takes alone on the fastest instance (`solo_decode_s`). Summing over v, each
interval T counts eta + 1 times, so the mean step interval is at least

    (mean over versions of solo(longest sample dispatched at v) + mean train step) / (eta + 1).

No placement, migration, sync or queue policy changes this; only not training the slowest samples does
(redundant rollout, releasing stuck buffers) or a larger eta. `keep_all_floor` estimates it for a
scenario by drawing cohorts of B groups (one version's dispatch in steady state) from its length model.
The estimate is optimistic for the strategies (a tail sample would have to run alone from its first
token, known to be long in advance), so a keep-every-sample run cannot beat it by more than the draw's
noise.
"""

from __future__ import annotations

import functools

import numpy as np

from jaxflow.sim.fleet import InstanceSpec


def solo_decode_s(spec: InstanceSpec, prompt_tokens: int, length: float) -> float:
    """Seconds for one sequence alone on `spec` to decode `length` tokens after a `prompt_tokens`
    prompt: the integral of the decode step (a + b + c * (prompt + x)) / speed over x in [0, length]."""
    per_token = spec.step_s + spec.per_seq_s + spec.per_kv_token_s * prompt_tokens
    return (per_token * length + spec.per_kv_token_s * length * length / 2.0) / spec.speed


def keep_all_floor(scenario, eta: int, *, cohorts: int = 64) -> dict[str, float]:
    """The tail floor (module docstring) for `scenario` (a `jaxflow.sim.loop.Scenario`) at `eta`:
    {"step_s": the floor on the mean step interval, "solo_tail_s": mean solo time of a cohort's longest
    sample, "train_s": mean train step, "cap_share": share of cohorts holding a sample at max_tokens}."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if cohorts < 1:
        raise ValueError(f"cohorts must be >= 1, got {cohorts}")
    solo_s, train_s, cap_share = _cohort_means(scenario, cohorts)
    return {"step_s": (solo_s + train_s) / (eta + 1), "solo_tail_s": solo_s, "train_s": train_s,
            "cap_share": cap_share}


@functools.lru_cache(maxsize=16)
def _cohort_means(sc, cohorts: int) -> tuple[float, float, float]:
    """(mean solo time of a cohort's longest sample, mean train step, share of capped cohorts) over
    `cohorts` draws; cached because the floors of several etas share the same draws (a Scenario is
    frozen, so equal scenarios draw equal cohorts)."""
    b, n = sc.batch_groups, sc.group_size
    solo, train, capped = [], [], 0
    for k in range(cohorts):
        lengths = np.minimum(np.concatenate([sc.lengths.group_lengths(p, n) for p in range(k * b, (k + 1) * b)]),
                             sc.max_tokens)
        longest = float(lengths.max())
        solo.append(min(solo_decode_s(s, sc.prompt_tokens, longest) for s in sc.instances))
        train.append(sc.trainer.step_time(float(lengths.sum())))
        capped += longest >= sc.max_tokens
    return float(np.mean(solo)), float(np.mean(train)), capped / cohorts
