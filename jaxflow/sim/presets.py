"""Scenarios for the simulator.

`reasoning(instances)`: reasoning-style RL of an ~8B model, one H100-class instance per engine (the
fleet's `InstanceSpec` defaults), response lengths with median ~1.5k tokens and a tail clipped at 32k,
groups of 16, 4 groups per instance per step, and a trainer with about as many GPUs as the fleet
(~7k trained tokens/s per GPU, 10 s per step of optimizer and weight publishing).

`from_trace(...)`: a small scenario whose engines, trainer and lengths are fitted from a real run's
trace (see benchmarks/simulate.py), to check the simulator against the real thing.
"""

from __future__ import annotations

import statistics

import numpy as np

from jaxflow.sim.fleet import InstanceSpec
from jaxflow.sim.loop import Scenario, TrainerModel
from jaxflow.sim.workload import LengthModel, reasoning_lengths

GROUP_SIZE = 16
GROUPS_PER_INSTANCE = 4


def reasoning(instances: int, *, steps: int = 12, seed: int = 0, tick_s: float = 1.0) -> Scenario:
    spec = InstanceSpec()
    return Scenario(name=f"reasoning-{instances}", instances=tuple(spec for _ in range(instances)),
                    lengths=reasoning_lengths(block_tokens=256, seed=seed),
                    trainer=TrainerModel(step_s=10.0, tokens_per_s=7000.0 * instances),
                    batch_groups=GROUPS_PER_INSTANCE * instances, group_size=GROUP_SIZE, max_tokens=32768,
                    steps=steps, tick_s=tick_s)


def fit_linear(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares coefficients (non-negative, by clipping and refitting) of y = sum_k c_k x_k."""
    a, y = np.asarray(xs, float), np.asarray(ys, float)
    keep = list(range(a.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = [0.0] * a.shape[1]
            for k, c in zip(keep, coef):
                out[k] = max(float(c), 0.0)
            return out
        keep = [k for k, c in zip(keep, coef) if c >= 0] or keep[:1]


def from_trace(trace: dict, metrics: list[dict], *, instances: int, max_running: int, kv_capacity: int,
               batch_groups: int, group_size: int, max_tokens: int, prompt_tokens: int, steps: int,
               warmup_steps: int, tick_s: float = 0.02) -> tuple[Scenario, dict]:
    """A scenario fitted to a real run: `trace` is the coordinator's (coordinator_trace.json), `metrics`
    the per-step lines of metrics.jsonl. Fits, by least squares:

    - the engine's decode step, running / tokens_per_s = a + b * running + c * kv_tokens, over the load
      samples with requests running (in the run, with the trainer sharing the cores, as it did);
    - the trainer's busy time per step, step_s + consumed_tokens / tokens_per_s;
    - the weight sync's cost: the median sync duration (it includes the KV recompute, so the simulated
      prefill is made free: the real engine's prefill cost is inside the fitted decode step too);
    - response lengths: the observed groups, resampled (`LengthModel.empirical`, 1-token blocks).

    Returns the scenario and the fitted figures."""
    rows = [r for r in trace["loads"] if r[2] > 0 and r[5] > 0]
    if len(rows) < 10:
        raise ValueError(f"the trace holds {len(rows)} load samples with requests running; need >= 10")
    a, b, c = fit_linear([[1.0, r[2], r[4] * kv_capacity] for r in rows], [r[2] / r[5] for r in rows])
    if a + b + c <= 0:
        raise ValueError("the fitted decode step is 0 s; the trace is degenerate")
    steps_m = [m for m in metrics if "trainer_busy_s" in m]
    t0, t1 = fit_linear([[1.0, m["consumed_tokens"]] for m in steps_m], [m["trainer_busy_s"] for m in steps_m])
    trainer = TrainerModel(step_s=t0, tokens_per_s=1.0 / t1 if t1 > 0 else 1e12)
    sync_s = statistics.median(trace["sync_s"]) if trace["sync_s"] else 0.0
    spec = InstanceSpec(step_s=a, per_seq_s=b, per_kv_token_s=c, kv_capacity=kv_capacity,
                        max_running=max_running, prefill_tokens_per_s=1e12, sync_s=sync_s)
    lengths = LengthModel.empirical([[max(1, x) for x in g] for g in trace["group_lengths"]], block_tokens=1,
                                    max_tokens=max_tokens)
    scenario = Scenario(name="calibration", instances=tuple(spec for _ in range(instances)), lengths=lengths,
                        trainer=trainer, batch_groups=batch_groups, group_size=group_size, max_tokens=max_tokens,
                        steps=steps, prompt_tokens=prompt_tokens, tick_s=tick_s, warmup_steps=warmup_steps)
    fitted = {"decode_step_s": a, "decode_per_seq_s": b, "decode_per_kv_token_s": c, "sync_s": sync_s,
              "trainer_step_s": t0, "trainer_tokens_per_s": trainer.tokens_per_s,
              "load_samples": len(rows), "groups_observed": len(trace["group_lengths"])}
    return scenario, fitted
