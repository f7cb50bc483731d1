"""Cluster mode on Ray: ray_actors.py (services in a Ray actor, and the proxy that stands in for them;
joining or starting a cluster with token authentication), ray_trainer.py (the trainer as N Ray actors
forming one JAX mesh). Ray is the `cluster` extra, imported only inside the functions that need it. The
services never import this package."""
