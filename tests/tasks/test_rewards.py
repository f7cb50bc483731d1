"""The reward pool: scores in worker processes, and survives reward functions that raise, hang, crash or return
nonsense, counting each, replacing workers, and leaving no process behind."""

import ctypes
import logging
import math
import multiprocessing
import multiprocessing.resource_tracker
import os
import pathlib
import subprocess
import time

import pytest
from waiting import wait_until

from jaxflow import machine
from jaxflow.data.records import GroupTask, Sample
from jaxflow.rewards import RewardPool, group_reward_fn, resolve, score_inline
from jaxflow.rewards import reaper as rewards  # MARKER_ENV, _kill_marked
from jaxflow.rewards.pool import MIN_DEFAULT_MEMORY_MB, default_memory_limit_mb

pytestmark = pytest.mark.slow  # reward worker processes, started and killed test by test

psutil = pytest.importorskip("psutil")

HERE = __name__  # the workers import this module by the name pytest gave it


# ---- reward functions the workers call, by reference ----

def length_reward(response, meta):
    return float(len(response)) * meta.get("scale", 1.0)


def raising_reward(response, meta):
    raise KeyError(f"no field {response}")


def hanging_reward(response, meta):
    time.sleep(3600)


def announced_hanging_reward(response, meta):
    """Hangs once it has written the file `response`: a test sees the call running."""
    pathlib.Path(response).write_text("running")
    time.sleep(3600)


def hanging_reward_with_a_child(response, meta):
    child = subprocess.Popen(["sleep", "3600"])
    pathlib.Path(response).write_text(str(child.pid))
    time.sleep(3600)


def _start_escaped_sleep(pid_file):
    """`sleep 3600` in a session of its own whose parent shell exits at once: no process group, session or
    parent links it to the worker any more."""
    subprocess.run(["setsid", "sh", "-c", f"sleep 3600 >/dev/null 2>&1 & echo $! > {pid_file}"], check=True)


def hanging_reward_with_a_setsid_grandchild(response, meta):
    subprocess.Popen(["sleep", "3600"], start_new_session=True)  # a new session: its own group too
    _start_escaped_sleep(response)
    time.sleep(3600)


def reward_leaving_a_setsid_daemon(response, meta):
    _start_escaped_sleep(response)
    return 1.0


def crashing_reward_leaving_a_setsid_daemon(response, meta):
    _start_escaped_sleep(response)
    os._exit(9)


def crashing_reward(response, meta):
    os._exit(7)


def segfaulting_reward(response, meta):
    ctypes.string_at(0)


def exiting_reward(response, meta):
    raise SystemExit(3)


def invalid_reward(response, meta):
    return {"nan": math.nan, "inf": -math.inf, "str": "1.0", "none": None, "huge": 10 ** 400}[response]


def allocating_reward(response, meta):
    return float(len(bytearray(4 << 30)))


def address_space_limit_mb(response, meta):
    """The worker's RLIMIT_AS in MiB, -1 for none."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return -1.0 if soft == resource.RLIM_INFINITY else float(soft >> 20)


def picky_reward(response, meta):
    if response == "hang":
        time.sleep(3600)
    if response == "crash":
        os._exit(5)
    if response == "raise":
        raise ValueError("no")
    return float(len(response))


def ref(fn):
    return f"{HERE}:{fn.__name__}"


def gone(pid):
    """True once `pid` no longer exists (our workers are reaped, so no zombies either)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def live_children():
    # Spawning starts multiprocessing's resource tracker once per parent process; it is not a worker.
    multiprocessing.resource_tracker.ensure_running()
    return {c.pid for c in psutil.Process().children(recursive=True) if not gone(c.pid)}


TIMEOUT_S = 0.5  # the pool fixture's timeout_s


@pytest.fixture
def pool():
    """Two workers with this module preloaded, and a check that no process outlives the pool: neither its
    workers, nor the replacements it started on the way."""
    before = live_children()
    seen = set()
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, preload=[ref(length_reward)]) as p:
        p.seen_pids = seen
        seen.update(p.worker_pids())
        yield p
        seen.update(p.worker_pids())
    assert all(gone(pid) for pid in seen)
    assert live_children() <= before
    assert not {c.pid for c in multiprocessing.active_children()} & seen


