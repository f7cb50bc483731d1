"""The RL job end to end on a very small model: warm start cache, an async run's outputs and accounting,
resume after Ctrl-C with no group lost or trained twice, and its bad-input errors."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess

import pytest
from checkpoint_faults import damage_extra
from small_runs import CONFIG, check_each_step_once, job_command, records, small_config, start_until_step
from tolerances import assert_engines_served_the_trainers_weights

from jaxflow.config import ConfigError, flat_keys, load_config
from jaxflow.jobs import warm_start
from jaxflow.main import main
from jaxflow.models.hf_io import load_model

pytestmark = pytest.mark.slow  # runs of the RL job end to end

def test_missing_base_model_says_how_to_build_it(tmp_path, capsys):
    config = small_config(tmp_path, tmp_path / "nowhere", **{"base.build_if_missing": False})
    with pytest.raises(warm_start.BaseModelMissing, match=r"does not exist.*--config\.job=warm_start"):
        warm_start.ensure_base_model(config)
    assert main([f"--config={CONFIG}", f"--config.base.dir={tmp_path / 'nowhere'}",
                 "--config.base.build_if_missing=False", f"--config.workdir={tmp_path / 'run'}"]) == 2
    assert "--config.job=warm_start" in capsys.readouterr().err


def test_base_model_cache_is_reused_only_for_the_same_settings(tmp_path, base_dir):
    config = small_config(tmp_path, base_dir, **{"base.build_if_missing": False})
    assert warm_start.ensure_base_model(config) == pathlib.Path(base_dir)  # same settings: reused
    other = small_config(tmp_path, base_dir, **{"base.build_if_missing": False, "base.lr": "0.001"})
    with pytest.raises(warm_start.BaseModelMissing, match="built with other settings"):
        warm_start.ensure_base_model(other)


def test_a_stale_base_is_rebuilt_in_place_but_a_foreign_model_is_kept(tmp_path, base_dir):
    stale = tmp_path / "stale"
    shutil.copytree(base_dir, stale)
    config = small_config(tmp_path, stale, **{"base.steps": "2", "eval.num_prompts": "2"})
    assert warm_start.read_info(stale)["fingerprint"] != warm_start.fingerprint(config)
    assert warm_start.ensure_base_model(config, log=lambda *_: None) == stale
    assert warm_start.read_info(stale)["fingerprint"] == warm_start.fingerprint(config)
    foreign = tmp_path / "foreign"
    shutil.copytree(base_dir, foreign)
    (foreign / warm_start.INFO_FILE).unlink()
    before = (foreign / "model.safetensors").read_bytes()
    # A model the warm start did not build is used as given, whatever the settings; never rebuilt.
    config = small_config(tmp_path, foreign, **{"base.steps": "2"})
    assert warm_start.ensure_base_model(config, log=lambda *_: None) == foreign
    with pytest.raises(FileExistsError, match=f"{foreign} holds a model that no warm start built"):
        warm_start.build_base_model(config, foreign, log=lambda *_: None)
    assert (foreign / "model.safetensors").read_bytes() == before
    assert not (foreign / warm_start.INFO_FILE).exists()


def test_bad_values_are_named(tmp_path, capsys):
    assert main([f"--config={CONFIG}", "--config.rollout.engine=sglang", "--config.trainer.eta=-1",
                 "--config.trainer.minibatches=0", "--config.rollout.coordination.sync_mode=drop",
                 "--config.trainer.loss.aggregation=median", "--config.trainer.schedule=linear",
                 f"--config.workdir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine 'sglang' is not one of ('jax', 'vllm')" in err and "trainer.eta must be >= 0" in err
    assert "trainer.minibatches must be >= 1" in err
    assert "rollout.coordination.sync_mode 'drop' is not one of ('keep', 'keep_kv', 'abort')" in err
    # The update's options are checked with the rest, before anything starts (no workdir, no base model).
    assert "trainer.loss.aggregation 'median' is not one of" in err and "trainer.schedule 'linear' is not one of" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("minibatches", [1, 3])
def test_each_train_step_makes_minibatches_optimizer_updates(tmp_path, base_dir, minibatches):
    import jax
    import numpy as np

    from jaxflow import sharding
    from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
    from jaxflow.trainer.rl_trainer import RLTrainer

    config = small_config(tmp_path, base_dir, **{"trainer.minibatches": minibatches})
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    trainer = RLTrainer(load_model(base_dir, mesh=mesh), config.trainer, mesh, seq_len=64, max_sequences=6 * 4)
    assert trainer._step.compiles == 1  # at construction, before any batch
    rng = np.random.default_rng(0)
    groups = []
    for g in range(5):
        samples = [Sample(tokens=rng.integers(3, 60, n).tolist(), logprobs=[-2.0] * n, versions=[0] * n,
                          finish_reason="stop") for n in rng.integers(3, 20, 4)]
        groups.append(FinishedGroup(g, rng.integers(3, 60, 8).tolist(), 0, samples, [1.0, 0.0, 0.0, 1.0]))
    solved = Sample([9] * 30, [-1.0] * 30, [0] * 30, "stop")
    groups.append(FinishedGroup(5, [5, 6, 7], 0, [solved] * 4, [1.0] * 4))
    before = jax.device_get(trainer.state.params)
    metrics, staleness = trainer.train(ConsumedBatch(0, groups, "full"))
    # The all-solved group carries no signal: consumed and counted, not trained.
    assert metrics["groups"] == 6 and metrics["groups_trained"] == 5
    assert metrics["zero_signal_groups_frac"] == pytest.approx(1 / 6)
    # One version per train step, `minibatches` optimizer updates inside it, each on a share of the batch.
    assert trainer.version == 1 and int(trainer.state.step) == minibatches
    trained = sum(len(s.tokens) for g in groups[:5] for s in g.samples)
    assert metrics["num_tokens"] == metrics["trained_tokens"] == trained
    assert staleness == {0: metrics["trained_tokens"]}
    after = jax.device_get(trainer.state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    # Another batch of other lengths and fewer groups reuses the one compiled shape.
    short = [Sample(rng.integers(3, 60, 2).tolist(), [-2.0] * 2, [1] * 2, "stop") for _ in range(4)]
    metrics, _ = trainer.train(ConsumedBatch(1, [FinishedGroup(10 + g, [5, 6], 1, short, [1.0, 0.0, 0.0, 0.0])
                                                 for g in range(2)], "full"))
    assert metrics["train_step_compiles"] == 1 and metrics["groups_trained"] == 2


def test_batches_beyond_max_sequences_get_one_deeper_shape(tmp_path, base_dir, caplog):
    import jax
    import numpy as np

    from jaxflow import sharding
    from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
    from jaxflow.trainer.rl_trainer import RLTrainer

    config = small_config(tmp_path, base_dir, **{"trainer.pack": "False", "trainer.share_prompts": "False",
                                                 "trainer.micro_batch_rows": "4"})
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    trainer = RLTrainer(load_model(base_dir, mesh=mesh), config.trainer, mesh, seq_len=64, max_sequences=4)
    assert trainer.batch_shape[0] * trainer.batch_shape[1] < 12
    rng = np.random.default_rng(1)

    def batch(version):
        return ConsumedBatch(version, [FinishedGroup(
            g, [5, 6, 7], version, [Sample(rng.integers(3, 60, 5).tolist(), [-2.0] * 5, [version] * 5, "stop")
                                    for _ in range(4)], [1.0, 0.0, 0.0, 0.0]) for g in range(3)], "full")

    metrics, _ = trainer.train(batch(0))
    assert metrics["groups_trained"] == 3 and metrics["train_step_compiles"] == 2
    assert "do not fit the compiled batch shape" in caplog.text
    metrics, _ = trainer.train(batch(1))  # the next batch of that size reuses it
    assert metrics["train_step_compiles"] == 2


# Keys a plain `rl.run` (JAX engine, one worker per engine) legitimately does not read, each with its reason.
UNREAD_BY_RL_RUN = {
    "job": "read by jaxflow.main to pick the job module; rl.run is that module's entry point",
}


def record_key_reads(monkeypatch, config):
    """Returns a set that fills with the dotted keys of `config` read from now on: by attribute, item, get,
    items/values (all go through __getitem__) or to_dict (reads everything under the node)."""
    import ml_collections

    prefixes = {}

    def walk(node, prefix):
        prefixes[id(node)] = prefix
        for key, value in node._fields.items():
            if isinstance(value, ml_collections.ConfigDict):
                walk(value, f"{prefix}{key}.")

    walk(config, "")
    read = set()
    getitem, to_dict = ml_collections.ConfigDict.__getitem__, ml_collections.ConfigDict.to_dict

    def recording_getitem(self, key):
        if id(self) in prefixes and isinstance(key, str):
            read.add(prefixes[id(self)] + key)
        return getitem(self, key)

    def recording_to_dict(self, *args, **kwargs):
        if id(self) in prefixes:
            read.update(prefixes[id(self)] + k for k in flat_keys(self))
        return to_dict(self, *args, **kwargs)

    monkeypatch.setattr(ml_collections.ConfigDict, "__getitem__", recording_getitem)
    monkeypatch.setattr(ml_collections.ConfigDict, "to_dict", recording_to_dict)
    return read


def unread_keys(config, read, exempt=UNREAD_BY_RL_RUN):
    return sorted(k for k in flat_keys(config) if k not in read and not any(
        k == e or (e.endswith(".") and k.startswith(e)) for e in exempt))


def test_unknown_key_names_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.etaa'; nearest valid keys: .*trainer\.eta"):
        load_config(CONFIG, {"trainer.etaa": "1"})


def test_async_run_outputs_and_accounting_and_the_run_reads_every_config_key(tmp_path, base_dir, capsys,
                                                                             monkeypatch):
    """An async run's outputs, timings and accounting, and the keys it reads: a key nobody reads is an option
    that silently does nothing, so the run must read every leaf key of the config (but the explicit
    exemptions). A planted top-level `never_read` shows the check catches one."""
    from jaxflow.jobs import rl
    config = small_config(tmp_path, base_dir, **{"trainer.steps": "4", "trainer.eta": "2"})
    with config.unlocked():  # top level: every section refuses a key its dataclass lacks
        config.never_read = 1
    read = record_key_reads(monkeypatch, config)
    assert rl.run(config) == 0
    monkeypatch.undo()  # stop recording: listing the keys below reads them all
    assert unread_keys(config, read) == ["never_read"]
    # Every exemption is needed: it names keys this run did not read (a stale one would hide a real miss).
    unexempted = unread_keys(config, read, exempt={})
    assert all(any(k == e or (e.endswith(".") and k.startswith(e)) for k in unexempted) for e in UNREAD_BY_RL_RUN)
    workdir = pathlib.Path(config.workdir)
    out = capsys.readouterr().out
    steps = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    base = records(workdir)[0]  # the base model's eval, timed (benchmarks take it out of training time)
    assert "loss" not in base and 0 < base["eval_s"] <= base["time_s"] < steps[0]["time_s"]
    for r in steps:
        assert 0 <= r["reward_mean"] <= 1 and r["trained_tokens"] > 0
        assert max(int(k) for k in r["staleness"]) <= 2  # the staleness bound, token by token
    assert "step 3/4" in out and "held-out accuracy" in out
    # One train-step compile, before the first step, whatever the four batches held.
    assert out.index("train step compiled for batches of") < out.index("step 0/4")
    assert "train-step compiles: 1 (" in out and all(r["train_step_compiles"] == 1 for r in steps)
    result = json.loads((workdir / "result.json").read_text())
    assert result["train_step_compiles"] == 1
    a = result["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"]
    assert a["consumed"] == a["ledger_groups"] == 4 * 2 and a["ledger_duplicates"] == 0
    # eval.every=2: evals after steps 1 and 3, each timed; their sum is in the result, inside wall_s.
    evals = [r["eval_s"] for r in steps if "eval_s" in r]
    assert [r["step"] for r in steps if "eval_s" in r] == [1, 3] and min(evals) > 0
    assert result["eval_s"] == pytest.approx(sum(evals), rel=1e-3) and result["eval_s"] < result["wall_s"]
    # The loop's wall time by phase: each timed phase is the sum of its per-step figures, all of them
    # together the wall time, printed in one line.
    phases = result["phases_s"]
    assert list(phases) == ["wait_rollout", "batch", "update", "publish", "eval", "checkpoint", "other"]
    assert phases["eval"] == pytest.approx(sum(evals), abs=1e-2)
    assert phases["batch"] == pytest.approx(sum(r["batch_s"] for r in steps), abs=1e-2)
    assert phases["publish"] == pytest.approx(sum(r["publish_s"] for r in steps), abs=1e-2)
    assert min(phases[k] for k in ("batch", "update", "publish", "checkpoint")) > 0
    assert sum(phases.values()) == pytest.approx(result["wall_s"], abs=1e-2)
    assert 0 <= result["rollout_idle_frac"] <= 1
    # The CPU time of the process and its children over the loop: more than its evals' share, at most every
    # usable core for the whole loop.
    assert result["cores"] == len(os.sched_getaffinity(0))
    assert 0 < result["eval_cpu_s"] < result["cpu_s"] <= result["wall_s"] * result["cores"] * 1.01
    assert re.search(r"train loop [\d.]+s: wait rollout [\d.]+s \(\d+%\), batch .* rollout engines busy \d+% of it"
                     r"; this process and its children used [\d.]+ of \d+ cores", out)
    assert load_model(workdir / "export").config.num_layers == 2
    assert (workdir / "plots" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert list((workdir / "tensorboard").iterdir())
    # A finished run is not rerun.
    assert rl.run(config) == 0 and "nothing to do" in capsys.readouterr().out
    # More steps under a time limit already past after one step: that step ends the run as a last step
    # does (held-out eval, checkpoint, result.json), not as an interrupted one.
    more = small_config(tmp_path, base_dir, **{"trainer.steps": "100", "trainer.eta": "2",
                                               "trainer.time_limit_s": "0.001"})
    assert rl.run(more) == 0
    out = capsys.readouterr().out
    assert "after 5 steps (trainer.time_limit_s 0.001 reached)" in out
    steps = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4] and "eval_accuracy" in steps[-1]
    result = json.loads((workdir / "result.json").read_text())
    assert not result["interrupted"] and result["final_accuracy"] == steps[-1]["eval_accuracy"]


def _run_on_ray(tmp_path, base_dir, more=(), **cluster) -> dict:
    """Runs the small job for 3 steps at eta 1 with `cluster.*` overrides (and `more`); checks the bound
    token by token and that every group is accounted and trained once; returns result.json."""
    from jaxflow.jobs import rl
    config = small_config(tmp_path, base_dir, **{"trainer.steps": "3", "trainer.eta": "1", "eval.every": "100",
                                                 **{f"cluster.{k}": v for k, v in cluster.items()}, **dict(more)})
    assert rl.run(config) == 0
    workdir = pathlib.Path(config.workdir)
    steps = [r for r in records(workdir) if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(max(int(k) for k in r["staleness"]) <= 1 for r in steps)  # token by token
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    ledger = [g for r in records(workdir, "ledger.jsonl") for g in r["groups"]]
    assert a["consumed"] == len(ledger) == 3 * 2 and len(set(ledger)) == len(ledger)
    return result


def test_the_data_services_and_rollout_actors_on_ray_keep_the_bound_and_the_accounting(tmp_path, base_dir, capsys):
    """The trajectory service in a Ray actor of its own and, with LoRA adapters trained in this process, two
    rollout actors whose JAX engines (the base without adapters) take each version's merged weights and serve
    what the trainer computes (pi_prox / mu near 1)."""
    result = _run_on_ray(tmp_path, base_dir, {"trainer.lora.rank": "8", "trainer.lr": "1e-3"},
                         mode="ray", rollout_actors="2")
    placed = result["cluster"]["trajectory_service"]
    assert result["cluster"]["mode"] == "ray" and placed["pid"] != os.getpid()  # served by another process
    actors = result["cluster"]["rollout_actors"]
    assert len(actors) == 2 and len({a["pid"] for a in actors} | {os.getpid()}) == 3  # two actors of their own
    assert result["coordination"]["requests_submitted"] > 0 and result["coordination"]["syncs"] >= 2
    out = capsys.readouterr().out
    assert "jaxflow: LoRA rank 8" in out and "merged weights" in out
    assert result["trained_params"] < 50_000  # the adapters alone
    assert_engines_served_the_trainers_weights([r for r in records(tmp_path / "run") if "loss" in r])
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_ctrl_c_then_resume_loses_no_group_then_sigkill_then_resume_redoes_the_steps_after_the_checkpoint(
        tmp_path, base_dir):
    """One run stopped twice by the same command line. Ctrl-C: the run checkpoints where it stands and
    exits 130; rerun, it resumes from that step, no group lost or trained twice. Then killed outright (no
    chance to checkpoint): rerun, it resumes from its newest checkpoint and trains the steps after it again.
    The metrics, the ledger and the service's accounting hold each of the 8 steps once. (One test: each
    start of the job's process pays its imports and its warm start's load.)"""
    workdir = tmp_path / "run"
    cmd, env = job_command(base_dir, workdir, **{"trainer.steps": 8, "checkpoint.every": 2})
    proc = start_until_step(cmd, env, workdir, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    assert "rerun the same command to resume" in out
    stopped = len([r for r in records(workdir) if "loss" in r])
    assert 2 <= stopped <= 5, out
    # Resumed from the Ctrl-C: killed two steps on, after a periodic checkpoint (every 2 steps) or none.
    log = tmp_path / "resumed.log"
    with log.open("w") as sink:
        proc = start_until_step(cmd, env, workdir, stopped + 2, stdout=sink, stderr=subprocess.STDOUT)
        proc.kill()
        proc.wait(timeout=60)
    assert f"resuming {workdir} from step {stopped}" in log.read_text()
    killed_at = len([r for r in records(workdir) if "loss" in r])
    assert stopped + 2 <= killed_at < 8, "the run finished before it could be killed"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = re.search(r"resuming \S+ from step (\d+)", done.stdout)
    assert resumed, done.stdout
    assert stopped <= int(resumed.group(1)) <= killed_at
    # The curve continues: every step once, in order; the earlier records are kept.
    check_each_step_once(workdir, 8, 2)


def test_vllm_rollouts_keep_the_staleness_bound_and_the_accounting(tmp_path, base_dir):
    """The same job with real vLLM (AsyncLLM, its own processes) as the rollout engine. It runs as its own
    process: vLLM's loggers bind to the streams of the process that imports it. (With the data services in
    a Ray actor: tests/jobs/test_lora_job.py, whose vLLM pulls its adapters from there.)"""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"vLLM is not importable ({e})")
    workdir = tmp_path / "run"
    cmd, env = job_command(base_dir, workdir, **{"rollout.engine": "vllm", "trainer.steps": 4, "trainer.eta": 1})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "held-out accuracy" in proc.stdout
    steps = [r for r in records(workdir) if "loss" in r]
    for r in steps:
        assert max(int(k) for k in r["staleness"]) <= 1
    # vLLM's log-probs of its own samples agree with the trainer's recomputation, version by version.
    assert_engines_served_the_trainers_weights(steps)
    check_each_step_once(workdir, 4, 2)


# Every coordination strategy, in two mixes, on the real job with two JAX engines and one coordinator.
STRATEGY_MIXES = {
    "keep": {"routing": "throughput", "queue": "oldest_first", "sync": "selective", "sync_mode": "keep",
             "migrate": True, "migrate_trigger": 1.5, "migrate_stop": 1.1, "migrate_min_requests": 1,
             "extra_samples": 1, "stuck": "retry", "stuck_threshold": 2, "stuck_patience": 0.0},
    "abort": {"routing": "round_robin", "queue": "fifo", "sync": "all", "sync_mode": "abort",
              "migrate": False, "extra_groups": 0.5, "stuck": "release", "stuck_threshold": 1,
              "stuck_patience": 0.0},
}


@pytest.mark.parametrize("mix", sorted(STRATEGY_MIXES))
def test_coordinated_two_engine_run_keeps_the_staleness_bound_and_the_accounting(tmp_path, base_dir, mix):
    from jaxflow.jobs import rl
    strategy = {f"rollout.coordination.{k}": v for k, v in STRATEGY_MIXES[mix].items()}
    config = small_config(tmp_path, base_dir, **{
        "trainer.steps": "6", "trainer.eta": "2", "rollout.num_engines": "2",
        "trainer.batch_groups": "3", "rollout.coordination.max_running": "6", **strategy})
    assert rl.run(config) == 0
    workdir = pathlib.Path(config.workdir)
    steps = [r for r in records(workdir) if "loss" in r]
    for r in steps:
        assert max(int(k) for k in r["staleness"]) <= 2  # token by token
    ledger = [g for r in records(workdir, "ledger.jsonl") for g in r["groups"]]
    assert len(set(ledger)) == len(ledger)
    result = json.loads((workdir / "result.json").read_text())
    a, c = result["accounting"], result["coordination"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    # The coordinator stops the surplus groups it still runs; the others finished before the news.
    assert a["consumed"] == len(ledger) and a["surplus"] >= c["groups_surplus"]
    assert c["requests_submitted"] > 0 and c["syncs"] >= 2  # both engines took new weights
    if mix == "keep":
        # Every group launched a sample more than it keeps: the extras were stopped and counted.
        assert steps[-1]["samples_redundant"] > 0 and a["surplus"] == 0
    else:
        # Released buffers hand the trainer what they hold: no more than B per step, and B' > B
        # reservations per buffer leave surplus groups.
        assert all(r["groups"] <= 3 for r in steps) and a["surplus"] > 0
    # Per-step metrics carry the counters (the coordinator runs on after the last step's line).
    assert steps[-1]["samples_redundant"] <= c["samples_redundant"]
    trace = json.loads((workdir / "coordinator_trace.json").read_text())
    assert trace["loads"] and {row[1] for row in trace["loads"]} == {0, 1}
    assert all(len(g) == 4 for g in trace["group_lengths"])


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, base_dir, capsys):
    """The newest checkpoint damaged: the run says so, keeps it aside and resumes from the step before, each
    step trained once; with no usable checkpoint left (damaged arrays, a wrong trajectory snapshot) it stops
    with exit code 2, the directory and each step's damage named."""
    from jaxflow.jobs import rl
    config = small_config(tmp_path, base_dir, **{"trainer.steps": "2", "eval.every": "100"})
    assert rl.run(config) == 0
    workdir = pathlib.Path(config.workdir)
    ckpts = workdir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["1", "2"]
    (ckpts / "2" / "state" / "_METADATA").write_text('{"tree_metadata": ')
    capsys.readouterr()
    longer = small_config(tmp_path, base_dir, **{"trainer.steps": "3", "eval.every": "100"})
    assert rl.run(longer) == 0
    out, err = capsys.readouterr()
    assert f"checkpoint step 2 in {ckpts} is damaged" in err and f"kept as {ckpts / 'damaged-2'}" in err
    assert f"resuming {workdir} from step 1" in out
    assert (ckpts / "damaged-2" / "state").is_dir()
    check_each_step_once(workdir, 3, 2)
    # Step 2's arrays damaged, step 3's trajectory snapshot saved wrong (its checksums match): neither usable.
    (ckpts / "2" / "state" / "_METADATA").write_text("")
    damage_extra(ckpts / "3", "wrong-value", resign=True)
    assert rl.run(small_config(tmp_path, base_dir, **{"trainer.steps": "4"})) == 2
    err = capsys.readouterr().err
    assert f"no intact checkpoint in {ckpts}" in err and "step 2" in err and "Traceback" not in err
    # v_train one ahead: the snapshot's own checks refuse it, or, when the groups it held are consistent with
    # either version (as the run's timing leaves them), the check of its version against the step's does.
    said = f"checkpoint step 3 in {ckpts} is damaged: its trajectory snapshot ('trajectories') is "
    assert f"{said}invalid" in err or f"{said}at train version 4, the checkpoint's step is 3" in err, err
