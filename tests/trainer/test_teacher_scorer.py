"""On-policy distillation with the teacher beside the rollout (`trainer.distill.where = "rollout"`): the
`TeacherScorer`'s per-token log-probs equal the step's own teacher forward on the same tokens within the rounding of
two programs computing one forward (multi-turn samples and split training sequences included), a step given the
recorded log-probs makes the in-step teacher's update, records with bad teacher log-probs are refused naming the
field (and travel and snapshot intact when good), and a failing teacher fails only its group, by name."""

import threading

import jax
import numpy as np
import pytest
from engine_helpers import lively_tiny_model
from flax import nnx
from tolerances import F32_EPS, forward_terms, sum_atol
from train_step_setup import host, one_device, optimizer

from jaxflow.config import ConfigError
from jaxflow.data import checks
from jaxflow.data.records import FinishedGroup, GroupTask, Sample
from jaxflow.data.service_errors import SampleRefused
from jaxflow.data.service_snapshot import _sample, snapshot_samples
from jaxflow.models.hf_io import load_model
from jaxflow.models.tiny import write_tiny_model
from jaxflow.trainer.batch import make_batch
from jaxflow.trainer.distill import DistillOptions
from jaxflow.trainer.rl_trainer import screen_groups, trajectories_of
from jaxflow.trainer.state import create_train_state, train_state_shardings
from jaxflow.trainer.step import StepConfig, TrainStep, token_logprobs
from jaxflow.transport import wire
from rollout_bridge import teacher as teacher_module
from rollout_bridge.teacher import TeacherFailed, TeacherScorer

SEQ_LEN = 64
LR, EPS = 1e-3, 1e-3  # train_step_setup.optimizer's: Adam's first update is (LR / EPS)-Lipschitz in the gradient


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(student directory, teacher directory): a tiny student and a larger, lively teacher of its vocabulary."""
    root = tmp_path_factory.mktemp("distill_models")
    return (write_tiny_model(root / "student"),
            lively_tiny_model(root / "teacher", hidden_size=96, num_layers=3, seed=0))


def _groups(version=0, seed=0) -> list[FinishedGroup]:
    """Four groups of four samples; one sample a multi-turn episode (env spans), one split into two training
    sequences (a started one)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = []
        for n in rng.integers(4, 16, 4):
            samples.append(Sample(rng.integers(3, 500, n).tolist(), (-5.5 + 0.3 * rng.normal(size=n)).tolist(),
                                  [version] * n, "stop"))
        groups.append(FinishedGroup(g, rng.integers(3, 500, int(rng.integers(3, 9))).tolist(), version, samples,
                                    [1.0, 0.0, 0.0, 1.0]))
    episode = groups[1].samples[0] = Sample(rng.integers(3, 500, 12).tolist(), [-5.0] * 12, [version] * 12, "stop")
    episode.env_spans = [[3, 6]]
    split = groups[2].samples[1] = Sample(rng.integers(3, 500, 12).tolist(), [-5.0] * 12, [version] * 12, "stop")
    split.env_spans, split.sequence_starts = [[2, 4], [7, 9]], [7]
    return groups


def _scored(scorer: TeacherScorer, groups: list[FinishedGroup]) -> list[FinishedGroup]:
    for g in groups:
        task = GroupTask(g.group_id, g.prompt, len(g.samples), g.v_start)
        for s, logp in zip(g.samples, scorer.score_group(task, g.samples)):
            s.teacher_logprobs = logp
    return groups


def _max_logit(model, batch) -> float:
    """max |logit| of `model` over the batch's positions (the scale `forward_terms` rounds over)."""
    out = 0.0
    for i in range(batch.tokens.shape[0]):
        h, _ = model.hidden_states(batch.tokens[i], batch.positions[i], batch.segment_ids[i], batch.context_ids[i],
                                   with_router=True)
        out = max(out, float(np.abs(np.asarray(model.logits(h))).max()))
    return out


@pytest.mark.slow  # compiles the teacher's scorer and a forward of the step's
def test_the_scorer_gives_the_steps_teacher_log_probs(models):
    """The recorded log-probs, carried through `trajectories_of` and `make_batch` as the trainer does, equal
    `token_logprobs(teacher, micro-batch)`, the step's teacher pass, on every trained token within
    sum_atol(forward_terms, max|logit|); tokens the environment wrote, or that start a sequence, record 0."""
    _, teacher_dir = models
    groups = _groups()
    with TeacherScorer(teacher_dir, max_len=SEQ_LEN, batch_size=8, chunk=16) as scorer:
        _scored(scorer, groups)
        stats = scorer.stats()
    assert stats["groups"] == 4 and stats["rows"] == 17 and stats["batches"] >= 3, stats  # 16 samples, 17 rows
    for g in groups:  # the service's own check passes them
        checks.check_samples(g.group_id, 4, g.samples, "finish", 0, 0, True, vocab_size=512)
    episode, split = groups[1].samples[0], groups[2].samples[1]
    assert episode.teacher_logprobs[3:6] == [0.0] * 3
    assert split.teacher_logprobs[2:4] == [0.0] * 2 and split.teacher_logprobs[7:9] == [0.0] * 2

    teacher = load_model(teacher_dir)
    batch, _ = make_batch(trajectories_of(groups), num_rows=16, seq_len=SEQ_LEN, micro_batches=2, pack=True,
                          share_prompts=True, teacher=True)
    in_step = np.stack([np.asarray(token_logprobs(teacher, jax.tree.map(lambda x, i=i: x[i], batch), chunk=16)[0])
                        for i in range(batch.tokens.shape[0])])
    mask = np.asarray(batch.loss_mask) > 0
    recorded = np.asarray(batch.teacher_logp)
    assert mask.sum() > 100 and np.all(recorded[~mask] == 0)
    atol = sum_atol(forward_terms(teacher.config), _max_logit(teacher, batch))
    np.testing.assert_allclose(recorded[mask], in_step[mask], rtol=0, atol=atol)
    assert np.abs(recorded[mask] + np.log(512)).max() > 100 * atol  # a lively teacher: far from uniform


