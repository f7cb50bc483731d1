"""The request admission every engine shares (`Engine.submit` / `poll`), on a minimal engine that only
queues what it accepts: ids in flight are refused, requests that cannot run or whose resumed prefix is
already complete come straight back through poll, and an accepted request gets its own copy of its
prefix. The JAX and vLLM engines run the same paths in their own tests."""

import pytest

from jaxflow.data.records import Sample
from rollout_bridge.engine import Engine, EngineError, EngineLoad, Request, SamplingParams, request_error


class QueueEngine(Engine):
    """Accepts into a list; `launched` records the callables submit runs after releasing its lock."""

    def __init__(self):
        self._init_admission()
        self.accepted: list[tuple[Request, Sample]] = []
        self.launched: list[str] = []

    version = 0
    paused = False

    def _invalid(self, request):
        return request_error(request, vocab_size=100, context=16, context_name="context")

    def _in_flight(self, request_id):
        return any(r.request_id == request_id for r, _ in self.accepted)

    def _accept(self, request, sample):
        self.accepted.append((request, sample))
        return lambda: self.launched.append(request.request_id) if not self._lock.locked() else None

    def abort(self, request_ids):
        return []

    def progress(self, request_ids):
        return []

    def update_weights(self, version, tensors, *, keep_kv=False):
        pass

    def pause(self, mode="keep"):
        return []

    def resume(self):
        pass

    def load(self):
        return EngineLoad(len(self.accepted), 0, 0.0, 0.0, 0)

    def close(self):
        with self._lock:
            self._closing = True


def test_admission_accepts_refuses_and_completes_at_once():
    e = QueueEngine()
    prefix = Sample([7, 8], [-0.5, 0.0], [3, 3], env_spans=[[1, 2]])  # token 8: an environment's
    params = SamplingParams(max_tokens=4, stop_token_ids=(9,))
    e.submit(Request("a", [1, 2], params, prefix=prefix))
    (request, sample), = e.accepted
    assert sample == Sample([7, 8], [-0.5, 0.0], [3, 3], env_spans=[[1, 2]]) and sample.tokens is not prefix.tokens
    sample.tokens.append(5)
    sample.env_spans[0][1] = 3
    assert prefix.tokens == [7, 8] and prefix.env_spans == [[1, 2]]  # the caller's prefix is left alone
    assert e.launched == ["a"]  # launched after the lock was released
    with pytest.raises(ValueError, match="'a' is already in flight"):
        e.submit(Request("a", [1, 2], params))
    e.submit(Request("long", [1, 2], params, prefix=Sample([7, 8, 6, 5], [0.0] * 4, [0] * 4)))
    e.submit(Request("stopped", [1, 2], params, prefix=Sample([7, 9], [0.0] * 2, [0] * 2)))
    e.submit(Request("bad", [1, 200], params))
    done = {c.request_id: c for c in e.poll(timeout=0)}
    assert {k: c.sample.finish_reason for k, c in done.items()} == {"long": "length", "stopped": "stop",
                                                                     "bad": "error"}
    assert "[0, 100)" in done["bad"].error and done["long"].error is None
    assert done["long"].sample.tokens == [7, 8, 6, 5] and len(e.accepted) == 1
    assert e.poll(timeout=0) == []
    e.close()
    with pytest.raises(EngineError, match="closed"):
        e.poll(timeout=0)
    with pytest.raises(EngineError, match="closed"):
        e.submit(Request("late", [1], params))
