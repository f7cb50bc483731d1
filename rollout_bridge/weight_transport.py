"""Which path each policy version takes from the trainer to the rollout engines (`rollout.weight_transport`),
and the errors a version meets on the NCCL path before anything is sent.

    transport = resolve_weight_transport("auto", "vllm")             # -> "param_service"
    transport = resolve_weight_transport("nccl", "jax")              # -> WeightTransportMismatch

The values, and where each one fits (the deployment is read from the `cluster` section):

  auto           today's path for the engine kind and deployment, as below (the default)
  device         JAX engines in the job's process: each version on device (`jaxflow.data.device_params`)
  param_service  vLLM engines in the job's process, and rollout actors beside an in-process trainer: HF-named
                 host tensors through a parameter service (in process, or in a Ray actor), loaded into vLLM
                 by its worker extension (`rollout_bridge.vllm_worker_ext`)
  object_store   the trainer as Ray processes (`cluster.trainer_processes` > 0): Ray's object store
                 (`jaxflow.cluster.weights`)
  nccl           vLLM engines in the job's process: the HF tensors the parameter service holds are cast to
                 the engine's dtype and broadcast to its workers by NCCL through vLLM's weight-transfer API
                 (`rollout_bridge.nccl_weights`), in buckets of `rollout.weight_bucket_mb`

An explicit value other than `auto` must be the one that fits, or `nccl` where it is offered; anything else is
a `WeightTransportMismatch` before the run starts. The NCCL errors (`WeightDtypeRefused`, `WeightBucketTooLarge`)
are `WeightsRejected`: raised before the first byte moves, so the engine keeps serving the version it has.
"""

from __future__ import annotations

from rollout_bridge.engine import WeightsRejected

__all__ = ["MAX_BUCKET_MB", "WEIGHT_TRANSPORTS", "WeightBucketTooLarge", "WeightDtypeRefused",
           "WeightTransportMismatch", "resolve_weight_transport"]

WEIGHT_TRANSPORTS = ("auto", "device", "param_service", "object_store", "nccl")

# The largest bucket a vLLM engine takes over NCCL, in MiB. vLLM's workers receive each bucket into buffers
# they allocate beside the model and KV cache (`packed_num_buffers` of them, 2 by default), outside the
# memory its `gpu_memory_utilization` budgets; vLLM's own default bucket (`DEFAULT_PACKED_BUFFER_SIZE_BYTES`
# in vllm.distributed.weight_transfer.packed_tensor) is 1 GiB, so 1 GiB x 2 is the headroom a default vLLM
# deployment leaves for them. vLLM itself checks no limit: a bigger bucket fails as a CUDA out-of-memory on
# the worker, part way through a version.
MAX_BUCKET_MB = 1024


class WeightTransportMismatch(WeightsRejected):
    """`rollout.weight_transport` names a path the engine kind or the deployment does not have (e.g. `nccl`
    with the JAX engine); nothing was started or sent."""


class WeightDtypeRefused(WeightsRejected):
    """A tensor (or the engine's serving dtype) is of a dtype the NCCL path cannot carry or cast to the
    engine's; nothing was sent and the engine keeps serving its version."""


class WeightBucketTooLarge(WeightsRejected):
    """A bucket of the NCCL path would exceed what the engine takes (`MAX_BUCKET_MB` by default); nothing was
    sent and the engine keeps serving its version."""


def _fits(engine: str, rollout_actors: int, trainer_processes: int) -> tuple[str, tuple[str, ...]]:
    """(what `auto` resolves to, every value that fits) for one engine kind and deployment."""
    if trainer_processes:
        return "object_store", ("object_store",)
    if rollout_actors:
        return "param_service", ("param_service",)
    if engine == "jax":
        return "device", ("device",)
    return "param_service", ("param_service", "nccl")


def resolve_weight_transport(transport: str, engine: str, *, rollout_actors: int = 0,
                             trainer_processes: int = 0) -> str:
    """The path versions take to engines of kind `engine` ("jax" or "vllm") in a deployment with
    `rollout_actors` rollout actors and `trainer_processes` trainer processes (0: in the job's process).

    Raises ValueError for a value that is not a transport, WeightTransportMismatch for one that does not fit.
    """
    if transport not in WEIGHT_TRANSPORTS:
        raise ValueError(f"rollout.weight_transport must be one of {', '.join(WEIGHT_TRANSPORTS)}, got "
                         f"{transport!r}")
    auto, fitting = _fits(engine, rollout_actors, trainer_processes)
    if transport == "auto":
        return auto
    if transport not in fitting:
        where = ("the trainer as Ray processes" if trainer_processes else
                 "rollout actors" if rollout_actors else f"the {engine} engine in the job's process")
        raise WeightTransportMismatch(f"rollout.weight_transport {transport!r} does not fit {where}; it takes "
                                      f"{' or '.join(fitting)} (auto: {auto})")
    return transport
