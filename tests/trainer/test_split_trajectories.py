"""A sample split into training sequences (`Sample.sequence_starts`) in the trainer: one Trajectory per
sequence (a started one its own context), every member's advantage computed once per member whatever its
number of sequences, the length screen per sequence, and the batch laying each sequence out so that it sees
its own tokens only (its segment, positions from 0), shared prompts included."""

import dataclasses

import numpy as np
import pytest

from jaxflow.data.records import FinishedGroup, RouteSpec, Sample
from jaxflow.trainer.batch import make_batch, validate_batch
from jaxflow.trainer.rl_trainer import screen_groups, trajectories_of

SPEC = RouteSpec(layers=2, top_k=2, num_experts=4)
PROMPT = [1, 2, 3, 4]


def sample(n, spans, starts, first_token, seed, finish="stop"):
    """n tokens from `first_token` on, environment tokens in `spans`; each model token has a log-prob of its
    own (so it can be found in any layout) and a version 0 or 1; routes recorded on the model's tokens."""
    rng = np.random.default_rng(seed)
    mask = np.ones(n, bool)
    for a, b in spans:
        mask[a:b] = False
    logprobs = [-(first_token + i) / 1000 if m else 0.0 for i, m in enumerate(mask)]
    versions = rng.integers(0, 2, n).tolist()
    routes = rng.integers(0, SPEC.num_experts, size=SPEC.shape(n)).astype(np.int8)
    routes[~mask] = -1
    return Sample(list(range(first_token, first_token + n)), logprobs, versions, finish, [list(s) for s in spans],
                  routes=routes, sequence_starts=list(starts))


def members():
    """A group's four members: one answer; an agent's episode that rewrote its history (every call its own
    context: starts [0, 9]); an episode continued after the prompt, then restarted at 6; a multi-turn episode
    with one observation."""
    return [sample(5, [], [], 10, 0),
            sample(12, [[0, 3], [6, 8], [9, 11]], [0, 9], 20, 1),
            sample(12, [[2, 3], [6, 8]], [6], 40, 2),
            sample(6, [[2, 4]], [], 60, 3)]


REWARDS = [1.0, 0.0, 1.0, 0.25]


def group(samples=None, rewards=REWARDS, gid=7, prompt=PROMPT):
    samples = members() if samples is None else samples
    return FinishedGroup(gid, list(prompt), 0, samples, list(rewards), {}, 0)


def unsplit(samples):
    return [Sample(s.tokens, s.logprobs, s.versions, s.finish_reason, s.env_spans, s.reward, s.routes)
            for s in samples]


def test_one_trajectory_per_training_sequence():
    samples = members()
    trajs = trajectories_of([group(samples)])
    assert [t.member for t in trajs] == [0, 1, 1, 2, 2, 3]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.25] and {t.group_id for t in trajs} == {7}
    s1, s2 = samples[1], samples[2]
    # Member 1, every sequence its own context: its prompt the env span it opens with, the rest its completion.
    a, b = trajs[1], trajs[2]
    assert list(a.prompt) == s1.tokens[0:3] and list(a.completion) == s1.tokens[3:9]
    assert [list(x) for x in a.env_spans] == [[3, 5]]  # the tool result [6, 8), shifted
    assert list(b.prompt) == s1.tokens[9:11] and list(b.completion) == s1.tokens[11:12] and list(b.env_spans) == []
    assert list(b.behav_logp) == s1.logprobs[11:12] and list(b.versions) == s1.versions[11:12]
    np.testing.assert_array_equal(b.routes, s1.routes[11:12])
    # Member 2: tokens [0, 6) follow the group's prompt; [6, 12) is its own context.
    c, d = trajs[3], trajs[4]
    assert list(c.prompt) == PROMPT and list(c.completion) == s2.tokens[0:6]
    assert [list(x) for x in c.env_spans] == [[2, 3]]
    assert list(d.prompt) == s2.tokens[6:8] and list(d.completion) == s2.tokens[8:12] and list(d.env_spans) == []
    np.testing.assert_array_equal(c.routes, s2.routes[0:6])
    # Unsplit members are as before: the whole sample after the prompt.
    for t, s in ((trajs[0], samples[0]), (trajs[5], samples[3])):
        assert list(t.prompt) == PROMPT and list(t.completion) == s.tokens and list(t.env_spans) == s.env_spans
    # Every member's trained tokens, with their log-probs and versions, are there once, in order.
    for m, s in enumerate(samples):
        got = {"tokens": [], "logprobs": [], "versions": []}
        for t in (t for t in trajs if t.member == m):
            trained = np.ones(len(t.completion), bool)
            for x, y in t.env_spans:
                trained[x:y] = False
            assert len(t.behav_logp) == len(t.versions) == len(t.completion)
            got["tokens"] += np.asarray(t.completion)[trained].tolist()
            got["logprobs"] += np.asarray(t.behav_logp)[trained].tolist()
            got["versions"] += np.asarray(t.versions)[trained].tolist()
        mask = s.model_mask()
        for field, values in got.items():
            assert values == np.asarray(getattr(s, field))[mask].tolist(), (m, field)


