"""The trainer's last line of defence: groups a consumed batch should never hold (NaN log-probs, bad
rewards, too long) are dropped from the update, counted and logged, instead of ending the job."""

import logging
import math

import pytest

from jaxflow.data.records import FinishedGroup, Sample
from jaxflow.trainer.rl_trainer import screen_groups


def group(gid, logprobs=(-1.0, -1.0), rewards=(1.0, 0.0), versions=(0, 0), tokens=(5, 6)):
    s = Sample(list(tokens), list(logprobs), list(versions), "stop")
    return FinishedGroup(gid, [1, 2], 0, [s, Sample([7], [-0.5], [0], "stop")], list(rewards), {}, 0)


def test_bad_groups_are_dropped_with_a_reason_and_good_ones_kept(caplog):
    groups = [group(0), group(1, logprobs=[math.nan, math.nan]), group(2, logprobs=["abc", None]),
              group(3, rewards=[math.inf, 0.0]), group(4, versions=[0, 2]), group(5, tokens=[5] * 40,
              logprobs=[-1.0] * 40, versions=[0] * 40), group(6, rewards=[1.0])]
    with caplog.at_level(logging.ERROR):
        good, rejected = screen_groups(groups, version=1, seq_len=16)
    assert [g.group_id for g in good] == [0]
    assert [gid for gid, _ in rejected] == [1, 2, 3, 4, 5, 6]
    reasons = dict(rejected)
    assert "logprobs[0]" in reasons[1] and "logprobs[0]" in reasons[2] and "rewards[0]" in reasons[3]
    assert "versions" in reasons[4] and "seq_len" in reasons[5] and "rewards" in reasons[6]
    assert "group 1" in caplog.text


def test_a_batch_with_no_usable_group_raises_a_clear_error():
    with pytest.raises(ValueError, match="buffer 3: all 1 groups were rejected.*group 9"):
        screen_groups([group(9, logprobs=[math.nan, 0.0])], version=3, seq_len=16)