def replaced_workers_are_gone(pool):
    """Every worker seen before that is no longer one of the pool's has exited and been reaped."""
    current = set(pool.worker_pids())
    replaced = pool.seen_pids - current
    pool.seen_pids.update(current)
    return bool(replaced) and all(gone(pid) for pid in replaced)


def still_works(pool):
    assert pool.score_group(ref(length_reward), ["ab", "abc", ""], {"scale": 2.0}) == [4.0, 6.0, 0.0]


# ---- tests ----

def test_scores_in_workers(pool):
    future = pool.submit(ref(length_reward), "abcd", {})
    assert future.result(timeout=10) == 4.0
    still_works(pool)
    meta = {"task": "arithmetic", "answer": 12}
    assert pool.score_group("jaxflow.tasks:reward", ["<answer>12</answer>", "<answer>13</answer>"], meta) == [1.0, 0.0]
    stats = pool.stats()
    assert stats["submitted"] == stats["scored"] == 6 and stats["pending"] == 0
    assert stats["raised"] == stats["timed_out"] == stats["crashed"] == stats["invalid"] == 0


def test_raising_function_scores_failed_value_and_logs_once(pool, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxflow.rewards"):
        assert pool.score_group(ref(raising_reward), ["x", "x", "x", "y"], {}) == [0.0] * 4
        assert pool.score_group(ref(exiting_reward), ["x"], {}) == [0.0]
    assert pool.stats()["raised"] == 5
    messages = [r.getMessage() for r in caplog.records]
    assert sum("KeyError: 'no field x'" in m for m in messages) == 1
    assert sum("KeyError: 'no field y'" in m for m in messages) == 1
    assert any("SystemExit: 3" in m for m in messages)
    # Raising does not cost a worker.
    assert pool.stats()["workers_started"] == 2
    still_works(pool)


def test_on_failure_gets_each_distinct_failure_once_instead_of_the_log(caplog):
    said = []

    def on_failure(message):
        said.append(message)
        raise RuntimeError("a reporting bug")  # logged; the pool goes on

    with caplog.at_level(logging.WARNING, logger="jaxflow.rewards"), \
            RewardPool(num_workers=1, timeout_s=0.5, on_failure=on_failure) as pool:
        assert pool.score_group(ref(raising_reward), ["x", "x", "y"], {}) == [0.0] * 3
        assert pool.score_group(ref(invalid_reward), ["nan"], {}) == [0.0]
        still_works(pool)
    assert said == [f"reward function {ref(raising_reward)} raised KeyError: 'no field x'",
                    f"reward function {ref(raising_reward)} raised KeyError: 'no field y'",
                    f"reward function {ref(invalid_reward)} returned nan, not a finite real number"]
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("on_failure callback failed" in r.getMessage() for r in caplog.records) == 3


def test_hanging_function_is_killed_and_replaced(pool):
    start = time.monotonic()
    results = pool.score_group(ref(hanging_reward), ["a", "b", "c"], {})
    elapsed = time.monotonic() - start
    assert results == [0.0] * 3
    assert pool.stats()["timed_out"] == 3
    # Two workers, three calls that each time out: two rounds of timeout_s at least. The upper bound only
    # says the timeouts fired (a call not timed out would hang for an hour), with room for the replacements.
    assert 2 * TIMEOUT_S <= elapsed < 60 * TIMEOUT_S
    # The last replacement starts just after its call is failed.
    wait_until(lambda: pool.stats()["workers_started"] >= 5, 10, "the third replacement worker")
    assert pool.stats()["workers_started"] == 5
    assert replaced_workers_are_gone(pool)
    still_works(pool)


def test_a_timeout_also_kills_what_the_reward_started(pool, tmp_path):
    pid_file = tmp_path / "child.pid"
    assert pool.score_group(ref(hanging_reward_with_a_child), [str(pid_file)], {}) == [0.0]
    child = int(pid_file.read_text())
    wait_until(lambda: gone(child), 5, lambda: _who(child))
    still_works(pool)


def _who(pid):
    """What a process that outlived its kill is, for the failure message."""
    try:
        p = psutil.Process(pid)
        return (f"pid {pid} alive: {p.status()}, ppid {p.ppid()}, {p.cmdline()}, "
                f"{rewards.MARKER_ENV}={p.environ().get(rewards.MARKER_ENV)!r}")
    except psutil.Error as e:
        return f"pid {pid}: {e!r}"


def _escaped_pid(pid_file):
    pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 5, f"{pid_file} written"))
    assert psutil.Process(pid).ppid() != os.getpid() and os.getsid(pid) != os.getsid(0)
    return pid


