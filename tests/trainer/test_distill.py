"""On-policy distillation (jaxflow/trainer/distill.py): the advantage against a float64 reference, a teacher equal
to the student leaves the policy bit for bit unchanged (full or LoRA) and the task's advantage as it is in a mix,
another (larger) teacher moves the student towards itself with the per-token KL it reports, the forward passes
it adds, and the config check refuses a teacher whose vocabulary is not the student's, naming both."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import lively_tiny_model
from flax import nnx
from tolerances import F32_EPS, assert_sums_close, forward_terms, policy_loss_scale, sum_atol
from train_step_setup import SEQ_LEN, assert_trees_close, host, one_device, optimizer, run, setup, trajectories

from jaxflow import sharding
from jaxflow.config import ConfigError, load_config
from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample
from jaxflow.jobs import rl
from jaxflow.models.hf_io import load_model
from jaxflow.models.lora import LoRASpec
from jaxflow.models.tiny import write_tiny_model
from jaxflow.models.transformer import Transformer
from jaxflow.trainer import step as step_module
from jaxflow.trainer.batch import make_batch
from jaxflow.trainer.distill import DistillOptions, distill_advantage, distill_metrics, teacher_problems
from jaxflow.trainer.rl_trainer import RLTrainer, TrainerConfig, check_trainer_config, step_config
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, token_logprobs


def test_advantage_and_metrics_equal_a_float64_reference():
    rng = np.random.default_rng(0)
    teacher = rng.uniform(-12, 0, (3, 17)).astype(np.float32)
    student = rng.uniform(-12, 0, (3, 17)).astype(np.float32)
    task = rng.normal(0, 1.5, (3, 17)).astype(np.float32)
    mask = rng.random((3, 17)) < 0.7
    for coef, task_coef in ((1.0, 0.0), (0.5, 1.0), (2.0, 0.25)):
        got = np.asarray(distill_advantage(teacher, student, task, coef, task_coef))
        t, s, a = (x.astype(np.float64) for x in (teacher, student, task))
        want = coef * (t - s) + task_coef * a
        # Each term rounds once or twice in float32: a few eps of the terms' magnitudes.
        scale = coef * (np.abs(t) + np.abs(s)) + task_coef * np.abs(a)
        np.testing.assert_array_less(np.abs(got - want), 4 * F32_EPS * scale + 1e-30)
        metrics = {k: float(v) for k, v in distill_metrics(teacher, student, got, mask).items()}
        n = mask.sum()
        np.testing.assert_allclose(metrics["distill_kl"], (s - t)[mask].mean(), rtol=0,
                                   atol=sum_atol(n, np.abs(s - t).max()) / n * 4)
        np.testing.assert_allclose(metrics["distill_adv_mean"], want[mask].mean(), rtol=0,
                                   atol=sum_atol(n, np.abs(want).max()) / n * 4 + 4 * F32_EPS * scale.max())
        np.testing.assert_allclose(metrics["distill_adv_abs_mean"], np.abs(want)[mask].mean(), rtol=0,
                                   atol=sum_atol(n, np.abs(want).max()) / n * 4 + 4 * F32_EPS * scale.max())


def test_options_are_checked_by_key():
    with pytest.raises(ConfigError) as e:
        DistillOptions.from_config({"teacher": "", "coef": -1.0, "task_coef": float("nan"), "coeff": 1.0})
    text = str(e.value)
    for key in ("trainer.distill.teacher", "trainer.distill.coef", "trainer.distill.task_coef",
                "trainer.distill.coeff"):
        assert key in text, (key, text)
    with pytest.raises(ConfigError, match="trainer.distill.coef and trainer.distill.task_coef are both 0"):
        DistillOptions(teacher="somewhere", coef=0.0, task_coef=0.0)
    # The trainer section holds it, and step_config passes its coefficients on only with a teacher set.
    trainer = TrainerConfig.section(distill={"teacher": "t", "coef": 0.5, "task_coef": 1.0})
    check_trainer_config(trainer)
    assert step_config(trainer).distill == DistillOptions(teacher="t", coef=0.5, task_coef=1.0)
    assert step_config(TrainerConfig.section()).distill is None
    with pytest.raises(ValueError, match="teacher set"):
        StepConfig(distill=DistillOptions())
    with pytest.raises(ConfigError, match="trainer.distill.coef"):
        check_trainer_config(TrainerConfig.section(distill={"teacher": "t", "coef": -2.0}))


@pytest.mark.slow  # writes five tiny models and builds a trainer
def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path):
    student = write_tiny_model(tmp_path / "student")
    assert teacher_problems(student, student) == []
    # A larger teacher with the same tokenizer is fine.
    assert teacher_problems(write_tiny_model(tmp_path / "larger", hidden_size=96, num_layers=3), student) == []

    bigger_vocab = write_tiny_model(tmp_path / "bigger_vocab", vocab_size=640)
    problems = teacher_problems(bigger_vocab, student)
    assert any("vocab sizes" in p and "teacher 640, student 512" in p for p in problems), problems
    assert all(str(bigger_vocab) in p and str(student) in p and "trainer.distill.teacher" in p for p in problems)

    other_merges = write_tiny_model(tmp_path / "other_merges", seed=1)  # same size, another BPE vocabulary
    problems = teacher_problems(other_merges, student)
    assert len(problems) == 1, problems
    assert "do not share a tokenizer" in problems[0] and "first difference at id" in problems[0], problems
    assert str(other_merges) in problems[0] and str(student) in problems[0]

    missing = teacher_problems(tmp_path / "nowhere", student)
    assert missing and all(str(tmp_path / "nowhere") in p for p in missing), missing

    # The trainer itself refuses a teacher of another vocab size, whoever built it.
    trainer_config = load_config("configs/arithmetic_tiny.py", {"trainer.distill.teacher": str(bigger_vocab)}).trainer
    with pytest.raises(ConfigError, match=f"trainer.distill.teacher {bigger_vocab} has vocab size 640 and the "
                                          f"policy 512"):
        RLTrainer(load_model(student), trainer_config, one_device(), seq_len=64, max_sequences=16)

    # The rl job's config check runs it against the base model when that exists, else on the teacher alone.
    config = load_config("configs/arithmetic_tiny.py", {"trainer.distill.teacher": str(other_merges),
                                                        "base.dir": str(student)})
    with pytest.raises(ConfigError, match="do not share a tokenizer") as e:
        rl.check_config(config)
    assert str(other_merges) in str(e.value) and str(student) in str(e.value)
    rl.check_config(load_config("configs/arithmetic_tiny.py", {"trainer.distill.teacher": str(other_merges),
                                                               "base.dir": str(tmp_path / "not_built")}))
    with pytest.raises(ConfigError, match="trainer.distill.teacher: the teacher model .*nowhere"):
        rl.check_config(load_config("configs/arithmetic_tiny.py", {"trainer.distill.teacher": str(tmp_path / "nowhere"),
                                                                   "base.dir": str(tmp_path / "not_built")}))


def _consumed(version: int, seed: int) -> ConsumedBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = [Sample(rng.integers(3, 60, n).tolist(), [-2.0] * n, [version] * n, "stop")
                   for n in rng.integers(3, 20, 4)]
        groups.append(FinishedGroup(g, rng.integers(3, 60, 8).tolist(), version, samples, [1.0, 0.0, 0.0, 1.0]))
    return ConsumedBatch(version, groups, "full")


@pytest.mark.slow  # compiles and trains the model
@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_a_teacher_equal_to_the_student_gives_zero_advantage_and_no_update(tmp_path, lora_rank):
    """Pure distillation (task_coef 0) from the student's own directory: every advantage is exactly 0, so
    the gradient is 0 and, without weight decay, AdamW leaves every parameter bit for bit as it was (with LoRA:
    every adapter, over the base the teacher is)."""
    student = write_tiny_model(tmp_path / "m")
    config = load_config("configs/arithmetic_tiny.py", {"trainer.distill.teacher": str(student),
                                                        "trainer.distill.task_coef": "0.0",
                                                        "trainer.weight_decay": "0.0",
                                                        "trainer.lora.rank": str(lora_rank)})
    mesh = sharding.make_mesh(fsdp=2, devices=jax.devices()[:2])
    model = load_model(student, mesh=mesh, lora=LoRASpec.from_config(config.trainer.lora))
    trainer = RLTrainer(model, config.trainer, mesh, seq_len=64, max_sequences=16)
    assert trainer.teacher is not None and (trainer.lora is not None) == (lora_rank > 0)
    before = host(trainer.state.params)
    metrics, _ = trainer.train(_consumed(0, seed=0))
    assert metrics["distill_kl"] == 0.0 and metrics["distill_adv_abs_mean"] == 0.0, metrics
    assert metrics["grad_norm"] == 0.0 and metrics["num_tokens"] > 0, metrics
    after = host(trainer.state.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
    assert trainer.version == 1


@pytest.mark.slow  # compiles and trains two models
def test_a_larger_teacher_moves_the_student_by_its_per_token_kl(tmp_path):
    """A teacher of another shape (its own graphdef) on the student's mesh: the step's distill_kl is the
    masked mean of log pi_S - log pi_T computed outside the step, and the update is not zero."""
    student_dir = write_tiny_model(tmp_path / "student")
    # Weights ~10x the initializer's: a teacher whose log-probs are far from the near-uniform student's.
    teacher_dir = lively_tiny_model(tmp_path / "teacher", hidden_size=96, num_layers=3, seed=0)
    mesh = one_device()
    model, teacher = load_model(student_dir, mesh=mesh), load_model(teacher_dir, mesh=mesh)
    tx = optimizer()
    state = create_train_state(model, tx, mesh)
    cfg = StepConfig(distill=DistillOptions(teacher=str(teacher_dir), coef=1.0, task_coef=0.0))
    step = TrainStep(nnx.graphdef(model), tx, cfg, mesh,
                     train_state_shardings(state.params, tx, mesh), teacher=teacher)
    batch, _ = make_batch(trajectories(seed=3), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)

    mask = np.asarray(batch.loss_mask) > 0
    logp = {}
    for name, m in (("student", model), ("teacher", teacher)):
        logp[name] = np.stack([np.asarray(token_logprobs(m, jax.tree.map(lambda x, i=i: x[i], batch))[0])
                               for i in range(batch.tokens.shape[0])])
    kl = (logp["student"] - logp["teacher"])[mask]
    before = host(state.params)
    state, metrics = step(state, batch)
    metrics = host(metrics)
    # Two programs computing the same forwards: each log-prob within the rounding of its logits.
    scale = max(np.abs(x[mask]).max() for x in logp.values())
    atol = 2 * sum_atol(max(forward_terms(c) for c in (model.config, teacher.config)), scale)
    np.testing.assert_allclose(metrics["distill_kl"], kl.mean(), rtol=0, atol=atol)
    np.testing.assert_allclose(metrics["distill_adv_abs_mean"], np.abs(kl).mean(), rtol=0, atol=atol)
    assert abs(kl.mean()) > 100 * atol  # a different model: the KL is far from zero
    assert metrics["grad_norm"] > 0
    after = host(state.params)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    assert all(moved), moved
    # The direction: further updates on these tokens bring the student's log-probs towards the teacher's.
    gaps = [float(metrics["distill_adv_abs_mean"])]
    for _ in range(4):
        state, metrics = step(state, batch)
        gaps.append(float(metrics["distill_adv_abs_mean"]))
    assert all(b < a for a, b in zip(gaps, gaps[1:])), gaps



@pytest.mark.slow  # compiles and trains the model
@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_teacher_equal_to_the_student_leaves_the_task_advantage_as_it_is(minibatches):
    """The mix with task_coef 1 and a teacher equal to the student is the plain update: the distillation term
    is exactly 0 (with two minibatches the student's starting log-probs are the π_prox pass)."""
    mesh = one_device()
    batch, _ = make_batch(trajectories(seed=4), num_rows=16, seq_len=SEQ_LEN, micro_batches=2)
    plain_params, plain = run(mesh, batch, StepConfig(minibatches=minibatches))
    state, _, model = setup(mesh)
    tx = optimizer()
    cfg = StepConfig(minibatches=minibatches, distill=DistillOptions(teacher="the student", coef=1.0, task_coef=1.0))
    teacher = nnx.merge(nnx.graphdef(model), jax.tree.map(jnp.copy, nnx.state(model)))  # the state is donated
    step = TrainStep(nnx.graphdef(model), tx, cfg, mesh, train_state_shardings(state.params, tx, mesh),
                     teacher=teacher)
    state, metrics = step(state, batch)
    metrics = host(metrics)
    assert metrics["distill_kl"] == 0.0, metrics
    # The step's metrics are means over its minibatches of each one's token mean.
    adv, mask = (np.asarray(x).reshape(minibatches, -1) for x in (batch.advantages, batch.loss_mask))
    want = np.mean([np.abs(a)[m > 0].mean() for a, m in zip(adv, mask)])
    np.testing.assert_allclose(metrics["distill_adv_abs_mean"], want, rtol=0,
                               atol=sum_atol(int(mask.sum()), np.abs(adv).max()))
    assert_sums_close(metrics["loss"], plain[0]["loss"], *policy_loss_scale(batch))
    assert_trees_close(host(state.params), plain_params, atol=1e-6)


@pytest.mark.slow  # traces the step four times
def test_the_teacher_adds_one_forward_pass_and_the_students_start_reuses_prox(monkeypatch):
    """Forward passes traced into the step: the teacher's, plus the student's at its starting weights, which
    with two minibatches (prox "recompute") is the π_prox pass itself. Traced, not compiled or run."""
    calls = []
    original = step_module.token_logprobs

    def counting(model, *args, **kwargs):
        calls.append(model.config.hidden_size)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(step_module, "token_logprobs", counting)
    monkeypatch.setattr(jax.stages.Lowered, "compile", lambda self, *args, **kwargs: None)
    mesh = one_device()
    state, _, model = setup(mesh)
    teacher = Transformer(dataclasses.replace(model.config, hidden_size=96), rngs=nnx.Rngs(1))  # another shape
    tx = optimizer()
    counts = {}
    for minibatches in (1, 2):
        for distilled in (False, True):
            cfg = StepConfig(minibatches=minibatches,
                             distill=DistillOptions(teacher="t") if distilled else None)
            step = TrainStep(nnx.graphdef(model), tx, cfg, mesh, train_state_shardings(state.params, tx, mesh),
                             teacher=teacher if distilled else None)
            calls.clear()
            step.compile(state, (2, 8, SEQ_LEN))
            counts[minibatches, distilled] = list(calls)
    for minibatches, extra_student in ((1, 1), (2, 0)):
        plain, distilled = counts[minibatches, False], counts[minibatches, True]
        assert distilled.count(96) == 1 and 96 not in plain, counts
        assert distilled.count(64) == plain.count(64) + extra_student, counts