@pytest.mark.slow  # compiles and runs two train steps
def test_a_step_given_recorded_teacher_log_probs_makes_the_in_step_teachers_update(models):
    """The same float32 batch through the step with the teacher in it and through the step given the scorer's
    recorded log-probs: the same distill metrics, loss and update, within what the log-probs' rounding moves."""
    student_dir, teacher_dir = models
    groups = _groups(seed=1)
    with TeacherScorer(teacher_dir, max_len=SEQ_LEN, chunk=16) as scorer:
        _scored(scorer, groups)
    mesh = one_device()
    teacher = load_model(teacher_dir, mesh=mesh)
    batch, _ = make_batch(trajectories_of(groups), num_rows=16, seq_len=SEQ_LEN, micro_batches=2, pack=True,
                          teacher=True)
    results = {}
    for where in ("step", "rollout"):
        model = load_model(student_dir, mesh=mesh)
        tx = optimizer(lr=LR, eps=EPS)
        state = create_train_state(model, tx, mesh)
        cfg = StepConfig(logprob_chunk=16, distill=DistillOptions(teacher=str(teacher_dir), where=where))
        step = TrainStep(nnx.graphdef(model), tx, cfg, mesh, train_state_shardings(state.params, tx, mesh),
                         teacher=teacher if where == "step" else None)
        before = host(state.params)
        if where == "rollout":  # the recorded log-probs are required
            with pytest.raises(ValueError, match="teacher_logp"):
                step(state, batch.replace(teacher_logp=None))
        state, metrics = step(state, batch)
        results[where] = host(state.params), host(metrics)
    (params_s, m_s), (params_r, m_r) = results["step"], results["rollout"]
    mask = np.asarray(batch.loss_mask) > 0
    n = int(mask.sum())
    # How far the recorded log-probs are from the step's teacher forward on these tokens (twice: the step's own
    # pass is a third program), within the bound the test above checks.
    in_step = np.stack([np.asarray(token_logprobs(teacher, jax.tree.map(lambda x, i=i: x[i], batch), chunk=16)[0])
                        for i in range(batch.tokens.shape[0])])
    delta = 2 * float(np.abs(np.asarray(batch.teacher_logp) - in_step)[mask].max()) + F32_EPS * np.abs(in_step).max()
    assert delta <= 2 * sum_atol(forward_terms(teacher.config), _max_logit(teacher, batch))
    # Means over the trained tokens of terms that moved by at most delta each, plus their own summation rounding.
    kl_scale = abs(m_s["distill_kl"]) + m_s["distill_adv_abs_mean"]
    for key in ("distill_kl", "distill_adv_mean", "distill_adv_abs_mean"):
        np.testing.assert_allclose(m_r[key], m_s[key], rtol=0, atol=delta + sum_atol(n, kl_scale))
    assert m_s["grad_norm"] > 0 and m_s["distill_adv_abs_mean"] > 100 * delta
    # Both steps run one program on one batch but for the teacher's log-probs. The gradient is sum_t w_t A_t c_t
    # with token weights summing to 1; the advantages moved by at most delta, i.e. by delta / mean|A| relative,
    # so the gradient by about that fraction of its norm; Adam's first update (eps = EPS) moves by at most
    # LR / EPS times the gradient's change.
    grad_delta = 4 * delta / m_s["distill_adv_abs_mean"] * m_s["grad_norm"]
    np.testing.assert_allclose(m_r["grad_norm"], m_s["grad_norm"], rtol=0, atol=grad_delta)
    moved = 0.0
    for a, b, c in zip(jax.tree.leaves(params_r), jax.tree.leaves(params_s), jax.tree.leaves(before)):
        np.testing.assert_allclose(a, b, rtol=0, atol=LR / EPS * grad_delta + 4 * F32_EPS * np.abs(c).max())
        moved = max(moved, float(np.abs(b - c).max()))
    assert moved > 10 * LR / EPS * grad_delta  # the update is far larger than what the tolerance lets through


