"""Packed rows attend in parts: `split_attention` against plain masked attention, and the packer keeping
short sequences inside parts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.models import transformer
from jaxflow.models.transformer import (
    attention,
    attention_mask,
    attention_units,
    row_splits,
    split_attention,
    split_index,
)
from jaxflow.trainer.batch import Trajectory, make_batch

pytestmark = pytest.mark.slow  # compiles attention at several lengths and layouts


def packed_segments(lengths_per_row: list[list[int]], t: int) -> np.ndarray:
    seg = np.zeros((len(lengths_per_row), t), np.int32)
    for r, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            if n:
                seg[r, start:start + n] = i + 1
            start += n
    return seg


def test_row_splits_and_split_index():
    assert row_splits(224) == (1, 2, 4) and row_splits(256) == (1, 2, 4, 8)
    assert row_splits(48) == (1,) and row_splits(64) == (1, 2)
    # 4 and 6 parts of 192: neither's cuts contain the other's, so the most parts of any clean cut wins.
    assert row_splits(192) == (1, 2, 4, 6)
    sixths = packed_segments([[32] * 6, [30, 2, 32, 20, 12, 32, 32, 32]], 192)
    assert int(split_index(sixths, row_splits(192))) == 3
    fourths = packed_segments([[48] * 4, [40, 8, 48, 48, 48]], 192)
    assert int(split_index(fourths, row_splits(192))) == 2
    # Quarters and sixths in one batch share only the cut at 96.
    assert int(split_index(np.concatenate([sixths, fourths]), row_splits(192))) == 1
    splits = row_splits(128)  # (1, 2, 4)
    quarters = packed_segments([[32, 32, 32, 32], [20, 12, 32, 0, 32, 30]], 128)
    assert int(split_index(quarters, splits)) == 2
    halves = packed_segments([[40, 24, 64], [64, 64]], 128)  # 40 + 24 crosses the quarter at 32
    assert int(split_index(halves, splits)) == 1
    whole = packed_segments([[70, 58], [128]], 128)
    assert int(split_index(whole, splits)) == 0
    padding = np.zeros((2, 128), np.int32)  # nothing to cut: every cut is clean
    assert int(split_index(padding, splits)) == 2


@pytest.mark.parametrize("t, rows", [(128, [[32, 32, 32, 32], [10, 22, 64, 20]]),  # quarters
                                     (128, [[40, 24, 50, 14], [64, 64]]),  # halves
                                     (128, [[100, 28], [7, 90, 31]]),  # whole rows
                                     (192, [[32] * 6, [20, 12, 32, 32, 32, 30]]),  # sixths
                                     (192, [[48] * 4, [30, 18, 48, 48, 48]])])  # quarters of 192
def test_split_attention_equals_masked_attention(t, rows):
    seg = jnp.asarray(packed_segments(rows, t))
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (2, t, 2, 2, 16))
    k = jax.random.normal(kk, (2, t, 2, 16))
    v = jax.random.normal(kv, (2, t, 2, 16))
    d_out = jax.random.normal(kd, (2, t, 2, 2, 16))

    def full(q, k, v):
        return attention(q, k, v, attention_mask(seg))

    def split(q, k, v):
        return split_attention(q, k, v, seg)

    real = (seg > 0)[:, :, None, None, None]  # a padding query's output is never used
    out_full, vjp_full = jax.vjp(full, q, k, v)
    out_split, vjp_split = jax.vjp(split, q, k, v)
    # Outputs are convex combinations of values of size ~1 and gradients sums of ~t such terms: the only
    # difference is the order of float32 sums over a row or a part of it.
    np.testing.assert_allclose(np.where(real, out_split, 0), np.where(real, out_full, 0), atol=1e-5)
    d_out = jnp.where(real, d_out, 0)
    for a, b in zip(vjp_split(d_out), vjp_full(d_out)):
        np.testing.assert_allclose(a, b, atol=1e-5 * np.sqrt(t))


def test_a_shared_prompt_and_its_samples_are_never_cut_apart():
    # Row 0: a prompt (segment 1) and two samples that see it (segments 2, 3: context 1) over [0, 64), then two
    # sequences of 32; row 1 in quarters. Segment ids alone would allow quarters (every quarter starts a
    # segment) and cut the sample at 32 off its prompt: the unit ends at 64, so halves.
    seg = jnp.asarray(packed_segments([[20, 12, 32, 32, 32], [32] * 4], 128))
    ctx = jnp.zeros_like(seg).at[0, 20:64].set(1)
    assert int(split_index(seg, row_splits(128))) == 2
    assert int(split_index(attention_units(seg, ctx), row_splits(128))) == 1
    kq, kk, kv, kd = jax.random.split(jax.random.key(1), 4)
    q, d_out = jax.random.normal(kq, (2, 128, 2, 2, 16)), jax.random.normal(kd, (2, 128, 2, 2, 16))
    k, v = jax.random.normal(kk, (2, 128, 2, 16)), jax.random.normal(kv, (2, 128, 2, 16))
    out_full, vjp_full = jax.vjp(lambda q, k, v: attention(q, k, v, attention_mask(seg, context_ids_bt=ctx)), q, k, v)
    out_split, vjp_split = jax.vjp(lambda q, k, v: split_attention(q, k, v, seg, ctx), q, k, v)
    np.testing.assert_allclose(out_split, out_full, atol=1e-5)
    for a, b in zip(vjp_split(d_out), vjp_full(d_out)):
        np.testing.assert_allclose(a, b, atol=1e-5 * np.sqrt(128))
    # The samples see the prompt: their output differs from attending within their own segment alone.
    alone = attention(q, k, v, attention_mask(seg))
    assert np.abs(np.asarray(alone - out_full)[0, 32:64]).max() > 1e-2


def test_long_rows_attend_in_query_blocks_with_the_same_result(monkeypatch):
    # 600 queries: three blocks of ATTENTION_QUERY_BLOCK (256), the last one padded; row 1 ends in
    # padding. Against the same call with every query at once.
    t = 600
    seg = jnp.asarray(packed_segments([[250, 350], [400, 0]], t))
    kq, kk, kv, kd = jax.random.split(jax.random.key(2), 4)
    q, d_out = jax.random.normal(kq, (2, t, 2, 1, 8)), jax.random.normal(kd, (2, t, 2, 1, 8))
    k, v = jax.random.normal(kk, (2, t, 2, 8)), jax.random.normal(kv, (2, t, 2, 8))

    def attend(q, k, v):
        return attention(q, k, v, attention_mask(seg))

    assert t > transformer.ATTENTION_QUERY_BLOCK and t % transformer.ATTENTION_QUERY_BLOCK
    out_blocks, vjp_blocks = jax.vjp(attend, q, k, v)
    monkeypatch.setattr(transformer, "ATTENTION_QUERY_BLOCK", t)
    out_whole, vjp_whole = jax.vjp(attend, q, k, v)
    real = (seg > 0)[:, :, None, None, None]
    np.testing.assert_allclose(np.where(real, out_blocks, 0), np.where(real, out_whole, 0), atol=1e-5)
    d_out = jnp.where(real, d_out, 0)
    for a, b in zip(vjp_blocks(d_out), vjp_whole(d_out)):
        np.testing.assert_allclose(a, b, atol=1e-5 * np.sqrt(t))


def trajectory(n_prompt, n_completion, group):
    return Trajectory(prompt=[5] * n_prompt, completion=[7] * n_completion, behav_logp=[-1.0] * n_completion,
                      versions=[0] * n_completion, reward=float(group % 2), group_id=group)


def test_packer_keeps_short_sequences_inside_parts():
    # Sequence lengths 30, 58, 30, 49, 20, 31, 108, 50 (prompt + completion), longest placed first.
    lengths = [(10, 20), (8, 50), (12, 18), (9, 40), (10, 10), (16, 15), (8, 100), (20, 30)]
    trajs = [trajectory(p, c, i // 2) for i, (p, c) in enumerate(lengths)]
    batch, _ = make_batch(trajs, num_rows=8, seq_len=128, pack=True)
    seg = np.asarray(batch.segment_ids)[0]
    assert int((seg > 0).sum()) == sum(p + c for p, c in lengths)
    splits = row_splits(128)
    # 108 (+ the 20 that fits after it): a whole row; 58 + 50 and 49 + 31 + 30: halves; the last 30: quarters.
    assert [int(split_index(seg[r:r + 1], splits)) for r in range(4)] == [0, 1, 1, 2]
    assert not seg[4:].any()
    # Parts would need 3 rows for six 40-token sequences, plain first-fit 2: with 2 rows it falls back.
    six = [trajectory(10, 30, i // 2) for i in range(6)]
    tight, _ = make_batch(six, num_rows=2, seq_len=128, pack=True)
    assert int((np.asarray(tight.segment_ids) > 0).sum()) == 240
    roomy, _ = make_batch(six, num_rows=4, seq_len=128, pack=True)
    assert int(split_index(np.asarray(roomy.segment_ids)[0], splits)) == 1
    # Rows of 192: six sequences of 29-32 tokens fill one row in sixths (quarters of 48 would take two rows).
    short = [trajectory(12, 17 + i % 4, i // 2) for i in range(6)]
    sixths, _ = make_batch(short, num_rows=2, seq_len=192, pack=True)
    seg = np.asarray(sixths.segment_ids)[0]
    assert not seg[1].any() and int(split_index(seg[:1], row_splits(192))) == 3
