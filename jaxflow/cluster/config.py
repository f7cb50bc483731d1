"""The `cluster` section of a run's config, checked: where the run's pieces go.

    cluster.mode                 "embedded" (everything in the job's process) or "ray"
    cluster.address              the Ray cluster to join ("host:port" or "auto"); None starts a local one
    cluster.rollout_actors       rollout engines each in a Ray actor (0: rollout.num_engines in the job)
    cluster.trainer_processes    the trainer as this many Ray actors forming one JAX mesh (0: in the job)
    cluster.trainer_cpu_devices  CPU devices each trainer process gets (CPU hosts, tests); None: its own
    cluster.trainer_mesh.fsdp / .tensor
                                 the mesh over all the trainer processes' devices (fsdp -1: the rest)
    cluster.node_resource.<piece>
                                 a custom Ray resource placing data / trainer / rollout / rewards actors

`cluster_problems` returns one message per bad key (the RL job's `check_config` joins them).
"""

from __future__ import annotations

import ml_collections

__all__ = ["CLUSTER_MODES", "cluster_problems"]

CLUSTER_MODES = ("embedded", "ray")


def _count(value, key: str, low: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return f"cluster.{key} must be an int >= {low}, got {value!r}"
    return None


def _trainer_problems(cluster: ml_collections.ConfigDict) -> list[str]:
    problems = []
    if (bad := _count(cluster.trainer_processes, "trainer_processes", 0)) is not None:
        return [bad]
    devices = cluster.trainer_cpu_devices
    if devices is not None and (bad := _count(devices, "trainer_cpu_devices", 1)) is not None:
        problems.append(bad)
    mesh = cluster.trainer_mesh
    for key in ("fsdp", "tensor"):
        size = mesh[key]
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and not (key == "fsdp" and size == -1)):
            problems.append(f"cluster.trainer_mesh.{key} must be an int >= 1{' or -1' if key == 'fsdp' else ''}, "
                            f"got {size!r}")
    if not problems and devices is not None and cluster.trainer_processes:
        total = devices * cluster.trainer_processes
        fsdp = total // mesh.tensor if mesh.fsdp == -1 else mesh.fsdp
        if total % mesh.tensor or fsdp * mesh.tensor != total:
            problems.append(f"cluster.trainer_mesh fsdp {mesh.fsdp} x tensor {mesh.tensor} does not cover the "
                            f"{total} devices of {cluster.trainer_processes} trainer processes x "
                            f"{devices} (cluster.trainer_cpu_devices)")
    return problems


def cluster_problems(cluster: ml_collections.ConfigDict) -> list[str]:
    """What is wrong with the `cluster` section (mode "ray" also needs Ray installed: the cluster extra)."""
    if cluster.mode not in CLUSTER_MODES:
        return [f"cluster.mode {cluster.mode!r} is not one of {CLUSTER_MODES}"]
    address = cluster.address
    if address is not None and (not isinstance(address, str) or not address.strip()):
        return [f"cluster.address must be None (start a local Ray) or 'host:port' / 'auto', got {address!r}"]
    actors = cluster.rollout_actors
    if (bad := _count(actors, "rollout_actors", 0)) is not None:
        return [bad]
    problems = _trainer_problems(cluster)
    for piece, resource in cluster.node_resource.items():
        if resource is not None and (not isinstance(resource, str) or not resource.strip()):
            problems.append(f"cluster.node_resource.{piece} must be None (any node) or the name of a custom Ray "
                            f"resource, got {resource!r}")
    if problems:
        return problems
    trainers = cluster.trainer_processes
    if cluster.mode == "embedded":
        if actors or trainers:
            return [f"cluster.{'rollout_actors' if actors else 'trainer_processes'}="
                    f"{actors or trainers} needs cluster.mode=ray"]
        return [] if address is None else [f"cluster.address is set but cluster.mode is 'embedded'; set "
                                           f"cluster.mode=ray to join the cluster at {address!r}"]
    if trainers and not actors:
        return [f"cluster.trainer_processes={trainers} needs cluster.rollout_actors >= 1 (the engines then "
                f"take each version from the trainer processes through Ray's object store)"]
    try:
        import ray  # noqa: F401
    except ImportError:
        return ["cluster.mode 'ray' needs Ray: install the cluster extra (`pip install -e '.[cluster]'`, or "
                "rerun `python3 -m jaxflow.setup_env`)"]
    return []
