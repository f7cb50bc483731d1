"""The trainer's last line of defence: groups a consumed batch should never hold (NaN log-probs, bad
rewards, too long, token ids the model cannot embed) are dropped from the update, counted and logged,
instead of ending the job or NaN-ing the update."""

import logging
import math

import pytest

from jaxflow.data.records import FinishedGroup, Sample
from jaxflow.trainer.batch import Trajectory, make_batch
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


def test_token_ids_the_model_cannot_embed_are_dropped_before_batching(caplog):
    """Ids >= the vocab would NaN the whole update; ids >= 2**31 would raise OverflowError while the int32
    batch is written. Both are screened out, with the group, the field and the id named."""
    groups = [group(0), group(1, tokens=(5, 64)), group(2, tokens=(2**31, 6)), group(3)]
    groups[3].prompt = [1, 99]
    with caplog.at_level(logging.ERROR):
        good, rejected = screen_groups(groups, version=1, seq_len=16, vocab_size=64)
    assert [g.group_id for g in good] == [0]
    reasons = dict(rejected)
    assert r"tokens[1] = 64" in reasons[1] and f"tokens[0] = {2**31}" in reasons[2] and "prompt[1] = 99" in reasons[3]
    assert "group 2" in caplog.text
    # Without the model's vocab, ids still have to fit the batch's int32.
    good, rejected = screen_groups(groups[:3], version=1, seq_len=16)
    assert [g.group_id for g in good] == [0, 1] and [gid for gid, _ in rejected] == [2]


def test_batching_names_an_id_too_large_for_int32_instead_of_overflowing():
    trajectories = [Trajectory([1, 2], [5, 2**31], [-1.0, -1.0], [0, 0], reward=1.0),
                    Trajectory([1, 2], [5, 6], [-1.0, -1.0], [0, 0], reward=0.0)]
    with pytest.raises(ValueError, match=r"trajectory 0: completion token ids span \[5, 2147483648\]"):
        make_batch(trajectories, num_rows=2, seq_len=8)
