"""The three placements of a jaxflow service, for tests that must pass against all of them.

embedded: the object itself. server: the object served by `jaxflow.transport.rpc.Server` on loopback (with a
token) and reached through a `jaxflow.transport.rpc.Client`. ray: the object moved into a Ray actor
(`jaxflow.cluster.ray_actors.host`) and reached through its `ServiceProxy`. Each must behave as the object
does, exceptions included. The ray placement joins one local Ray (2 CPUs, token authentication) per test
session, started on first use and shut down by the session fixture in conftest.py.
"""

import contextlib
import os

import pytest
from waiting import wait_until

from jaxflow.cluster import ray_actors  # Ray itself is imported only where a placement needs it

# For parametrize and fixture params: the Ray placement starts a local Ray, so it is in the slow tier only.
PLACEMENTS = ["embedded", "server", pytest.param("ray", marks=pytest.mark.slow)]

# The allow-list every placement serves: the library's own (the RL job serves the same on Ray).
SERVICE_METHODS = {"TrajectoryService": list(ray_actors.TRAJECTORY_SERVICE_METHODS)}


@contextlib.contextmanager
def placed(placement):
    """Yields `place(obj)` returning obj, or a client of a server wrapping obj (closed on exit)."""
    if placement == "embedded":
        yield lambda obj: obj
        return
    if placement == "ray":
        with _ray_placed() as place:
            yield place
        return
    from jaxflow.transport import rpc
    servers, clients = [], []

    def place(obj):
        server = rpc.Server(obj, SERVICE_METHODS[type(obj).__name__], token="test-token").start()
        client = rpc.Client(server.address, token="test-token")
        servers.append(server)
        clients.append(client)
        return client

    try:
        yield place
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.close()


def ray_session():
    """This test session's service host actor, in its local Ray cluster; both start on first use and
    stay up for the session (starting an actor takes a process, ~1.5 s here)."""
    global _RAY_HOST
    ray_actors.connect(num_cpus=2)
    if _RAY_HOST is None:
        _RAY_HOST = ray_actors.start_host(name=f"test-services-{os.getpid()}")
    return _RAY_HOST


_RAY_HOST = None


def ray_session_end():
    """Leaves this session's local Ray (a test that needs a cluster of its own calls this first); the next
    "ray" placement starts a new one."""
    global _RAY_HOST
    import ray
    _RAY_HOST = None
    if ray.is_initialized():
        ray.shutdown()


def start_cluster(head_resources: dict[str, float], nodes: list[dict]):
    """A `ray.cluster_utils.Cluster` on this machine, this process connected to it (after leaving the
    session's local Ray): a head with no CPU and `head_resources`, and a node for each of `nodes` (each
    `add_node`'s arguments, e.g. {"num_cpus": 2, "resources": {"trainer": 2}}). The caller shuts it down
    (`ray.shutdown()`, then `cluster.shutdown()`).

    What a test never reads is left out: the dashboard's modules (the head still serves Ray's API) and the
    autoscaler's monitor. The nodes start together, each with its raylet and agents, and are waited for once.
    """
    from ray.cluster_utils import Cluster
    ray_session_end()  # one driver connection per process
    ray_actors.ensure_auth_token()  # a fresh machine has no token yet
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": dict(head_resources),
                                                            "include_dashboard": False, "no_monitor": True})
    for node in nodes:
        cluster.add_node(wait=False, **node)
    cluster.wait_for_nodes(timeout=120)  # a loaded machine; a hang fails here, not in a test
    ray_actors.connect(cluster.address)  # refuses a cluster without token authentication
    return cluster


def kill_and_wait(handle, timeout=60.0):
    """`ray.kill(handle)`, then returns once a call on the actor fails. The kill travels through Ray's
    control store while a call goes straight to the actor, so a call made just after the kill can still
    run; a test that needs the actor dead waits here."""
    import ray
    ray.kill(handle)

    def dead():
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the actor neither answered nor died within {timeout}s of ray.kill") from None
        return False
    wait_until(dead, timeout, "the actor to fail calls after ray.kill", interval=0.05)


@contextlib.contextmanager
def _ray_placed():
    on = ray_session()
    proxies = []

    def place(obj):
        proxies.append(ray_actors.host(obj, SERVICE_METHODS[type(obj).__name__], on=on))
        return proxies[-1]

    try:
        yield place
    finally:
        for p in proxies:
            p.close()