def test_records_with_bad_teacher_log_probs_are_refused_naming_the_field():
    good = Sample([5, 6, 7], [-1.0] * 3, [0] * 3, "stop", teacher_logprobs=[-0.5, -2.0, 0.0])
    checks.check_sample("group 3 sample 1", good, 0, 0, True)
    for bad, match in (([-0.5, -2.0], r"3 tokens but 2 teacher_logprobs"),
                       ([-0.5, float("nan"), -1.0], r"teacher_logprobs\[1\] = nan"),
                       ([-0.5, -1.0, float("-inf")], r"teacher_logprobs\[2\] = -inf"),
                       ([-0.5, 0.25, -1.0], r"teacher_logprobs\[1\] = 0.25"),
                       ((-0.5, -1.0, -1.0), r"teacher_logprobs must be None or a list")):
        sample = Sample([5, 6, 7], [-1.0] * 3, [0] * 3, "stop", teacher_logprobs=bad)
        with pytest.raises(SampleRefused, match=r"group 3 sample 1: .*" + match):
            checks.check_sample("group 3 sample 1", sample, 0, 0, True)
    with pytest.raises(ValueError, match="3 tokens but 2 teacher_logprobs"):
        Sample([5, 6, 7], [-1.0] * 3, [0] * 3, teacher_logprobs=[-1.0, -1.0]).validate("s", 0, 0)
    # The trainer drops a group without them when it trains with recorded ones, naming the group and the field.
    group = FinishedGroup(4, [1, 2], 0, [good, Sample([5, 6], [-1.0] * 2, [0] * 2, "stop")], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"group 4: samples \[1\] carry no teacher_logprobs"):
        screen_groups([group], 0, SEQ_LEN, teacher=True)
    assert screen_groups([group], 0, SEQ_LEN)[0] == [group]
    with pytest.raises(ValueError, match="trajectory 1: 2 completion tokens but none teacher log-probs"):
        make_batch(trajectories_of([group]), num_rows=2, seq_len=SEQ_LEN, teacher=True)
    # Over the wire and through a snapshot, as they were; None stays None and is not saved.
    back = wire.decode(wire.encode(good))
    assert back.teacher_logprobs == good.teacher_logprobs and back == good
    saved = snapshot_samples([good, group.samples[1]])
    assert saved[0]["teacher_logprobs"] == good.teacher_logprobs and "teacher_logprobs" not in saved[1]
    assert _sample(saved[0], "g") == good and _sample(saved[1], "g").teacher_logprobs is None


def test_where_is_checked_by_key():
    with pytest.raises(ConfigError, match=r"trainer.distill.where 'trainer' is not one of \('step', 'rollout'\)"):
        DistillOptions(teacher="t", where="trainer")
    assert DistillOptions(teacher="t", where="rollout").recorded and not DistillOptions(teacher="t").recorded
    assert DistillOptions(teacher="t").in_step and not DistillOptions(where="rollout").recorded


def test_a_failing_teacher_fails_its_group_by_name(models, monkeypatch):
    """A too-long sequence, a forward pass that raises and one that hangs past timeout_s each fail their group
    with TeacherFailed naming it; the scorer goes on scoring the next group."""
    _, teacher_dir = models
    scorer = TeacherScorer(teacher_dir, max_len=16, chunk=0)
    try:
        task = GroupTask(7, [3, 4, 5], 1, 0)
        with pytest.raises(TeacherFailed, match="group 7 sample 0: a training sequence with its context of 23"):
            scorer.score_group(task, [Sample(list(range(3, 23)), [-1.0] * 20, [0] * 20, "stop")])
        original = teacher_module.rows_logprobs

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")

        monkeypatch.setattr(teacher_module, "rows_logprobs", broken)
        sample = Sample([6, 7, 8], [-1.0] * 3, [0] * 3, "stop")
        with pytest.raises(TeacherFailed, match="group 7 sample 0: RuntimeError: device lost"):
            scorer.score_group(task, [sample])
        release = threading.Event()

        def hung(*args, **kwargs):  # a forward that does not come back until released
            release.wait()
            raise RuntimeError("released")

        monkeypatch.setattr(teacher_module, "rows_logprobs", hung)
        scorer.timeout_s = 0.2
        with pytest.raises(TeacherFailed, match="group 7 sample 0: not scored within timeout_s=0.2"):
            scorer.score_group(task, [sample])
        release.set()
        scorer.timeout_s = 600.0
        monkeypatch.setattr(teacher_module, "rows_logprobs", original)
        (logp,) = scorer.score_group(GroupTask(8, [3, 4, 5], 1, 0), [sample])
        assert len(logp) == 3 and all(np.isfinite(logp)) and max(logp) < 0
        assert scorer.stats()["groups_failed"] == 3 and scorer.stats()["groups"] == 1
    finally:
        scorer.close()
    with pytest.raises(TeacherFailed, match="closed"):
        scorer.score_group(GroupTask(9, [3, 4, 5], 1, 0), [sample])
