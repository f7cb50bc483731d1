"""One JAX mesh over several trainer processes, and the entry point each of those processes runs.

A launcher (a Ray actor, `run_local` below, or one command per host) calls
`run_trainer_process(coordinator_address, num_processes, process_id, config, buffers)` in every trainer
process. That call:

1. joins the process group (`initialize`): a handshake on the coordinator's port checks, before JAX is
   touched, that each process id 0..n-1 arrives exactly once and that all agree on n, so a peer that never
   starts is named after `init_timeout_s` instead of a hang or JAX's process abort; then
   `jax.distributed.initialize` forms the group on the same address;
2. lays the (data, fsdp, tensor) mesh over every process's devices, grouped by process (`global_mesh`):
   the same layout as one process holding all the devices, with the tensor axis inside a process;
3. builds an `RLTrainer` on that mesh (the same compiled step as on one process) and trains one buffer
   after another; each process passes the same whole buffer and feeds only its own rows of the batch
   (`sharding.put_global`, through `jax.make_array_from_process_local_data`);
4. returns what every process can read: the per-step metrics and, if asked, the parameters gathered to
   host.

A process that dies cannot rejoin its group: JAX's coordination service stops the others once its
heartbeats stop (`heartbeat_timeout_s`), and the launcher forms a new group in fresh processes.
On a Cloud TPU slice, Slurm or Open MPI, `jax.distributed.initialize()` finds its peers itself: pass
coordinator_address=None (and no count or id) and the handshake is left to JAX.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import re
import socket
import time
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.data.records import ConsumedBatch
from jaxflow.models import hf_io
from jaxflow.trainer.rl_trainer import RLTrainer

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 16


class ProcessGroupError(RuntimeError):
    """The trainer processes could not form (or keep) their group; the message names the process."""


def process_config(model_dir: str, trainer: ml_collections.ConfigDict, *, seq_len: int, max_sequences: int,
                   data: int = 1, fsdp: int = -1, tensor: int = 1, init_timeout_s: float = 60.0,
                   heartbeat_timeout_s: int = 100, return_params: bool = False) -> ml_collections.ConfigDict:
    """The config of one trainer process of a multi-process mesh (every process gets the same one)."""
    config = ml_collections.ConfigDict()
    # HF model directory every process loads its shards of the policy from.
    config.model_dir = str(model_dir)
    # The run config's trainer section (loss, optimizer, micro_batch_rows...).
    config.trainer = trainer
    # Tokens per row, and the most trajectories one batch holds (RLTrainer's compiled shape).
    config.seq_len = seq_len
    config.max_sequences = max_sequences
    # Mesh axis sizes over all processes' devices; one may be -1 to take the rest.
    config.mesh = ml_collections.ConfigDict(dict(data=data, fsdp=fsdp, tensor=tensor))
    # Seconds a process waits for all the others to join before naming the missing ones.
    config.init_timeout_s = init_timeout_s
    # Seconds without a heartbeat after which JAX declares a process dead and stops the group.
    config.heartbeat_timeout_s = heartbeat_timeout_s
    # Return the trained parameters gathered to host (costs a full copy in every process).
    config.return_params = return_params
    config.lock()
    return config


def check_process_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the bad keys of a `process_config`; reads no file beyond a stat."""
    problems = []
    for key in ("data", "fsdp", "tensor"):
        size = config.mesh[key]
        if not isinstance(size, int) or (size < 1 and size != -1):
            problems.append(f"mesh.{key}={size!r} must be a positive int or -1")
    for key in ("seq_len", "max_sequences"):
        if not isinstance(config[key], int) or config[key] < 1:
            problems.append(f"{key}={config[key]!r} must be a positive int")
    for key in ("init_timeout_s", "heartbeat_timeout_s"):
        if not isinstance(config[key], (int, float)) or not config[key] > 0:
            problems.append(f"{key}={config[key]!r} must be > 0 seconds")
    if not os.path.isdir(config.model_dir):
        problems.append(f"model_dir={config.model_dir!r} is not a directory")
    if problems:
        raise ValueError("trainer process config: " + "; ".join(problems))


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of a "host:port" coordinator address; ValueError naming the address otherwise."""
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", address) if isinstance(address, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"coordinator_address {address!r} is not host:port with a port in 1..65535")
    return m.group(1), int(m.group(2))


def _check_group_args(coordinator_address, num_processes, process_id) -> tuple[str, int] | None:
    if coordinator_address is None:
        if num_processes is not None or process_id is not None:
            raise ValueError("num_processes and process_id come with a coordinator_address; without one "
                             "JAX detects all three (Cloud TPU, Slurm, Open MPI)")
        return None
    address = parse_address(coordinator_address)
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes={num_processes!r} must be a positive int")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id!r} must be an int in 0..{num_processes - 1} "
                         f"(num_processes={num_processes})")
    return address


def _jax_started() -> bool:
    """Whether this process already started a JAX backend (then it can no longer join a group)."""
    from jax._src import xla_bridge  # no public API tells this before initialize fails
    return xla_bridge.backends_are_initialized()


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _recv(conn: socket.socket) -> dict:
    """One JSON line; ValueError if the peer closes first or sends something else."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk or len(data) > _MAX_MESSAGE:
            raise ValueError(f"the peer closed the connection or sent no message line ({len(data)} bytes)")
        data += chunk
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError(f"not a message: {message!r}")
    return message


