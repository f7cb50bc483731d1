"""The coordinator under faults, against a real trajectory service and a scripted engine: a reward that
raises or returns NaN fails its group (counted) instead of stopping the loop, and so does a distillation teacher
that raises or scores a token NaN (the others' teacher log-probs reach the service), the coordinator renews the
leases of what it holds, `stop` hands back every group it can even when one hand-back is refused, and a failed
engine stops the coordinator for good with an error the train loop raises."""

import math
import types

import pytest
from waiting import wait_until

from jaxflow.coordination import Coordination, Coordinator
from jaxflow.coordination.coordinator import RolloutFailed
from jaxflow.data.prompt_source import PromptSource
from jaxflow.data.records import Sample
from jaxflow.data.trajectory_service import TrajectoryService
from jaxflow.jobs import train_loop
from rollout_bridge.engine import Completion, EngineError, EngineLoad, SamplingParams


class ScriptedEngine:
    """Holds every request until `finish_all`; an abort hands back two generated tokens."""

    version, paused = 0, False

    def __init__(self):
        self.requests, self.out = {}, []

    def submit(self, request):
        self.requests[request.request_id] = request

    def poll(self, timeout=None):
        out, self.out = self.out, []
        return out

    def abort(self, ids):
        return [Completion(i, Sample([3, 4], [-0.5, -0.5], [0, 0], "abort")) for i in ids
                if self.requests.pop(i, None) is not None]

    def progress(self, ids):
        return [Completion(i, Sample([3], [-0.5], [0])) for i in ids if i in self.requests]

    def finish_all(self):
        self.out += [Completion(i, Sample([5, 6], [-0.5, -0.5], [0, 0], "stop")) for i in self.requests]
        self.requests = {}

    def load(self):
        return EngineLoad(len(self.requests), 0, 0.0, 1.0, 0)

    def update_weights(self, version, tensors, *, keep_kv=False):
        pass


class NoWeights:
    def latest(self):
        return None


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def setup(reward_fn, clock, groups=2, scoring_threads=0, teacher_fn=None):
    records = [{"prompt": [5, 6 + i], "meta": {"i": i}} for i in range(20)]
    svc = TrajectoryService(PromptSource(records, shuffle=False), batch_groups=groups, group_size=2, eta=0,
                            lease_s=10.0, clock=clock)
    engine = ScriptedEngine()
    coord = Coordinator("c", [engine], svc, NoWeights(), strategy=Coordination(max_running=2 * groups), eta=0,
                        sampling=SamplingParams(max_tokens=8), reward_fn=reward_fn, clock=clock,
                        renew_every_s=1.0, scoring_threads=scoring_threads, teacher_fn=teacher_fn)
    return svc, engine, coord


def test_a_nan_or_raising_reward_fails_the_group_and_the_loop_goes_on():
    calls = []

    def reward(task, samples):
        calls.append(task.group_id)
        if task.group_id == 0:
            return [math.nan, 1.0]
        if task.group_id == 1:
            raise RuntimeError("reward crashed")
        return [1.0, 0.0]

    clock = Clock()
    svc, engine, coord = setup(reward, clock)
    coord.step()
    engine.finish_all()
    coord.step()  # must not raise
    stats = svc.stats()
    assert stats["counts"]["failed"] == 2 and coord.counts["groups_failed"] == 2
    assert stats["groups"]["running"] == 2  # the loop went on and took new work
    assert "reward" in str(svc.snapshot()["groups"][0]["meta"]["failure"])


@pytest.mark.parametrize("scoring_threads", [0, 2])
def test_a_raising_or_nan_teacher_fails_its_group_and_the_others_record_their_teacher_log_probs(scoring_threads):
    def teacher(task, samples):
        if task.group_id == 0:
            raise RuntimeError("teacher forward raised")
        if task.group_id == 1:
            return [[-0.25, math.nan], [-0.25, -1.0]]
        return [[-0.25, -1.0 - task.group_id] for _ in samples]

    clock = Clock()
    svc, engine, coord = setup(lambda task, samples: [1.0, 0.0], clock, groups=3, teacher_fn=teacher,
                               scoring_threads=scoring_threads)
    coord.step()
    engine.finish_all()
    coord.step()  # must not raise
    wait_until(lambda: coord.step() or coord.counts["groups_failed"] + coord.counts["groups_finished"] == 3,
               timeout=30, what=lambda: f"the three groups handed in: {coord.counts}")
    assert svc.stats()["counts"]["failed"] == 2 and coord.counts["groups_failed"] == 2
    failures = {g["group_id"]: str(g["meta"].get("failure")) for g in svc.snapshot()["groups"]}
    assert "teacher forward raised" in failures[0] and "teacher_logprobs[1] = nan" in failures[1], failures
    (finished,) = [g for g in svc.snapshot()["groups"] if g["group_id"] == 2]
    assert [s["teacher_logprobs"] for s in finished["samples"]] == [[-0.25, -3.0], [-0.25, -3.0]]


def test_the_coordinator_renews_its_leases_and_drops_the_groups_it_lost():
    clock = Clock()
    svc, engine, coord = setup(lambda t, s: [1.0, 0.0], clock)
    coord.step()
    held = sorted(coord._groups)  # noqa: SLF001
    for t in range(1, 30):
        clock.t = float(t)
        coord.step()
    assert svc.stats()["counts"]["expired"] == 0 and sorted(coord._groups) == held  # noqa: SLF001
    clock.t = 45.0  # the coordinator hung for longer than the lease: its groups went back
    assert svc.dispatch("other", 0, 4) and svc.stats()["counts"]["expired"] == 2
    coord.step()
    assert coord.counts["groups_lost"] == 2 and not set(held) & set(coord._groups)  # noqa: SLF001


