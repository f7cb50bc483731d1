"""The LLM judge (`rollout_bridge.judge.Judge`) over engines that answer as a test says: verdicts parsed into
scores, one group's requests on the engine together with another's, and every failure (a judge that times
out, a parse that raises or gives NaN, a prompt function that raises, an engine error or failure) scored
`failed_value`, counted, and never stalling the next call."""

import math
import re
import threading
import time

import pytest
from waiting import wait_until

from jaxflow.rewards import group_reward_fn
from jaxflow.rewards.judging import judge_prompt, prompt_messages, score_verdict
from rollout_bridge.engine import Completion, Engine, EngineError, EngineLoad
from rollout_bridge.judge import Judge
from rollout_bridge.scripted import CharTokenizer

TOKENIZER = CharTokenizer()
META = {"question": "What is 2 + 3?", "answer": 5}
HANG = "hang"  # a response whose verdict the engine never finishes


def _response(request) -> str:
    """The response the default judge prompt quotes, read back from the rendered request."""
    text = TOKENIZER.decode(request.prompt)
    return re.search(r"Response:\n(.*?)\n\nDoes the response", text, re.DOTALL).group(1)


def length_verdict(request) -> str:
    """A judge's rule the tests can predict: the score is the response's length."""
    return f"I think <score>{len(_response(request))}</score>"


class HeldEngine(Engine):
    """An engine that keeps each request until `batch` are held at once, then completes them all with
    `verdict(request)`'s text; a request whose response contains HANG is never completed (only aborted).
    Records the largest number of requests held at once and the ids of each batch it completed."""

    paused = False
    version = 0

    def __init__(self, verdict=length_verdict, batch=1):
        self.verdict, self.batch = verdict, batch
        self.held, self.batches, self.aborted, self.most_held = {}, [], [], 0
        self._init_admission()

    def _invalid(self, request):
        return "prompt too long" if len(request.prompt) > 2000 else None

    def _in_flight(self, request_id):
        return request_id in self.held

    def _accept(self, request, sample):
        self.held[request.request_id] = (request, sample)
        self.most_held = max(self.most_held, len(self.held))
        ready = [k for k, (r, _) in self.held.items() if HANG not in _response(r)]
        if len(ready) >= self.batch:
            self.batches.append(ready)
            for k in ready:
                r, s = self.held.pop(k)
                s.tokens += TOKENIZER.encode(self.verdict(r))
                s.finish_reason = "stop"
                self._hand_out(Completion(k, s))

    def abort(self, request_ids):
        with self._lock:
            out = []
            for k in request_ids:
                if k in self.held:
                    _, s = self.held.pop(k)
                    s.finish_reason = "abort"
                    self.aborted.append(k)
                    out.append(Completion(k, s))
            return out

    def fail(self, error):
        with self._lock:
            self._error = error
            self._finished.notify_all()

    def progress(self, request_ids):
        return []

    def update_weights(self, version, tensors, *, keep_kv=False):
        pass

    def pause(self, mode="keep"):
        return []

    def resume(self):
        pass

    def load(self):
        return EngineLoad(len(self.held), 0, 0.0, 0.0, 0)

    def close(self):
        with self._lock:
            self._closing = True
            self._finished.notify_all()


def _judge(engine, **kw):
    errors = []
    kw = {"timeout_s": 5.0, "failed_value": -1.0, "on_failure": errors.append, **kw}
    return Judge(engine, TOKENIZER, **kw), errors


def test_verdicts_are_parsed_into_scores_through_the_pool_interface():
    engine = HeldEngine()
    judge, errors = _judge(engine)
    with judge:
        responses = ["5", "<answer>5</answer>", "It is six."]
        assert judge.score_group(judge.name, responses, META) == [float(len(r)) for r in responses]
        assert judge.submit(judge.name, "abc", META).result(timeout=5) == 3.0

        class Sample:
            def __init__(self, text):
                self.tokens = TOKENIZER.encode(text)

        class Task:
            meta = META

        reward_fn = group_reward_fn(judge, judge.name, TOKENIZER.decode)
        assert reward_fn(Task, [Sample("ab"), Sample("abcd")]) == [2.0, 4.0]
        stats = judge.stats()
        assert stats["submitted"] == stats["scored"] == stats["requests"] == 6
        assert stats["pending"] == 0 and stats["in_flight"] == 0 and not errors
        # Greedy, at most max_tokens, ending at the tokenizer's eos (none for the char tokenizer).
        assert judge.params.temperature == 0.0 and judge.params.max_tokens == 256
        with pytest.raises(ValueError, match="asked to score for 'jaxflow.tasks:reward'"):
            judge.score_group("jaxflow.tasks:reward", responses, META)
    assert engine._closing  # the judge closed the engine it was given


