"""The RL job with LoRA adapters (`trainer.lora`): the base frozen, the adapters alone trained, synced to
the JAX engine and checkpointed; a resumed run continues from the adapters it saved; the export is the
merged policy. (That LoRA learns as full fine-tuning does is a run of the tool demo, not a test.)"""

import json
import subprocess

import jax
import numpy as np
import pytest
from engine_helpers import require_vllm
from flax import nnx
from small_runs import check_each_step_once, job_command, records, small_config
from tolerances import assert_engines_served_the_trainers_weights

from jaxflow.jobs import rl
from jaxflow.models import hf_io

pytestmark = pytest.mark.slow  # runs of the RL job end to end

LEARNS = {"base.steps": "300", "base.num_examples": "2000", "task.max_ops": "1",
          "task.reward_ref": "jaxflow.tasks.arithmetic:even_answer_reward", "trainer.batch_groups": "8",
          "trainer.eta": "2", "eval.every": "1000", "checkpoint.every": "4", "trainer.lora.rank": "8",
          "trainer.lr": "1e-3"}


def test_lora_trains_the_adapters_alone_and_resumes_from_them(tmp_path, capsys, shared_base):
    steps = 8
    # A base warm-started long enough that its answers earn the reward some of the time: every step has a
    # signal that moves the adapters.
    config = small_config(tmp_path, tmp_path / "base", **{**LEARNS, "trainer.steps": str(steps // 2)})
    shared_base(config, tmp_path / "base")  # the run finds it built for its settings
    assert rl.run(config) == 0
    out = capsys.readouterr().out
    assert "jaxflow: LoRA rank 8 (alpha 32) on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in out
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    base = hf_io.load_model(tmp_path / "base")
    total = sum(x.size for x in jax.tree.leaves(nnx.state(base)))
    # Adapters on 7 projections of 2 layers, rank 8: 8 x (in + out) each, a small fraction of the model.
    assert 0 < result["trained_params"] < total / 5
    # Resumed from the adapters it checkpointed: the steps continue, none twice.
    with config.unlocked():
        config.trainer.steps = steps
    assert rl.run(config) == 0
    assert "resuming" in capsys.readouterr().out
    trained = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in trained] == list(range(steps))
    # Every step with a reward signal moved the adapters (a gradient reached them through the frozen base).
    assert all(r["update_norm"] > 0 and r["grad_norm"] > 0 for r in trained if r["zero_signal_groups_frac"] < 1)
    # The export is the merged policy: an HF model that differs from the base where the adapters moved it.
    export = hf_io.load_model(tmp_path / "run" / "export")
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(jax.tree.leaves(nnx.state(export)),
                             jax.tree.leaves(nnx.state(base)))]
    assert max(moved) > 0
    # Adapters of another rank cannot take over the run: refused before anything changes, the checkpoints kept.
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with config.unlocked():
        config.trainer.lora.rank, config.trainer.steps = 4, steps + 4
    assert rl.run(config) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == kept


def test_lora_with_vllm_rollouts_syncs_the_adapters_alone(tmp_path, base_dir):
    """The job with real vLLM (its public LoRA interface) as the rollout engine: each version reaches vLLM
    as a new adapter (merged weights, or adapters to an engine without LoRA, would be refused and stop the
    job), the bound and the accounting hold, and vLLM's log-probs agree with the trainer's recomputation.
    That vLLM applies the adapters it gets, to 1e-4, is tests/rollout_bridge/test_vllm_engine_lora.py's
    (four steps move the adapters too little for pi_prox / mu to tell). Its own process: vLLM's loggers
    bind to the streams of the process that imports it. The data services run in a Ray actor: vLLM pulls
    each version's adapters from the parameter service there."""
    require_vllm("the LoRA job with vLLM")
    workdir = tmp_path / "run"
    cmd, env = job_command(base_dir, workdir, **{"rollout.engine": "vllm", "trainer.steps": 4, "trainer.eta": 1,
                                                 "trainer.lora.rank": 8, "trainer.lr": 1e-3, "cluster.mode": "ray"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "jaxflow: weight syncs to vLLM carry the LoRA adapters alone" in proc.stdout
    steps = [r for r in records(workdir) if "loss" in r]
    assert len(steps) == 4 and steps[-1]["weight_syncs"] >= 2
    for r in steps:
        assert max(int(k) for k in r["staleness"]) <= 1
    assert_engines_served_the_trainers_weights(steps)
    check_each_step_once(workdir, 4, 2)
    assert (workdir / "adapter" / "adapter_model.safetensors").exists()
    placed = json.loads((workdir / "result.json").read_text())["cluster"]
    assert placed["parameter_service"] == placed["trajectory_service"]  # one data-services actor
    assert f"the data services run in a Ray actor (pid {placed['parameter_service']['pid']}," in proc.stdout