def test_stop_hands_back_every_group_even_when_one_hand_back_is_refused():
    clock = Clock()
    svc, engine, coord = setup(lambda t, s: [1.0, 0.0], clock, groups=3)
    coord.step()
    assert coord.in_flight() == 3
    clock.t = 11.0
    svc.renew("c", [1, 2])  # group 0's lease lapses; another worker takes it
    (taken,) = svc.dispatch("other", 0, 1)
    assert taken.group_id == 0
    coord.stop(abort_in_flight=True)
    stats = svc.stats()
    assert stats["groups"]["requeued"] == 2 and coord.in_flight() == 0
    assert stats["groups"]["running"] == 1  # only the one "other" holds


def test_scoring_threads_score_groups_together_while_the_loop_goes_on():
    # Each group's reward waits until both groups are being scored: on the loop (scoring_threads=0) that could
    # never happen; on threads the two meet, and meanwhile the loop's steps return.
    import threading

    meet = threading.Barrier(2, timeout=30)
    raised, go = threading.Event(), threading.Event()

    def reward(task, samples):
        meet.wait()
        go.wait(30)
        if task.group_id == 1:
            raised.set()
            raise RuntimeError("reward crashed")
        return [1.0, 0.0]

    clock = Clock()
    svc, engine, coord = setup(reward, clock, scoring_threads=2)
    coord.step()
    engine.finish_all()
    coord.step()  # both groups go to the scoring threads
    coord.step()
    assert coord.stats()["groups_scoring"] == 2 and coord.in_flight() == 2
    assert svc.stats()["groups"]["running"] == 2  # still the coordinator's until handed in
    go.set()
    wait_until(lambda: raised.is_set() and coord.counts["groups_finished"] + coord.counts["groups_failed"] == 2
               or (coord.step() and False), timeout=30, what="both groups scored")
    stats = svc.stats()
    assert coord.counts["groups_finished"] == 1 and coord.counts["groups_failed"] == 1, coord.counts
    assert stats["counts"]["failed"] == 1 and "reward crashed" in str(svc.snapshot()["groups"][1]["meta"]["failure"])
    assert coord.stats()["groups_scoring"] == 0


def test_a_group_still_being_scored_is_renewed_and_handed_back_whole_on_stop():
    import threading

    release = threading.Event()

    def reward(task, samples):
        release.wait(30)
        return [1.0, 0.0]

    clock = Clock()
    svc, engine, coord = setup(reward, clock, groups=1, scoring_threads=1)
    coord.step()
    engine.finish_all()
    coord.step()
    assert coord.stats()["groups_scoring"] == 1
    for t in range(1, 30):  # far past the 10 s lease: the scoring group's lease is renewed with the others
        clock.t = float(t)
        coord.step()
    assert svc.stats()["counts"]["expired"] == 0 and coord.counts["groups_lost"] == 0
    coord.stop(abort_in_flight=True)
    release.set()
    assert coord.in_flight() == 0 and coord.counts["groups_aborted"] == 1
    assert svc.stats()["groups"]["requeued"] == 1
    (task,) = svc.dispatch("other", 0, 1)  # it comes back complete: the next worker only rewards it
    assert task.group_id == 0 and all(x is not None and x.done for x in task.partial), task


def test_scoring_threads_are_checked():
    with pytest.raises(ValueError, match="scoring_threads"):
        setup(lambda t, s: [1.0, 0.0], Clock(), scoring_threads=-1)


class DeadEngine(ScriptedEngine):
    """Its loop has failed: every poll raises EngineError, as a real engine's does from then on."""

    def __init__(self):
        super().__init__()
        self.error = RuntimeError("Unsupported element type for DotThunk::Execute")

    def poll(self, timeout=None):
        raise EngineError(f"the engine loop failed with {self.error}") from self.error

    def failure(self):
        return self.error


def test_a_failed_engine_stops_the_coordinator_and_the_trainer_gets_its_error():
    records = [{"prompt": [5, 6 + i], "meta": {"i": i}} for i in range(20)]
    svc = TrajectoryService(PromptSource(records, shuffle=False), batch_groups=2, group_size=2, eta=0)
    coord = Coordinator("c", [DeadEngine()], svc, NoWeights(), strategy=Coordination(max_running=4), eta=0,
                        sampling=SamplingParams(max_tokens=8), reward_fn=lambda task, samples: [1.0, 0.0])
    coord.start(tick_s=0.01)
    try:
        wait_until(lambda: coord.error is not None, 30, "the coordinator to record the engine's failure")
        wait_until(lambda: not coord._thread.is_alive(), 30, "the coordinator's loop to end, not retry")
        assert isinstance(coord.error, RolloutFailed) and "DotThunk" in str(coord.error)
        assert isinstance(coord.error.__cause__, EngineError)
        assert svc.stats()["groups"].get("running", 0) == 0  # its groups went back to the service
        with pytest.raises(RolloutFailed):  # the train loop raises it instead of waiting for the buffer
            train_loop._consume(svc, 0, types.SimpleNamespace(requested=False), coord)
    finally:
        coord.stop()