def test_the_default_prompt_and_parser():
    [message] = judge_prompt("It is 5.", META)
    assert message["role"] == "user"
    for part in ("What is 2 + 3?", "Reference answer:\n5", "Response:\nIt is 5.", "<score>1</score>"):
        assert part in message["content"]
    no_reference = judge_prompt("x", {"messages": [{"role": "system", "content": "S"},
                                                   {"role": "user", "content": "Q?"}]})[0]["content"]
    assert "Q?" in no_reference and "Reference" not in no_reference and "S" not in no_reference.split("\n")[1]
    assert score_verdict("first <score>0</score>, on reflection <score> 0.75 </score>", META) == 0.75
    assert score_verdict("<score>-2e-1</score>", META) == -0.2
    for bad in ("YES", "<score>high</score>", "<score>nan</score>"):
        with pytest.raises(ValueError, match="no <score>number</score> in the verdict"):
            score_verdict(bad, META)
    with pytest.raises(ValueError, match="neither 'messages' nor a 'question'"):
        prompt_messages({"answer": 1})


def test_one_groups_requests_are_on_the_engine_with_anothers():
    """The engine completes nothing until it holds 6 requests: two groups of 3 are scored only because the
    judge puts both groups' requests on it at once, whether one caller hands both groups or two callers one
    each (as a Ray host's threads would)."""
    groups = [(["a", "bb", "ccc"], META), (["dddd", "eeeee", "ffffff"], {"question": "Q2"})]
    engine = HeldEngine(batch=6)
    with _judge(engine, close_engine=False)[0] as judge:
        assert judge.score_groups(judge.name, groups) == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
        assert engine.most_held == 6 and len(engine.batches) == 1
        results = [None, None]

        def caller(i):
            results[i] = judge.score_group(judge.name, *groups[i])

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert results == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]] and len(engine.batches) == 2
        assert judge.stats()["timed_out"] == 0


def test_a_judge_that_times_out_scores_failed_value_counts_and_the_run_goes_on():
    engine = HeldEngine()
    judge, errors = _judge(engine, timeout_s=0.3, max_in_flight=1)
    with judge:
        started = time.monotonic()
        scores = judge.score_group(judge.name, ["ab", HANG, "abcd"], META)
        # The hung verdict fails at its deadline; the one queued behind it (one slot) then runs.
        assert scores == [2.0, -1.0, 4.0]
        assert time.monotonic() - started < 5.0
        stats = judge.stats()
        assert stats["timed_out"] == 1 and stats["scored"] == 2 and stats["aborted"] == 1
        assert stats["pending"] == 0 and stats["in_flight"] == 0
        assert len(engine.aborted) == 1 and not engine.held  # aborted on the engine: its slot is free
        assert len(errors) == 1 and "longer than timeout_s=0.3s" in errors[0] and judge.name in errors[0]
        # A whole group that times out, then the next call answers as before; one message for all of them.
        assert judge.score_group(judge.name, [HANG, HANG + "!"], META) == [-1.0, -1.0]
        assert judge.score_group(judge.name, ["abc"], META) == [3.0]
        stats = judge.stats()
        assert stats["timed_out"] == 3 and stats["scored"] == 3 and len(errors) == 1


@pytest.mark.parametrize("parse, says", [
    (lambda verdict, meta: math.nan, "returned nan, not a finite number"),
    (lambda verdict, meta: "1", "returned 1, not a finite number"),
    (lambda verdict, meta: True, "returned True, not a finite number"),
    (score_verdict, "raised ValueError: no <score>number</score> in the verdict"),
])
def test_a_verdict_the_parse_function_cannot_read_is_invalid(parse, says):
    engine = HeldEngine(verdict=lambda r: "<score>x</score>" if "bad" in _response(r) else "<score>7</score>")
    judge, errors = _judge(engine, parse_ref=parse)
    with judge:
        scores = judge.score_group(judge.name, ["good", "bad", "bad too"], META)
        stats = judge.stats()
    if parse is score_verdict:  # only the verdicts without a number fail
        assert scores == [7.0, -1.0, -1.0] and stats["invalid"] == 2 and stats["scored"] == 1
    else:
        assert scores == [-1.0] * 3 and stats["invalid"] == 3 and stats["scored"] == 0
    assert stats["pending"] == 0 and len(errors) == 1 and says in errors[0]


