"""The RL job on a 3-node Ray cluster: 2 trainer processes forming one mesh, 2 rollout actors, the data
services in their own actor; and, training LoRA adapters, its recovery when a rollout actor, a trainer
process or the data-services actor dies."""

import json
import pathlib
import statistics
import threading
import time

import numpy as np
import pytest
import ray  # the `cluster` extra, which the setup script installs: a missing Ray fails here, never skips
from service_placements import start_cluster
from small_runs import records, small_config
from tolerances import assert_engines_served_the_trainers_weights
from waiting import wait_until

from jaxflow.cluster import names
from jaxflow.jobs import rl
from jaxflow.models import hf_io, lora

pytestmark = pytest.mark.slow  # Ray clusters and actors

ETA = 2
# What these runs change in the small run (tests/small_runs.py): a base warm-started longer on one-operation
# problems, a reward any policy learns in a few steps (an even answer): the run must show learning, fast.
# Then a cluster of two rollout actors and a trainer mesh over two processes, each piece on its own node.
OVERRIDES = {"base.steps": 300, "base.num_examples": 2000, "task.max_ops": 1, "data.train_prompts": 2000,
             "trainer.lr": 3e-4, "task.reward_ref": "jaxflow.tasks.arithmetic:even_answer_reward",
             "trainer.batch_groups": 4, "eval.every": 1000, "trainer.eta": ETA, "rollout.lease_s": 5.0,
             "cluster.mode": "ray", "cluster.rollout_actors": 2, "cluster.trainer_processes": 2,
             "cluster.trainer_cpu_devices": 4, "cluster.trainer_mesh.fsdp": 4, "cluster.trainer_mesh.tensor": 2,
             "cluster.node_resource.data": "data", "cluster.node_resource.rewards": "data",
             "cluster.node_resource.trainer": "trainer", "cluster.node_resource.rollout": "rollout"}


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"data": 2}, [{"num_cpus": 2, "resources": {"trainer": 2}},
                                    {"num_cpus": 2, "resources": {"rollout": 2}}])
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, shared_base):
    """One warm-started base for the module's runs (each run building its own cost ~40 s here), the same as
    the job tests' that learn (tests/shared_bases.py)."""
    directory = tmp_path_factory.mktemp("base") / "model"
    config = small_config(tmp_path_factory.mktemp("unused"), directory, **OVERRIDES)
    return shared_base(config, directory)


def config_for(cluster, tmp_path, base_dir, **more):
    return small_config(tmp_path, base_dir, **{**OVERRIDES, "cluster.address": cluster.address, **more})


def check_run(workdir: pathlib.Path, steps: int, groups_per_step: int = 4):
    """Each step once, each group trained once, the bound token by token, the accounting closed."""
    trained = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    for r in trained:
        assert max(int(k) for k in r["staleness"]) <= ETA, r["staleness"]
    ledger = [g for r in records(workdir, "ledger.jsonl") for g in r["groups"]]
    assert len(ledger) == len(set(ledger)) == steps * groups_per_step
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert a["consumed"] == len(ledger) and a["ledger_duplicates"] == 0
    return trained, result


