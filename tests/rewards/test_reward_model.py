"""The scalar-head reward model: parity with transformers, batching across groups, failures scored and counted."""

import json
import shutil
import threading

import numpy as np
import pytest
from waiting import wait_until

from jaxflow.models.classifier import SCORE_TENSOR, load_sequence_classifier
from jaxflow.models.config import ModelConfigError
from jaxflow.models.safetensors_io import CheckpointError, CheckpointReader, write_checkpoint
from jaxflow.models.tiny import write_tiny_model, write_tiny_reward_model
from jaxflow.rewards import group_reward_fn
from jaxflow.rewards.model import RewardModel

META = {"question": "What is 2 + 3?"}
RESPONSES = ["<answer>5</answer>", "It is five.", "2 + 3 = 6, so <answer>6</answer>", "hello"]
# Float32 scores of order 1 from sums of 64 terms: rounding differences between programs are ~1e-6.
TOL = 1e-4


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def _variant(src, dst, edit_tensors=None, edit_config=None):
    """A copy of the model directory `src` at `dst` with its tensors and/or config.json edited."""
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        with CheckpointReader(src) as reader:
            tensors = {name: np.array(reader.get(name)) for name in reader}
        edit_tensors(tensors)
        write_checkpoint(dst, tensors)
    if edit_config is not None:
        config = json.loads((src / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _rendered(rm, response, meta=META):
    return rm.tokenizer.encode_chat([*[{"role": "user", "content": meta["question"]}],
                                     {"role": "assistant", "content": response}], add_generation_prompt=False)


@pytest.mark.slow  # imports torch and transformers
@pytest.mark.parametrize("architecture", ["Qwen3ForSequenceClassification", "LlamaForSequenceClassification"])
def test_scores_match_transformers(architecture, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    directory = write_tiny_reward_model(tmp_path / "rm", architecture=architecture)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager").eval()

    def reference(rows, lengths):
        mask = (np.arange(rows.shape[1])[None] < np.asarray(lengths)[:, None]).astype(np.int64)
        with torch.no_grad():
            out = hf(input_ids=torch.tensor(rows, dtype=torch.long), attention_mask=torch.tensor(mask))
        return out.logits[:, 0].float().numpy()

    # The classifier on right-padded rows, one with a pad token (id 0) inside: both skip it when pooling.
    rng = np.random.default_rng(0)
    lengths = np.array([16, 5, 9, 7])
    rows = rng.integers(3, 300, (4, 16)).astype(np.int32)
    rows[3, 6] = 0
    for b, n in enumerate(lengths):
        rows[b, n:] = 0
    ours = np.asarray(load_sequence_classifier(directory)(rows, lengths))
    ref = reference(rows, lengths)
    assert np.abs(ref).max() > 0.1  # the scores are not all ~0: the comparison means something
    np.testing.assert_allclose(ours, ref, atol=TOL * max(1.0, np.abs(ref).max()))

    # The reward model end to end: the chat-rendered [prompt + response], scored as transformers scores it.
    with RewardModel(directory, batch_size=4) as rm:
        scores = rm.score_group(rm.name, RESPONSES, META)
        ids = [_rendered(rm, r) for r in RESPONSES]
    expected = np.concatenate([reference(np.asarray([x]), [len(x)]) for x in ids])
    np.testing.assert_allclose(scores, expected, atol=TOL * max(1.0, np.abs(expected).max()))
    assert len(set(np.round(scores, 4))) == len(RESPONSES)  # different responses, different scores


def test_batches_span_groups_and_the_pool_interface_works(reward_dir):
    errors = []
    with RewardModel(reward_dir, batch_size=4, on_failure=errors.append) as rm:
        alone = [rm.score_group(rm.name, [r], META)[0] for r in RESPONSES]
        before = rm.stats()["batches"]
        groups = [(RESPONSES[:3], META), (RESPONSES[1:], META), (RESPONSES[::2], META)]
        together = rm.score_groups(rm.name, groups)
        stats = rm.stats()
        # 8 samples in batches of at most 4: 2 forward passes, each mixing groups.
        assert stats["batches"] - before == 2
        for (responses, _), scores in zip(groups, together):
            want = [alone[RESPONSES.index(r)] for r in responses]
            np.testing.assert_allclose(scores, want, atol=TOL * max(1.0, np.abs(want).max()))
        assert stats["submitted"] == stats["scored"] == len(RESPONSES) + 8
        assert stats["pending"] == 0 and not errors
        # The prompt from meta["messages"] when the meta has them: the same user turn scores the same, a
        # system turn before it is part of what the reward model reads.
        user = [{"role": "user", "content": META["question"]}]
        same = rm.score_group(rm.name, [RESPONSES[0]], {"messages": user})[0]
        system = rm.score_group(rm.name, [RESPONSES[0]], {"messages": [{"role": "system", "content": "Be brief."},
                                                                       *user]})[0]
        assert abs(same - alone[0]) <= TOL * max(1.0, abs(alone[0])) and abs(system - alone[0]) > 1e-3

        # A rollout worker's reward function over it, as the job builds one over a RewardPool.
        class Sample:
            def __init__(self, text):
                self.tokens = rm.tokenizer.encode(text)

        class Task:
            meta = META

        reward_fn = group_reward_fn(rm, rm.name, rm.tokenizer.decode)
        np.testing.assert_allclose(reward_fn(Task, [Sample(r) for r in RESPONSES]), alone, atol=TOL * 10)
        with pytest.raises(ValueError, match="jaxflow.tasks:reward"):
            rm.score_group("jaxflow.tasks:reward", RESPONSES, META)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_head_scores_failed_value_and_counts(reward_dir, tmp_path, bad):
    def poison(tensors):
        tensors[SCORE_TENSOR][0, 0] = bad

    directory = _variant(reward_dir, tmp_path / "bad", poison)
    errors = []
    with RewardModel(directory, failed_value=-1.0, on_failure=errors.append) as rm:
        scores = rm.score_group(rm.name, RESPONSES, META)
        stats = rm.stats()
    assert scores == [-1.0] * len(RESPONSES)
    assert stats["invalid"] == len(RESPONSES) and stats["scored"] == 0 and stats["pending"] == 0
    assert len(errors) <= 2 and all(str(directory) in e and "not a finite number" in e for e in errors)


def test_one_non_finite_sample_does_not_fail_its_batch(reward_dir, tmp_path):
    """A token whose embedding is NaN poisons only the rows that hold it: those samples score failed_value,
    counted invalid; the others in the same batch score as with the clean model."""
    with RewardModel(reward_dir, batch_size=4) as clean:
        ids = [_rendered(clean, r) for r in RESPONSES]
        want = clean.score_group(clean.name, RESPONSES, META)
    token = next(t for t in ids[1] if all(t not in other for i, other in enumerate(ids) if i != 1))

    def poison(tensors):
        tensors["model.embed_tokens.weight"][token] = np.nan

    with RewardModel(_variant(reward_dir, tmp_path / "nan", poison), batch_size=4, failed_value=-3.0) as rm:
        scores = rm.score_group(rm.name, RESPONSES, META)
        stats = rm.stats()
    assert scores[1] == -3.0
    others = [i for i in range(len(RESPONSES)) if i != 1]
    np.testing.assert_allclose([scores[i] for i in others], [want[i] for i in others], atol=TOL * 10)
    assert (stats["invalid"], stats["scored"], stats["batches"]) == (1, 3, 1)


def test_timeout_scores_failed_value_counts_and_the_next_batch_scores(reward_dir):
    with RewardModel(reward_dir, batch_size=4, timeout_s=0.5, max_stuck=1, failed_value=-2.0) as rm:
        want = rm.score_group(rm.name, RESPONSES, META)  # compiles the batch's program (compile_timeout_s)
        release = threading.Event()
        forward = rm._forward

        def hung_once(tokens, lengths):
            rm._forward = forward
            release.wait(60)  # a device that does not answer, until the test lets it
            return forward(tokens, lengths)

        rm._forward = hung_once
        assert rm.score_group(rm.name, RESPONSES, META) == [-2.0] * 4
        assert rm.stats()["timed_out"] == 4 and rm.stats()["stuck"] == 1
        # max_stuck=1 batch is still running: the next one is failed at once rather than queued behind it.
        assert rm.score_group(rm.name, RESPONSES[:2], META) == [-2.0] * 2
        assert rm.stats()["timed_out"] == 6
        release.set()
        wait_until(lambda: rm.stats()["stuck"] == 0, 60, "the timed-out batch to finish")
        again = rm.score_group(rm.name, RESPONSES, META)
        stats = rm.stats()
    np.testing.assert_allclose(again, want, atol=TOL * max(1.0, np.abs(want).max()))
    assert stats["scored"] == 8 and stats["pending"] == 0


def test_samples_that_cannot_be_scored_count_as_raised(reward_dir):
    errors = []
    with RewardModel(reward_dir, max_len=40, failed_value=-1.0, on_failure=errors.append) as rm:
        long = "word " * 60
        assert rm.score_group(rm.name, ["short", long], META)[1] == -1.0
        assert rm.score_group(rm.name, ["a", "b"], {"answer": 5}) == [-1.0, -1.0]  # no prompt in the meta
        stats = rm.stats()
    assert (stats["raised"], stats["scored"]) == (3, 1)
    assert any("max_len=40" in e for e in errors) and any("neither 'messages' nor a 'question'" in e for e in errors)


def test_a_directory_of_the_wrong_kind_is_refused_with_its_name(reward_dir, tmp_path):
    causal = write_tiny_model(tmp_path / "causal")
    with pytest.raises(ModelConfigError, match=rf"{causal} is not a reward model.*Qwen3ForCausalLM"):
        RewardModel(causal)

    def two_labels(config):
        config["id2label"] = {"0": "bad", "1": "good"}

    pair = _variant(reward_dir, tmp_path / "pair", edit_config=two_labels)
    with pytest.raises(ModelConfigError, match=rf"{pair} is a Qwen3ForSequenceClassification with 2 labels"):
        load_sequence_classifier(pair)

    def no_head(tensors):
        del tensors[SCORE_TENSOR]

    headless = _variant(reward_dir, tmp_path / "headless", no_head)
    with pytest.raises(CheckpointError, match=rf"{headless} has no 'score.weight'"):
        load_sequence_classifier(headless)


@pytest.mark.slow  # a local Ray
def test_placed_as_a_ray_actor_it_batches_its_callers_groups(reward_dir):
    """Built in a Ray host actor (as the job builds its reward pool there), it serves the pool's calls through
    a proxy; the host's threads serve callers at once, so their groups share batches."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from jaxflow.cluster import ray_actors

    with RewardModel(reward_dir, batch_size=8) as local:
        want = local.score_group(local.name, RESPONSES, META)
    started = ray_actors.connect(num_cpus=2)
    try:
        proxy = ray_actors.build(RewardModel, ("score_group", "stats"), kwargs={
            "directory": str(reward_dir), "batch_size": 8, "name": "rm"}, timeout=300)
        # Compiles the program of a batch of one only: the callers' first batch below compiles its own, and
        # the others' samples queue meanwhile.
        proxy.score_group("rm", RESPONSES[:1], META)

        def call(_):
            return proxy.score_group("rm", RESPONSES, META)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(call, range(6)))
        stats = proxy.stats()
    finally:
        if started:
            ray.shutdown()
    for scores in results:
        np.testing.assert_allclose(scores, want, atol=TOL * max(1.0, np.abs(want).max()))
    assert stats["scored"] == 1 + 6 * len(RESPONSES) and stats["pending"] == 0
    assert stats["batches"] < 1 + 6  # some batch held samples of more than one caller's group