def test_a_parse_that_hangs_times_out_without_holding_the_others():
    release = threading.Event()

    def parse(verdict, meta):
        if meta.get("slow"):
            release.wait(30)
        return len(verdict)

    engine = HeldEngine(verdict=lambda r: "xyz")
    judge, errors = _judge(engine, parse_ref=parse, timeout_s=0.3)
    try:
        slow = judge.submit(judge.name, "a", {**META, "slow": True})
        assert judge.score_group(judge.name, ["b", "c"], META) == [3.0, 3.0]  # the other parse thread
        assert slow.result(timeout=5) == -1.0
        assert judge.stats()["timed_out"] == 1 and "did not return within timeout_s" in errors[0]
    finally:
        release.set()
        judge.close()
    assert judge.stats()["scored"] == 2  # the late parse's result was dropped, not counted twice


def test_prompt_functions_that_raise_and_engine_errors_are_raised():
    def prompt(response, meta):
        if response == "boom":
            raise KeyError("question")
        if response == "odd":
            return "not a list"
        if response == "long":
            return [{"role": "user", "content": "x" * 3000}]
        return judge_prompt(response, meta)

    engine = HeldEngine()
    judge, errors = _judge(engine, prompt_ref=prompt)
    with judge:
        assert judge.score_group(judge.name, ["ab", "boom", "odd", "long", "abc"], META) == [2.0, -1.0, -1.0, -1.0,
                                                                                             3.0]
        stats = judge.stats()
        assert stats["raised"] == 3 and stats["scored"] == 2 and stats["pending"] == 0
        assert any("raised KeyError: 'question'" in e for e in errors)
        assert any("returned not a list, not a non-empty list" in e for e in errors)
        assert any("the engine refused the judge's request: prompt too long" in e for e in errors)
        # An engine that fails for good: what it held and everything after score failed_value, at once.
        engine.fail(RuntimeError("device lost"))
        assert judge.score_group(judge.name, ["a", "b"], META) == [-1.0, -1.0]
        assert judge.stats()["raised"] == 5
        assert any("did not take the request: EngineError" in e and "device lost" in e for e in errors)


def test_an_engine_that_fails_with_requests_on_it_fails_them():
    engine = HeldEngine(batch=3)
    judge, errors = _judge(engine)
    with judge:
        futures = [judge.submit(judge.name, r, META) for r in ("a", "b")]
        wait_until(lambda: len(engine.held) == 2, 5, "both requests on the engine")
        engine.fail(RuntimeError("device lost"))
        assert [f.result(timeout=5) for f in futures] == [-1.0, -1.0]
        assert judge.stats()["raised"] == 2 and "the engine failed: EngineError" in errors[0]
    with pytest.raises(RuntimeError, match="Judge is closed"):
        judge.submit(judge.name, "a", META)


def test_close_answers_what_is_left_and_bad_arguments_are_refused():
    engine = HeldEngine()
    judge, _ = _judge(engine)
    held = judge.submit(judge.name, HANG, META)
    wait_until(lambda: engine.held, 5, "the request on the engine")
    judge.close()
    with pytest.raises(RuntimeError, match="closed before the sample was scored"):
        held.result(timeout=5)
    assert engine.aborted and engine._closing
    for kw, says in [({"timeout_s": 0}, "timeout_s"), ({"max_in_flight": 0}, "max_in_flight"),
                     ({"failed_value": math.inf}, "failed_value"), ({"temperature": -1.0}, "temperature"),
                     ({"parse_ref": "nowhere_module:parse"}, "nowhere_module")]:
        with pytest.raises(ValueError, match=says):
            Judge(HeldEngine(), TOKENIZER, **kw)
    with pytest.raises(EngineError):
        engine.poll(timeout=0)



@pytest.mark.slow  # a JAX engine compiled and run
def test_a_judge_on_the_jax_engine_aborts_what_times_out_and_answers_after(tmp_path):
    from engine_helpers import check_judge, lively_tiny_model

    from jaxflow.tokenizer import Tokenizer
    from rollout_bridge.jax_engine import JaxEngine

    directory = lively_tiny_model(tmp_path / "judge")
    engine = JaxEngine(directory, max_slots=4, max_len=128, decode_chunk=8, prefill_buckets=(32, 64),
                       reuse_turns=False)
    try:
        check_judge(engine, Tokenizer.from_dir(directory))
    finally:
        engine.close()
