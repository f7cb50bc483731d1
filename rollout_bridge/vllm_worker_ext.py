"""jaxflow's vLLM worker extension: receives HF-named weights and reloads them in place.

vLLM imports this module inside its worker processes (`worker_extension_cls=
"rollout_bridge.vllm_worker_ext.JaxflowWorkerExtension"`) and mixes the class into its Worker, so the
methods below run with `self` being the worker and are reached through `AsyncLLM.collective_rpc`.
It needs torch only: no JAX, no jaxflow import, nothing heavy in a worker.

Tensors travel as (name, dtype, shape, raw bytes) tuples: vLLM's RPC serialises torch tensors and numpy
arrays into nested lists when the receiving side does not declare a type, which is slow and loses the
dtype, while bytes cross unchanged. A weight update is staged in chunks (so no single message holds the
whole model) and applied at once by `jaxflow_commit_weights`, which calls the worker's public
`reload_weights`. Plain `model.load_weights` is not enough on CPU: kernels that repack weights after
loading keep the old copies, and only `reload_weights` re-runs that processing — except for a tied LM
head, which `_reprocess_tied_embeddings` handles.
"""

from __future__ import annotations

import torch

# numpy dtype names (what the adapter sends) -> torch dtypes.
_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def tensor_from_payload(dtype: str, shape, data: bytes) -> torch.Tensor:
    """Rebuilds a CPU tensor from a (dtype, shape, bytes) payload; raises ValueError on a mismatch."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_TORCH_DTYPES)}")
    torch_dtype = _TORCH_DTYPES[dtype]
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    if len(data) != numel * torch_dtype.itemsize:
        raise ValueError(f"{len(data)} bytes for a {dtype} tensor of shape {shape} "
                         f"({numel * torch_dtype.itemsize} expected)")
    if numel == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # bytearray: torch.frombuffer wants a writable buffer; the copy is one tensor at a time.
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


@torch.no_grad()
def _reprocess_tied_embeddings(model: torch.nn.Module) -> None:
    """Re-runs weight processing of embedding-like layers that share a parameter with another layer.

    With tied embeddings, the LM head holds the embedding's parameter and no checkpoint tensor of its
    own, so `reload_weights` never reprocesses it. On CPU that processing packs the weight into a GEMM
    kernel handle, and the LM head would go on multiplying by the old embedding (seen with vLLM 0.32:
    the logits of a reloaded tied Qwen3 came from the previous weights). Processing an unquantized
    embedding only rebuilds that handle from the current parameter (a no-op off CPU), so re-running it
    is safe.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)


class JaxflowWorkerExtension:
    """Methods mixed into vLLM's Worker; called by `rollout_bridge.vllm_engine.VllmEngine`."""

    def jaxflow_stage_weights(self, payloads: list) -> int:
        """Stages [(name, dtype, shape, bytes), ...] for the next commit; returns how many are staged."""
        staged = self.__dict__.setdefault("_jaxflow_staged", {})
        for name, dtype, shape, data in payloads:
            try:
                staged[name] = tensor_from_payload(dtype, shape, data)
            except ValueError as e:
                raise ValueError(f"weight payload {name!r}: {e}") from None
        return len(staged)

    def jaxflow_commit_weights(self) -> int:
        """Loads every staged tensor into the model in place, then drops the staging copies.

        Returns the number of tensors applied. The caller has paused generation, and recomputes the
        KV cache (reset_prefix_cache) afterwards.
        """
        staged = self.__dict__.pop("_jaxflow_staged", {})
        if not staged:
            raise ValueError("no staged weights to commit")
        self.reload_weights(weights_iterator=iter(list(staged.items())))
        _reprocess_tied_embeddings(self.model_runner.get_model())
        return len(staged)

    def jaxflow_discard_staged(self) -> int:
        """Drops staged tensors of an update that will not be committed; returns how many there were."""
        return len(self.__dict__.pop("_jaxflow_staged", {}))

    def jaxflow_eager_sampler(self) -> bool:
        """With the model eager (compilation mode NONE, as `enforce_eager` sets) on CPU, turns off
        torch.compile in this worker for the small sampler helpers vLLM still compiles; returns whether it
        did.

        vLLM 0.32 torch.compiles `batched_count_greater_than` (the rank of each sampled token, computed
        whenever a request asks for log-probs, i.e. every jaxflow request) with inductor, which on CPU
        builds C++ at the engine's first request: 10 to 35 s on a 2-core machine, against a step of
        milliseconds. Eager, it is one [batch, vocab] comparison per step, the same counts. Dynamo reads
        the switch when a function is first called, and no request has run when the engine calls this.
        """
        from vllm.config import CompilationMode

        if self.vllm_config.compilation_config.mode != CompilationMode.NONE or self.device.type != "cpu":
            return False
        torch._dynamo.config.disable = True
        return True