def _gather_peers(port: int, num_processes: int, timeout_s: float) -> None:
    """Process 0's side of the handshake: every other id exactly once, or an error to all that came."""
    dual = socket.has_dualstack_ipv6()  # IPv4 and IPv6 peers alike
    try:
        server = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                      backlog=num_processes, dualstack_ipv6=dual)
    except OSError as e:
        raise ProcessGroupError(f"process 0 cannot serve the group on port {port}: it is in use ({e})") from e
    deadline = time.monotonic() + timeout_s
    joined: dict[int, socket.socket] = {}
    others: list[socket.socket] = []
    problems: list[str] = []
    try:
        while len(joined) < num_processes - 1 and not problems and time.monotonic() < deadline:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                conn, peer = server.accept()
            except TimeoutError:
                break
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            try:
                hello = _recv(conn)
            except (OSError, ValueError) as e:
                logger.warning("process group: ignoring a connection from %s that sent no hello: %s", peer, e)
                conn.close()
                continue
            pid, count = hello.get("process_id"), hello.get("num_processes")
            if count != num_processes:
                problems.append(f"process {pid} was started with num_processes={count}, process 0 with "
                                f"{num_processes}")
            elif not isinstance(pid, int) or not 0 < pid < num_processes or pid in joined:
                problems.append(f"a second process claims process_id={pid}" if pid in joined or pid == 0
                                else f"process_id={pid!r} is outside 0..{num_processes - 1}")
            if problems:
                others.append(conn)
            else:
                joined[pid] = conn
        missing = sorted(set(range(1, num_processes)) - set(joined))
        if missing and not problems:
            problems.append(f"process(es) {missing} of {num_processes} did not join the group on port {port} "
                            f"within {timeout_s:g} s")
        verdict = {"error": "; ".join(problems)} if problems else {"ok": True}
        for conn in [*joined.values(), *others]:
            try:
                _send(conn, verdict)
            except OSError:
                pass
        if problems:
            raise ProcessGroupError(verdict["error"])
        # The peers close first, so no closed connection lingers on the port that JAX binds next.
        for conn in joined.values():
            try:
                conn.settimeout(5.0)
                conn.recv(1)
            except OSError:
                pass
    finally:
        for conn in [*joined.values(), *others]:
            conn.close()
        server.close()


