"""The `cluster` section of a run's config, checked: where the run's pieces go.

`ClusterConfig` is the section (its docstring says what each key means; `ClusterConfig.section(**overrides)`
generates it for config files); `cluster_problems` returns one message per bad key (the RL job's
`check_config` joins them).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import ml_collections

from jaxflow.config import Section, check_choice, check_int

__all__ = ["CLUSTER_MODES", "ClusterConfig", "NodeResources", "TrainerMesh", "cluster_problems"]

CLUSTER_MODES = ("embedded", "ray")


@dataclasses.dataclass(frozen=True)
class TrainerMesh(Section):
    """The mesh over all the trainer processes' devices, fsdp x expert x tensor.

    fsdp: devices along the fsdp axis; -1: the devices left.
    expert: devices along the expert axis (a mixture of experts' experts split over them; the batch's rows too).
    tensor: devices along the tensor axis.
    """

    SECTION: ClassVar[str] = "cluster.trainer_mesh"

    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    def problems(self) -> list[str]:
        problems: list[str] = []
        if self.fsdp != -1 or isinstance(self.fsdp, bool):
            check_int(problems, self.key("fsdp"), self.fsdp, 1)
            if problems:
                problems[-1] = problems[-1].replace("must be ", "must be -1 (the devices left) or ", 1)
        check_int(problems, self.key("expert"), self.expert, 1)
        check_int(problems, self.key("tensor"), self.tensor, 1)
        return problems


@dataclasses.dataclass(frozen=True)
class NodeResources(Section):
    """Custom Ray node resources that place each piece: the actors of a piece each ask for one unit of the
    named resource, so they run on the nodes started with it (`ray start --resources='{"trainer": 8}'`);
    None: any node.

    data: the trajectory and parameter services' actor.
    trainer: the trainer processes.
    rollout: the rollout engines' actors.
    rewards: the reward workers.
    scorers: the actor of a reward model, LLM judge or rollout-side teacher (`jaxflow.jobs.scorers`).
    """

    SECTION: ClassVar[str] = "cluster.node_resource"

    data: str | None = None
    trainer: str | None = None
    rollout: str | None = None
    rewards: str | None = None
    scorers: str | None = None

    def problems(self) -> list[str]:
        return [f"{self.key(piece)} must be None (any node) or the name of a custom Ray resource, got {resource!r}"
                for piece, resource in dataclasses.asdict(self).items()
                if resource is not None and (not isinstance(resource, str) or not resource.strip())]


@dataclasses.dataclass(frozen=True)
class ClusterConfig(Section):
    """The `cluster` section: where the run's pieces go.

    mode: "embedded" (everything in the job's process) or "ray" (the trajectory service in a Ray actor of
      its own, reached through a proxy; everything else as embedded). Ray needs the cluster extra.
    address: the Ray cluster to join ("host:port", or "auto" for the one `ray start` started on this
      machine); None starts a local Ray for the run and stops it at the end. Ray's token auth stays on.
    rollout_actors: rollout engines each in a Ray actor of its own (mode "ray"; one GPU each where the cluster
      has GPUs, one CPU otherwise), scoring rewards there; 0 keeps rollout.num_engines engines in the job.
    trainer_processes: the trainer as this many Ray actors (one GPU each where the cluster has GPUs) forming
      one JAX mesh (mode "ray", with rollout actors); 0 trains in the job's process.
    trainer_cpu_devices: CPU devices per trainer process (CPU hosts and tests); None: what JAX finds there.
    trainer_mesh: the mesh over all the trainer processes' devices (`TrainerMesh`).
    node_resource: the custom Ray resource that places each piece (`NodeResources`).
    """

    SECTION: ClassVar[str] = "cluster"

    mode: str = "embedded"
    address: str | None = None
    rollout_actors: int = 0
    trainer_processes: int = 0
    trainer_cpu_devices: int | None = None
    trainer_mesh: TrainerMesh = dataclasses.field(default_factory=TrainerMesh)
    node_resource: NodeResources = dataclasses.field(default_factory=NodeResources)

    def problems(self) -> list[str]:
        problems: list[str] = []
        check_choice(problems, self.key("mode"), self.mode, CLUSTER_MODES)
        address = self.address
        if address is not None and (not isinstance(address, str) or not address.strip()):
            problems.append(f"cluster.address must be None (start a local Ray) or 'host:port' / 'auto', "
                            f"got {address!r}")
        check_int(problems, self.key("rollout_actors"), self.rollout_actors, 0)
        check_int(problems, self.key("trainer_processes"), self.trainer_processes, 0)
        check_int(problems, self.key("trainer_cpu_devices"), self.trainer_cpu_devices, 1, optional=True)
        if problems:
            return problems
        actors, trainers, devices, mesh = (self.rollout_actors, self.trainer_processes, self.trainer_cpu_devices,
                                           self.trainer_mesh)
        if devices is not None and trainers:
            total = devices * trainers
            rest = mesh.expert * mesh.tensor
            fsdp = total // rest if mesh.fsdp == -1 else mesh.fsdp
            if total % rest or fsdp * rest != total:
                problems.append(f"cluster.trainer_mesh fsdp {mesh.fsdp} x expert {mesh.expert} x tensor {mesh.tensor} "
                                f"does not cover the "
                                f"{total} devices of {trainers} trainer processes x {devices} "
                                f"(cluster.trainer_cpu_devices)")
        if self.mode == "embedded":
            if actors or trainers:
                problems.append(f"cluster.{'rollout_actors' if actors else 'trainer_processes'}="
                                f"{actors or trainers} needs cluster.mode=ray")
            elif address is not None:
                problems.append(f"cluster.address is set but cluster.mode is 'embedded'; set cluster.mode=ray to "
                                f"join the cluster at {address!r}")
        elif trainers and not actors:
            problems.append(f"cluster.trainer_processes={trainers} needs cluster.rollout_actors >= 1 (the engines "
                            f"then take each version from the trainer processes through Ray's object store)")
        return problems


def cluster_problems(cluster: ml_collections.ConfigDict) -> list[str]:
    """What is wrong with the `cluster` section (mode "ray" also needs Ray installed: the cluster extra)."""
    problems = ClusterConfig.config_problems(cluster)
    if problems or cluster.mode != "ray":
        return problems
    try:
        import ray  # noqa: F401
    except ImportError:
        return [("cluster.mode 'ray' needs Ray: install the cluster extra (`pip install -e '.[cluster]'`, or "
                 "rerun `python3 -m jaxflow.setup_env`)")]
    return []