def test_two_trainer_processes_and_two_rollout_actors_learn(cluster, tmp_path, base_dir):
    steps = 24
    # No checkpoints (the recovery test below saves one a step): each costs 1.2 s of barriers here.
    config = config_for(cluster, tmp_path, base_dir, **{"trainer.steps": steps, "trainer.batch_groups": 8,
                                                        "checkpoint.every": 1000})
    assert rl.run(config) == 0
    trained, result = check_run(pathlib.Path(config.workdir), steps, groups_per_step=8)
    placed = result["cluster"]
    assert len(placed["trainer_processes"]) == 2 and placed["trainer_processes"][0]["mesh"] == {
        "data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    assert len({p["pid"] for p in placed["trainer_processes"]}) == 2
    assert len(placed["rollout_actors"]) == 2
    # The engines generate with the weights the trainer processes published, version by version.
    assert_engines_served_the_trainers_weights(trained)
    # The reward rises: the first 8 steps' mean against the last 8's (32 samples a step; embedded, the same
    # settings went from 0.51 to 0.63, about 2.7 standard errors of the difference).
    rewards = [r["reward_mean"] for r in trained]
    first, last = statistics.mean(rewards[:8]), statistics.mean(rewards[-8:])
    assert last > first, [round(x, 3) for x in rewards]
    assert (pathlib.Path(config.workdir) / "export" / "config.json").exists()


def _steps_trained(workdir: pathlib.Path) -> int:
    path = workdir / "metrics.jsonl"
    return sum('"loss"' in ln for ln in path.read_text().splitlines()) if path.exists() else 0


def _kill_when(workdir, steps, name, deadline_s=300):
    """Waits for `steps` trained steps, then kills the actor `name` (Ray may restart it)."""
    wait_until(lambda: _steps_trained(workdir) >= steps, deadline_s, f"the run to reach step {steps}",
               interval=0.2)
    ray.kill(ray.get_actor(name), no_restart=False)
    return time.time()


def test_the_run_survives_a_rollout_actor_a_trainer_process_and_the_data_services_actor_killed(
        cluster, tmp_path, base_dir, capsys):
    """With LoRA adapters trained on the mesh of the two trainer processes: each process merges its shards
    on device and the rollout actors' JAX engines (the base without adapters) take each version's merged
    weights. A rollout actor, a trainer process and the data-services actor are killed in turn; the run
    recovers from each and finishes with every step once. The export holds the adapters in PEFT's format and
    the merged model, which agree."""
    # A recovery rolls the run back to its newest checkpoint, and metrics.jsonl with it: the trainer, killed
    # at 3 steps, resumes at 2 or 3; the data services, killed at 5, two or three steps after that (each step
    # on the new group, so its recovery is measured); then at least two steps on the restored services.
    steps = 7
    config = config_for(cluster, tmp_path, base_dir, **{"trainer.steps": steps, "trainer.lora.rank": 8,
                                                        "trainer.lr": 1e-3})
    workdir = pathlib.Path(config.workdir)
    tag = names.run_tag(workdir)
    code = []
    job = threading.Thread(target=lambda: code.append(rl.run(config)), daemon=True)
    job.start()
    _kill_when(workdir, 2, names.rollout(tag, 0))  # Ray restarts it; it rejoins by itself
    killed = [("trainer", _kill_when(workdir, 3, names.trainer(tag, 1)))]
    killed.append(("data", _kill_when(workdir, 5, names.data(tag))))
    job.join(timeout=600)
    assert code == [0]
    out = capsys.readouterr().out
    assert "jaxflow: LoRA rank 8" in out and "merged weights" in out
    _, result = check_run(workdir, steps)
    assert len({p["pid"] for p in result["cluster"]["trainer_processes"]}) == 2
    assert result["coordination"]["actor_restarts"] >= 1  # the rollout actor's process was replaced
    recoveries = result["recoveries"]
    assert [r["kind"] for r in recoveries] == ["trainer", "data"], recoveries
    for (_kind, at), r in zip(killed, recoveries):
        assert r["detected_at"] >= at - 1 and r["recovered_s"] > 0
        assert r["step"] <= steps
    spec, adapters = lora.read_adapter(workdir / "adapter")
    assert spec.rank == 8 and adapters
    base = hf_io.load_model(base_dir)
    merged = dict(hf_io.iter_hf_tensors(hf_io.load_model(workdir / "export")))
    with_adapters = hf_io.load_model(base_dir, lora=spec)
    for name, value in lora.adapter_arrays(with_adapters.layers, adapters, source="export").items():
        getattr(with_adapters.layers, name)[...] = value
    for name, w in hf_io.iter_hf_tensors(with_adapters):
        np.testing.assert_allclose(merged[name], w, atol=1e-6, err_msg=name)
    assert any(not np.array_equal(merged[n], w) for n, w in hf_io.iter_hf_tensors(base))  # it trained


def test_a_judge_and_a_teacher_beside_the_rollout_score_in_the_scorers_actor(cluster, tmp_path, base_dir, capsys):
    """Trainer processes, rollout actors and the scorers' actor (`jaxflow.jobs.scorers`): an LLM judge (the base
    model, its verdicts read by a parse function of the package) scores the rollouts and a teacher scores their
    tokens, both in that one actor, which both rollout actors call; the trainer processes train on the teacher's
    log-probs the samples carried (the distillation terms are not 0) and the judge's counts are the accounting."""
    from engine_helpers import perturbed

    steps = 2
    teacher, _ = perturbed(hf_io.load_model(base_dir), seed=7, scale=0.1)
    teacher_dir = hf_io.export_model(teacher, tmp_path / "teacher", tokenizer_dir=base_dir)
    config = config_for(cluster, tmp_path, base_dir, **{
        "trainer.steps": steps, "checkpoint.every": 1000, "trainer.distill.teacher": teacher_dir,
        "trainer.distill.where": "rollout", "trainer.distill.task_coef": 1.0,
        "rollout.judge.dir": str(base_dir), "rollout.judge.parse_ref": "jaxflow.tasks.arithmetic:even_answer_reward",
        # The default prompt (instructions, question, reference answer, response) is about 106 tokens plus the
        # response's, up to rollout.max_tokens (48): a context of 384 holds every one with its verdict, so no
        # sample fails for its length.
        "rollout.judge.max_tokens": 16, "rollout.judge.max_len": 384, "rollout.judge.max_slots": 8})
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    tag = names.run_tag(tmp_path / "run")
    assert f"rollouts are scored by the judge {base_dir} on its own jax engine in the Ray actor {names.scorers(tag)}" \
        in out, out
    assert f"distilling from the teacher {teacher_dir}" in out and "scored beside the rollout engines" in out, out
    trained, result = check_run(pathlib.Path(config.workdir), steps)
    for r in trained:
        assert r["distill_adv_abs_mean"] > 0 and r["distill_kl"] != 0, r
    placed = result["cluster"]
    others = {p["pid"] for p in placed["trainer_processes"]} | {a["pid"] for a in placed["rollout_actors"]}
    assert placed["scorers"]["pid"] not in others
    samples = config.trainer.batch_groups * config.rollout.group_size
    a = result["accounting"]
    assert a["reward_calls"] >= a["reward_scored"] >= steps * samples, a
    failures = {k: a[f"reward_{k}"] for k in ("raised", "timed_out", "crashed", "invalid")}
    assert not any(failures.values()), failures
