"""Cluster mode on Ray: ray_actors.py (a service as a Ray actor, and the proxy that stands in for it;
joining or starting a cluster with token authentication). Ray is the `cluster` extra, imported only inside
the functions that need it. The services never import this package."""
