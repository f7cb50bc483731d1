"""The JAX engine's exact mode (`rollout.exact_logprobs`): the log-probs it reports are the trainer's recompute
at the same version bit for bit, for greedy and sampled answers, a prefix resumed after an abort, an
environment-interleaved episode, tokens of two versions across a weight swap, and a LoRA adapter.

"The trainer's recompute" is the update itself: `RLTrainer.train` on the engine's samples reports
`onpolicy_logp_gap_max`, the largest |π_prox - μ| over tokens sampled at the step's version, where π_prox is what
the step computed for its loss."""

import dataclasses

import jax
import ml_collections
import numpy as np
import pytest
from engine_helpers import adapted, lively_tiny_model, poll_all
from flax import nnx
from jax_engine_setup import pause_after_decode
from test_episodes import Echo, requests

from jaxflow import sharding
from jaxflow.config import load_config
from jaxflow.data.device_params import DeviceParamSource
from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
from jaxflow.models.hf_io import load_model
from jaxflow.models.lora import LoRASpec
from jaxflow.tokenizer import Tokenizer
from jaxflow.trainer import scoring
from jaxflow.trainer.rl_trainer import RLTrainer
from rollout_bridge.engine import Request, SamplingParams
from rollout_bridge.episodes import EpisodeEngine
from rollout_bridge.jax_engine import JaxEngine

pytestmark = pytest.mark.slow  # engines and train steps compiled and run

MAX_LEN = 160
CHUNK = 64  # log-prob chunks shorter than the rows: the chunked head is part of what must agree
PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46], [7] * 12]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return lively_tiny_model(tmp_path_factory.mktemp("exact") / "model")


def trainer_section() -> ml_collections.ConfigDict:
    trainer = load_config("configs/arithmetic_tiny.py", {}).trainer
    trainer.pack = trainer.share_prompts = False  # the exact program scores one sequence a row
    trainer.logprob_chunk = CHUNK
    return trainer


def make_trainer(model) -> RLTrainer:
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    return RLTrainer(model, trainer_section(), mesh, seq_len=MAX_LEN, max_sequences=32, exact_logprobs=True)


def exact_engine(trainer: RLTrainer) -> JaxEngine:
    # As the job builds it: over the trainer's model, with the trainer's log-prob chunk.
    return JaxEngine(trainer.model(), max_slots=4, max_len=MAX_LEN, decode_chunk=8, prefill_buckets=(16, 64),
                     exact_logprobs=True, logprob_chunk=trainer.step_config.logprob_chunk)


def train_on(trainer: RLTrainer, samples: list[tuple[list[int], Sample]]) -> dict[str, float]:
    """One update on the samples (a group per prompt, rewards varied so no group lacks signal)."""
    groups = [FinishedGroup(i, prompt, trainer.version, [sample, sample], [1.0, 0.0])
              for i, (prompt, sample) in enumerate(samples)]
    return trainer.train(ConsumedBatch(trainer.version, groups, "full"))[0]


