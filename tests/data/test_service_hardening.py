"""Hardening of the trajectory service: complete validation before any change (bad samples, rewards,
arguments, snapshots), leases that hand back the groups of dead or hung workers, and exactly-once consume
across a lost reply."""

import copy
import json
import math
import socket
import threading
import time

import pytest
from service_placements import PLACEMENTS, SERVICE_METHODS, placed
from waiting import wait_until

from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import ConsumeSuperseded, SampleRefused, TrajectoryService
from jaxflow.transport import rpc, wire


def records(n):
    return [{"prompt": [1 + i % 50, 2 + i % 7], "meta": {"index": i}} for i in range(n)]


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def make(n_prompts=200, **kw):
    kw.setdefault("batch_groups", 2)
    kw.setdefault("group_size", 2)
    kw.setdefault("eta", 1)
    return TrajectoryService(PromptSource(records(n_prompts), shuffle=False, num_epochs=1), **kw)


def done(task, version=0, length=2):
    return [Sample([7] * length, [-1.0] * length, [version] * length, "stop") for _ in range(task.n)]


@pytest.fixture(params=PLACEMENTS)
def place(request):
    with placed(request.param) as p:
        yield p


def assert_only_refusals_counted(svc, before, reason, calls=1):
    """The service is as `before`, but for `calls` refusals counted under `reason`."""
    expected = copy.deepcopy(before)
    expected["counts"]["refused"] += calls
    expected["counts"][f"refused_{reason}"] += calls
    assert svc.stats() == expected


# ---- 1. samples and rewards validated completely ---------------------------------------------------

BAD_SAMPLES = [
    ("nan log-prob", Sample([5, 6], [math.nan, math.nan], [0, 0], "stop"), r"sample 0: logprobs\[0\]"),
    ("string log-prob", Sample([5, 6], ["abc", None], [0, 0], "stop"), r"sample 0: logprobs\[0\]"),
    ("positive log-prob", Sample([5, 6], [-1.0, 0.5], [0, 0], "stop"), r"sample 0: logprobs\[1\]"),
    ("inf log-prob", Sample([5, 6], [-math.inf, -1.0], [0, 0], "stop"), r"sample 0: logprobs\[0\]"),
    ("+inf log-prob", Sample([5, 6], [-1.0, math.inf], [0, 0], "stop"), r"sample 0: logprobs\[1\]"),
    ("float token", Sample([5, 6.5], [-1.0, -1.0], [0, 0], "stop"), r"sample 0: tokens\[1\]"),
    ("bool token", Sample([True, 6], [-1.0, -1.0], [0, 0], "stop"), r"sample 0: tokens\[0\]"),
    ("negative token", Sample([5, -6], [-1.0, -1.0], [0, 0], "stop"), r"sample 0: tokens\[1\]"),
    ("float version", Sample([5, 6], [-1.0, -1.0], [0, 0.5], "stop"), r"sample 0: versions\[1\]"),
    ("future version", Sample([5, 6], [-1.0, -1.0], [0, 3], "stop"), r"sample 0: .*versions"),
    ("short versions", Sample([5, 6], [-1.0, -1.0], [0], "stop"), r"sample 0: 2 tokens but 2 log-probs and 1"),
    ("int finish_reason", Sample([5, 6], [-1.0, -1.0], [0, 0], 5), r"sample 0: finish_reason"),
    ("tokens not a list", Sample("ab", [-1.0, -1.0], [0, 0], "stop"), r"sample 0: tokens"),
]


@pytest.mark.parametrize("name,bad,match", BAD_SAMPLES, ids=[b[0] for b in BAD_SAMPLES])
def test_bad_sample_is_refused_before_anything_changes(place, name, bad, match):
    svc = place(make())
    (t,) = svc.dispatch("w0", 0, 1)
    before = svc.stats()
    with pytest.raises(ValueError, match=f"group {t.group_id} {match}"):
        svc.finish(t.group_id, "w0", [bad, done(t)[0]], [1.0, 0.0])
    with pytest.raises(ValueError, match=f"group {t.group_id} {match}"):
        svc.abort(t.group_id, "w0", [bad, done(t)[0]])
    assert_only_refusals_counted(svc, before, "malformed")  # the finish's; an abort is not a refusal
    assert svc.finish(t.group_id, "w0", done(t), [1.0, 0.0]) == 0  # the group is still the worker's


