"""jaxflow's own rollout engine: continuous batching over a fixed-shape KV cache, in JAX.

It is the embedded default engine (trainer and rollout in one process, one machine) and the TPU path.
A background thread runs the loop:

1. apply commands from other threads (weight swaps, aborts, pauses) — only ever between decode calls;
   while paused, it stops here until `resume`;
2. admit waiting requests into free slots: prefill prompt (+ resumed prefix) into the slot's cache rows
   (once per distinct context: a GRPO group's samples share their prompt, and the row is written to all
   their slots); a request that extends what its own earlier request left in a slot (an episode's next
   turn: same request id, the finished turn plus the environment's answer) computes only its new tokens
   (`reuse_turns`; `release` forgets the turns of requests that will not continue);
3. run `decode_chunk` decode steps for the active slots in one jitted call;
4. hand finished samples to `poll`, freeing their slots for the next admission.

A decode call's cost follows the work left rather than the engine's size (`jax_slots`): it runs only the
active slots, padded to a slot bucket (8, 12, 16, 24, ... max_slots), and each group of similar-length sequences
attends over the smallest of a few window sizes that holds it, so the draining tail of a rollout round
and a mix of short and long sequences stay cheap.

Shapes never depend on the requests: the cache is [layers, max_slots, kv_heads, max_len, head_dim],
windows are traced indices into a static list, and prefill lengths are rounded up to `prefill_buckets`,
so the engine compiles one decode program per slot bucket (see `warmup`) and a few prefill ones.

`prefill_stats()` counts what admission computed: the context positions of the requests admitted, those a
kept turn already held (reused, not computed), and those prefill and extend calls ran through the model
(`PrefillStats`); benchmarks/prefix_reuse.py reads it per turn of an agent's episodes.

Log-probabilities: by default each token's log-probability under the model's unmodified distribution
(temperature 1, no top-k/top-p) — the quantity the trainer recomputes for the behaviour policy, so
importance weights compare like with like. `logprobs_mode="processed"` reports the log-probability
under the distribution actually sampled from instead.

Exact mode (`exact_logprobs=True`, the run config's `rollout.exact_logprobs`): every token's reported
log-probability is recomputed by `jaxflow.trainer.scoring`, the per-sequence program the trainer's update
computes π_prox with, under the weights that sampled the token: when its sample finishes, is aborted, or
before a weight swap moves it to other weights. The trainer then recomputes the same bits for on-policy tokens
(π_prox / μ = 1 exactly) instead of agreeing to rounding. It costs one more forward pass of each sample.

Weight updates keep requests in flight: the new weights are checked (against the HF name table, or for
`DeviceWeights` from a trainer in this process, against the engine's own parameter tree) before anything
changes, swapped in between decode calls, and every in-flight sequence's cache is recomputed
under them (prompt + tokens so far), so the tokens after the swap are exactly what the new weights
produce from that prefix; each token records the version that produced it. `keep_kv=True` keeps the
caches instead (PipelineRL's in-flight update): no recompute, later tokens attend to older keys.

Routing (a mixture-of-experts model): every sample records the experts each sparse layer chose for each
token (`Sample.routes`, for routing replay in the update): a generated token gets those of the decode step
that sampled it (computed at its input, the token before it), under the weights that sampled it. A
resumed prefix keeps the routes it brings (a prefix without any gets -1, "not recorded"), and nothing
recorded is ever recomputed: a weight swap's recompute or a later turn's prefill leaves them as they are.
An episode's environment tokens (`Sample.env_spans`) get theirs from the forward that processes their
inputs, the prefill or extend that admits the next turn; until then, and for an episode that ends on
them, they stay -1 (the trainer routes them itself).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping

import jax
import numpy as np
from flax import nnx

from jaxflow import sharding
from jaxflow.data.device_params import DeviceWeights
from jaxflow.data.records import Sample, route_dtype
from jaxflow.models import hf_io, lora, precision
from jaxflow.models.transformer import Transformer
from jaxflow.trainer import scoring
from jaxflow.trainer.step import LOGPROB_CHUNK
from rollout_bridge import jax_decode, jax_slots, jax_warmup
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

log = logging.getLogger(__name__)

# Window of recent decode calls that `load().tokens_per_s` averages over.
_RATE_WINDOW_S = 5.0
_FINISH_NAMES = {jax_decode.FINISH_STOP: "stop", jax_decode.FINISH_LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class PrefillStats:
    """What a JaxEngine's admissions computed, counted since it started (`JaxEngine.prefill_stats`), in
    cache positions. A request's context is its prompt and resumed prefix less the last token, which the
    first decode step feeds (so `context_tokens` counts one less per request than prompt + prefix).

    admitted: requests admitted into slots. context_tokens: the positions of their contexts.
    reused_tokens: positions the request's own kept turn already held (`reuse_turns`): not computed again.
    computed_tokens: positions prefill and extend calls ran through the model for them (their padding to a
    prefill bucket not counted); a context several requests share (a GRPO group's prompt) is computed once,
    so context = reused + computed + shared.
    recomputed_tokens: positions of in-flight sequences computed again under new weights (a weight swap
    without keep_kv); not part of the others.
    """

    admitted: int = 0
    context_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0

    def __sub__(self, other: PrefillStats) -> PrefillStats:
        """The counts between two readings (later - earlier)."""
        return PrefillStats(*(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)))

    def __add__(self, other: PrefillStats) -> PrefillStats:
        """The counts of two engines together."""
        return PrefillStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


@dataclasses.dataclass
class _Running:
    """A request waiting for a slot or in one: its sample so far (a resumed prefix included)."""

    request: Request
    sample: Sample
    exact_from: int = 0  # exact mode: tokens before this one carry their final (rescored) log-probs

    @property
    def sequence(self) -> list[int]:
        return list(self.request.prompt) + self.sample.tokens


class JaxEngine(Engine):
    """The JAX rollout engine; see the module docstring. Requests are admitted by `Engine.submit` into a
    queue that the loop moves into free slots.

    Args:
      model: an HF model directory, or a loaded `Transformer` (copied onto `mesh`).
      max_slots: sequences decoded at once.
      max_len: cache positions per slot, in tokens (prompt + completion).
      decode_chunk: decode steps per jitted call (the granularity of admission, aborts and weight swaps).
      mesh: default one device; params follow their logical axes, the cache is split by slots over
        data/fsdp and by kv heads over tensor (each where it divides).
      version: the weights' policy version.
      prefill_buckets: prefill lengths in tokens (capped at max_len; max_len is always one); the shortest
        is also the smallest decode attention window (`jax_slots.attention_windows`).
      seed: draws per-request seeds for requests without one.
      param_dtype: the serving dtype (default the checkpoint's); only for a model directory.
      compute_dtype: the dtype the engine decodes in ("float32" or "bfloat16"; `model.compute_dtype`): the
        weights are cast to it once, here and at each weight sync (which then takes weights of any float
        dtype, e.g. a trainer's float32 master weights), and the KV cache is kept in it. None: the model's
        own dtype. A name the engine cannot take is a DtypeError before anything is built.
      cast_weights: let `update_weights` cast tensors of another dtype; by default that is refused.
      logprobs_mode: "raw" or "processed" (module docstring).
      prefill_batch: most sequences per prefill call (calls are padded to a power of two).
      prefill_fanout: most slots one prefill row is written to (sequences sharing a context beyond that
        take another row).
      max_stop_ids: most stop token ids per request.
      rules: logical axis -> mesh axes, for the params and the cache (None: `sharding.LOGICAL_RULES`).
      warmup: compile the largest decode program and the prefill programs of the shortest prefill bucket
        at construction, and the other decode programs (one per slot bucket; then, with reuse_turns, the
        extend programs) on a background thread (`jax_warmup`; `warmed` waits for them), so that no decode
        call waits for a compile. False: every program compiles when first used.
      exact_logprobs: report log-probs recomputed by the trainer's per-sequence program (module docstring);
        needs logprobs_mode "raw". logprob_chunk: the trainer's `logprob_chunk`, which that program uses.
      reuse_turns: a request that finishes with a stop keeps its cache row (until a weight swap, or until
        the slot is needed: least recently finished first); the same request id submitted again with a
        sequence that extends it (an episode's next turn) is admitted there and computes only its new
        tokens.
    """

    def __init__(self, model: str | os.PathLike | Transformer, *, max_slots: int = 32,
                 max_len: int = 1024, decode_chunk: int = 16, mesh: jax.sharding.Mesh | None = None,
                 version: int = 0, prefill_buckets: Iterable[int] = (32, 64, 128, 256, 512, 1024),
                 seed: int = 0, param_dtype=None, compute_dtype: str | None = None, cast_weights: bool = False,
                 logprobs_mode: str = "raw", prefill_batch: int = 8, prefill_fanout: int = 8,
                 max_stop_ids: int = 8, rules=None, warmup: bool = True, reuse_turns: bool = True,
                 exact_logprobs: bool = False, logprob_chunk: int = LOGPROB_CHUNK):
        if logprobs_mode not in jax_decode.LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r} is not one of {jax_decode.LOGPROBS_MODES}")
        if exact_logprobs and logprobs_mode != "raw":
            raise ValueError(f"exact_logprobs reports the model's own log-probs (logprobs_mode 'raw'), not "
                             f"logprobs_mode {logprobs_mode!r}")
        if min(max_slots, decode_chunk, prefill_batch, prefill_fanout) < 1 or max_len < 2:
            raise ValueError(f"need max_slots, decode_chunk, prefill_batch, prefill_fanout >= 1 and "
                             f"max_len >= 2; got {max_slots}, {decode_chunk}, {prefill_batch}, "
                             f"{prefill_fanout}, {max_len}")
        compute = None if compute_dtype is None else precision.dtype_of(compute_dtype)
        self._mesh = mesh or sharding.make_mesh(devices=jax.devices()[:1])
        self._rules = rules
        if isinstance(model, Transformer):
            if param_dtype is not None:
                raise ValueError("param_dtype applies to a model directory; a loaded Transformer is "
                                 "served in its own dtype")
        else:
            model = hf_io.load_model(model, mesh=self._mesh, param_dtype=param_dtype or compute, rules=rules)
        self.config = cfg = model.config
        self._graphdef, params = nnx.split(model)
        if compute is not None and compute != model.embed[...].dtype:
            params = precision.cast_floating(params, compute)  # once; a sync casts each version the same way
            cast_weights = True
        self._param_dtype = model.embed[...].dtype if compute is None else compute
        # Placed exactly as update_weights places new weights, so a swap never triggers a recompile; and
        # copied, so that a trainer donating its own params (one process, same mesh) leaves ours intact.
        self._all_shardings = sharding.state_shardings(params, self._mesh, rules)
        self._params = jax.device_put(params, self._all_shardings, may_alias=False)
        # What a weight sync replaces: every parameter, or with LoRA adapters only the adapters (the base
        # stays as loaded; `lora.adapter_arrays` checks HF-named adapters against the model).
        self.lora = model.layers.lora
        self._synced = nnx.LoRAParam if self.lora is not None else nnx.Param
        self._param_shardings = nnx.filter_state(self._all_shardings, self._synced)
        self._cast_weights = cast_weights
        self._version = version
        self.max_slots, self.max_len, self.decode_chunk = max_slots, max_len, decode_chunk
        self._buckets = tuple(sorted({min(int(b), max_len) for b in prefill_buckets} | {max_len}))
        self._prefill_batch, self._prefill_fanout = prefill_batch, prefill_fanout
        self._logprobs_mode = logprobs_mode
        self._exact, self._logprob_chunk = bool(exact_logprobs), int(logprob_chunk)
        self._max_stop_ids = max_stop_ids
        self._seeds = np.random.default_rng(seed)
        self._cache_sharding = jax_decode.cache_sharding(cfg, max_slots, max_len, self._mesh, rules)
        self._cache = jax_decode.init_cache(cfg, max_slots, max_len, self._param_dtype,
                                            self._cache_sharding)
        # Decoding only the active rows gathers them from the cache: with slots sharded over devices that
        # would move cache rows between devices at every step, so a slot-sharded engine runs all slots.
        v_shape = self._cache.v_lbgsk.shape
        slots_sharded = self._cache_sharding.v_lbgsk.shard_shape(v_shape)[1] != max_slots
        self._windows = jax_slots.attention_windows(self._buckets[0], max_len)
        self._slots = jax_slots.SlotTable(max_slots, max_stop_ids, self._windows,
                                          select_rows=not slots_sharded)
        # (L_sparse, k) of the routes each token records; None for a dense model (no routes).
        self._route_shape = (len(cfg.sparse_layers), cfg.num_experts_per_tok) if cfg.num_experts else None
        self._route_dtype = route_dtype(cfg.num_experts)
        self._decode_kw = dict(num_steps=decode_chunk, windows=self._windows, logprobs_mode=logprobs_mode,
                               out_sharding=self._cache_sharding)
        self._running: dict[int, _Running] = {}  # slot -> request; the loop changes it, under _lock
        self._reuse_turns = reuse_turns
        self._kept = jax_slots.KeptTurns()  # finished turns kept for their next one; the loop's alone
        self._prefill_stats = PrefillStats()  # replaced whole by the loop, under _lock
        self._rates: collections.deque[tuple[float, float, int]] = collections.deque()
        # Shared with the API threads, under _lock.
        self._init_admission()
        self._wake = threading.Condition(self._lock)  # the loop waits for work
        self._waiting: collections.deque[_Running] = collections.deque()
        self._commands: list[tuple] = []
        self._active_ids: set[str] = set()
        self._released: set[str] = set()  # requests whose kept turn the loop forgets before it next admits
        self._snapshot = EngineLoad(0, 0, 0.0, 0.0, version)
        self._paused = False
        self._background: jax_warmup.BackgroundCompiles | None = None
        if warmup:
            self._warmup()
        self._thread = threading.Thread(target=self._loop, name="jax-engine", daemon=True)
        self._thread.start()

    # ----- the Engine interface (any thread) -----

    @property
    def version(self) -> int:
        return self._version

    def abort(self, request_ids: Iterable[str]) -> list[Completion]:
        """Partial samples (finish_reason "abort") of those `request_ids` still waiting or running; ids
        already finished (their completion is in, or will be in, `poll`) or unknown are skipped. Works
        after a loop failure too, so no in-flight work is lost.
        """
        ids = set(request_ids)
        future = concurrent.futures.Future()
        with self._lock:
            loop_alive = self._thread.is_alive() and self._error is None and not self._closing
            if loop_alive:
                self._commands.append(("abort", ids, future))
                self._wake.notify()
        if loop_alive:
            try:
                return future.result()
            except EngineError:
                pass  # the loop stopped before getting to it: nothing runs now, take them directly
        return self._abort(ids)

    def progress(self, request_ids: Iterable[str]) -> list[Completion]:
        """Copies of the samples so far of those `request_ids` waiting or running (see `Engine.progress`);
        read under the lock, between two decode calls' worth of tokens, without waiting for the loop."""
        ids = set(request_ids)
        with self._lock:
            runs = [r for r in (*self._waiting, *self._running.values()) if r.request.request_id in ids]
            return [Completion(r.request.request_id, in_flight_copy(r.sample)) for r in runs]

    def prefill_stats(self) -> PrefillStats:
        """The context positions admitted since the engine started, and how many of them a kept turn
        already held and how many prefill and extend calls computed (`PrefillStats`). Two readings'
        difference counts what was admitted between them."""
        with self._lock:
            return self._prefill_stats

    @property
    def param_shardings(self):
        """The shardings the engine serves the parameters a weight sync replaces with (an nnx.State of
        NamedShardings on its mesh; with LoRA, the adapters'): the target to register with a
        `DeviceParamSource`, so that each version is copied straight onto this layout when the trainer
        publishes it."""
        return self._param_shardings

    def update_weights(self, version: int, tensors: Mapping[str, np.ndarray] | DeviceWeights, *,
                       keep_kv: bool = False) -> None:
        """Checks the new weights, places them on the mesh, then waits for the loop to swap them in
        between decode calls and recompute the in-flight caches (with `keep_kv`, keep them: see
        `Engine.update_weights`). Raises WeightsRejected, with nothing changed, on any mismatch.

        tensors: HF-named host arrays (checked against the model's name table: names, shapes, dtypes),
        or `DeviceWeights` from a trainer in this process (checked against the engine's parameter tree:
        structure, shapes, dtypes), moved onto this engine's mesh by `jaxflow.data.reshard`. An engine serving
        LoRA adapters takes the adapters alone (PEFT-named, `jaxflow.models.lora`, or the trainer's
        adapter state on device) and keeps its base.
        """
        self._raise_if_down()
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
            raise WeightsRejected(f"version must be an int, got {version!r}")
        if isinstance(tensors, DeviceWeights):
            params = tensors.checked_placed(int(version), nnx.filter_state(self._params, self._synced),
                                            self._param_shardings, cast=self._cast_weights,
                                            error=WeightsRejected)
        elif self.lora is not None:
            params = self._adapters_from_hf(int(version), tensors)
        else:
            params = hf_io.params_from_hf(self.config, tensors, self._mesh, param_dtype=self._param_dtype,
                                          cast=self._cast_weights, rules=self._rules, error=WeightsRejected,
                                          source=f"weights of version {version}")
        future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_down()
            self._commands.append(("weights", (int(version), params, bool(keep_kv)), future))
            self._wake.notify()
        future.result()

    def _adapters_from_hf(self, version: int, tensors: Mapping[str, np.ndarray]) -> nnx.State:
        """PEFT-named adapter tensors, checked against this engine's adapters and placed on its mesh."""
        model = nnx.merge(self._graphdef, self._params)  # new Variables over the same arrays
        arrays = lora.adapter_arrays(model.layers, tensors, source=f"adapters of version {version}",
                                     error=WeightsRejected)
        shardings = nnx.merge(self._graphdef, self._all_shardings).layers
        for name, value in arrays.items():
            getattr(model.layers, name)[...] = jax.device_put(value, getattr(shardings, name).get_value())
        return nnx.state(model, nnx.LoRAParam)

    def pause(self, mode: str = "keep") -> list[Completion]:
        """Stops generating at the next decode-call boundary (see `Engine.pause`). Kept sequences keep
        their slots and cache rows; a weight update while paused treats those rows as in flight."""
        check_pause_mode(mode)
        future = concurrent.futures.Future()
        with self._lock:
            self._raise_if_down()
            self._commands.append(("pause", mode, future))
            self._wake.notify()
        return future.result()

    def resume(self) -> None:
        with self._lock:
            self._raise_if_down()
            self._paused = False
            self._wake.notify()

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> EngineLoad:
        with self._lock:
            return dataclasses.replace(self._snapshot, waiting=len(self._waiting), version=self._version)

    def close(self) -> None:
        """Stops the loop after the decode call in progress. Requests still waiting or running come out
        of the next `poll` as partial samples (finish_reason "abort"), so closing loses nothing."""
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        if self._background is not None:
            self._background.close()
        with self._lock:
            in_flight = set(self._active_ids)
        aborted = self._abort(in_flight)
        with self._lock:
            self._completions.extend(aborted)
            self._finished.notify_all()

    # ----- admission (Engine.submit calls these, holding the lock) -----

    _failure_subject = "the engine loop"

    def _in_flight(self, request_id: str) -> bool:
        return request_id in self._active_ids

    def _accept(self, request: Request, sample: Sample) -> None:
        if self._route_shape is not None:  # a prefix keeps its routes; one without any has none recorded
            sample.routes = (np.full((len(sample.tokens), *self._route_shape), -1, self._route_dtype)
                             if sample.routes is None else np.asarray(sample.routes, self._route_dtype))
        self._active_ids.add(request.request_id)
        self._waiting.append(_Running(request, sample, exact_from=len(sample.tokens)))
        self._wake.notify()

    def _invalid(self, request: Request) -> str | None:
        """Why `request` cannot run (a per-request error, the engine keeps serving), or None."""
        error = request_error(request, vocab_size=self.config.vocab_size, context=self.max_len,
                              context_name="max_len", route_shape=self._route_shape,
                              num_experts=self.config.num_experts)
        if error is not None:
            return error
        p: SamplingParams = request.params
        if len(p.stop_token_ids) > self._max_stop_ids:
            return (f"{len(p.stop_token_ids)} stop token ids, more than this engine's max_stop_ids="
                    f"{self._max_stop_ids}")
        return None

    # ----- the loop (engine thread) -----

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    self._wake.wait_for(lambda: self._closing or self._commands or (
                        not self._paused and (self._waiting or self._running)))
                    if self._closing:
                        for _, _, future in self._commands:
                            future.set_exception(self._engine_error())
                        self._commands = []
                        return
                    commands, self._commands = self._commands, []
                for kind, arg, future in commands:
                    try:
                        result = self._run_command(kind, arg)
                    except BaseException as e:
                        future.set_exception(e)
                        raise
                    future.set_result(result)
                if self._paused:
                    self._publish_load()
                    continue
                self._admit()
                if self._running:
                    self._decode()
                else:
                    self._publish_load()
        except BaseException as e:  # surfaced on the next poll/submit, never swallowed
            log.exception("JAX engine: its loop failed; every request in flight fails with it")
            with self._lock:
                self._error = e
                for _, _, future in self._commands:
                    future.set_exception(self._engine_error())
                self._commands = []
                self._finished.notify_all()

    def _run_command(self, kind: str, arg):
        if kind == "abort":
            return self._abort(arg)
        if kind == "weights":
            return self._swap_weights(*arg)
        assert kind == "pause", kind
        with self._lock:
            self._paused = True
            in_flight = set(self._active_ids)
        return self._abort(in_flight) if arg == "abort" else []

    def release(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._released.update(request_ids)

    def _admit(self) -> None:
        """Moves waiting requests into free slots and computes their caches."""
        admitted, extended = [], []
        with self._lock:
            released, self._released = self._released, set()
            for request_id in released:
                self._kept.drop(request_id)
            while self._waiting and len(self._running) < self.max_slots:
                run = self._waiting.popleft()
                slot, start = self._take_slot(run)
                self._running[slot] = run
                if start:
                    extended.append((slot, start))
                else:
                    admitted.append(slot)
        for slot in admitted + [slot for slot, _ in extended]:
            self._fill_slot(slot)
        computed = self._prefill(admitted) + self._extend(extended)
        if admitted or extended:
            context = sum(len(self._running[slot].sequence) - 1 for slot in admitted + [s for s, _ in extended])
            self._count(admitted=len(admitted) + len(extended), context_tokens=context,
                        reused_tokens=sum(start for _, start in extended), computed_tokens=computed)

    def _count(self, **more: int) -> None:
        """Adds `more` to the prefill counters (`prefill_stats`)."""
        with self._lock:
            s = self._prefill_stats
            self._prefill_stats = dataclasses.replace(s, **{k: getattr(s, k) + v for k, v in more.items()})

    def _take_slot(self, run: _Running) -> tuple[int, int]:
        """(A free slot for `run`, how many of its positions already hold its sequence): its own finished
        turn's slot when the sequence extends that turn; else a free slot that keeps nothing; else the
        least recently kept one."""
        slot, start = self._kept.take(run.request.request_id, run.sequence)
        if slot is None:
            slot = next((s for s in range(self.max_slots) if s not in self._running and s not in self._kept), None)
        return (self._kept.evict() if slot is None else slot), start

    def _fill_slot(self, slot: int) -> None:
        run = self._running[slot]
        p = run.request.params
        seed = p.seed if p.seed is not None else int(self._seeds.integers(2**32))
        self._slots.fill(slot, run.sequence, len(run.sample.tokens), p.max_tokens, p.temperature, p.top_k,
                         p.top_p, seed, p.stop_token_ids)

    def _free_slot(self, slot: int) -> _Running:
        self._slots.free(slot)
        return self._running.pop(slot)

    def _prefill(self, slots: list[int]) -> int:
        """(Re)computes the cache rows of `slots` from their sequences under the current weights; returns
        the positions it computed.

        Sequences with the same context (a GRPO group's samples of one prompt, episodes that made the
        same tool call) are computed once, in one prefill row written to up to prefill_fanout slots;
        rows go to calls by bucket (`_calls`).
        """
        shared: dict[tuple[int, ...], list[int]] = {}
        for slot in slots:
            context = tuple(self._running[slot].sequence[:-1])  # the last token is the pending decode input
            if context:
                shared.setdefault(context, []).append(slot)
        by_bucket: dict[int, list[tuple[tuple[int, ...], list[int]]]] = collections.defaultdict(list)
        r = self._prefill_fanout
        for context, targets in shared.items():
            bucket = next(b for b in self._buckets if b >= len(context))
            by_bucket[bucket] += [(context, targets[i:i + r]) for i in range(0, len(targets), r)]
        computed = 0
        for t, p, group in self._calls(by_bucket):
            computed += sum(len(context) for context, _ in group)
            tokens_pt = np.zeros((p, t), np.int32)
            lengths_p = np.zeros(p, np.int32)
            slots_pr = np.full((p, r), self.max_slots, np.int32)  # out of range: dropped
            for row, (context, targets) in enumerate(group):
                tokens_pt[row, :len(context)] = context
                lengths_p[row] = len(context)
                slots_pr[row, :len(targets)] = targets
            cache, routes_ptlk = jax_decode.prefill(self._graphdef, self._params, self._cache, tokens_pt,
                                                    lengths_p, slots_pr, out_sharding=self._cache_sharding)
            self._keep_cache(cache)
            self._env_routes([(slot, row, 0, len(context)) for row, (context, targets) in enumerate(group)
                              for slot in targets], routes_ptlk)
        return computed

    def _calls(self, by_bucket: dict[int, list]):
        """(bucket length t, rows p, items) per prefill or extend call: up to prefill_batch items of one
        bucket, padded to a power of two rows, so the compiled shapes stay at buckets x log2(prefill_batch)."""
        for t, items in sorted(by_bucket.items()):
            for first in range(0, len(items), self._prefill_batch):
                group = items[first:first + self._prefill_batch]
                yield t, 1 << (len(group) - 1).bit_length(), group

    def _extend(self, extended: list[tuple[int, int]]) -> int:
        """Computes the new tokens of requests admitted into their own finished turn's slot, (slot, start):
        positions start.. of the context (the pending last token excluded), grouped by bucket as
        `_prefill` does; returns the positions it computed."""
        by_bucket: dict[int, list[tuple[int, int, list[int]]]] = collections.defaultdict(list)
        for slot, start in extended:
            new = self._running[slot].sequence[start:-1]
            if new:
                by_bucket[next(b for b in self._buckets if b >= len(new))].append((slot, start, new))
        computed = 0
        for t, p, group in self._calls(by_bucket):
            computed += sum(len(new) for _, _, new in group)
            tokens_pt = np.zeros((p, t), np.int32)
            starts_p = np.zeros(p, np.int32)
            slots_p = np.full(p, self.max_slots, np.int32)  # out of range: padding rows are dropped
            for row, (slot, start, new) in enumerate(group):
                tokens_pt[row, :len(new)] = new
                starts_p[row], slots_p[row] = start, slot
            cache, routes_ptlk = jax_decode.extend(self._graphdef, self._params, self._cache, tokens_pt, starts_p,
                                                   slots_p, out_sharding=self._cache_sharding)
            self._keep_cache(cache)
            self._env_routes([(slot, row, start, len(new)) for row, (slot, start, new) in enumerate(group)],
                             routes_ptlk)
        return computed

    def _env_routes(self, computed: list[tuple[int, int, int, int]], routes_ptlk) -> None:
        """Records the routes of environment tokens that have none from the prefill or extend call that
        computed their inputs. computed: (slot, row, first, n) per slot written: the call's row `row`
        holds the routes of that slot's sequence positions first .. first + n - 1. Token i of a sample
        is produced at position len(prompt) + i - 1. Routes of model tokens, and any already recorded,
        are left as they are. The routes leave the device only when some token takes them."""
        if routes_ptlk is None:
            return
        fills = []
        for slot, row, first, n in computed:
            run = self._running[slot]
            routes, shift = run.sample.routes, len(run.request.prompt) - 1 - first
            for a, b in run.sample.env_spans:
                lo, hi = max(a, -shift), min(b, n - shift, len(routes))
                if lo < hi:
                    missing = np.flatnonzero(np.all(routes[lo:hi] < 0, axis=(1, 2))) + lo
                    fills += [(routes, row, missing, missing + shift)] if len(missing) else []
        if not fills:
            return
        routes_ptlk = np.asarray(jax.device_get(routes_ptlk))
        with self._lock:  # `progress` reads samples from other threads
            for routes, row, tokens, positions in fills:
                routes[tokens] = routes_ptlk[row, positions]

    def warmed(self, timeout: float | None = None) -> bool:
        """Waits until the programs `warmup` compiles in the background are compiled; False on timeout."""
        return self._background is None or self._background.wait(timeout)

    def _warmup(self) -> None:
        """Compiles the programs `warmup` promises. Those of construction run on free slots, which changes
        nothing: a decode call whose rows are all inactive stops before its first step, and a prefill call
        of padding rows only drops all its writes. The others compile ahead of time from the shapes
        alone (the loop keeps the cache meanwhile): the smaller decode buckets, largest first (a call
        uses only ready ones), then the extend programs (a turn that needs one first compiles it), then
        in exact mode the rescoring ones."""
        *later, largest = self._slots.idle_plans()
        self._decode_call(largest)
        rows = [1 << i for i in range((min(self._prefill_batch, self.max_slots) - 1).bit_length() + 1)]
        t, drop = self._buckets[0], self.max_slots  # an out-of-range slot: the row's writes are dropped
        for p in rows:
            self._keep_cache(jax_decode.prefill(
                self._graphdef, self._params, self._cache, np.zeros((p, t), np.int32), np.zeros(p, np.int32),
                np.full((p, self._prefill_fanout), drop, np.int32), out_sharding=self._cache_sharding)[0])
        jax.block_until_ready(self._cache)
        params, cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                     (self._params, self._cache))
        # What makes a program this engine's and no other's: equal for engines of the same shapes.
        leaves, tree = jax.tree.flatten((params, cache))
        shapes = (self._graphdef, tree, tuple(leaves), tuple(sorted(self._decode_kw.items())))
        jobs = [(("decode", len(plan.rows_b), shapes), functools.partial(
            jax_decode.decode.lower, self._graphdef, params, cache, self._slots.state(plan), plan.rows_b,
            plan.window_g, **self._decode_kw)) for plan in reversed(later)]
        jobs += [(("extend", p, shapes), functools.partial(
            jax_decode.extend.lower, self._graphdef, params, cache, np.zeros((p, t), np.int32), np.zeros(p, np.int32),
            np.full(p, drop, np.int32), out_sharding=self._cache_sharding)) for p in rows if self._reuse_turns]
        if self._exact:  # the rescoring programs, one per power-of-two row count (`_rescore`)
            jobs += [(("score", n, shapes), functools.partial(
                scoring.score.lower, self._graphdef, params, np.zeros((n, self.max_len), np.int32),
                np.zeros(n, np.int32), chunk=self._logprob_chunk))
                for n in (1 << i for i in range((self.max_slots - 1).bit_length() + 1))]
        if later:
            self._slots.ready = {len(largest.rows_b)}
        if jobs:
            self._background = jax_warmup.BackgroundCompiles(
                jobs, lambda key: key[0] == "decode" and self._slots.ready.add(key[1]), name="jax-engine-warmup")

    def _keep_cache(self, cache: jax_decode.KVCache) -> None:
        """Takes the cache a program returned. Programs label its sharding with an equivalent but
        normalised spec; relabelling it with the engine's own (same buffers, no copy) keeps every call's
        input signature the same, so that the programs `_warmup` compiled are the ones the loop hits."""
        self._cache = jax.device_put(cache, self._cache_sharding)

    def _decode_call(self, plan: jax_slots.DecodePlan):
        """Dispatches one decode call over the plan's rows, replacing the cache (donated); returns the
        rows' (state, tokens_bc, logprobs_bc, routes_bclk or None), still on device."""
        cache, state, tokens_bc, logprobs_bc, routes_bclk = jax_decode.decode(
            self._graphdef, self._params, self._cache, self._slots.state(plan), plan.rows_b, plan.window_g,
            **self._decode_kw)
        self._keep_cache(cache)
        return state, tokens_bc, logprobs_bc, routes_bclk

    def _decode(self) -> None:
        """One decode call over the active slots; appends its tokens and completes finished requests."""
        version, start = self._version, time.monotonic()
        plan = self._slots.plan(self.decode_chunk)
        state, tokens_bc, logprobs_bc, routes_bclk = jax.device_get(self._decode_call(plan))
        self._slots.update(plan, state)
        generated, finished = 0, []
        with self._lock:  # samples grow under the lock: `progress` reads them from other threads
            for row, slot in enumerate(self._slots.slots(plan).tolist()):
                if slot not in self._running:  # a padding row
                    continue
                n = int((tokens_bc[row] >= 0).sum())
                sample = self._running[slot].sample
                sample.tokens.extend(tokens_bc[row, :n].tolist())
                sample.logprobs.extend(logprobs_bc[row, :n].tolist())
                sample.versions.extend([version] * n)
                if routes_bclk is not None:
                    sample.routes = np.concatenate([sample.routes, routes_bclk[row, :n]])
                generated += n
                if not state.active_b[row]:
                    sample.finish_reason = _FINISH_NAMES[int(state.finish_b[row])]
                    run = self._free_slot(slot)
                    # A turn that stopped stays in its slot for the request's next turn; the stop token
                    # was sampled, never fed: not in the cache.
                    if self._reuse_turns and sample.finish_reason == "stop":
                        self._kept.keep(run.request.request_id, slot, run.sequence[:-1],
                                        int(state.lengths_b[row]))
                    finished.append(run)
        now = time.monotonic()
        self._rates.append((start, now, generated))
        while self._rates and self._rates[0][1] < now - _RATE_WINDOW_S:
            self._rates.popleft()
        self._rescore(finished)
        # Load first, so that whoever polls a completion sees a load that already counts it out.
        self._publish_load()
        with self._lock:
            for run in finished:
                self._complete(run.request, run.sample)

    def _complete(self, request: Request, sample: Sample) -> None:
        """Hands a finished sample to poll (caller holds the lock)."""
        self._active_ids.discard(request.request_id)
        self._hand_out(Completion(request.request_id, sample))

    def _abort(self, ids: set[str]) -> list[Completion]:
        """Removes waiting and running requests in `ids`; their partial samples, finish_reason "abort"."""
        out, running = [], []
        with self._lock:
            for run in [r for r in self._waiting if r.request.request_id in ids]:
                self._waiting.remove(run)
                run.sample.finish_reason = "abort"
                self._active_ids.discard(run.request.request_id)
                out.append(Completion(run.request.request_id, run.sample))
            for slot in [s for s, run in self._running.items() if run.request.request_id in ids]:
                run = self._free_slot(slot)
                run.sample.finish_reason = "abort"
                self._active_ids.discard(run.request.request_id)
                out.append(Completion(run.request.request_id, run.sample))
                running.append(run)
        if self._error is None:  # a failed loop's weights may be what failed: its samples go out as they are
            self._rescore(running)
        return out

    def _swap_weights(self, version: int, params: nnx.State, keep_kv: bool) -> None:
        """Serves `params` (with LoRA: new adapters over the base) from now on and recomputes every
        in-flight cache under them (unless `keep_kv`: then the caches, kept turns included, stay)."""
        self._rescore(list(self._running.values()))  # under the weights that sampled them
        if self.lora is not None:
            params = nnx.merge_state(self._params, params)
        self._params, self._version = params, version
        if not keep_kv:
            self._kept.clear()  # computed under the old weights
            self._count(recomputed_tokens=self._prefill(list(self._running)))

    def _rescore(self, runs: list[_Running]) -> None:
        """Exact mode: replaces the decode log-probs of the runs' tokens not yet rescored with those of
        `scoring.score` under the current weights (those that sampled them). Calls of up to max_slots
        sequences, padded to a power of two rows, each a row of max_len (the trainer's row length)."""
        todo = [r for r in runs if r.exact_from < len(r.sample.tokens)] if self._exact else []
        for first in range(0, len(todo), self.max_slots):
            group = todo[first:first + self.max_slots]
            rows = 1 << (len(group) - 1).bit_length()
            tokens_nt = np.zeros((rows, self.max_len), np.int32)
            lengths_n = np.zeros(rows, np.int32)
            for i, run in enumerate(group):
                sequence = run.sequence
                tokens_nt[i, :len(sequence)], lengths_n[i] = sequence, len(sequence)
            logp_nt = np.asarray(scoring.score(self._graphdef, self._params, tokens_nt, lengths_n,
                                               chunk=self._logprob_chunk))
            with self._lock:  # `progress` reads samples from other threads
                for i, run in enumerate(group):
                    start, end = (len(run.request.prompt) + k for k in (run.exact_from, len(run.sample.tokens)))
                    run.sample.logprobs[run.exact_from:] = logp_nt[i, start:end].tolist()
                    run.exact_from = len(run.sample.tokens)

    def _publish_load(self) -> None:
        now = time.monotonic()
        rates = [r for r in self._rates if r[1] >= now - _RATE_WINDOW_S]
        tokens_per_s = sum(r[2] for r in rates) / max(now - rates[0][0], 1e-9) if rates else 0.0
        used = self._slots.used_positions()
        with self._lock:
            self._snapshot = EngineLoad(running=len(self._running), waiting=len(self._waiting),
                                        kv_used=used / (self.max_slots * self.max_len),
                                        tokens_per_s=tokens_per_s, version=self._version)
