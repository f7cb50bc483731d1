"""What `python -m jaxflow.main` runs (`config.job`): rl.py (the async RL run; rl_cluster.py drives it when the
trainer runs as Ray processes), warm_start.py (the supervised warm start that builds a tiny base model),
model_check.py (HF round trip on the mesh), and rollout_worker.py (a rollout worker as its own process;
ray_rollout.py as a Ray actor). Beside them the pieces they share: train_loop.py (the RL train loop, its
evaluator and its conclusion), scorers.py (where a reward model, judge or rollout-side teacher runs), prompts.py,
bookkeeping.py, evaluation.py and run_log.py. No module here
depends on one that depends on it (pyproject.toml's import-linter contract "jaxflow.jobs acyclic")."""