@pytest.mark.parametrize("rewards,match,reason", [
    ([math.nan, 1.0], r"rewards\[0\]", "reward"), ([1.0, math.inf], r"rewards\[1\]", "reward"),
    (["1", 0.0], r"rewards\[0\]", "reward"), ([True, 0.0], r"rewards\[0\]", "reward"),
    ([1.0], "1 rewards for 2 samples", "malformed"), (1.0, "rewards must be a list", "malformed"),
    ([None, 1.0], r"rewards\[0\]", "reward"),
    # Each finite, but their sum overflows float32 (the trainer's advantages would be NaN).
    ([3e38, 3e38], "rewards .* overflow float32", "reward"), ([1e308, 1e308], "rewards .* overflow float32", "reward")])
def test_bad_rewards_are_refused_at_finish_and_reward(place, rewards, match, reason):
    svc = place(make())
    t1, t2 = svc.dispatch("w0", 0, 2)
    before = svc.stats()
    with pytest.raises(SampleRefused, match=f"group {t1.group_id}: {match}"):
        svc.finish(t1.group_id, "w0", done(t1), rewards)
    assert_only_refusals_counted(svc, before, reason)
    svc.finish(t2.group_id, "w0", done(t2))
    before = svc.stats()
    with pytest.raises(SampleRefused, match=f"group {t2.group_id}: {match}"):
        svc.reward(t2.group_id, rewards)
    assert_only_refusals_counted(svc, before, reason)
    svc.reward(t2.group_id, [0, 1])


def test_token_ids_the_model_cannot_embed_are_refused_and_counted(place):
    """An id >= the model's vocab would NaN the whole update (every good group with it), and one >= 2**31
    does not even fit the trainer's int32 batch: `finish` refuses both by name and counts them; the group
    stays its worker's, which fails it (counted) or finishes it with good samples."""
    svc = place(make(vocab_size=64))
    bad_group, good_group = svc.dispatch("w0", 0, 2)
    before = svc.stats()
    for bad_id in (64, 2**31, 2**40):
        samples = done(bad_group)
        samples[1].tokens[1] = bad_id
        where = rf"group {bad_group.group_id} sample 1: tokens\[1\] = {bad_id}"
        with pytest.raises(SampleRefused, match=where) as e:
            svc.finish(bad_group.group_id, "w0", samples, [1.0, 0.0])
        assert e.value.reason == "token_id"
    assert_only_refusals_counted(svc, before, "token_id", calls=3)
    svc.fail(bad_group.group_id, "finish refused")  # what the coordinator does with a refused group
    assert svc.finish(good_group.group_id, "w0", done(good_group, length=3), [1.0, 0.0]) == 0
    counts = svc.stats()["counts"]
    assert counts["failed"] == 1 and counts["rewarded"] == 1 and counts["created"] == 2


def test_without_a_model_ids_must_still_fit_int32(place):
    svc = place(make())  # no vocab_size: the model is not known
    (t,) = svc.dispatch("w0", 0, 1)
    samples = done(t)
    samples[0].tokens[0] = 2**31
    with pytest.raises(SampleRefused, match="int32"):
        svc.finish(t.group_id, "w0", samples, [1.0, 0.0])
    samples[0].tokens[0] = 2**31 - 1  # the model is not known: any int32 id is taken
    assert svc.finish(t.group_id, "w0", samples, [1.0, 0.0]) == 0
    assert svc.stats()["counts"]["refused_token_id"] == 1


def test_an_episode_whose_turn_rewards_sum_to_inf_is_refused_and_counted(place):
    svc = place(make())
    (t,) = svc.dispatch("w0", 0, 1)
    samples = done(t)
    for s in samples:  # each turn's reward is finite; the episode's sum is not
        s.reward = float(sum([1e308, 1e308]))
    before = svc.stats()
    with pytest.raises(SampleRefused, match=f"group {t.group_id} sample 0: reward inf") as e:
        svc.finish(t.group_id, "w0", samples, [s.reward for s in samples])
    assert e.value.reason == "reward"
    assert_only_refusals_counted(svc, before, "reward")


def test_a_sample_longer_than_a_trainer_row_is_refused_and_counted(place):
    """A sample the trainer could not lay out in a row (prompt + tokens > max_sequence_tokens) is refused at
    `finish`, whatever its size, before its tokens are looked at one by one."""
    svc = place(make(max_sequence_tokens=16))
    t1, t2 = svc.dispatch("w0", 0, 2)
    assert len(t1.prompt) == 2
    before = svc.stats()
    for length in (15, 100_000):
        with pytest.raises(SampleRefused, match=f"group {t1.group_id} sample 0: {length} tokens") as e:
            svc.finish(t1.group_id, "w0", done(t1, length=length), [1.0, 0.0])
        assert e.value.reason == "length"
    assert_only_refusals_counted(svc, before, "length", calls=2)
    assert svc.finish(t1.group_id, "w0", done(t1, length=14), [1.0, 0.0]) == 0  # prompt + 14 = 16 fits