def member_advantages(batch, samples):
    """member -> the advantages on its trained tokens (found by their behaviour log-probs)."""
    trained = np.asarray(batch.loss_mask) > 0
    behav, adv = np.asarray(batch.behav_logp)[trained], np.asarray(batch.advantages)[trained]
    out = {}
    for m, s in enumerate(samples):
        mine = np.isin(behav, np.asarray(s.logprobs, np.float32)[s.model_mask()])
        assert mine.sum() == s.model_mask().sum()
        out[m] = adv[mine]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_split_member_counts_once_in_its_groups_advantages(estimator):
    """The same group, its members split or not: every member gets the same advantage on all its tokens
    (each member one reward in the group's statistics, not one per sequence)."""
    samples = members()
    kw = dict(num_rows=8, seq_len=20, advantage_estimator=estimator, route_spec=SPEC)
    split_trajs = trajectories_of([group(samples)])
    split, split_stats = make_batch(split_trajs, **kw)
    whole, whole_stats = make_batch(trajectories_of([group(unsplit(samples))]), **kw)
    got, want = member_advantages(split, samples), member_advantages(whole, samples)
    for m in range(len(samples)):
        assert np.ptp(got[m]) == 0 and np.ptp(want[m]) == 0  # one advantage a member
        # Advantages of order 1 from rewards of order 1: float32 rounding of a few terms.
        np.testing.assert_allclose(got[m][0], want[m][0], rtol=0, atol=1e-6)
    assert split_stats["num_groups"] == whole_stats["num_groups"] == 1
    # Counting each sequence as a member would weigh the split members' rewards more, and differ.
    for t in split_trajs:
        t.member = None
    per_sequence = member_advantages(make_batch(split_trajs, **kw)[0], samples)
    assert any(abs(per_sequence[m][0] - want[m][0]) > 1e-3 for m in range(len(samples)))


def test_the_sequences_of_one_member_share_its_reward():
    trajs = trajectories_of([group()])
    trajs[2].reward = 5.0  # member 1's second sequence
    with pytest.raises(ValueError, match=r"trajectories 1 and 2 \(group 7 member 1\) carry rewards 0.0 and 5.0"):
        make_batch(trajs, num_rows=8, seq_len=20, route_spec=SPEC)


def test_the_length_screen_is_per_training_sequence():
    """Split, the members' longest sequence with its context is member 2's first (4 + 6 tokens); unsplit,
    member 1's prompt and 12 tokens."""
    good, rejected = screen_groups([group()], version=1, seq_len=10, route_spec=SPEC)
    assert [g.group_id for g in good] == [7] and rejected == []
    with pytest.raises(ValueError, match="group 7: the longest training sequence with its context .* is 10 tokens, "
                                         "more than seq_len=9"):
        screen_groups([group()], version=1, seq_len=9, route_spec=SPEC)
    with pytest.raises(ValueError, match="group 7: .* is 16 tokens, more than seq_len=10"):
        screen_groups([group(unsplit(members()))], version=1, seq_len=10, route_spec=SPEC)


def segments(batch):
    """For each segment with trained tokens, the tokens it sees and their fields: those of the shared prompt
    segment it attends to (its context id), if any, then its own."""
    rows = {name: np.asarray(getattr(batch, name)).reshape(-1, np.shape(batch.tokens)[-1])
            for name in ("tokens", "positions", "segment_ids", "context_ids", "loss_mask", "behav_logp", "versions",
                         "advantages")}
    routes = None if batch.routes is None else np.asarray(batch.routes).reshape(-1, *np.shape(batch.routes)[2:])
    out = []
    for r in range(len(rows["tokens"])):
        seg, ctx = rows["segment_ids"][r], rows["context_ids"][r]
        for k in set(seg[rows["loss_mask"][r] > 0].tolist()):
            own = np.flatnonzero(seg == k)
            assert len(set(ctx[own].tolist())) == 1  # one context for the whole segment
            c = int(ctx[own[0]])
            where = np.concatenate([np.flatnonzero(seg == c) if c else np.zeros(0, int), own])
            item = {name: v[r, where] for name, v in rows.items()}
            item["routes"] = None if routes is None else routes[r, where]
            out.append(item)
    return out


