"""The environment side of multi-turn episodes: the protocol's checks, calls under a time limit, the
calculator tool, and a SkyRL-gym environment through the adapter."""

import asyncio
import math
import re
import warnings

import pytest

from jaxflow.envs import base
from jaxflow.envs.adapters import SkyRLEnv, skyrl_env
from jaxflow.envs.base import EnvironmentFailed, Step
from jaxflow.envs.calculator import CalculatorEnv, evaluate


def run(coro):
    return asyncio.run(coro)


# --- the checks ---------------------------------------------------------------------------------------------

def test_a_step_is_normalised_from_a_dict_or_a_step():
    got = base.check_step({"observation": "<result>5</result>", "reward": 1, "done": True}, "w")
    assert got == Step([{"role": "tool", "content": "<result>5</result>"}], 1.0, True, {})
    assert base.check_step(Step(), "w") == Step([], None, False, {})
    messages = [{"role": "user", "content": "go on", "name": "x"}]
    assert base.check_step({"observation": messages}, "w").observation == [{"role": "user", "content": "go on"}]


@pytest.mark.parametrize("answer, match", [
    ({"observation": 5}, "observation must be None, a string or a list"),
    ({"observation": [{"role": "user"}]}, "message 0 must be a dict with string 'role' and 'content'"),
    ({"observation": [{"role": "", "content": "x"}]}, "message 0 has an empty role"),
    ({"observation": [{"role": "u", "content": "x"}] * (base.MAX_MESSAGES + 1)}, "messages in one observation"),
    ({"reward": "1.0"}, "reward must be None or a finite number"),
    ({"reward": True}, "reward must be None or a finite number"),
    ({"reward": math.nan}, "reward must be None or a finite number"),
    ({"done": 1}, "done must be a bool"),
    ({"info": [1]}, "info must be a dict"),
    ({"obs": "x"}, r"unknown step field\(s\) \['obs'\]"),
    ("just text", "step must return a Step or a dict, got str"),
])
def test_malformed_answers_are_named(answer, match):
    with pytest.raises(ValueError, match=match):
        base.check_step(answer, "env")


class Scripted:
    """An environment whose step does what it is told."""

    def __init__(self, behaviour):
        self.behaviour = behaviour

    async def reset(self, meta):
        return None

    async def step(self, action):
        if self.behaviour == "sleep":
            await asyncio.sleep(30)
        if self.behaviour == "raise":
            raise KeyError("the tool broke")
        if self.behaviour == "malformed":
            return {"observation": [{"role": "tool", "content": 7}], "reward": 0.0}
        return {"reward": 0.5, "done": True}

    async def close(self):
        return None


@pytest.mark.parametrize("behaviour, kind, match", [
    ("sleep", "timeout", "step took more than 0.05 s"),
    ("raise", "error", "step raised KeyError: 'the tool broke'"),
    ("malformed", "malformed", "message 0 must be a dict with string 'role' and 'content'"),
])
def test_a_failing_call_names_the_environment_and_the_episode(behaviour, kind, match):
    with pytest.raises(EnvironmentFailed, match=f"environment 'scripted', episode 17: .*{match}") as info:
        run(base.call(Scripted(behaviour), "step", "hi", timeout_s=0.05, env_name="scripted", episode=17))
    assert info.value.kind == kind and kind in base.FAILURE_KINDS and info.value.episode == 17


def test_a_good_call_returns_the_checked_step():
    got = run(base.call(Scripted("ok"), "step", "hi", timeout_s=5, env_name="s", episode=0))
    assert got == Step([], 0.5, True, {})


# --- the calculator -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("7*8", "56"), (" 7 + 5 * 3 - 2 ", "20"), ("(7+5)*3", "36"), ("-4*-2", "8"), ("7/2", "7/2"), ("84/7", "12"),
])
def test_evaluate_is_exact_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, error, match", [
    ("__import__('os')", ValueError, "only integers"),
    ("2**10", ValueError, "only integers"),
    ("1.5*2", ValueError, "only integers"),
    ("7 +", ValueError, "not an arithmetic expression"),
    ("9" * 31, ValueError, "more than 30 digits"),
    ("1+" * 150 + "1", ValueError, "longer than 200"),
    ("5/(3-3)", ZeroDivisionError, None),
])
def test_evaluate_refuses_what_is_not_small_arithmetic(expression, error, match):
    with pytest.raises(error, match=match):
        evaluate(expression)


@pytest.mark.parametrize("expression, match", [("3 - 1or 2", "only integers"), ("1 + 2if", "only integers"),
                                               ("1(2)", "only integers"), ("1 +", "not an arithmetic")])