def test_service_options_are_checked():
    for kw in ({"vocab_size": 0}, {"max_sequence_tokens": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            make(**kw)
    with pytest.raises(TypeError, match="vocab_size"):
        make(vocab_size=64.0)


# ---- 5. arguments checked first; restore validates the whole snapshot -------------------------------

@pytest.mark.parametrize("call,exc,match", [
    (lambda s: s.dispatch("w0", -0.5), TypeError, "version"),
    (lambda s: s.dispatch("w0", -1), ValueError, "version"),
    (lambda s: s.dispatch("w0", True), TypeError, "version"),
    (lambda s: s.dispatch("w0", 0, 0), ValueError, "max_groups"),
    (lambda s: s.dispatch("w0", 0, 2.0), TypeError, "max_groups"),
    (lambda s: s.dispatch(7, 0), TypeError, "worker"),
    (lambda s: s.dispatch("", 0), ValueError, "worker"),
    (lambda s: s.consume(0, timeout=math.nan), ValueError, "timeout"),
    (lambda s: s.consume(0, timeout=-1), ValueError, "timeout"),
    (lambda s: s.consume(0.0, timeout=0.1), TypeError, "version"),
    (lambda s: s.needs_sync("1"), TypeError, "version"),
    (lambda s: s.release(-3), ValueError, "step"),
    (lambda s: s.buffer_state(1.5), TypeError, "step"),
    (lambda s: s.mark_published(0.5), TypeError, "version"),
    (lambda s: s.finish("0", "w0", []), TypeError, "group_id"),
    (lambda s: s.abort(0, "w0", None, reason=3), TypeError, "reason"),
    (lambda s: s.fail(0, None), TypeError, "reason"),
    (lambda s: s.release_worker(None), TypeError, "worker"),
    (lambda s: s.finish(0, "w0", "ab"), TypeError, "samples"),
])
def test_bad_arguments_change_nothing(place, call, exc, match):
    svc = place(make())
    svc.dispatch("w0", 0, 1)
    before = svc.stats()
    with pytest.raises(exc, match=match):
        call(svc)
    assert svc.stats() == before
    assert all(b["reserved"] >= 0 for b in before["buffers"].values())


def _corrupt(snap, path, value):
    bad = copy.deepcopy(snap)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return bad


@pytest.mark.parametrize("path,value", [
    (("v_train",), -1), (("v_train",), "1"), (("published",), 5), (("next_id",), 0), (("counts",), None),
    (("counts", "created"), -2), (("groups", 0, "state"), "bogus"), (("groups", 1, "reserved"), 99),
    (("groups", 0, "samples", 0, "logprobs"), [math.nan, 0.0]), (("groups", 1, "rewards"), ["x", 1.0]),
    (("groups", 0, "group_id"), 1), (("groups", 1, "prompt"), []), (("source",), {"index": -1}),
    (("groups", 0, "n"), 3), (("groups", 0, "unknown_field"), 1), (("groups", 1, "step"), 7),
    (("groups", 0, "samples", 0, "env_spans"), [[0, 5]]), (("groups", 0, "samples", 0, "spans"), [])])
def test_restore_validates_the_whole_snapshot_first(place, path, value):
    svc = place(make())
    t1, t2 = svc.dispatch("w0", 0, 2)
    svc.abort(t1.group_id, "w0", [Sample([7], [-1.0], [0]), Sample()])
    svc.finish(t2.group_id, "w0", done(t2), [1.0, 0.0])
    snap = svc.snapshot()
    other = place(make())
    (t3,) = other.dispatch("w1", 0, 1)
    before_stats, before_snap = other.stats(), other.snapshot()
    with pytest.raises((ValueError, TypeError), match="snapshot"):
        other.restore(_corrupt(snap, path, value))
    assert other.stats() == before_stats and other.snapshot() == before_snap
    other.restore(snap)  # the intact snapshot still restores
    assert other.stats()["groups"]["occupied"] == 1


def test_an_episode_keeps_its_environment_spans_through_abort_resume_and_snapshot(place):
    """A multi-turn episode's samples carry which tokens the environment wrote, through every placement's
    transport, the requeued task, and the JSON snapshot; spans that do not fit the tokens are refused."""
    svc = place(make())
    (t,) = svc.dispatch("w0", 0, 1)
    episode = Sample([5, 6, 90, 91, 7], [-1.0, -0.5, 0.0, 0.0, -2.0], [0, 0, 0, 0, 0], None, [[2, 4]])
    with pytest.raises(ValueError, match=r"group \d+ sample 0: env_spans\[0\] = \[3, 9\]"):
        svc.abort(t.group_id, "w0", [Sample([5], [-1.0], [0], None, [[3, 9]]), Sample()])
    svc.abort(t.group_id, "w0", [episode, Sample()])
    (again,) = svc.dispatch("w1", 0, 1)
    assert again.partial[0].env_spans == [[2, 4]] and again.partial[0].tokens == episode.tokens
    snap = json.loads(json.dumps(svc.snapshot()))
    other = place(make())
    other.restore(snap)
    (restored,) = other.dispatch("w2", 0, 1)
    assert restored.partial[0].env_spans == [[2, 4]]


# ---- 2. leases ----------------------------------------------------------------------------------

def test_hung_worker_lease_expires_and_the_group_goes_to_a_healthy_worker():
    clock = FakeClock()
    svc = make(batch_groups=2, eta=0, lease_s=10.0, clock=clock)
    hung = svc.dispatch("hung", 0, 1)[0]
    svc.abort(hung.group_id, "hung", [Sample([7], [-1.0], [0]), Sample()])  # some tokens handed in
    hung = svc.dispatch("hung", 0, 1)[0]  # and it takes the group again, then hangs
    (healthy,) = svc.dispatch("good", 0, 1)
    clock.t = 8.0
    assert svc.renew("good", [healthy.group_id]) == []
    clock.t = 12.0
    again = svc.dispatch("good", 0, 4)
    assert [t.group_id for t in again] == [hung.group_id]
    assert again[0].partial[0].tokens == [7]  # its partial tokens came back with it
    assert svc.stats()["counts"]["expired"] == 1
    svc.finish(healthy.group_id, "good", done(healthy), [1.0, 0.0])
    svc.finish(hung.group_id, "good", done(again[0]), [0.0, 1.0])
    batch = svc.consume(0, timeout=1)
    assert sorted(g.group_id for g in batch.groups) == sorted([hung.group_id, healthy.group_id])
    with pytest.raises(ValueError, match="lease .* expired|not held"):  # the hung worker wakes up late
        svc.finish(hung.group_id, "hung", done(hung), [1.0, 1.0])
    assert svc.renew("hung", [hung.group_id]) == [hung.group_id]  # it is told the group is not its own


def test_trainer_does_not_wait_longer_than_the_lease_on_an_orphan():
    # Real time, served: a worker reserves and never comes back; a healthy one polls for work.
    with placed("server") as p:
        svc = p(make(batch_groups=2, eta=0, lease_s=0.3))
        svc.dispatch("dead", 0, 2)
        stop = threading.Event()

        def healthy():
            while not stop.is_set():
                for t in svc.dispatch("good", 0, 2):
                    svc.finish(t.group_id, "good", done(t), [1.0, 0.0])
                time.sleep(0.02)

        thread = threading.Thread(target=healthy, daemon=True)
        thread.start()
        try:
            batch = svc.consume(0, timeout=10)
        finally:
            stop.set()
            thread.join()
        assert len(batch.groups) == 2 and svc.stats()["counts"]["expired"] == 2


def _stored(svc, group_id):
    """The samples the service holds for a group (what it would resume it from)."""
    (g,) = [g for g in svc.snapshot()["groups"] if g["group_id"] == group_id]
    return None if g["samples"] is None else [Sample(**s) if isinstance(s, dict) else s for s in g["samples"]]


def test_renew_progress_is_what_a_dead_workers_group_resumes_from(place):
    """A worker reports its groups' tokens so far with `renew`; when it dies without handing them back,
    `release_worker` requeues them with those tokens, through every placement's transport."""
    svc = place(make(batch_groups=2, eta=0))
    (t,) = svc.dispatch("w0", 0, 1)
    early = [Sample([5], [-1.0], [0]), Sample()]
    so_far = [Sample([5, 6, 7], [-1.0, -0.5, -2.0], [0, 0, 0]), Sample([8], [-0.1], [0], "stop")]
    assert svc.renew("w0", [t.group_id], {t.group_id: early}) == []
    assert svc.renew("w0", [t.group_id], {t.group_id: so_far}) == []  # the latest report replaces the last
    assert svc.renew("w0", [t.group_id]) == [] and _stored(svc, t.group_id) == so_far  # a bare renew keeps it
    restored = place(make(batch_groups=2, eta=0))  # a checkpoint's snapshot keeps the progress too
    restored.restore(json.loads(json.dumps(svc.snapshot())))
    assert restored.dispatch("w2", 0, 1)[0].partial == so_far
    assert svc.release_worker("w0", "worker died") == 1
    (again,) = svc.dispatch("w1", 0, 1)
    assert again.group_id == t.group_id and again.v_start == 0 and again.partial == so_far
    assert svc.stats()["counts"]["recovered_tokens"] == 4


def test_bad_progress_is_refused_and_changes_nothing(place):
    svc = place(make(batch_groups=2, eta=0))
    mine, theirs = svc.dispatch("w0", 0, 1)[0].group_id, svc.dispatch("w1", 0, 1)[0].group_id
    good = [Sample([5, 6], [-1.0, -0.5], [0, 0]), Sample()]
    svc.renew("w0", [mine], {mine: good})
    before = svc.stats()["counts"]
    bad = [
        ({theirs: good}, ValueError, rf"progress for group\(s\) \[{theirs}\] not among group_ids"),
        ({mine: [Sample([5], [-1.0], [1]), Sample()]}, ValueError,
         rf"group {mine} sample 0: token versions span \[1, 1\], outside \[v_start=0, latest published=0\]"),
        ({mine: good + [Sample()]}, ValueError, rf"group {mine}: progress has 3 samples, expected 2"),
        ({mine: [Sample([5], [0.5], [0]), Sample()]}, ValueError, rf"group {mine} sample 0: logprobs\[0\]"),
        ({mine: "tokens"}, TypeError, rf"group {mine}: progress samples must be a list"),
        ([good], TypeError, "progress must be None or a dict"),
    ]
    for progress, exc, match in bad:
        with pytest.raises(exc, match=match):
            svc.renew("w0", [mine], progress)
        assert _stored(svc, mine) == good and _stored(svc, theirs) is None
    # Another worker's group: not an error (its lease may have passed on), but ignored and reported lost.
    assert svc.renew("w0", [mine, theirs], {theirs: good}) == [theirs]
    assert _stored(svc, theirs) is None and svc.stats()["counts"] == before


def test_an_expired_lease_hands_the_group_back_with_its_last_reported_tokens():
    clock = FakeClock()
    svc = make(batch_groups=2, eta=0, lease_s=10.0, clock=clock)
    (t,) = svc.dispatch("w0", 0, 1)
    so_far = [Sample([5, 6], [-1.0, -0.5], [0, 0]), Sample([9], [-0.2], [0])]
    clock.t = 5.0
    svc.renew("w0", [t.group_id], {t.group_id: so_far})
    clock.t = 8.0
    with pytest.raises(ValueError, match="not among group_ids"):  # refused: the lease is not extended either
        svc.renew("w0", [t.group_id], {t.group_id + 1: so_far})
    clock.t = 14.0
    assert svc.dispatch("w1", 0, 1)[0].group_id == t.group_id + 1  # w0's lease runs to 15: still its group
    clock.t = 16.0
    (again,) = svc.dispatch("w1", 0, 1)
    assert again.group_id == t.group_id and again.partial == so_far
    counts = svc.stats()["counts"]
    assert counts["expired"] == 1 and counts["recovered_tokens"] == 3
    late = [Sample([5, 6, 7], [-1.0, -0.5, -0.5], [0, 0, 0]), Sample()]
    assert svc.renew("w0", [t.group_id], {t.group_id: late}) == [t.group_id]  # ignored, told it is lost
    assert _stored(svc, t.group_id) == so_far


# ---- 3. exactly-once consume across a lost reply -------------------------------------------------

def test_consume_retry_after_a_lost_reply_gets_the_same_batch_counted_once():
    service = make(batch_groups=2, eta=0)
    with rpc.Server(service, SERVICE_METHODS["TrajectoryService"], token="t").start() as server, \
            rpc.Client(server.address, token="t", timeout=1) as impatient, \
            rpc.Client(server.address, token="t") as worker:
        with pytest.raises((TimeoutError, OSError)):
            impatient.consume(0, timeout=5)  # the client gives up after 1 s; the server keeps waiting
        for t in worker.dispatch("w", 0, 2):
            worker.finish(t.group_id, "w", done(t), [1.0, 0.0])
        # The server's consume runs, and its reply is lost.
        wait_until(lambda: worker.stats()["v_train"] != 0, 10, "the server's consume")
        again = impatient.consume(0, timeout=5)
        assert len(again.groups) == 2 and again.step == 0
        assert impatient.consume(0, timeout=5).groups == again.groups  # asking twice is harmless
        stats = worker.stats()
        assert stats["counts"]["consumed"] == 2 and stats["groups"]["consumed"] == 2
        with pytest.raises(ValueError, match="next buffer is 1"):
            impatient.consume(2, timeout=0.1)


def _threads_waiting(service) -> int:
    """Threads waiting on the service's condition (CPython's Condition keeps them in `_waiters`)."""
    return len(service._lock._waiters)


def test_a_consume_retried_while_the_first_call_waits_gets_the_batch_once():
    """The trainer's first consume(0) is still waiting in the service when the trainer, having given up on
    it, asks again. The newer call gets the batch; the older one gives way and takes nothing, even when
    the prompts have run out (the older used to take the groups and leave the retry an empty batch, which
    then replaced the kept one)."""
    svc = make(n_prompts=2, batch_groups=2, eta=0)  # the prompts run out with this batch
    outcome = {}

    def consume(name):
        try:
            outcome[name] = svc.consume(0, timeout=30)
        except Exception as e:  # noqa: BLE001 - recorded for the assertions below
            outcome[name] = e

    first = threading.Thread(target=consume, args=("first",), daemon=True)
    first.start()
    wait_until(lambda: _threads_waiting(svc) == 1, 10, "the first consume to wait")
    retry = threading.Thread(target=consume, args=("retry",), daemon=True)
    retry.start()
    wait_until(lambda: _threads_waiting(svc) == 2 or "first" in outcome, 10, "the retry to arrive")
    for t in svc.dispatch("w", 0, 2):
        svc.finish(t.group_id, "w", done(t), [1.0, 0.0])
    first.join(10)
    retry.join(10)
    batch = outcome["retry"]
    assert [len(g.samples) for g in batch.groups] == [2, 2], outcome  # no group lost to the abandoned call
    wait_until(lambda: _threads_waiting(svc) == 0, 10, "every consume to return")
    assert svc.consume(0, timeout=1).groups == batch.groups  # the kept batch is not replaced by an empty one
    assert isinstance(outcome["first"], ConsumeSuperseded), outcome
    counts = svc.stats()["counts"]
    assert counts["consumed"] == 2 and counts["consume_superseded"] == 1


def test_a_served_consume_retried_while_the_abandoned_call_waits_gets_the_batch_once():
    """The same over the RPC server: the first request's client is gone (its connection is still open, as
    a client that timed out leaves it), the retry comes on another connection."""
    service = make(n_prompts=2, batch_groups=2, eta=0)
    with rpc.Server(service, SERVICE_METHODS["TrajectoryService"], token="t").start() as server, \
            rpc.Client(server.address, token="t") as trainer, rpc.Client(server.address, token="t") as worker, \
            socket.create_connection(server.address, timeout=10) as abandoned:
        wire.send_message(abandoned, {"token": "t"})
        wire.recv_message(abandoned, 1 << 20)
        wire.send_message(abandoned, {"id": 1, "method": "consume", "args": [0], "kwargs": {"timeout": 30}})
        wait_until(lambda: worker.stats()["consume_waiting"] == 1, 10, "the first consume to wait")
        got = {}
        retry = threading.Thread(target=lambda: got.update(batch=trainer.consume(0, timeout=30)), daemon=True)
        retry.start()
        reply = wire.recv_message(abandoned, 1 << 20)  # the abandoned call gives way at once
        assert not reply["ok"] and reply["error"]["type"].endswith("ConsumeSuperseded"), reply
        for t in worker.dispatch("w", 0, 2):
            worker.finish(t.group_id, "w", done(t), [1.0, 0.0])
        retry.join(10)
        assert len(got["batch"].groups) == 2
        assert trainer.consume(0, timeout=1).groups == got["batch"].groups
        stats = worker.stats()
        assert stats["counts"]["consumed"] == 2 and stats["counts"]["consume_superseded"] == 1
        assert stats["consume_waiting"] == 0
