"""The two placements of a jaxflow service, for tests that must pass against both.

embedded: the object itself. server: the object served by `jaxflow.transport.rpc.Server` on loopback (with a
token) and reached through a `jaxflow.transport.rpc.Client`, which must behave the same, exceptions included.
"""

import contextlib

PLACEMENTS = ["embedded", "server"]

SERVICE_METHODS = {
    "TrajectoryService": ["dispatch", "finish", "reward", "abort", "fail", "release_worker", "unrewarded",
                          "needs_sync", "take_surplus", "progress", "release", "mark_published", "buffer_state",
                          "consume", "stats", "snapshot", "renew", "ack",
                          "restore"],
}


@contextlib.contextmanager
def placed(placement):
    """Yields `place(obj)` returning obj, or a client of a server wrapping obj (closed on exit)."""
    if placement == "embedded":
        yield lambda obj: obj
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
