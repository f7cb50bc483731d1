"""On-policy distillation: a frozen teacher's per-token log-probs on the student's sampled tokens as an advantage.

With `trainer.distill.teacher` set (an HF model directory of any supported family, possibly larger than the
student), the trainer loads the teacher onto its own mesh, sharded like the student and frozen (its own
graphdef: it need not have the student's shape), and the jitted step (`jaxflow.trainer.step`) scores every
batch with it in a forward-only pass, as it does the KL reference policy. Each trained token then gets

    A_t = coef * (log π_T(y_t) - log π_S(y_t)) + task_coef * A_task,t        (`distill_advantage`)

where π_T is the teacher, π_S the student at the step's starting weights (a forward-only pass of the same
program as the teacher's, so a teacher equal to the student gives exactly 0), and A_task the task reward's
advantage (the batch's, from `trainer.advantage`). The first term is the per-token reverse KL, as a reward:
maximising E_{y~π_S}[log π_T(y) - log π_S(y)] minimises KL(π_S || π_T) on the student's own samples
(Agarwal et al. 2024, "On-policy distillation of language models"; Thinking Machines 2025, "On-policy
distillation"). Each token's term is its own: no sum over the tokens after it (a discount of 0, as Thinking
Machines' recipe runs) and no normalisation over the group (the log-ratios already share one scale, nats).
The advantage is a constant of the update (no gradient flows through either log-prob); the chosen policy
loss (decoupled PPO, ...) applies its usual staleness and behaviour corrections with it, since the tokens
were still sampled by μ, possibly stale.

The teacher must share the student's vocabulary: the same token ids must mean the same strings, and the
embedding tables must be the same size. `teacher_problems` compares both directories' tokenizer.json
vocabularies and config.json vocab sizes, naming both directories and what differs; the job runs it
before it loads anything.

Where the teacher's log-probs are computed is `where` (`trainer.distill.where`):

- "step" (the default): in the trainer's jitted step, as above: the teacher's weights frozen on the trainer's
  mesh, scoring exactly the rows the step trains, with no service beside it.
- "rollout": by a teacher scorer beside the rollout engines (`rollout_bridge.teacher.TeacherScorer`: a
  prefill-only, teacher-forced forward of each finished sample, batched across groups), recorded on each sample
  like its behaviour log-probs (`Sample.teacher_logprobs`) and carried into the batch (`TrajectoryBatch.
  teacher_logp`); the trainer loads no teacher, so its memory stays off the trainer's mesh, and groups are scored
  while the trainer trains. Both placements run the same log-prob function (`jaxflow.trainer.step.
  token_logprobs`), so they agree within the rounding of two programs computing the same forward.

The student's starting log-probs (log π_S) are computed in the step either way.

Metrics per step: distill_kl (the mean over trained tokens of log π_S - log π_T: the reverse-KL estimate on
the sampled tokens), distill_adv_mean and distill_adv_abs_mean (of A_t over the trained tokens).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxflow.config import Section, check_choice, check_float

TOKENIZER_FILE = "tokenizer.json"
# Where the teacher's per-token log-probs are computed (module docstring).
WHERE = ("step", "rollout")


@dataclasses.dataclass(frozen=True)
class DistillOptions(Section):
    """The `trainer.distill` section: on-policy distillation from a frozen teacher (jaxflow/trainer/distill.py).

    teacher: an HF model directory (config.json, safetensors, tokenizer.json) whose vocabulary is the student's;
      None: no distillation (coef and task_coef are then unused).
    coef: weight of the distillation advantage coef * (log pi_teacher - log pi_student) per token.
    task_coef: weight of the task reward's advantage in the mix; 0: pure distillation (the task's rewards are
      still computed and reported, but do not move the policy).
    where: "step" (the trainer's step scores each batch with the teacher on its own mesh) or "rollout" (a
      teacher scorer beside the rollout engines records each sample's teacher log-probs; the trainer loads no
      teacher). See the module docstring.
    """

    SECTION: ClassVar[str] = "trainer.distill"

    teacher: str | None = None
    coef: float = 1.0
    task_coef: float = 0.0
    where: str = "step"

    def problems(self) -> list[str]:
        problems: list[str] = []
        if self.teacher is not None and (not isinstance(self.teacher, str) or not self.teacher.strip()):
            problems.append(f"{self.key('teacher')} must be None or the path of an HF model directory, "
                            f"got {self.teacher!r}")
        for name in ("coef", "task_coef"):
            check_float(problems, self.key(name), getattr(self, name), 0.0)
        check_choice(problems, self.key("where"), self.where, WHERE)
        if not problems and self.teacher is not None and self.coef == 0 and self.task_coef == 0:
            problems.append(f"{self.key('coef')} and {self.key('task_coef')} are both 0: with a teacher set, "
                            f"every advantage would be 0 and nothing would train")
        return problems

    @property
    def enabled(self) -> bool:
        """Whether a teacher is set (its log-probs then enter every step's advantage)."""
        return self.teacher is not None

    @property
    def in_step(self) -> bool:
        """Whether the trainer's step computes the teacher's log-probs (a teacher set, where "step")."""
        return self.enabled and self.where == "step"

    @property
    def recorded(self) -> bool:
        """Whether the batch carries the teacher's log-probs, recorded beside the rollout (where "rollout")."""
        return self.enabled and self.where == "rollout"


def distill_advantage(teacher_logp_bt: jax.Array, student_logp_bt: jax.Array, task_adv_bt: jax.Array,
                      coef: float, task_coef: float) -> jax.Array:
    """The per-token advantage of on-policy distillation, [B, T] float32:

        A_t = coef * (log π_T(y_t) - log π_S(y_t)) + task_coef * A_task,t

    teacher_logp_bt: log π_T of the sampled tokens; student_logp_bt: log π_S at the step's starting weights;
    task_adv_bt: the task reward's advantage. All three are treated as constants (stop_gradient): the
    advantage weighs the policy gradient, it is not differentiated. Masked tokens are the caller's to zero
    (the policy loss zeroes them before any arithmetic)."""
    t, s, a = (jax.lax.stop_gradient(jnp.asarray(x, jnp.float32))
               for x in (teacher_logp_bt, student_logp_bt, task_adv_bt))
    return coef * (t - s) + task_coef * a


def distill_metrics(teacher_logp_bt: jax.Array, student_logp_bt: jax.Array, adv_bt: jax.Array,
                    mask_bt: jax.Array) -> dict[str, jax.Array]:
    """Means over the trained tokens (mask > 0) of one (micro-)batch: distill_kl (log π_S - log π_T, the
    reverse-KL estimate on the sampled tokens), distill_adv_mean and distill_adv_abs_mean (of the
    distillation advantage `adv_bt`). 0 when the mask is empty."""
    m = jnp.asarray(mask_bt) > 0
    n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    mean = lambda x: jnp.sum(jnp.where(m, x, 0.0)) / n  # noqa: E731
    return {"distill_kl": mean(student_logp_bt - teacher_logp_bt), "distill_adv_mean": mean(adv_bt),
            "distill_adv_abs_mean": mean(jnp.abs(adv_bt))}


def _vocab(directory: pathlib.Path) -> dict[str, int]:
    """token -> id of the directory's tokenizer.json, added tokens included."""
    import tokenizers  # here: the config half of this module stays light

    return tokenizers.Tokenizer.from_file(str(directory / TOKENIZER_FILE)).get_vocab(with_added_tokens=True)


def _vocab_difference(student: dict[str, int], teacher: dict[str, int]) -> str | None:
    """What differs between two vocabularies (None when they are the same), in a few words."""
    if student == teacher:
        return None
    by_id_s = {i: t for t, i in student.items()}
    by_id_t = {i: t for t, i in teacher.items()}
    ids = sorted(set(by_id_s) | set(by_id_t))
    first = next(i for i in ids if by_id_s.get(i) != by_id_t.get(i))
    token = lambda by_id: repr(by_id[first]) if first in by_id else "no token"  # noqa: E731
    return (f"their tokenizer.json vocabularies differ (the student's has {len(student)} tokens, the teacher's "
            f"{len(teacher)}; first difference at id {first}: student {token(by_id_s)}, teacher "
            f"{token(by_id_t)})")


def teacher_problems(teacher: str | os.PathLike, student: str | os.PathLike | None) -> list[str]:
    """Why the HF directory `teacher` cannot teach the student in `student` ([] when it can): each must hold a
    readable config.json and tokenizer.json, their vocab sizes (config.json, the embedding rows) must be equal,
    and so must their tokenizers' vocabularies (token -> id, added tokens included). Each message names both
    directories and what differs. Reads the two config files and tokenizers, no weights. student None: the
    teacher's own files only (for a check before the student's directory exists)."""
    from jaxflow.models.config import ModelConfigError, from_hf_config, read_hf_config

    teacher = pathlib.Path(teacher)
    key = DistillOptions.SECTION + ".teacher"
    configs, problems = {}, []
    roles = [("teacher", teacher)] + ([] if student is None else [("student", pathlib.Path(student))])
    for role, directory in roles:
        try:
            configs[role] = from_hf_config(read_hf_config(directory), source=str(directory / "config.json"))
        except ModelConfigError as e:
            problems.append(f"{key}: the {role} model {directory}: {e}")
        if not (directory / TOKENIZER_FILE).is_file():
            problems.append(f"{key}: the {role} model {directory} has no {TOKENIZER_FILE} to compare "
                            f"vocabularies with")
    if problems or student is None:
        return problems
    student = pathlib.Path(student)
    both = f"{key}: the teacher {teacher} and the student {student}"
    if configs["teacher"].vocab_size != configs["student"].vocab_size:
        problems.append(f"{both} have different vocab sizes (config.json vocab_size: teacher "
                        f"{configs['teacher'].vocab_size}, student {configs['student'].vocab_size})")
    try:
        differs = _vocab_difference(_vocab(student), _vocab(teacher))
    except Exception as e:  # noqa: BLE001 -- whatever the tokenizers library raises on a malformed file
        return [*problems, f"{both}: a tokenizer.json does not load: {type(e).__name__}: {e}"]
    if differs:
        problems.append(f"{both} do not share a tokenizer: {differs}")
    return problems
