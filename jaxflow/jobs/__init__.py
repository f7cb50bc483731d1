"""What `python -m jaxflow.main` runs (`config.job`): rl.py (the embedded async RL run), warm_start.py (the
supervised warm start that builds a tiny base model), model_check.py (HF round trip on the mesh), and
rollout_worker.py (a rollout worker as its own process); with evaluation.py and run_log.py beside them."""