def test_evaluate_refuses_without_python_warnings(expression, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Python's parser warns of "1or" (invalid decimal literal)
        with pytest.raises(ValueError, match=match):
            evaluate(expression)


def test_a_calculator_episode():
    async def episode():
        env = CalculatorEnv(max_calls=2)
        await env.reset({"answer": 56})
        first = await env.step("Compute 7*8 with <tool>7*8</tool>")
        bad = await env.step("<tool>1/0</tool>")
        over = await env.step("<tool>2+2</tool>")  # past max_calls: the turn is the final answer
        return first, bad, over

    first, bad, over = run(episode())
    assert first == Step([{"role": "tool", "content": "<result>56</result>"}], None, False, {"tool_calls": 1})
    assert bad.observation[0]["content"] == "<result>error: division by zero</result>" and not bad.done
    assert over.done and over.reward == 0.0 and over.info == {"tool_calls": 2}

    async def answered():
        env = CalculatorEnv()
        await env.reset({"answer": 56})
        return await env.step("so <answer>56</answer>")

    assert run(answered()) == Step([], 1.0, True, {"tool_calls": 0})


def test_tool_latency_overlaps_across_episodes(monkeypatch):
    """Tool waits are asyncio sleeps (no thread, no CPU): 8 episodes' tool calls all wait at once."""
    waiting, most = [0], [0]
    real_sleep = asyncio.sleep

    async def counting_sleep(seconds):
        assert seconds == 0.3
        waiting[0] += 1
        most[0] = max(most[0], waiting[0])
        await real_sleep(0.01)
        waiting[0] -= 1

    monkeypatch.setattr("jaxflow.envs.calculator.asyncio.sleep", counting_sleep)

    async def many():
        envs = [CalculatorEnv(latency_s=0.3) for _ in range(8)]
        for env in envs:
            await env.reset({"answer": 1})
        return await asyncio.gather(*(env.step("<tool>1+1</tool>") for env in envs))

    steps = run(many())
    assert all(s.observation[0]["content"] == "<result>2</result>" for s in steps)
    assert most[0] == 8


@pytest.mark.parametrize("kwargs, match", [
    ({"latency_s": -1}, "latency_s"), ({"latency_s": True}, "latency_s"), ({"max_calls": 1.5}, "max_calls"),
    ({"reward_ref": "nomodule"}, "not of the form"),
])
def test_calculator_options_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CalculatorEnv(**kwargs)


# --- SkyRL-gym through the adapter --------------------------------------------------------------------------

def test_skyrl_gym_multi_turn_gsm8k_runs_unmodified():
    """SkyRL-gym's own registered gsm8k_multi_turn environment (its code, its rewards) through the adapter."""
    async def episode(answers):
        env = skyrl_env("gsm8k_multi_turn", extras={"reward_spec": {"ground_truth": "42"}, "max_turns": 3})
        await base.call(env, "reset", {"prompt": [{"role": "user", "content": "6*7?"}]}, timeout_s=10,
                        env_name="gsm8k_multi_turn", episode=0)
        steps = []
        for text in answers:
            steps.append(await base.call(env, "step", text, timeout_s=10, env_name="gsm8k_multi_turn", episode=0))
            if steps[-1].done:
                break
        await env.close()
        return steps

    wrong_then_right = run(episode(["I think #### 41", "#### 42"]))
    assert [s.done for s in wrong_then_right] == [False, True]
    assert wrong_then_right[0].observation and wrong_then_right[0].observation[0]["role"] == "user"
    assert wrong_then_right[-1].reward == 1.0
    assert 0 < wrong_then_right[0].reward < 1.0  # SkyRL's per-turn format score for a wrong answer
    never = run(episode(["no idea", "still none", "nothing"]))
    assert len(never) == 3 and never[-1].done and all(s.reward == 0.0 for s in never)


def test_a_skyrl_env_answer_that_is_malformed_is_named():
    class Broken:
        def init(self, prompt):
            return prompt, {}

        def step(self, action):
            return {"observations": "not a list of messages but fine", "reward": "high", "done": False}

        def close(self):
            pass

    with pytest.raises(EnvironmentFailed, match="environment 'broken', episode 3: .*reward must be None or a "
                                                "finite number, got 'high'"):
        run(base.call(SkyRLEnv(Broken()), "step", "x", timeout_s=5, env_name="broken", episode=3))
    with pytest.raises(TypeError, match="not a SkyRL-gym text environment: no init, step"):
        SkyRLEnv(object())


# --- environments in their own process ----------------------------------------------------------------------

def test_an_environment_process_that_dies_fails_its_episodes_and_is_replaced(monkeypatch):
    import pathlib

    from jaxflow.envs.isolated import isolated

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    # Episodes 0 and 2 are still waiting on their tool when episode 1's kills the process: their wait is
    # far longer than any scheduling delay between the three calls (0.5 s was not, on a loaded machine, and
    # 30 s failed once in a full suite on 2 cores), and never served, since the process dies first. Episode
    # 3, on the new process, has no wait.
    make_env = isolated("crashing_env:CrashOn", {"crash_q": 1, "latency_s": 300.0, "slow_qs": [0, 2]})

    async def episode(q):
        env = make_env({"q": q})
        await base.call(env, "reset", {"q": q}, timeout_s=600, env_name="crash", episode=q)
        return await base.call(env, "step", "x", timeout_s=600, env_name="crash", episode=q)

    async def together():
        return await asyncio.gather(*(episode(q) for q in (0, 1, 2)), return_exceptions=True)

    first = run(together())
    # Episode 1's tool killed the process: its call and those waiting beside it fail, named, as errors.
    assert all(isinstance(r, EnvironmentFailed) and r.kind == "error" and "environment process exited"
               in str(r) for r in first), [(type(r).__name__, getattr(r, "kind", None), str(r)) for r in first]
    later = run(episode(3))  # a new process serves the next episodes
    assert later.reward == 1.0 and make_env.restarts == 1
    assert later.info["pid"] != __import__("os").getpid()


def test_a_call_whose_pipe_broke_before_the_process_was_seen_dead_is_named(monkeypatch):
    # The child died and its pipe is closed, but the reader thread has not marked the process dead yet: a
    # call sent then fails on the pipe, and must say the process exited, as the calls already waiting do.
    import pathlib

    from jaxflow.envs.isolated import EnvironmentProcessDied, isolated

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    make_env = isolated("crashing_env:CrashOn", {"crash_q": 99})
    env = make_env({"q": 0})
    run(base.call(env, "reset", {"q": 0}, timeout_s=60, env_name="crash", episode=0))

    class BrokenPipe:
        def send(self, message):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(env.process, "conn", BrokenPipe())
    with pytest.raises(EnvironmentFailed, match="environment process exited") as failed:
        run(base.call(env, "step", "x", timeout_s=60, env_name="crash", episode=0))
    assert failed.value.kind == "error" and isinstance(failed.value.__cause__, EnvironmentProcessDied)
    assert not env.process.pending  # nothing left waiting on an answer that cannot come


def test_an_isolated_environment_answers_like_an_in_process_one():
    from jaxflow.envs.isolated import isolated

    make_env = isolated("jaxflow.envs.calculator:CalculatorEnv", {"max_calls": 1})

    async def episode():
        env = make_env({})
        await env.reset({"answer": 56})
        steps = [await env.step("<tool>7*8</tool>"), await env.step("<answer>56</answer>")]
        await env.close()
        return steps

    tool, final = run(episode())
    assert tool == Step([{"role": "tool", "content": "<result>56</result>"}], None, False, {"tool_calls": 1})
    assert final.reward == 1.0 and final.done


def test_an_environment_process_that_hangs_is_killed_and_replaced(monkeypatch):
    """A tool that blocks the process's event loop for good: its episode times out, the process does not
    answer the ping that follows and is killed, and the next episode resets on a new process. A call that
    is only slow times out too, but its process answers the ping and is kept."""
    import pathlib

    from jaxflow.envs import isolated as isolated_module

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    monkeypatch.setattr(isolated_module, "PING_TIMEOUT_S", 1.0, raising=False)
    make_env = isolated_module.isolated("crashing_env:HangOn", {"hang_q": 1, "latency_s": 300.0, "slow_qs": [0]})

    async def episode(q, step_timeout_s=600):
        env = make_env({"q": q})
        try:
            await base.call(env, "reset", {"q": q}, timeout_s=120, env_name="hang", episode=q)
            return await base.call(env, "step", "x", timeout_s=step_timeout_s, env_name="hang", episode=q)
        except EnvironmentFailed as e:
            return e
        finally:
            try:
                await base.call(env, "close", timeout_s=30, env_name="hang", episode=q)
            except EnvironmentFailed:
                pass

    slow = run(episode(0, step_timeout_s=0.5))
    assert isinstance(slow, EnvironmentFailed) and slow.kind == "timeout", slow
    pid = run(episode(2)).info["pid"]  # after the ping's verdict: the slow call's process was kept
    assert make_env.restarts == 0
    hung = run(episode(1, step_timeout_s=0.5))
    assert isinstance(hung, EnvironmentFailed) and hung.kind == "timeout", hung
    later = run(episode(3))  # waits for the verdict on the hung process, then starts a new one
    assert not isinstance(later, EnvironmentFailed), later
    assert later.reward == 1.0 and later.info["pid"] != pid
    assert make_env.restarts == 1 and make_env.hung == 1


# --- tool-call parsing ----------------------------------------------------------------------------------------

class ScanLog(str):
    """A turn that records each `find` on it: (where the search started, where it stopped looking)."""

    def find(self, sub, start=0, end=None):
        found = str.find(self, sub, start, *(() if end is None else (end,)))
        self.scans.append((start, len(self) if found < 0 else found + len(sub)))
        return found


def scanned(text):
    turn = ScanLog(text)
    turn.scans = []
    return turn


@pytest.mark.parametrize("turn, regex_is_linear", [
    ("<tool>" * 200_000, False),  # degenerate: no call ever closes (1.2 MB)
    ("<tool>1+1" * 100_000 + "</tool>", True),  # one call spanning the turn
    ("<tool>1</tool> x </tool><tool>" * 40_000 + "<tool>2", True),  # many calls, stray closings, one left open
])
def test_tool_calls_are_found_in_one_pass(turn, regex_is_linear):
    """Each search starts at or after where the previous one stopped looking, so the whole scan reads each
    character a bounded number of times (a regex with `.*?` rescans the rest from every `<tool>`)."""
    from jaxflow.envs.calculator import tool_calls

    text = scanned(turn)
    calls = tool_calls(text)
    assert calls == (re.findall(r"<tool>(.*?)</tool>", turn, re.DOTALL) if regex_is_linear else [])
    for (start, stop), (next_start, _) in zip(text.scans, text.scans[1:]):
        assert start <= stop <= next_start, text.scans[:8]
    assert len(text.scans) <= 2 * len(calls) + 2


@pytest.mark.parametrize("turn", ["<tool>3*4</tool>", "a <tool>1</tool> b <tool>2+2</tool> c", "<tool>7",
                                  "<tool><tool>5</tool>", "</tool><tool>6</tool>", "x", "<tool></tool>"])
def test_tool_calls_are_the_regex_calls(turn):
    from jaxflow.envs.calculator import tool_calls

    assert tool_calls(turn) == re.findall(r"<tool>(.*?)</tool>", turn, re.DOTALL)


def test_the_calculator_parses_its_turns_with_the_one_pass_scanner():
    """Its step reads the turn through `find` only (no backtracking regex over the turn), and a degenerate
    turn of unterminated markers is the final answer."""
    async def steps():
        env = CalculatorEnv()
        await env.reset({"answer": 12})
        tool = scanned("so <tool>3*4</tool>")
        answered = await env.step(tool)
        assert answered.observation == [{"role": "tool", "content": "<result>12</result>"}] and tool.scans
        degenerate = scanned("<tool>" * 200_000)
        final = await env.step(degenerate)
        assert final.done and final.reward == 0.0 and len(degenerate.scans) == 2

    run(steps())


def test_expressions_are_parsed_one_at_a_time_across_threads(monkeypatch):
    # CPython 3.11's AST constructor shares its recursion depth between threads (gh-106905): two parses at
    # once can fail a well-formed call with a SystemError, so the calculator parses under one lock. A slow
    # stand-in for ast.parse counts how many threads are inside it at once.
    import ast
    import threading
    import time

    from jaxflow.envs import calculator

    inside, most, guard, parse = [0], [0], threading.Lock(), ast.parse

    def slow_parse(*args, **kwargs):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.005)
        try:
            return parse(*args, **kwargs)
        finally:
            with guard:
                inside[0] -= 1

    monkeypatch.setattr(calculator.ast, "parse", slow_parse)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(evaluate(f"{i} * 2 + 1"))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=int) == [str(2 * i + 1) for i in range(8)]
    assert most[0] == 1


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie nobody has reaped yet has exited)."""
    import pathlib

    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


PARENT_KILLED_OUTRIGHT = """
import asyncio, os, sys, time
sys.path.insert(0, sys.argv[1])
from jaxflow.envs.isolated import isolated

async def main():
    make_env = isolated("crashing_env:CrashOn", {"latency_s": 300.0})
    env = make_env({"q": 0})
    await env.reset({"q": 0})
    step = asyncio.ensure_future(env.step("x"))  # the tool is still waiting when the parent dies
    await asyncio.sleep(0.2)
    if os.fork() == 0:  # a process forked after the child, holding the parent's end of its pipe, as a worker would
        time.sleep(120)
        os._exit(0)
    print(make_env.process().process.pid, flush=True)
    await step

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_environment_process_ends_with_a_parent_killed_outright(tmp_path):
    # SIGKILL leaves no cleanup, and the forked sibling keeps the pipe open, so no end of file reaches the child:
    # it must see its parent gone by itself.
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(PARENT_KILLED_OUTRIGHT)
    parent = subprocess.Popen([sys.executable, str(script), str(pathlib.Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive while its parent is
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # the child checks every second; the slack is for a loaded machine
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.2)
        if _running(child):
            os.kill(child, signal.SIGKILL)
            raise AssertionError(f"the environment process {child} outlived its parent by 30 s")
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the forked sibling (and anything left) in the parent's session
