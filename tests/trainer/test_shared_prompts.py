"""A GRPO group's samples sharing one copy of their prompt in a packed row (`make_batch(share_prompts=True)`):
the same log-probabilities, gradients and update as every sample laid out alone, with fewer tokens; and
`validate_batch` refusing context ids that would let a token see what it must not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_sums_close, policy_loss_scale
from train_step_setup import assert_grad_norms_close, assert_trees_close, one_device, run, setup

from jaxflow.models import transformer
from jaxflow.trainer.batch import Trajectory, make_batch, validate_batch
from jaxflow.trainer.losses import LossConfig
from jaxflow.trainer.step import StepConfig, token_logprobs

pytestmark = pytest.mark.slow  # compiles and trains the model


def groups(seed=0, num_groups=6, group_size=8, seq_len=64, with_env=True):
    """Groups of samples with one prompt each (2-12 tokens) and completions of 1-20 tokens; every sample's
    behaviour log-probs are a value of its own, so its tokens can be found in any layout."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(0, 256, int(rng.integers(2, 13))).tolist()
        for _ in range(group_size):
            n = int(rng.integers(1, min(21, seq_len - len(prompt) + 1)))
            spans = [(1, 3)] if with_env and n > 5 and rng.random() < 0.3 else []  # an environment's reply
            out.append(Trajectory(prompt, rng.integers(0, 256, n).tolist(), [-1.0 - 0.001 * len(out)] * n,
                                  [0] * n, reward=float(rng.integers(0, 2)), group_id=g, env_spans=spans))
    return out


def per_trajectory(batch, values, trajs):
    """values[batch position] of each trajectory's trained tokens, in order, found by its behaviour log-prob."""
    mask, behav = np.asarray(batch.loss_mask) > 0, np.asarray(batch.behav_logp)
    flat = lambda x: x.reshape(-1)  # noqa: E731 - row-major, so each row's tokens stay in order
    return [flat(np.asarray(values))[flat(mask & (behav == np.float32(t.behav_logp[0])))] for t in trajs]


