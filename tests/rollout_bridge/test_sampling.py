"""The JAX engine's sampler draws from the distribution it reports: frequencies over many seeds against
the softmax of the temperature-scaled, top-k/top-p filtered logits."""

import jax.numpy as jnp
import numpy as np
import pytest

from rollout_bridge.jax_decode import SlotState, _inverse_cdf, sample_tokens

pytestmark = pytest.mark.slow  # the sampler's frequencies over many seeds

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -30.0], np.float32)


def draw(n, temperature=1.0, top_k=0, top_p=1.0, generated=0):
    b = n
    state = SlotState(tokens_b=jnp.zeros(b, jnp.int32), lengths_b=jnp.zeros(b, jnp.int32),
                      active_b=jnp.ones(b, bool), generated_b=jnp.full(b, generated, jnp.int32),
                      max_tokens_b=jnp.full(b, 10, jnp.int32), temperature_b=jnp.full(b, temperature, jnp.float32),
                      top_k_b=jnp.full(b, top_k, jnp.int32), top_p_b=jnp.full(b, top_p, jnp.float32),
                      seeds_b=jnp.arange(b, dtype=jnp.uint32), stop_ids_bn=jnp.full((b, 1), -1, jnp.int32),
                      finish_b=jnp.zeros(b, jnp.int32))
    tokens, logprobs = sample_tokens(jnp.asarray(np.tile(LOGITS, (b, 1))), state)
    return np.asarray(tokens), np.asarray(logprobs)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8)])
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p):
    n = 40_000
    tokens, logprobs = draw(n, temperature, top_k, top_p)
    scaled = LOGITS / temperature
    p = softmax(scaled)
    keep = np.ones_like(p, bool)
    if top_k:
        keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
    if top_p < 1.0:
        order = np.argsort(-p * keep)
        before = np.cumsum((p * keep)[order] / (p * keep).sum()) - (p * keep)[order] / (p * keep).sum()
        nucleus = np.zeros_like(keep)
        nucleus[order[before < top_p]] = True
        keep &= nucleus
    expected = np.where(keep, p, 0) / np.where(keep, p, 0).sum()
    freq = np.bincount(tokens, minlength=len(LOGITS)) / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-12), (freq, expected)
    assert not np.any(freq[~keep])  # a filtered token is never drawn
    # Reported log-probs are the raw (temperature 1, unfiltered) ones of the drawn tokens.
    np.testing.assert_allclose(logprobs, np.log(softmax(LOGITS))[tokens], rtol=0, atol=1e-5)


def test_draws_depend_on_seed_and_position_only():
    a, _ = draw(64, generated=3)
    b, _ = draw(64, generated=3)
    c, _ = draw(64, generated=4)
    assert (a == b).all() and (a != c).any()
    greedy, _ = draw(16, temperature=0.0)
    assert (greedy == 0).all()


@pytest.mark.parametrize("vocab", [8, 33, 1000])
def test_inverse_cdf_finds_the_first_token_reaching_the_target(vocab):
    """The two-level search (blocks, then tokens) against a float64 search over the whole vocabulary:
    the same token wherever the target is not within rounding of a boundary, and never a token without
    probability, however the zeros fall against the blocks."""
    rng = np.random.default_rng(vocab)
    rows = 64
    probs = rng.random((rows, vocab)) * (rng.random((rows, vocab)) < 0.3)  # most tokens filtered
    probs[:, -1] = np.where(probs.sum(-1) == 0, 1.0, probs[:, -1])
    probs /= probs.sum(-1, keepdims=True)
    u = np.concatenate([rng.random(rows - 2), [1.0, 1e-9]]).astype(np.float32)
    tokens = np.asarray(_inverse_cdf(jnp.asarray(probs, jnp.float32), jnp.asarray(u)))
    assert (probs[np.arange(rows), tokens] > 0).all()
    cdf = np.cumsum(probs, axis=-1)
    expected = (cdf < u[:, None] * cdf[:, -1:]).sum(-1)
    near = np.abs(cdf - u[:, None]).min(-1) < 1e-5
    assert (tokens == np.minimum(expected, vocab - 1))[~near].all()
    assert (~near).sum() > rows // 2
