"""The trainer as N processes on Ray: `run_on_ray` starts one Ray actor per trainer process and runs
`jaxflow.trainer.distributed.run_trainer_process` in each, so that together they form one JAX mesh.

Process 0's actor picks the group's coordinator address (its node's IP and a port free there); every actor
then joins with its process id, as `distributed.run_local` does with local processes. Each actor is a
fresh Ray worker process (JAX has not run there), with one GPU where the cluster has GPUs and
`num_cpus` CPUs otherwise; `cpu_devices_per_process` gives each that many CPU devices (tests, CPU hosts).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import ml_collections

from jaxflow.cluster.ray_actors import require_ray
from jaxflow.data.records import ConsumedBatch
from jaxflow.trainer import distributed

__all__ = ["TrainerProcess", "run_on_ray"]


class TrainerProcess:
    """The body of one trainer process's actor."""

    def address(self) -> str:
        """"ip:port" on this actor's node, with a port free there a moment ago: the group's coordinator."""
        return f"{require_ray().util.get_node_ip_address()}:{distributed.free_port()}"

    def run(self, address: str, num_processes: int, process_id: int, config: ml_collections.ConfigDict,
            buffers: list[ConsumedBatch]) -> dict[str, Any]:
        """`distributed.run_trainer_process` in this actor's process."""
        return distributed.run_trainer_process(address, num_processes, process_id, config, buffers)


def run_on_ray(config: ml_collections.ConfigDict, buffers: Sequence[ConsumedBatch], *, num_processes: int,
               cpu_devices_per_process: int | None = None, num_cpus: float = 1,
               resources: dict[str, float] | None = None, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Trains `buffers` with `num_processes` trainer actors forming one mesh; their results by process id
    (`distributed.train_on_mesh`'s). Ray must be connected (`ray_actors.connect`). resources: custom node
    resources each actor needs. A process that fails raises `distributed.ProcessGroupError` naming it;
    the actors are ended either way."""
    ray = require_ray()
    distributed.check_process_config(config)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    env: dict[str, str] = {}
    if cpu_devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cpu_devices_per_process}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if gpus else {"num_cpus": num_cpus}
    if resources:
        options["resources"] = dict(resources)
    if env:
        options["runtime_env"] = {"env_vars": env}
    remote = ray.remote(TrainerProcess).options(**options)
    actors = [remote.remote() for _ in range(num_processes)]
    try:
        address = ray.get(actors[0].address.remote(), timeout=timeout_s)
        refs = [a.run.remote(address, num_processes, i, config, list(buffers)) for i, a in enumerate(actors)]
        out: list[dict[str, Any]] = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                raise distributed.ProcessGroupError(f"trainer process {i} gave no result within {timeout_s:g} s") \
                    from None
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                cause = getattr(e, "cause", None) or e
                raise distributed.ProcessGroupError(f"trainer process {i} failed: {type(cause).__name__}: "
                                                    f"{cause}") from None
        return out
    finally:
        for a in actors:
            ray.kill(a)
