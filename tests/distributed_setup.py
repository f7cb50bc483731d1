"""What the tests of one trainer mesh over several processes share (tests/trainer/test_distributed.py,
tests/cluster/test_ray_trainer.py): the batches they train, the trainer settings and the bound on "the same
step"."""

import numpy as np

from jaxflow.config import load_config
from jaxflow.data.records import ConsumedBatch, FinishedGroup, Sample

# The bound for "the same step": on the loss relative to the size of its terms, on the gradient
# norm relative to itself, on every parameter absolutely.
BOUND = 1e-5
# Metrics that are wall-clock times, which differ from process to process.
TIMINGS = ("step_s", "batch_s", "compile_s")


def buffer(version: int, seed: int) -> ConsumedBatch:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = [Sample(rng.integers(3, 60, n).tolist(), (-2.0 + 0.3 * rng.normal(size=n)).tolist(),
                          [version] * n, "stop") for n in rng.integers(3, 20, 4)]
        groups.append(FinishedGroup(g, rng.integers(3, 60, 8).tolist(), version, samples,
                                    rng.integers(0, 2, 4).astype(float).tolist()))
    return ConsumedBatch(version, groups, "full")


def trainer_section():
    trainer = load_config("configs/arithmetic_tiny.py", {}).trainer
    trainer.lr, trainer.warmup_steps, trainer.micro_batch_rows = 1e-3, 0, 0
    # A large Adam eps keeps the update continuous in the gradient: with eps=1e-8 the first update is
    # lr * sign(g), and summation-order noise on a near-zero gradient element would flip it whole.
    trainer.adam_eps = 1e-3
    # One trajectory per row, so that both processes' halves of the batch hold (different) data.
    trainer.pack = trainer.share_prompts = False
    return trainer
