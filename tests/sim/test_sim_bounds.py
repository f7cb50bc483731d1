"""The tail floor (jaxflow.sim.bounds): its arithmetic, and that simulated runs which train every sample
stay above it while dropping the slowest groups is what goes below it."""

from __future__ import annotations

import dataclasses

import pytest

from jaxflow.coordination import Coordination
from jaxflow.sim import InstanceSpec, LengthModel
from jaxflow.sim.bounds import keep_all_floor, solo_decode_s
from jaxflow.sim.loop import Scenario, TrainerModel, simulate

SPEC = InstanceSpec(step_s=0.01, per_seq_s=1e-3, per_kv_token_s=1e-6, kv_capacity=1_000_000, max_running=64,
                    prefill_tokens_per_s=1e6, sync_s=0.5)


def test_solo_decode_is_the_integral_of_the_step():
    # (0.01 + 0.001 + 1e-6 * 64) * 1000 + 1e-6 * 1000**2 / 2 = 11.064 + 0.5
    assert solo_decode_s(SPEC, 64, 1000) == pytest.approx(11.564)
    assert solo_decode_s(dataclasses.replace(SPEC, speed=2.0), 64, 1000) == pytest.approx(11.564 / 2)


def test_floor_arithmetic_with_fixed_lengths():
    """Every sample 512 tokens except sample 3 of each group, 2048: each cohort's longest is 2048."""
    lm = LengthModel.empirical([[512, 512, 512, 2048]], block_tokens=16, max_tokens=2048)
    sc = Scenario(name="fixed", instances=(SPEC, dataclasses.replace(SPEC, speed=0.5)), lengths=lm,
                  trainer=TrainerModel(1.0, 1000.0), batch_groups=2, group_size=4, max_tokens=2048, steps=4,
                  prompt_tokens=64)
    tokens = 2 * (3 * 512 + 2048)
    for eta in (0, 1, 4):
        f = keep_all_floor(sc, eta, cohorts=3)
        assert f["solo_tail_s"] == pytest.approx(solo_decode_s(SPEC, 64, 2048))  # the fast instance
        assert f["train_s"] == pytest.approx(1.0 + tokens / 1000.0)
        assert f["step_s"] == pytest.approx((f["solo_tail_s"] + f["train_s"]) / (eta + 1))
        assert f["cap_share"] == 1.0
    with pytest.raises(ValueError, match="eta"):
        keep_all_floor(sc, -1)


@pytest.mark.slow  # simulates full runs
def test_runs_that_keep_every_sample_stay_above_the_floor_and_dropping_goes_below():
    """A tail-bound scenario: long samples (up to 2048 tokens) in most cohorts, a fast trainer. Both
    keep-every-sample systems step no faster than the floor; dropping the slowest groups steps faster."""
    lm = LengthModel(median=250.0, sigma_prompt=0.3, sigma_sample=1.0, max_tokens=2048, block_tokens=16)
    sc = Scenario(name="tail", instances=(SPEC,) * 16, lengths=lm, trainer=TrainerModel(0.5, 50000.0),
                  batch_groups=16, group_size=4, max_tokens=2048, steps=14, prompt_tokens=64, tick_s=0.25)
    eta = 2
    floor = keep_all_floor(sc, eta, cohorts=200)
    assert floor["cap_share"] > 0.5 and floor["solo_tail_s"] > 10 * floor["train_s"]
    kept = {name: simulate(sc, strategy, eta=eta, max_wall_s=60.0)
            for name, strategy in (("areal_like", Coordination.areal_like(max_running=8)),
                                   ("default", Coordination(max_running=8)))}
    for name, r in kept.items():
        assert r["groups_surplus"] == 0
        print(name, r["step_s_mean"], floor)
        assert r["step_s_mean"] >= 0.9 * floor["step_s"], (name, r["step_s_mean"], floor)
    dropped = simulate(sc, Coordination(max_running=8, extra_groups=0.5), eta=eta, max_wall_s=60.0)
    assert dropped["groups_surplus"] > 0
    assert dropped["step_s_mean"] < floor["step_s"], (dropped["step_s_mean"], floor)
