"""The trainer: batch.py (trajectories -> token rows), advantages.py, losses.py (the policy-loss registry),
step.py (the jit-compiled, sharded update), state.py (the train state pytree), checkpoint.py (orbax), and
rl_trainer.py (a consumed buffer -> one update -> the next version published)."""