def test_a_timeout_kills_a_setsid_grandchild(pool, tmp_path):
    pid_file = tmp_path / "escaped.pid"
    assert pool.score_group(ref(hanging_reward_with_a_setsid_grandchild), [str(pid_file)], {}) == [0.0]
    daemon = _escaped_pid(pid_file)
    wait_until(lambda: gone(daemon), 5, lambda: _who(daemon))
    still_works(pool)


def test_a_crash_kills_a_setsid_grandchild(pool, tmp_path):
    pid_file = tmp_path / "escaped.pid"
    assert pool.score_group(ref(crashing_reward_leaving_a_setsid_daemon), [str(pid_file)], {}) == [0.0]
    daemon = _escaped_pid(pid_file)
    wait_until(lambda: gone(daemon), 5, lambda: _who(daemon))
    still_works(pool)


def test_closing_the_pool_kills_a_setsid_daemon_a_reward_left(tmp_path):
    pid_file = tmp_path / "escaped.pid"
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        assert pool.score_group(ref(reward_leaving_a_setsid_daemon), [str(pid_file)], {}) == [1.0]
        daemon = _escaped_pid(pid_file)
        assert not gone(daemon)  # a reward may leave a helper running while the pool is in use
    wait_until(lambda: gone(daemon), 5, lambda: _who(daemon))


def test_a_marked_process_is_killed_when_psutil_cached_an_earlier_process_at_its_pid():
    """A long run may wrap the pid space (pid_max can be 32768): psutil.process_iter's cache may still hold an earlier
    process at a reused pid, and that object's kill() refuses the process living there now."""
    marker = f"test-{os.getpid()}-reused-pid"
    daemon = subprocess.Popen(["sleep", "60"], env={**os.environ, rewards.MARKER_ENV: marker})
    try:
        stale = psutil.Process(daemon.pid)
        stale._ident = (daemon.pid, stale._ident[1] - 100.0)  # as psutil keeps the earlier process's start
        psutil._pmap[daemon.pid] = stale  # process_iter's cache (psutil 7)
        assert any(p is stale for p in psutil.process_iter())  # the cache is really stale, else nothing is tested
        rewards._kill_marked(marker)
        assert daemon.wait(timeout=5) == -9
    finally:
        psutil._pmap.pop(daemon.pid, None)
        daemon.kill()
        daemon.wait()


@pytest.mark.parametrize("fn", [crashing_reward, segfaulting_reward])
def test_crashing_worker_is_replaced(pool, fn):
    assert pool.score_group(ref(fn), ["a", "b"], {}) == [0.0, 0.0]
    assert pool.stats()["crashed"] == 2
    assert replaced_workers_are_gone(pool)
    still_works(pool)


def test_invalid_results_are_counted(pool):
    assert pool.score_group(ref(invalid_reward), ["nan", "inf", "str", "none", "huge"], {}) == [0.0] * 5
    assert pool.stats()["invalid"] == 5
    still_works(pool)


def test_failed_value_and_a_mix_in_one_group():
    with RewardPool(num_workers=2, timeout_s=0.5, failed_value=-1.0) as pool:
        futures = [pool.submit(ref(length_reward), "abc", {}), pool.submit(ref(hanging_reward), "", {}),
                   pool.submit(ref(raising_reward), "", {}), pool.submit(ref(crashing_reward), "", {}),
                   pool.submit(ref(length_reward), "ab", {})]
        assert [f.result(timeout=20) for f in futures] == [3.0, -1.0, -1.0, -1.0, 2.0]
        stats = pool.stats()
        assert (stats["scored"], stats["timed_out"], stats["raised"], stats["crashed"]) == (2, 1, 1, 1)


