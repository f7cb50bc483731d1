"""The RL job with a vLLM engine in a Ray rollout actor (real vLLM, its own processes inside the actor):
the trainer in the job, the data services in their own actor, one rollout actor pulling each version's
HF tensors from the parameter service. Every step keeps the bound token by token, the engine samples
with the trainer's weights of each version (pi_prox / mu near 1), and the accounting closes.

Skipped when vLLM is not importable, except under CI, where vLLM must run.
"""

import json
import os
import pathlib

import pytest
from engine_helpers import require_vllm  # noqa: E402

require_vllm("the vLLM rollout actor test")

import psutil  # noqa: E402  (a vLLM dependency: imported once vLLM is known to be there)
from service_placements import ray_session_end  # noqa: E402
from small_runs import records, small_config  # noqa: E402
from tolerances import assert_engines_served_the_trainers_weights  # noqa: E402

from jaxflow.jobs import rl  # noqa: E402

pytestmark = pytest.mark.slow  # Ray clusters and actors

ETA, STEPS, GROUPS = 1, 3, 2
# What this run changes in the small run (tests/small_runs.py), which is 2 groups of 4 a step already: shorter
# answers and evals, a smaller KV cache; head_dim 32 is the config's (vLLM's CPU attention rejects less). A
# warm start long enough for the answer format, and a reward that format alone earns half the time (an even
# answer), so that every step's update moves the weights: each version differs.
OVERRIDES = {"base.steps": 300, "base.num_examples": 2000, "task.max_ops": 1,
             "task.reward_ref": "jaxflow.tasks.arithmetic:even_answer_reward", "trainer.lr": 3e-4,
             "trainer.batch_groups": GROUPS, "trainer.steps": STEPS, "trainer.eta": ETA, "rollout.max_tokens": 32,
             "rollout.kv_cache_gib": 0.25, "eval.num_prompts": 4, "eval.every": 1000, "checkpoint.every": 1000,
             "rollout.engine": "vllm", "cluster.mode": "ray", "cluster.rollout_actors": 1}


def vllm_processes_in_ray_actors() -> list[psutil.Process]:
    """Live vLLM engine-core and worker processes started from a Ray worker (they inherit its
    RAY_RAYLET_PID; vLLM started by a plain process, another test's, has none)."""
    found = []
    for p in psutil.process_iter():
        try:
            if " ".join(p.cmdline()).startswith("VLLM::") and "RAY_RAYLET_PID" in p.environ():
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_a_vllm_rollout_actor_keeps_the_bound_the_weights_and_the_accounting(tmp_path, shared_base):
    ray_session_end()  # the job starts a local Ray of its own (and stops it at the end)
    config = small_config(tmp_path, tmp_path / "base", **OVERRIDES)
    shared_base(config, tmp_path / "base")  # the base the job tests that learn use (tests/shared_bases.py)
    before = {p.pid for p in vllm_processes_in_ray_actors()}
    assert rl.run(config) == 0
    workdir = pathlib.Path(config.workdir)
    trained = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in trained] == list(range(STEPS))
    versions = set()
    for r in trained:
        lags = {int(k): n for k, n in r["staleness"].items()}
        assert max(lags) <= ETA and min(lags) >= 0, r["staleness"]  # token by token
        versions |= {r["step"] - k for k, n in lags.items() if n > 0}
        assert r["update_norm"] > 0, r  # each step changed the weights: every version differs
    # vLLM's log-probs of its own samples agree with the trainer's recomputation, version by version. Step 0
    # trains version-0 tokens only, sampled after the actor pulled version 0 from the parameter service into
    # vLLM: token by token they equal the trainer's up to fp32 summation order (1e-4 in log-prob,
    # tests/rollout_bridge/test_vllm_engine.py; measured here within 1e-6).
    assert_engines_served_the_trainers_weights(trained)
    # Tokens that vLLM labelled with a version the trainer published after the start were trained: the
    # actor's engine took new weights mid-run (with ETA 1, step 2 can only train versions >= 1).
    assert max(versions) >= 1, versions
    ledger = [g for r in records(workdir, "ledger.jsonl") for g in r["groups"]]
    assert len(ledger) == len(set(ledger)) == STEPS * GROUPS
    result = json.loads((workdir / "result.json").read_text())
    a, c = result["accounting"], result["coordination"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert a["consumed"] == len(ledger) and a["ledger_duplicates"] == 0
    assert c["syncs"] >= 2, c  # the first load, then at least one new version pulled into vLLM
    placed = result["cluster"]
    assert len(placed["rollout_actors"]) == 1 and placed["rollout_actors"][0]["pid"] != os.getpid()
    assert placed["parameter_service"] == placed["trajectory_service"]  # one data-services actor
    # The actor closed its engine: no vLLM process of the run outlives it.
    _, alive = psutil.wait_procs([p for p in vllm_processes_in_ray_actors() if p.pid not in before], timeout=30)
    assert not alive, [p.pid for p in alive]