def _join(host: str, port: int, num_processes: int, process_id: int, timeout_s: float) -> None:
    """The handshake of a process other than 0: announce, then wait for process 0's verdict."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(min(1.0, deadline - time.monotonic()), 0.01))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise ProcessGroupError(f"process {process_id}: process 0 (the coordinator at {host}:{port}) did "
                                        f"not answer within {timeout_s:g} s") from None
            time.sleep(0.1)
    with conn:
        # Process 0 answers once everyone joined or its own wait ran out: allow for it starting later.
        conn.settimeout(2 * timeout_s + 5.0)
        try:
            _send(conn, {"process_id": process_id, "num_processes": num_processes})
            verdict = _recv(conn)
        except (OSError, ValueError) as e:
            raise ProcessGroupError(f"process {process_id}: the coordinator at {host}:{port} gave no verdict on "
                                    f"the group ({e}): it formed without this process (another process with "
                                    f"process_id={process_id}?) or another service owns that port") from e
    if "error" in verdict:
        raise ProcessGroupError(f"process {process_id}: the group did not form: {verdict['error']}")


def rendezvous(coordinator_address: str, num_processes: int, process_id: int, timeout_s: float) -> None:
    """The handshake before `jax.distributed.initialize`: returns once every process 0..n-1 has arrived.

    Process 0 listens on the coordinator's port (then frees it for JAX's coordination service); the others
    announce their id and count. A missing, duplicate or out-of-range id, disagreeing counts, a port in use
    or an unreachable process 0 raise ProcessGroupError naming them, in every process that came. Touches
    no JAX state.
    """
    host, port = _check_group_args(coordinator_address, num_processes, process_id)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    start = time.monotonic()
    if process_id == 0:
        _gather_peers(port, num_processes, timeout_s)
    else:
        _join(host, port, num_processes, process_id, timeout_s)
    logger.info("process %d of %d: all processes joined in %.1f s", process_id, num_processes,
                time.monotonic() - start)


def initialize(coordinator_address: str | None, num_processes: int | None, process_id: int | None, *,
               timeout_s: float = 60.0, heartbeat_timeout_s: int = 100,
               local_device_ids: Sequence[int] | None = None) -> None:
    """Joins this process to the trainer's process group; call it before any other JAX call here.

    coordinator_address: "host:port" of process 0, which serves the group there (the port must be free
    on its host). All three None: JAX detects them (Cloud TPU, Slurm, Open MPI) and no handshake runs.
    num_processes == 1: nothing to join. timeout_s: how long the handshake (and then JAX's own connect)
    waits for the others. heartbeat_timeout_s: how long a silent process counts as alive before JAX stops
    the group. local_device_ids: the devices of this host that this process owns (default all; set it
    when several processes share a host's accelerators).
    Bad arguments raise ValueError; a peer that never arrives, a duplicate or out-of-range id, disagreeing
    counts, or a port in use raise ProcessGroupError naming them, all before `jax.distributed.initialize`
    is called.
    """
    address = _check_group_args(coordinator_address, num_processes, process_id)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
    if jax.distributed.is_initialized():
        raise ProcessGroupError("this process is already in a process group; a group is formed once per "
                                "process (start fresh processes to form a new one)")
    if num_processes == 1:
        return
    if _jax_started():
        raise ProcessGroupError("JAX already started in this process, so it can no longer join a process group: "
                                "call initialize before any other JAX call")
    if address is None:
        jax.distributed.initialize()
        return
    rendezvous(coordinator_address, num_processes, process_id, timeout_s)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
                               initialization_timeout=max(int(timeout_s), 1),
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))


def global_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp, expert, tensor) mesh over the devices of every process, grouped by process.

    Position i of the mesh is the i-th device in (process, device id) order, so process p holds a
    contiguous block of the data x fsdp rows and, when `tensor` divides its local device count, whole
    tensor groups: the layout a single process holding all the devices gets from `make_mesh`.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return sharding.make_mesh(data, fsdp, tensor, devices=devices, expert=expert)


def gather_params(params: nnx.State) -> dict[str, np.ndarray]:
    """Every parameter as a whole host array, keyed by its path ("layers/attn/q/kernel"), in every process."""
    from jax.experimental import multihost_utils

    flat = [("/".join(map(str, path)), var.get_value()) for path, var in nnx.to_flat_state(params)]
    values = [v if v.is_fully_addressable else multihost_utils.process_allgather(v, tiled=True)
              for _, v in flat]
    return {name: np.asarray(v) for (name, _), v in zip(flat, values)}


def train_on_mesh(config: ml_collections.ConfigDict, buffers: Iterable[ConsumedBatch]) -> dict[str, Any]:
    """Trains `buffers` in order on the mesh of this process group (or of this process alone).

    Returns {"process_id", "num_processes", "mesh" (axis sizes), "batch_shape", "metrics" (one dict per
    step), "params" (only with config.return_params)}.
    """
    check_process_config(config)
    mesh = global_mesh(**config.mesh)
    model = hf_io.load_model(config.model_dir, mesh=mesh, param_dtype=config.trainer.get("param_dtype", "float32"))
    trainer = RLTrainer(model, config.trainer, mesh,
                        seq_len=config.seq_len, max_sequences=config.max_sequences)
    metrics = [trainer.train(consumed)[0] for consumed in buffers]
    out = {"process_id": jax.process_index(), "num_processes": jax.process_count(),
           "mesh": dict(mesh.shape), "batch_shape": trainer.batch_shape, "metrics": metrics}
    if config.return_params:
        out["params"] = gather_params(trainer.state.params)
    return out


def run_trainer_process(coordinator_address: str | None, num_processes: int | None, process_id: int | None,
                        config: ml_collections.ConfigDict, buffers: Iterable[ConsumedBatch]) -> dict[str, Any]:
    """The entry point of one trainer process: joins the group, trains `buffers`, leaves the group.

    Call it in a fresh process (JAX must not have run there yet), in every process of the group with the
    same config and buffers. Returns `train_on_mesh`'s results.
    """
    check_process_config(config)
    initialize(coordinator_address, num_processes, process_id, timeout_s=config.init_timeout_s,
               heartbeat_timeout_s=config.heartbeat_timeout_s)
    try:
        return train_on_mesh(config, buffers)
    finally:
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()


def free_port() -> int:
    """A TCP port that was free on this host a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(results, env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    process_id = args[2]
    try:
        results.put(("ok", process_id, run_trainer_process(*args)))
    except BaseException as e:  # reported to the launcher, which names this process
        results.put(("error", process_id, "".join(traceback.format_exception_only(e)).strip()))


def cpu_devices_env(cpu_devices: int) -> dict[str, str]:
    """The environment that gives a new process `cpu_devices` JAX devices on the CPU platform (CPU hosts,
    tests): XLA_FLAGS as this process has them, with its device count replaced, and JAX_PLATFORMS=cpu."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={cpu_devices}".strip(),
            "JAX_PLATFORMS": "cpu"}


def run_local(config: ml_collections.ConfigDict, buffers: Sequence[ConsumedBatch], *, num_processes: int,
              cpu_devices_per_process: int | None = None, process_ids: Sequence[int] | None = None,
              port: int | None = None, env: dict[str, str] | None = None,
              timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Runs `run_trainer_process` in fresh local processes (spawned) and returns their results by process id.

    process_ids: the ids started here (default all; the others must join from elsewhere).
    cpu_devices_per_process: give each process that many CPU devices (tests, CPU hosts). env: extra
    environment of the processes (e.g. JAX_COMPILATION_CACHE_DIR). The first process to fail, or to exit
    without a result, raises ProcessGroupError naming it; the others are then stopped.
    """
    check_process_config(config)
    process_ids = list(range(num_processes) if process_ids is None else process_ids)
    _check_group_args("127.0.0.1:1", num_processes, 0)
    bad = [i for i in process_ids if not isinstance(i, int) or not 0 <= i < num_processes]
    if bad or len(set(process_ids)) != len(process_ids):
        raise ValueError(f"process_ids {process_ids} must be distinct ids in 0..{num_processes - 1}")
    env = dict(env or {})
    if cpu_devices_per_process is not None:
        env.update(cpu_devices_env(cpu_devices_per_process))
    address = f"127.0.0.1:{port or free_port()}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = {i: ctx.Process(target=_child, args=(results, env, (address, num_processes, i, config, list(buffers))),
                            name=f"jaxflow-trainer-{i}", daemon=True)
             for i in process_ids}
    for p in procs.values():
        p.start()
    out: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(procs):
            try:
                status, pid, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in procs.items() if i not in out and p.exitcode is not None]
                if dead:  # give a result still in the pipe a moment to arrive
                    try:
                        status, pid, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise ProcessGroupError(f"trainer process {dead[0]} exited with code "
                                                f"{procs[dead[0]].exitcode} before reporting") from None
                elif time.monotonic() > deadline:
                    raise ProcessGroupError(f"trainer processes {sorted(set(procs) - set(out))} gave no result "
                                            f"within {timeout_s:g} s") from None
                else:
                    continue
            if status == "error":
                raise ProcessGroupError(f"trainer process {pid} failed: {value}")
            out[pid] = value
    finally:
        for p in procs.values():
            p.join(timeout=10.0 if len(out) == len(procs) else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
    return [out[i] for i in process_ids]