def test_a_group_is_one_job_per_worker_and_each_call_keeps_its_own_outcome():
    """score_group hands a group to a worker as one job (one hand-off, not one per sample); a call that
    hangs or crashes fails alone, under its own timeout_s, and the calls after it run on the replacement."""
    with RewardPool(num_workers=1, timeout_s=0.5, failed_value=-1.0, preload=[ref(picky_reward)]) as pool:
        jobs = pool._next_job_id
        assert pool.score_group(ref(picky_reward), ["a", "bb", "ccc"] * 3, {}) == [1.0, 2.0, 3.0] * 3
        assert pool._next_job_id == jobs + 1
        group = ["abc", "hang", "ab", "crash", "raise", "abcd"]
        assert pool.score_group(ref(picky_reward), group, {}) == [3.0, -1.0, 2.0, -1.0, -1.0, 4.0]
        stats = pool.stats()
        assert (stats["scored"], stats["timed_out"], stats["crashed"], stats["raised"]) == (9 + 3, 1, 1, 1)
        assert stats["pending"] == 0 and stats["workers_started"] == 3
    with RewardPool(num_workers=2, timeout_s=0.5, preload=[ref(picky_reward)]) as pool:  # split over workers
        jobs = pool._next_job_id
        assert pool.score_group(ref(picky_reward), ["a", "bb", "ccc", "dddd", "eeeee"], {}) == [1, 2, 3, 4, 5]
        assert pool._next_job_id == jobs + 2


def test_bad_references_and_payloads(pool):
    with pytest.raises(ValueError, match="module:function"):
        pool.submit("no_colon", "x", {})
    with pytest.raises(TypeError, match="msgpack"):
        pool.submit(ref(length_reward), "x", {"array": object()})
    assert pool.score_group("no_such_module_xyz:reward", ["x"], {}) == [0.0]
    assert pool.score_group(f"{HERE}:no_such_function", ["x"], {}) == [0.0]
    assert pool.stats()["raised"] == 2
    still_works(pool)


def test_memory_limit_turns_a_runaway_allocation_into_a_raise():
    with RewardPool(num_workers=1, timeout_s=5.0, memory_limit_mb=2048) as pool:
        assert pool.score_group(ref(allocating_reward), ["x"], {}) == [0.0]
        assert pool.stats()["raised"] == 1
        assert pool.score_group(ref(length_reward), ["xy"], {}) == [2.0]


def test_workers_have_a_memory_limit_by_default_and_it_can_be_set_or_lifted():
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        assert pool.memory_limit_mb == default_memory_limit_mb(2)
        assert pool.score_group(ref(address_space_limit_mb), ["x", "y"], {}) == [pool.memory_limit_mb] * 2
    with RewardPool(num_workers=1, timeout_s=5.0, memory_limit_mb=3000) as pool:
        assert pool.score_group(ref(address_space_limit_mb), ["x"], {}) == [3000.0]
    with RewardPool(num_workers=1, timeout_s=5.0, memory_limit_mb=0) as pool:
        assert pool.memory_limit_mb is None
        assert pool.score_group(ref(address_space_limit_mb), ["x"], {}) == [-1.0]


def test_the_default_memory_limit_is_a_share_of_half_the_machine(monkeypatch):
    monkeypatch.setattr(machine, "physical_memory_bytes", lambda: 32 << 30)
    assert default_memory_limit_mb(1) == 16 << 10
    assert default_memory_limit_mb(4) == 4 << 10
    assert default_memory_limit_mb(64) == MIN_DEFAULT_MEMORY_MB  # many workers: each still gets the floor
    monkeypatch.setattr(machine, "physical_memory_bytes", lambda: 1 << 30)
    assert default_memory_limit_mb(1) == MIN_DEFAULT_MEMORY_MB