def assert_each_sequence_sees_only_itself(batch, trajs, advantages=None):
    """Every trajectory is one segment (with its shared prompt, if any) whose tokens are exactly its prompt
    and completion, at positions 0, 1, ...: nothing before its start (another sequence of its member, the
    group's prompt for a started one) is visible to it. Its completion's model tokens, and only those, are
    trained, with its log-probs, versions, advantage and routes (each at the position before its token)."""
    seen = segments(batch)
    for i, t in enumerate(trajs):
        trained = np.ones(len(t.completion), bool)
        for a, b in t.env_spans:
            trained[a:b] = False
        logps = np.asarray(t.behav_logp, np.float32)[trained]
        (item,) = [s for s in seen if np.array_equal(s["behav_logp"][s["loss_mask"] > 0], logps)]
        p = len(t.prompt)
        assert item["tokens"].tolist() == list(t.prompt) + list(t.completion), i
        assert item["positions"].tolist() == list(range(p + len(t.completion))), i
        assert item["loss_mask"].tolist() == [0.0] * p + trained.astype(float).tolist(), i
        assert item["versions"].tolist() == [-1] * p + np.where(trained, t.versions, -1).tolist(), i
        if advantages is not None:
            np.testing.assert_array_equal(item["advantages"][p:][trained], advantages[i])
        if item["routes"] is not None and t.routes is not None:
            np.testing.assert_array_equal(item["routes"][p - 1:-1], t.routes)
            assert (item["routes"][:p - 1] == -1).all()  # the prompt's positions route themselves
    assert len(seen) == len(trajs)


@pytest.mark.parametrize("pack", [False, True])
def test_a_batch_lays_each_sequence_out_on_its_own(pack):
    samples = members()
    trajs = trajectories_of([group(samples)])
    batch, _ = make_batch(trajs, num_rows=8, seq_len=20, pack=pack, route_spec=SPEC)
    validate_batch(batch, 1)
    adv = member_advantages(batch, samples)
    assert_each_sequence_sees_only_itself(batch, trajs, [adv[t.member][0] for t in trajs])
    # Member 1's second sequence: its own segment, positions from 0 at the token that starts it.
    seg, pos, tok = (np.asarray(x).reshape(-1, 20) for x in (batch.segment_ids, batch.positions, batch.tokens))
    (row, col), = np.argwhere(tok == samples[1].tokens[9])
    assert pos[row, col] == 0 and (pos[row, col:col + 3] == [0, 1, 2]).all()
    first = np.argwhere(tok == samples[1].tokens[0])
    assert all(r != row or seg[r, c] != seg[row, col] for r, c in first)
    if not pack:  # a row of its own: the sequence's three tokens and nothing else
        assert tok[row][seg[row] > 0].tolist() == samples[1].tokens[9:12]


def test_shared_prompts_join_only_equal_prompts():
    """A started sequence whose context equals the group's prompt token for token may share one copy of
    it; one whose context differs (here in its last token only) keeps its own."""
    prompt = [1, 2, 3, 4, 5, 6]
    ones = [sample(3, [], [], 10 + 10 * i, i) for i in range(3)]
    same = sample(9, [[0, 6]], [0], 50, 4)
    same.tokens[:6] = prompt  # the agent sent the group's prompt as its context
    other = sample(13, [[0, 6], [9, 11]], [0, 9], 70, 5)
    other.tokens[:6] = prompt[:5] + [9]
    samples = ones + [same, other]
    trajs = trajectories_of([group(samples, rewards=[1.0, 0.0, 1.0, 0.0, 0.5], prompt=prompt)])
    batch, _ = make_batch(trajs, num_rows=8, seq_len=64, pack=True, share_prompts=True, route_spec=SPEC)
    validate_batch(batch, 1)
    assert np.asarray(batch.context_ids).any()  # some prompt is shared
    adv = member_advantages(batch, samples)
    assert_each_sequence_sees_only_itself(batch, trajs, [adv[t.member][0] for t in trajs])


@pytest.mark.slow  # compiles and trains the model
def test_the_trainer_trains_a_buffer_of_split_samples(tmp_path):
    """RLTrainer.train on groups whose members are split: every model token of every member is trained
    once (trained_tokens), in the batch shape compiled for one trajectory per sample while they fit it."""
    import jax

    from jaxflow import sharding
    from jaxflow.config import load_config
    from jaxflow.data.records import ConsumedBatch
    from jaxflow.models.hf_io import load_model
    from jaxflow.models.tiny import write_tiny_model
    from jaxflow.trainer.rl_trainer import RLTrainer

    config = load_config("configs/arithmetic_tiny.py", {})
    mesh = sharding.make_mesh(fsdp=2, devices=jax.devices()[:2])
    trainer = RLTrainer(load_model(write_tiny_model(tmp_path / "m"), mesh=mesh), config.trainer, mesh,
                        seq_len=32, max_sequences=16)
    groups = []
    for g in range(2):
        samples = [dataclasses.replace(s, routes=None, versions=[0] * len(s.tokens)) for s in members()]
        groups.append(FinishedGroup(g, PROMPT, 0, samples, [1.0, 0.0, 0.5, 0.0] if g else REWARDS))
    assert len(trajectories_of(groups)) == 12  # fits the 16 sequences compiled for
    metrics, staleness = trainer.train(ConsumedBatch(0, groups, "full"))
    model_tokens = sum(int(s.model_mask().sum()) for g in groups for s in g.samples)
    assert metrics["groups_trained"] == 2 and metrics["trained_tokens"] == model_tokens
    assert staleness == {0: model_tokens} and np.isfinite(metrics["loss"]) and metrics["updates_skipped"] == 0
    assert trainer.compiles == 1 and trainer.version == 1