def sampled_and_greedy(engine: JaxEngine) -> list[tuple[list[int], Sample]]:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=11)
    reqs = [Request(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    reqs += [Request(f"s{i}.{k}", p, dataclasses.replace(sampled, seed=11 + k))
             for i, p in enumerate(PROMPTS) for k in range(3)]
    done = engine.generate(reqs, timeout=300)
    prompt_of = {r.request_id: r.prompt for r in reqs}
    assert all(len(c.sample.tokens) > 0 for c in done)
    return [(prompt_of[c.request_id], c.sample) for c in done]


def aborted_then_resumed(engine: JaxEngine) -> tuple[list[int], Sample]:
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=5)
    engine.submit(Request("long", PROMPTS[1], params))
    while not engine.progress(["long"]) or len(engine.progress(["long"])[0].sample.tokens) < 10:
        pass
    (partial,) = engine.abort(["long"])
    if partial.sample.finish_reason != "abort":  # it finished first: poll it, and resume nothing
        return PROMPTS[1], partial.sample
    n = len(partial.sample.tokens)
    assert 0 < n < 120
    (done,) = engine.generate([Request("long", PROMPTS[1], params, prefix=partial.sample)], timeout=300)
    assert done.sample.tokens[:n] == partial.sample.tokens and len(done.sample.tokens) > n
    assert done.sample.logprobs[:n] == partial.sample.logprobs  # the prefix's own, kept
    return PROMPTS[1], done.sample


def test_engine_log_probs_are_the_trainers_recompute_bit_for_bit(model_dir):
    trainer = make_trainer(load_model(model_dir))
    engine = exact_engine(trainer)
    try:
        samples = sampled_and_greedy(engine) + [aborted_then_resumed(engine)]
        tokenizer = Tokenizer.from_dir(model_dir)
        # Stand-ins for a tool-call marker: a token early in each episode's greedy first turn, so that it ends.
        probe = SamplingParams(max_tokens=8, temperature=0.0)
        stops = sorted({c.sample.tokens[3] for c in engine.generate(
            [Request(f"probe{r.request_id}", r.prompt, probe) for r in requests(2)], timeout=300)})
        episodes = EpisodeEngine(engine, lambda meta: Echo(turns=2), tokenizer, turn_stop_ids=stops,
                                 step_timeout_s=5.0, env_name="echo")
        for c in episodes.generate(requests(2), timeout=300):
            assert c.sample.env_spans, "an episode with environment tokens between model turns"
            samples.append(([3 + int(c.request_id[1:]), 40 + int(c.request_id[1:]), 77], c.sample))
    finally:
        engine.close()
    # The decode step's own log-probs of the same greedy tokens: rounding away from the exact ones, never 0.
    decode_engine = JaxEngine(trainer.model(), max_slots=4, max_len=MAX_LEN, decode_chunk=8, prefill_buckets=(16, 64))
    try:
        greedy = SamplingParams(max_tokens=40, temperature=0.0)
        decoded = decode_engine.generate([Request(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)], timeout=300)
    finally:
        decode_engine.close()
    exact = {tuple(s.tokens): np.asarray(s.logprobs) for _, s in samples[:len(PROMPTS)]}
    gaps = [np.abs(np.asarray(c.sample.logprobs) - exact[tuple(c.sample.tokens)]).max() for c in decoded]
    assert 0.0 < max(gaps) < 1e-3  # float32 rounding of a tiny model

    metrics = train_on(trainer, samples)
    assert metrics["onpolicy_logp_gap_max"] == 0.0
    assert metrics["behav_weight_max"] == 1.0


def test_tokens_sampled_across_a_weight_swap_carry_the_log_probs_of_their_own_version(model_dir, monkeypatch):
    model = load_model(model_dir)
    source = DeviceParamSource()
    engine = JaxEngine(model, max_slots=4, max_len=MAX_LEN, decode_chunk=8, prefill_buckets=(16, 64),
                       exact_logprobs=True, logprob_chunk=CHUNK)
    source.add_target(engine.param_shardings)
    try:
        v0 = jax.tree.map(np.asarray, nnx.state(model))
        held = pause_after_decode(monkeypatch, engine, call=1)  # the swap lands after the first 8 tokens
        engine.submit(Request("x", PROMPTS[0], SamplingParams(max_tokens=100, temperature=1.0, seed=3)))
        assert held.wait(timeout=120)
        rng = np.random.default_rng(0)
        moved = jax.tree.map(lambda a: a + 0.05 * rng.standard_normal(a.shape).astype(a.dtype),
                             nnx.state(model, nnx.Param))
        source.publish(1, moved)
        engine.update_weights(*source.pull(1))
        sample = poll_all(engine, 1)["x"].sample
    finally:
        engine.close()
    versions = np.asarray(sample.versions)
    assert 0 < (versions == 0).sum() and (versions == 1).sum() > 0, "tokens of both versions"
    graphdef = nnx.graphdef(model)
    seq = np.zeros((1, MAX_LEN), np.int32)
    n = len(PROMPTS[0]) + len(sample.tokens)
    seq[0, :n] = PROMPTS[0] + sample.tokens
    v1 = nnx.merge_state(nnx.state(model), moved)
    for version, weights in ((0, v0), (1, v1)):
        logp = np.asarray(scoring.score(graphdef, weights, seq, np.array([n], np.int32),
                                        chunk=CHUNK))[0, len(PROMPTS[0]):n]
        mine = versions == version
        np.testing.assert_array_equal(np.asarray(sample.logprobs)[mine], logp[mine])


def test_a_lora_adapter_gives_the_trainers_recompute_bit_for_bit(model_dir):
    model = adapted(model_dir, LoRASpec(4, 8.0, ("q_proj", "v_proj", "down_proj")), seed=2)
    trainer = make_trainer(model)
    assert trainer.lora is not None
    engine = exact_engine(trainer)
    try:
        samples = sampled_and_greedy(engine)
    finally:
        engine.close()
    metrics = train_on(trainer, samples)
    assert metrics["onpolicy_logp_gap_max"] == 0.0
