"""Cluster mode on Ray: config.py (the `cluster` config section, checked), names.py (the Ray names of a
run's actors), ray_actors.py (services in a Ray actor, and the proxy that stands in for them; joining or
starting a cluster with token authentication), trainer_group.py (the trainer as N Ray actors forming one
JAX mesh), weights.py (policy versions through Ray's object store); the RL job that drives them is
`jaxflow.jobs.rl_cluster`. Ray is the `cluster` extra, imported only inside the functions that
need it. The services never import this package."""