@pytest.mark.parametrize("overrides, expected", [({}, None), ({"rollout.reward_memory_mb": "3000"}, 3000.0)])
def test_the_rl_jobs_reward_pool_has_a_memory_limit(overrides, expected):
    """The pools the RL job builds (`reward_pool_options` of its rollout section) limit their workers' memory:
    by default a share of the machine's, or `rollout.reward_memory_mb`."""
    from jaxflow.config import load_config
    from jaxflow.jobs.bookkeeping import reward_pool_options

    rollout = load_config(str(pathlib.Path(__file__).parents[2] / "configs" / "arithmetic_tiny.py"), overrides).rollout
    expected = expected or float(default_memory_limit_mb(rollout.reward_workers))
    with RewardPool(**reward_pool_options(rollout)) as pool:
        assert pool.score_group(ref(address_space_limit_mb), ["x"], {}) == [expected]


@pytest.mark.parametrize("limit", [-1, 1.5, True, "2048"], ids=repr)
def test_a_bad_memory_limit_is_refused_before_any_worker_starts(limit):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="memory_limit_mb"):
        RewardPool(num_workers=1, memory_limit_mb=limit)
    assert not set(multiprocessing.active_children()) - before


def test_close_fails_unfinished_calls_and_refuses_new_ones(tmp_path):
    pool = RewardPool(num_workers=1, timeout_s=30.0)
    pids = pool.worker_pids()
    started = tmp_path / "started"
    running = pool.submit(ref(announced_hanging_reward), str(started), {})
    queued = pool.submit(ref(length_reward), "x", {})
    wait_until(started.exists, 30, "the hanging call running on the worker")
    pool.close()
    for future in (running, queued):
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(ref(length_reward), "x", {})
    pool.close()  # idempotent
    assert all(gone(pid) for pid in pids)


# A module whose import ends its process, as a worker that dies before it is ready does (out of memory, say).
DIES_ON_IMPORT = "import os\nos._exit(3)\n"


@pytest.mark.parametrize("preload, message", [
    # A preload that does not import: reported by the worker, and the pool stops at once.
    ("no_such_module_xyz:reward", "cannot start: preloading .*No module named 'no_such_module_xyz'"),
    # Workers that die before they are ready: the pool stops after three.
    ("dies_on_import_xyz:reward", "cannot start: 3 exited in a row"),
])
def test_workers_that_cannot_start_break_the_pool_clearly(preload, message, tmp_path, monkeypatch):
    (tmp_path / "dies_on_import_xyz.py").write_text(DIES_ON_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers start with this process's sys.path
    # Children of other tests in this process (a vLLM engine core, say) are not the pool's to stop.
    before = set(multiprocessing.active_children())
    pool = RewardPool(num_workers=1, preload=[preload])
    try:
        with pytest.raises(RuntimeError, match=message):
            wait_until(lambda: pool.submit(ref(length_reward), "x", {}).result(timeout=60) and False, 60,
                       "the pool to break")
    finally:
        pool.close()
    assert not set(multiprocessing.active_children()) - before


def test_score_inline():
    assert score_inline(ref(length_reward), "abc", {}) == 3.0
    with pytest.raises(KeyError):
        score_inline(ref(raising_reward), "x", {})
    with pytest.raises(ValueError, match="not a finite real number"):
        score_inline(ref(invalid_reward), "nan", {})
    with pytest.raises(ValueError, match="has no function"):
        resolve(f"{HERE}:missing")
    with pytest.raises(ValueError, match="module:function"):
        resolve("jaxflow.tasks")


def test_group_reward_fn_decodes_and_scores(pool):
    task = GroupTask(group_id=0, prompt=[1, 2], n=2, v_start=0, meta={"scale": 10.0})
    samples = [Sample(tokens=[1, 2, 3]), Sample(tokens=[4])]
    reward_fn = group_reward_fn(pool, ref(length_reward), decode=lambda ids: "x" * len(ids))
    assert reward_fn(task, samples) == [30.0, 10.0]


def test_throughput_of_a_trivial_reward(pool):
    meta = {"task": "arithmetic", "answer": 12}
    pool.score_group("jaxflow.tasks:reward", ["<answer>12</answer>"], meta)  # import outside the timing
    start = time.perf_counter()
    scores = pool.score_group("jaxflow.tasks:reward", ["= 12\n<answer>12</answer>"] * 200, meta)
    elapsed = time.perf_counter() - start
    assert scores == [1.0] * 200
    print(f"reward pool: 200 trivial samples on 2 workers in {elapsed * 1e3:.1f} ms "
          f"({200 / elapsed:.0f} samples/s)")