def test_shared_layout_holds_each_prompt_once_per_copy():
    trajs = groups(seed=1)
    plain, _ = make_batch(trajs, num_rows=32, seq_len=64, pack=True)
    shared, _ = make_batch(trajs, num_rows=32, seq_len=64, pack=True, share_prompts=True)
    validate_batch(shared, 0)
    seg, ctx, pos = (np.asarray(x).reshape(-1, 64) for x in (shared.segment_ids, shared.context_ids, shared.positions))
    assert ctx.any() and (np.asarray(shared.segment_ids) > 0).sum() < (np.asarray(plain.segment_ids) > 0).sum()
    assert np.asarray(shared.loss_mask).sum() == np.asarray(plain.loss_mask).sum()
    for row_seg, row_ctx, row_pos in zip(seg, ctx, pos):
        for c in set(row_ctx[row_ctx > 0].tolist()):
            head = np.flatnonzero(row_seg == c)
            samples = set(row_seg[row_ctx == c].tolist())
            assert (row_ctx[head] == 0).all() and head.max() < np.flatnonzero(row_ctx == c).min()
            for s in samples:  # each sample continues the prompt's positions from its last token
                assert row_pos[row_seg == s][0] == len(head)
    # Every trajectory's trained tokens, behaviour log-probs and versions are there, in order.
    for a, b in zip(per_trajectory(plain, plain.tokens, trajs), per_trajectory(shared, shared.tokens, trajs)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seq_len", [64, 192])
def test_shared_prompts_give_every_token_the_log_prob_it_has_alone(seq_len):
    trajs = groups(seed=2, seq_len=seq_len)
    plain, _ = make_batch(trajs, num_rows=48, seq_len=seq_len, pack=True)
    shared, _ = make_batch(trajs, num_rows=48, seq_len=seq_len, pack=True, share_prompts=True)
    assert np.asarray(shared.context_ids).any()
    _, _, model = setup(one_device())
    one = lambda b: jax.tree.map(lambda x: jnp.asarray(x[0]), b)  # noqa: E731
    for a, b in zip(per_trajectory(plain, token_logprobs(model, one(plain))[0][None], trajs),
                    per_trajectory(shared, token_logprobs(model, one(shared))[0][None], trajs)):
        # Log-probs of about -5.5 (vocab 256): the layouts differ only in float32 summation order.
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_shared_prompts_train_like_separate_ones(aggregation):
    trajs = groups(seed=3, num_groups=4, group_size=4)
    loss = StepConfig(loss=LossConfig(aggregation=aggregation))
    plain, _ = make_batch(trajs, num_rows=16, seq_len=64, pack=True, micro_batches=2)
    shared, _ = make_batch(trajs, num_rows=16, seq_len=64, pack=True, micro_batches=2, share_prompts=True)
    assert np.asarray(shared.context_ids).any()
    params_plain, m_plain = run(one_device(), plain, loss)
    params_shared, m_shared = run(one_device(), shared, loss)
    n, scale = policy_loss_scale(plain)
    assert m_shared[0]["num_tokens"] == m_plain[0]["num_tokens"] == n
    assert_sums_close(m_shared[0]["loss"], m_plain[0]["loss"], n, scale)
    assert_grad_norms_close(m_shared[0]["grad_norm"], m_plain[0]["grad_norm"], n)
    assert_trees_close(params_shared, params_plain, atol=1e-6)


def test_groups_share_only_an_identical_prompt_and_padded_rows_refuse():
    a = Trajectory([1, 2, 3], [4, 5], [-1.0, -1.0], [0, 0], group_id=0)
    b = Trajectory([1, 2, 9], [4, 5], [-1.0, -1.0], [0, 0], group_id=0)  # same group, another prompt
    c = Trajectory([1, 2, 3], [4, 5], [-1.0, -1.0], [0, 0], group_id=1)  # same prompt, another group
    batch, _ = make_batch([a, b, c], num_rows=4, seq_len=64, pack=True, share_prompts=True)
    assert not np.asarray(batch.context_ids).any()
    with pytest.raises(ValueError, match="share_prompts needs packed rows"):
        make_batch([a, b], num_rows=4, seq_len=64, share_prompts=True)


def test_validate_batch_refuses_context_a_token_must_not_see():
    trajs = groups(seed=4, num_groups=2, group_size=4, with_env=False)
    good, _ = make_batch(trajs, num_rows=8, seq_len=64, pack=True, share_prompts=True)
    validate_batch(good, 0)
    seg, ctx = np.asarray(good.segment_ids), np.asarray(good.context_ids)
    r = np.argwhere(ctx > 0)[0]
    later = np.argwhere((seg == seg[tuple(r)]) & (ctx > 0))[-1]  # the last token of a shared-prompt sample

    def broken(**fields):
        return good.replace(**{k: np.asarray(v) for k, v in fields.items()})

    cases = {"its own segment": ctx.copy(), "not earlier": ctx.copy(), "padding": ctx.copy(), "no row": ctx.copy()}
    cases["its own segment"][tuple(r)] = seg[tuple(r)]
    cases["not earlier"][tuple(r)] = seg[tuple(later)] + 1 if (seg == seg[tuple(later)] + 1).any() else 99
    cases["padding"][tuple(np.argwhere(seg == 0)[0])] = 1
    cases["no row"][tuple(r)] = 10_000
    messages = {"its own segment": "own segment", "not earlier": "not earlier|no row",
                "padding": "padding", "no row": "no row holds"}
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=messages[name]):
            validate_batch(broken(context_ids=bad), 0)
    # A sample's first token (the prompt's last) has no prediction in its own segment: never trained.
    mask = np.asarray(good.loss_mask).copy()
    first = tuple(np.argwhere((ctx > 0) & (np.asarray(good.loss_mask) == 0))[0])
    mask[first] = 1
    with pytest.raises(ValueError, match="first token"):
        validate_batch(broken(loss_mask=mask), 0)


def test_unrolled_layers_equal_the_layer_loop(monkeypatch):
    trajs = groups(seed=5, num_groups=2)
    batch, _ = make_batch(trajs, num_rows=8, seq_len=64, pack=True, share_prompts=True)
    mb = jax.tree.map(lambda x: jnp.asarray(x[0]), batch)
    _, _, model = setup(one_device())
    assert model.config.num_layers <= transformer.UNROLL_LAYERS
    unrolled = token_logprobs(model, mb)[0]
    monkeypatch.setattr(transformer, "UNROLL_LAYERS", 0)
    looped = token_logprobs(model, mb)[0]
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(looped), rtol=0, atol=1e-5)
