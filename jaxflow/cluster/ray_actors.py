"""jaxflow's services in a Ray actor, and the proxy that stands in for each.

A `ServiceHost` actor (`start_host`) holds one or more services by name. `host(service, methods, on=...)`
moves a service object (a `TrajectoryService`) into it, `build(factory, methods, on=...)` builds one there
(a `ParameterService`, whose shared memory does not pickle); both return a `ServiceProxy` with the same
allow-listed methods: the same arguments, the
same return values (Ray pickles them inside its own authenticated channel, so tuples stay tuples and
records stay records), and the same exceptions (the service's own `ValueError`, `KeyError`,
`TimeoutError`... unwrapped from Ray's `RayTaskError`, with the actor-side traceback kept in
`remote_traceback`). A caller cannot tell the proxy from the object, so the coordinator, the trainer
loop and the service tests take either.

The actor is threaded (`max_concurrency`, default 32 calls at once over all its services): a trainer
blocked in `consume(v, timeout=30)` holds one of its threads and never delays a rollout worker's
`dispatch`. The services are thread-safe, as they must be when embedded in a multi-threaded process.
A service actor asks for no CPU (`num_cpus=0`): it waits on callers, and on a small cluster it must not
take a CPU that a rollout actor needs.

Ray is imported inside the functions that need it (the `cluster` extra); `connect` starts or joins a
cluster with Ray's token authentication on, and refuses to run with it off.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Iterable
from typing import Any

__all__ = ["INSTALL_HINT", "PARAMETER_SERVICE_METHODS", "TRAJECTORY_SERVICE_METHODS", "ServiceHost",
           "ServiceNotHosted", "ServiceProxy", "build", "connect", "host", "require_ray", "start_host"]

INSTALL_HINT = ("Ray is not installed: install the cluster extra (`pip install -e '.[cluster]'`, or rerun "
                "`python3 -m jaxflow.setup_env`, which installs it)")
# The methods a service's callers need (the coordinator, the trainer loop, checkpoints), served by default.
TRAJECTORY_SERVICE_METHODS = ("dispatch", "finish", "reward", "abort", "fail", "release_worker", "unrewarded",
                              "needs_sync", "take_surplus", "progress", "release", "mark_published",
                              "buffer_state", "consume", "stats", "snapshot", "renew", "ack", "restore")
PARAMETER_SERVICE_METHODS = ("publish", "pull", "latest", "versions", "manifest", "wait_for_version",
                             "poll_version", "begin", "put", "commit", "abort_publish", "read")
# Calls one service actor serves at once; each blocked `consume` or `wait_for_version` holds one.
DEFAULT_MAX_CONCURRENCY = 32


def require_ray():
    """The `ray` module, or ImportError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


