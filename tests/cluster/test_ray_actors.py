"""A service in a Ray actor behind `ServiceProxy`: the same results and exception types as the object, a
blocked `consume` that does not hold up other callers, the allow-list enforced in the actor, a dead actor
as ConnectionError, a proxy handed to another Ray worker, and token authentication required."""

import threading

import pytest
import ray  # noqa: F401  (the `cluster` extra, which the setup script installs: never skipped)
from service_placements import SERVICE_METHODS, kill_and_wait, ray_session  # noqa: E402

from jaxflow.cluster import ray_actors  # noqa: E402
from jaxflow.data.prompt_source import PromptSource  # noqa: E402
from jaxflow.data.records import Sample  # noqa: E402
from jaxflow.data.trajectory_service import TrajectoryService  # noqa: E402

pytestmark = pytest.mark.slow  # Ray clusters and actors

METHODS = SERVICE_METHODS["TrajectoryService"]


def make():
    records = [{"prompt": [1 + i, 2], "meta": {"index": i}} for i in range(50)]
    return TrajectoryService(PromptSource(records, shuffle=False), batch_groups=2, group_size=2, eta=0)


def done(task):
    return [Sample([7, 7], [-1.0, -1.0], [0, 0], "stop") for _ in range(task.n)]


@pytest.fixture
def proxy():
    p = ray_actors.host(make(), METHODS, on=ray_session())
    yield p
    p.close()


def test_same_results_as_the_object(proxy):
    obj = make()
    tasks = obj.dispatch("w", 0, 2)
    assert proxy.dispatch("w", 0, 2) == tasks  # the same records, tuples and all, not wire-decoded lists
    for t in tasks:
        assert proxy.finish(t.group_id, "w", done(t), [1.0, 0.0]) == obj.finish(t.group_id, "w", done(t), [1.0, 0.0])
    assert proxy.consume(0, timeout=5) == obj.consume(0, timeout=5)
    assert proxy.stats() == obj.stats()


BAD_CALLS = [
    ("consume", (3,), {"timeout": 0.1}),  # ValueError: not the next buffer
    ("fail", (999, "why"), {}),  # KeyError: unknown group
    ("consume", (0,), {"timeout": 0.05}),  # TimeoutError: nothing arrived
    ("dispatch", ("w", "zero"), {}),  # TypeError or ValueError: a version that is not an int
    ("restore", ({"v_train": -1},), {}),
]


@pytest.mark.parametrize("method,args,kwargs", BAD_CALLS, ids=[f"{m}{i}" for i, (m, _, _) in enumerate(BAD_CALLS)])
def test_same_exception_types_and_messages_as_the_object(proxy, method, args, kwargs):
    with pytest.raises(Exception) as embedded:
        getattr(make(), method)(*args, **kwargs)
    with pytest.raises(Exception) as remote:
        getattr(proxy, method)(*args, **kwargs)
    assert type(remote.value) is type(embedded.value)
    assert str(remote.value) == str(embedded.value)
    assert method in remote.value.remote_traceback  # the actor-side traceback comes along


def test_a_blocked_consume_does_not_hold_up_other_callers(proxy):
    result = {}
    trainer = threading.Thread(target=lambda: result.update(batch=proxy.consume(0, timeout=60)))
    trainer.start()
    for t in proxy.dispatch("w", 0, 2):  # served while consume waits in the actor
        proxy.finish(t.group_id, "w", done(t), [1.0, 0.0])
    trainer.join(60)
    assert not trainer.is_alive() and len(result["batch"].groups) == 2


def test_only_allow_listed_methods_are_served(proxy):
    with pytest.raises(AttributeError, match="'_recount' is not served"):
        proxy.call("_recount")  # the actor refuses it, not just the proxy
    with pytest.raises(AttributeError, match="'source' is not served"):
        _ = proxy.source
    with pytest.raises(ValueError, match="TrajectoryService has no method.*nope"):
        ray_actors.host(make(), ["dispatch", "nope"], on=ray_session())


def test_a_closed_service_and_a_dead_actor():
    on = ray_session()
    p = ray_actors.host(make(), METHODS, on=on)
    p.close()
    with pytest.raises(KeyError, match="no service named"):
        p.stats()
    lone = ray_actors.host(make(), METHODS)  # in a host actor of its own
    assert lone.progress() == (0, 0)
    kill_and_wait(lone.handle)
    with pytest.raises(ConnectionError, match="progress: the service actor is gone"):
        lone.progress()


def test_a_proxy_works_from_another_ray_worker(proxy):

    @ray.remote(num_cpus=0)
    def rollout(service):
        tasks = service.dispatch("remote", 0, 1)
        return [t.group_id for t in tasks]

    (gid,) = ray.get(rollout.remote(proxy))
    assert proxy.stats()["groups"]["running"] == 1
    with pytest.raises(ValueError, match="assigned to worker 'remote'"):
        proxy.finish(gid, "local", done(make().dispatch("x", 0, 1)[0]), [1.0, 0.0])


def test_connect_refuses_to_run_without_token_authentication(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE='disabled'.*token authentication"):
        ray_actors.connect()
