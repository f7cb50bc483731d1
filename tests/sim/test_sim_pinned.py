"""The simulator's figures for fixed seeds, pinned: a rewrite for speed must give the same runs.

A small fleet that exercises what the fast paths touch (a slow instance, a small KV cache that
preempts, weight syncs mid-sample, migrations, retries, dropped surplus groups) under four strategies,
and a tail floor. Every figure must match exactly: the simulation is deterministic per seed, and code
that does the same arithmetic in the same order gives the same floats. A change meant to alter the
model regenerates the file: `python tests/sim/test_sim_pinned.py`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jaxflow.coordination import Coordination
from jaxflow.sim import InstanceSpec, LengthModel
from jaxflow.sim.bounds import keep_all_floor
from jaxflow.sim.loop import Scenario, TrainerModel, simulate

PINNED = pathlib.Path(__file__).with_name("pinned_figures.json")

SPEC = InstanceSpec(step_s=0.01, per_seq_s=1e-3, per_kv_token_s=1e-6, kv_capacity=6000, max_running=16,
                    prefill_tokens_per_s=1e5, sync_s=0.5)
SCENARIO = Scenario(name="pin", instances=(SPEC, SPEC, dataclasses.replace(SPEC, speed=0.5),
                                           dataclasses.replace(SPEC, kv_capacity=3000)),
                    lengths=LengthModel(median=200.0, sigma_prompt=0.5, sigma_sample=0.8, max_tokens=2048,
                                        block_tokens=16),
                    trainer=TrainerModel(0.5, 20000.0), batch_groups=8, group_size=4, max_tokens=2048, steps=6,
                    prompt_tokens=64, tick_s=0.25)
STRATEGIES = {"sync": (Coordination.areal_like(max_running=16), 0),
              "areal": (Coordination.areal_like(max_running=16), 2),
              "default": (Coordination(max_running=16), 2),
              "drop": (Coordination(max_running=16, extra_groups=0.5), 2)}


def figures() -> dict:
    """Every strategy's `simulate` result but its wall time, and the floor, as JSON reads them back."""
    out = {}
    for name, (strategy, eta) in STRATEGIES.items():
        r = simulate(SCENARIO, strategy, eta=eta)
        r.pop("wall_s")
        out[name] = r
    out["floor"] = keep_all_floor(SCENARIO, 2, cohorts=8)
    return json.loads(json.dumps(out))


def test_the_same_seeds_give_the_same_figures():
    got, want = figures(), json.loads(PINNED.read_text())
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == want[name], name
    # The pinned runs exercise the paths they are meant to.
    assert want["default"]["coordinator"]["requests_migrated"] > 0 and want["drop"]["groups_surplus"] > 0
    assert all(want[name]["coordinator"]["syncs"] > 0 for name in STRATEGIES)


if __name__ == "__main__":
    PINNED.write_text(json.dumps(figures(), indent=1, sort_keys=True) + "\n")
