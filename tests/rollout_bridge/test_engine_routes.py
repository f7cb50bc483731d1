"""The JAX engine records a mixture-of-experts model's routing (`Sample.routes`, for routing replay): at
every generated token, the experts each sparse layer's router chose at that token's input position, which
must be the router's own top-k in the trainer's forward pass over prompt + completion (same float32
weights): token i at position len(prompt) + i - 1. Checked for greedy and sampled answers, a GRPO group
sharing its prompt, an aborted sample resumed under other weights (its prefix keeps its routes), a weight
swap mid-sample (each token keeps its own version's), episodes with environment tokens (theirs come from
the next turn's extend or prefill), and a dense model (no routes)."""

import dataclasses

import jax
import numpy as np
import pytest
from engine_helpers import lively_tiny_model, lively_tiny_moe_model, perturbed, poll_all
from flax import nnx
from jax_engine_setup import pause_after_decode
from test_episodes import Echo, requests

from jaxflow.data.records import Sample, route_dtype
from jaxflow.models.hf_io import iter_hf_tensors, load_model
from jaxflow.tokenizer import Tokenizer
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.episodes import EpisodeEngine, model_turns
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # engines compiled and run end to end

MAX_LEN = 128
ENGINE_KW = dict(max_slots=4, max_len=MAX_LEN, decode_chunk=8, prefill_buckets=(16, 64))
PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46], [7] * 12, [300]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_moe_model(tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


@nnx.jit
def _router_topk(model, tokens_bt):
    return model.hidden_states(tokens_bt, with_router=True)[1].topk_btk


def trainer_routes(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The trainer forward's own top-k at each token's input position: [len(tokens), L_sparse, k]."""
    n = len(prompt) + len(tokens)
    seq = np.zeros((1, MAX_LEN), np.int32)  # one padded length: one compile (causal, the tail is inert)
    seq[0, :n] = prompt + tokens
    topk_lbtk = np.asarray(_router_topk(model, seq))
    return np.moveaxis(topk_lbtk[:, 0], 0, 1)[len(prompt) - 1:n - 1]


def check_routes(model, prompt: list[int], sample: Sample) -> None:
    cfg = model.config
    routes = sample.routes
    assert routes is not None and routes.dtype == route_dtype(cfg.num_experts)
    assert routes.shape == (len(sample.tokens), len(cfg.sparse_layers), cfg.num_experts_per_tok)
    np.testing.assert_array_equal(routes, trainer_routes(model, prompt, sample.tokens))


def test_routes_are_the_routers_own_top_k_in_the_trainer_forward(model_dir, model):
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=11)
    reqs = [Request(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    # A group of samples sharing one prefill row, more requests than slots (admitted as others finish).
    reqs += [Request(f"s{k}", PROMPTS[1], dataclasses.replace(sampled, seed=11 + k)) for k in range(4)]
    engine = JaxEngine(str(model_dir), **ENGINE_KW)
    try:
        done = engine.generate(reqs, timeout=300)
    finally:
        engine.close()
    prompt_of = {r.request_id: r.prompt for r in reqs}
    assert len({tuple(c.sample.tokens) for c in done}) == len(done)  # lively: the answers differ
    for c in done:
        assert c.sample.finish_reason == "length"
        check_routes(model, prompt_of[c.request_id], c.sample)
    # All experts in use: the comparison is not of one constant choice.
    assert set(np.concatenate([c.sample.routes.ravel() for c in done]).tolist()) == {0, 1, 2, 3}


def test_a_resumed_prefix_keeps_its_routes_and_a_swap_keeps_each_versions(model_dir, model, monkeypatch):
    """An aborted sample resumed under other weights: its prefix keeps the routes of the weights that
    sampled it, and the new tokens get the new weights'. A weight swap mid-sample (recompute) likewise."""
    moved, tensors = perturbed(model, seed=3, scale=0.1)
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5)
    engine = JaxEngine(str(model_dir), **ENGINE_KW)
    try:
        held = pause_after_decode(monkeypatch, engine, call=2)
        engine.submit(Request("x", prompt, params))
        assert held.wait(timeout=120)
        (partial,) = engine.abort(["x"])
        monkeypatch.undo()
        n = len(partial.sample.tokens)
        assert partial.sample.finish_reason == "abort" and n == 16
        check_routes(model, prompt, partial.sample)
        # A prefix whose routes do not fit the model is refused, naming them; the engine serves on.
        for routes in (partial.sample.routes[:, :, :1], partial.sample.routes[:-1], partial.sample.routes + 4):
            bad = dataclasses.replace(partial.sample, routes=routes)
            (refused,) = engine.generate([Request("bad", prompt, params, prefix=bad)], timeout=60)
            assert refused.sample.finish_reason == "error" and "prefix routes" in refused.error

        engine.update_weights(1, tensors)
        (done,) = engine.generate([Request("x", prompt, params, prefix=partial.sample)], timeout=300)
        s = done.sample
        assert s.tokens[:n] == partial.sample.tokens and len(s.tokens) > n
        assert s.versions == [0] * n + [1] * (len(s.tokens) - n)
        np.testing.assert_array_equal(s.routes[:n], partial.sample.routes)  # the prefix's own, kept
        np.testing.assert_array_equal(s.routes[n:], trainer_routes(moved, prompt, s.tokens)[n:])
        assert (s.routes[:n] != trainer_routes(moved, prompt, s.tokens)[:n]).any()  # the versions differ

        # A swap back to the on-disk weights after the second decode call, in flight (caches recomputed).
        held = pause_after_decode(monkeypatch, engine, call=2)
        engine.submit(Request("y", PROMPTS[2], params))
        assert held.wait(timeout=120)
        engine.update_weights(2, dict(iter_hf_tensors(model)))
        s = poll_all(engine, 1)["y"].sample
    finally:
        engine.close()
    versions = np.asarray(s.versions)
    assert (versions == 1).sum() == 16 and (versions == 2).sum() > 0
    old = versions == 1
    np.testing.assert_array_equal(s.routes[old], trainer_routes(moved, PROMPTS[2], s.tokens)[old])
    np.testing.assert_array_equal(s.routes[~old], trainer_routes(model, PROMPTS[2], s.tokens)[~old])


@pytest.mark.parametrize("reuse_turns", [True, False], ids=["extend", "prefill"])
def test_episode_environment_tokens_get_the_routes_of_the_next_turns_forward(model_dir, model, reuse_turns):
    """Each next turn's extend (a kept turn) or prefill (none kept) computes the environment tokens' inputs:
    every environment answer a model turn follows then carries the trainer forward's routes, as the
    model's tokens do."""
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = JaxEngine(str(model_dir), max_slots=4, max_len=256, reuse_turns=reuse_turns, warmup=False)
    try:
        # Stand-ins for a tool-call marker: a token early in each episode's greedy first turn, so that it ends.
        probe = SamplingParams(max_tokens=8, temperature=0.0)
        stops = sorted({c.sample.tokens[3] for c in engine.generate(
            [Request(f"probe{r.request_id}", r.prompt, probe) for r in requests(3)], timeout=300)})
        episodes = EpisodeEngine(engine, lambda meta: Echo(turns=3), tokenizer, turn_stop_ids=stops,
                                 step_timeout_s=5.0, env_name="echo")
        reqs = requests(3)
        done = episodes.generate(reqs, timeout=300)
    finally:
        engine.close()
    prompt_of = {r.request_id: r.prompt for r in reqs}
    answered = 0  # environment answers a model turn followed
    for c in done:
        s = c.sample
        assert s.finish_reason in ("stop", "length") and len(model_turns(s)) >= 2
        for a, b in s.env_spans:
            answered += b < len(s.tokens)
            # Followed by a turn: recorded. Last (the budget ran out on it): never fed, not recorded.
            assert (s.routes[a:b] >= 0).all() if b < len(s.tokens) else (s.routes[a:b] == -1).all()
        recorded = (s.routes >= 0).all(axis=(1, 2))
        assert recorded.sum() >= len(s.tokens) - (s.env_spans[-1][1] - s.env_spans[-1][0])
        np.testing.assert_array_equal(s.routes[recorded],
                                      trainer_routes(model, prompt_of[c.request_id], s.tokens)[recorded])
    assert answered >= 3


def test_an_episode_that_ends_on_environment_tokens_leaves_them_unrecorded(model_dir, model):
    """No forward ever feeds an episode's last environment answer when the episode ends on it (its budget
    spent): those tokens' routes stay -1, the model's are recorded."""
    tokenizer = Tokenizer.from_dir(model_dir)
    engine = JaxEngine(str(model_dir), max_slots=4, max_len=256, warmup=False)
    try:
        probe = SamplingParams(max_tokens=8, temperature=0.0)
        (first,) = engine.generate([Request("probe", [3, 40, 77], probe)], timeout=300)
        stop = first.sample.tokens[2]
        episodes = EpisodeEngine(engine, lambda meta: Echo(turns=3), tokenizer, turn_stop_ids=[stop],
                                 step_timeout_s=5.0, env_name="echo", max_observation_tokens=64)
        budget = SamplingParams(max_tokens=first.sample.tokens.index(stop) + 2, temperature=0.0)
        (c,) = episodes.generate([Request("e", [3, 40, 77], budget, meta={"q": 0})], timeout=300)
    finally:
        engine.close()
    s = c.sample
    assert s.finish_reason == "length" and len(s.env_spans) == 1 and s.env_spans[0][1] == len(s.tokens)
    a, b = s.env_spans[0]
    assert (s.routes[a:] == -1).all()
    np.testing.assert_array_equal(s.routes[:a], trainer_routes(model, [3, 40, 77], s.tokens)[:a])


def test_a_dense_model_records_no_routes(tmp_path):
    engine = JaxEngine(str(lively_tiny_model(tmp_path / "dense", hidden_size=32, intermediate_size=64)),
                       warmup=False, **{**ENGINE_KW, "max_slots": 2})
    try:
        done = engine.generate([Request(f"d{i}", p, SamplingParams(max_tokens=12, temperature=1.0, seed=i))
                                for i, p in enumerate(PROMPTS[:2])], timeout=300)
        # A prefix with routes is some mixture-of-experts model's, not this one's: refused.
        routed = dataclasses.replace(done[0].sample, routes=np.zeros((12, 2, 2), np.int8))
        (refused,) = engine.generate([Request("r", PROMPTS[0], SamplingParams(max_tokens=20), prefix=routed)])
    finally:
        engine.close()
    assert all(len(c.sample.tokens) == 12 and c.sample.routes is None for c in done)
    assert refused.sample.finish_reason == "error" and "no experts" in refused.error


def test_the_decode_programs_return_routes_only_for_a_moe_model(model, tmp_path):
    """Dense: the decode program's routes output is None (nothing extra computed or moved); MoE: int8."""
    from rollout_bridge import jax_decode

    outs = {}
    dense = load_model(lively_tiny_model(tmp_path / "dense", hidden_size=32, intermediate_size=64))
    for name, m in (("moe", model), ("dense", dense)):
        engine = JaxEngine(m, warmup=False, **{**ENGINE_KW, "max_slots": 2})
        try:
            plan = engine._slots.idle_plans()[-1]
            outs[name] = jax.eval_shape(lambda e=engine, p=plan: jax_decode.decode(
                e._graphdef, e._params, e._cache, e._slots.state(p), p.rows_b, p.window_g, **e._decode_kw))
        finally:
            engine.close()
    assert outs["dense"][-1] is None
    routes = outs["moe"][-1]
    assert routes.dtype == np.int8 and routes.shape == (2, ENGINE_KW["decode_chunk"], 2, 2)