def connect(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Starts a local Ray (address None, with `num_cpus` CPUs) or joins the cluster at `address`, unless
    this process is already connected; returns whether it connected now (the caller then shuts it down).
    Token authentication is required: RAY_AUTH_MODE unset (Ray's default for a local cluster) or "token";
    anything else is refused with a ValueError naming it."""
    ray = require_ray()
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: jaxflow runs on Ray only with token authentication "
                         f"(unset RAY_AUTH_MODE or set it to 'token')")
    started = not ray.is_initialized()
    if started:
        # Ray turns token authentication on by itself for a local cluster, and for joining one when a
        # token is at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
        # "local" starts a new cluster even when another one runs on this machine (address=None would join it).
        ray.init(address=address or "local", num_cpus=num_cpus if address is None else None,
                 include_dashboard=False, configure_logging=False)
    if not _token_auth_on():
        ray.shutdown()
        raise ValueError(f"the Ray cluster at {address or 'this machine'} runs without token authentication; "
                         f"jaxflow runs only on a cluster started with RAY_AUTH_MODE=token")
    return started


def ensure_auth_token() -> None:
    """Turns token authentication on for clusters this process starts (RAY_AUTH_MODE=token unless set) and
    makes sure a token exists, creating ~/.ray/auth_token on a machine that has none: what `ray.init()`
    does for a local cluster, needed before starting a `ray.cluster_utils.Cluster` (whose GCS otherwise
    exits, finding no token) on a fresh machine. Call it before `ray` is first imported in this process.
    Refuses RAY_AUTH_MODE other than "token", as `connect`."""
    # Ray reads RAY_AUTH_MODE when it is imported: set it first (call this before importing ray).
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: jaxflow runs on Ray only with token authentication "
                         f"(unset RAY_AUTH_MODE or set it to 'token')")
    require_ray()
    # Ray's own set-up step for a new local cluster (no public API does this one).
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    ensure_token_if_auth_enabled(create_token_if_missing=True)


def jax_env(cpu_devices: int | None = None) -> dict[str, str]:
    """Environment variables for an actor that runs JAX: this process's compilation cache settings (so
    actors reuse what was compiled before), and with `cpu_devices` that many CPU devices on the CPU
    platform (CPU hosts and tests)."""
    import sys
    env = {}
    jax = sys.modules.get("jax")
    for option in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes"):
        value = os.environ.get(option.upper())
        if value is None and jax is not None:
            value = getattr(jax.config, option, None)
        if value is not None:
            env[option.upper()] = str(value)
    if cpu_devices is not None:
        from jaxflow.trainer.distributed import cpu_devices_env
        env.update(cpu_devices_env(cpu_devices))
    return env


def actor_options(resources: dict[str, float] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Ray options of an actor that runs a model (a trainer process, a rollout engine): one GPU where the
    cluster has GPUs, one CPU otherwise; plus custom node `resources` and environment variables `env`."""
    gpus = require_ray().cluster_resources().get("GPU", 0) > 0
    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if gpus else {"num_cpus": 1}
    if resources:
        options["resources"] = dict(resources)
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    return options


def _token_auth_on() -> bool:
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    return is_token_auth_enabled()


class ServiceNotHosted(ConnectionError, KeyError):
    """A call for a service that its host actor does not hold: closed, or the actor was restarted by Ray and
    holds nothing yet. A ConnectionError (the service is unreachable: callers wait and retry, as for a dead
    actor) and a KeyError (it is not there)."""


class ServiceHost:
    """A Ray actor's body that hosts named service objects, each serving exactly its allow-listed methods.

    One host can hold several services (the trajectory and the parameter service of a run: "the data
    services in their own actor"); `start_host` makes one, `host` adds a service to it. Its methods are
    called remotely, through `ServiceProxy`.
    """

    def __init__(self):
        self._services: dict[str, tuple[Any, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, service: Any, methods: list[str]) -> None:
        """Hosts `service` under `name`; ValueError for a name in use or a method the service lacks."""
        missing = sorted(m for m in methods if not callable(getattr(service, m, None)))
        if missing:
            raise ValueError(f"{type(service).__name__} has no method(s) {', '.join(missing)}")
        with self._lock:
            if name in self._services:
                raise ValueError(f"a service named {name!r} is already hosted here")
            self._services[name] = (service, frozenset(methods))

    def build(self, name: str, factory: Any, kwargs: dict[str, Any], methods: list[str]) -> None:
        """Hosts `factory(**kwargs)` under `name`: for services that hold what cannot be pickled (the
        parameter service's shared memory), built where they run."""
        self.add(name, factory(**kwargs), methods)

    def remove(self, name: str) -> bool:
        """Drops the service `name` (closing it if it has `close`); whether it was hosted."""
        with self._lock:
            entry = self._services.pop(name, None)
        if entry is not None and callable(getattr(entry[0], "close", None)):
            entry[0].close()
        return entry is not None

    def where(self) -> dict[str, Any]:
        """{"pid", "node_id"}: the process and Ray node this host runs in."""
        return {"pid": os.getpid(), "node_id": require_ray().get_runtime_context().get_node_id()}

    def call(self, name: str, method: str, args: tuple, kwargs: dict) -> Any:
        """Runs `method(*args, **kwargs)` on the service `name`; AttributeError for a method not allowed,
        ServiceNotHosted for a service not hosted."""
        entry = self._services.get(name)
        if entry is None:
            raise ServiceNotHosted(f"no service named {name!r} is hosted here (hosted: {sorted(self._services)})")
        service, methods = entry
        if method not in methods:
            raise AttributeError(f"{method!r} is not served by {name!r}; served: {', '.join(sorted(methods))}")
        return getattr(service, method)(*args, **kwargs)


class ServiceProxy:
    """Stands in for a service hosted by a `ServiceHost` actor: `proxy.name(*args, **kwargs)` runs
    `service.name(*args, **kwargs)` in the actor and returns its result or raises its exception.

    handle: the host actor's handle. name: the service's name there. methods: the served methods.
    timeout: seconds a call may take before TimeoutError (None: no limit; it must exceed the longest
    blocking call). A dead or unreachable actor raises ConnectionError, as a lost RPC server does, so
    callers tell a transport failure from the service's own errors. The proxy pickles (its handle and
    method names), so it can be handed to other actors. The proxy's own attributes (`call`, `close`,
    `methods`, `handle`, `name`) take precedence over served methods of the same name; reach those
    through `call`.
    """

    def __init__(self, handle: Any, name: str, methods: Iterable[str], *, timeout: float | None = None):
        self.handle, self.name, self._methods, self._timeout = handle, name, frozenset(methods), timeout

    @property
    def methods(self) -> frozenset[str]:
        """The methods the actor serves."""
        return self._methods

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls `method(*args, **kwargs)` on the hosted service and returns its result."""
        return _get(self.handle.call.remote(self.name, method, args, kwargs), method, self._timeout)

    def close(self) -> None:
        """Drops the service from its host actor (which stays up for the others it hosts); the proxy's
        calls then raise KeyError."""
        try:
            require_ray().get(self.handle.remove.remote(self.name))
        except Exception:  # noqa: BLE001 - a host that is gone holds nothing
            pass

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not ordinary attributes.
        methods = self.__dict__.get("_methods", ())
        if name.startswith("_") or name not in methods:
            raise AttributeError(f"{name!r} is not served by this service actor; served: "
                                 f"{', '.join(sorted(methods))}")

        def method(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"Calls {name} on the service actor."
        return method

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self.handle, "name": self.name, "methods": sorted(self._methods),
                "timeout": self._timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["handle"], state["name"], state["methods"], timeout=state["timeout"])

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | self._methods)

    def __repr__(self) -> str:
        return f"ServiceProxy({self.handle!r}, {self.name!r}, methods={sorted(self._methods)})"


def start_host(*, max_concurrency: int = DEFAULT_MAX_CONCURRENCY, resources: dict[str, float] | None = None,
               name: str | None = None, max_restarts: int = 0, num_cpus: float = 0, num_gpus: float = 0,
               env: dict[str, str] | None = None) -> Any:
    """Starts a `ServiceHost` actor and returns its handle. The cluster must be connected (`connect`).

    max_concurrency: calls served at once, over all its services. resources: custom node resources the
    actor needs (e.g. {"data": 0.01}), which place it on the nodes that have them. name: the actor's
    name in Ray's dashboard and logs. max_restarts: how often Ray restarts it when its process dies (-1:
    always); a restarted host is empty (its owner hosts the services again) and the handle, and every
    proxy holding it, reaches the new process. num_cpus, num_gpus: CPUs and GPUs it reserves (a reward pool's
    workers use CPUs; a reward model a GPU). env: environment variables of its process (e.g. `jax_env()`).
    """
    ray = require_ray()
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
    if not ray.is_initialized():
        raise RuntimeError("Ray is not connected: call jaxflow.cluster.ray_actors.connect(address) first")
    options: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": max_concurrency}
    if num_gpus:
        options["num_gpus"] = num_gpus
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    if max_restarts:
        options["max_restarts"] = max_restarts
    if resources:
        options["resources"] = dict(resources)
    if name is not None:
        options["name"] = name
    return _remote_host_class().options(**options).remote()


def host(service: Any, methods: Iterable[str], *, on: Any = None, name: str | None = None,
         timeout: float | None = None) -> ServiceProxy:
    """Moves `service` into the host actor `on` (None: a new one, `start_host()`) under `name` (None: a
    fresh one), serving `methods`, and returns its proxy (`timeout`: see `ServiceProxy`).

    The service is pickled into the actor: from here on the actor's copy is the service, and the object
    passed in must not be used. Raises ValueError naming a method the service lacks, before anything is
    sent.
    """
    methods = sorted(set(methods))
    missing = [m for m in methods if not callable(getattr(service, m, None))]
    if missing:
        raise ValueError(f"{type(service).__name__} has no method(s) {', '.join(missing)}")
    handle = start_host() if on is None else on
    name = name if name is not None else f"{type(service).__name__}-{os.getpid()}-{next(_names)}"
    _get(handle.add.remote(name, service, methods), "add", None)
    return ServiceProxy(handle, name, methods, timeout=timeout)


def build(factory: Any, methods: Iterable[str], *, kwargs: dict[str, Any] | None = None, on: Any = None,
          name: str | None = None, timeout: float | None = None) -> ServiceProxy:
    """Like `host`, but the service is built in the actor as `factory(**kwargs)` (factory: a class or
    function importable there), so nothing of it is pickled but its arguments."""
    methods = sorted(set(methods))
    handle = start_host() if on is None else on
    name = name if name is not None else f"{getattr(factory, '__name__', 'service')}-{os.getpid()}-{next(_names)}"
    _get(handle.build.remote(name, factory, dict(kwargs or {}), methods), "build", None)
    return ServiceProxy(handle, name, methods, timeout=timeout)


_names = itertools.count()


def _get(ref: Any, what: str, timeout: float | None) -> Any:
    """`ray.get(ref)`, with the actor's exception re-raised as itself (not Ray's wrapper), a timeout as
    TimeoutError and a dead actor as ConnectionError."""
    ray = require_ray()
    from ray import exceptions as rex
    try:
        return ray.get(ref, timeout=timeout)
    except rex.RayTaskError as e:
        cause = e.cause
        if not isinstance(cause, BaseException):
            raise RuntimeError(f"{what} raised in the service actor:\n{e}") from None
        try:
            cause.remote_traceback = str(e)
        except (AttributeError, TypeError):
            pass
        raise cause from None
    except rex.GetTimeoutError:
        raise TimeoutError(f"{what}: no reply from the service actor within {timeout}s") from None
    except (rex.RayActorError, rex.ObjectLostError) as e:
        raise ConnectionError(f"{what}: the service actor is gone ({type(e).__name__}: {e})") from None


@functools.cache
def _remote_host_class():
    return require_ray().remote(ServiceHost)
