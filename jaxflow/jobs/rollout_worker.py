"""A rollout worker as its own process: the coordinator (`jaxflow.coordination`) over one engine,
talking to served data services over RPC.

    python -m jaxflow.jobs.rollout_worker --trajectories 127.0.0.1:7001 --params 127.0.0.1:7002 \\
        --model runs/x/base_model --engine jax --name w0 --reward jaxflow.tasks:reward

The trajectory and parameter services run elsewhere (`jaxflow.transport.rpc.Server`); the token, if any, comes
from the JAXFLOW_TOKEN environment variable so it never shows in a process list. The worker first
loads the newest published weights, then runs until SIGTERM/SIGINT, when it hands its in-flight groups
back (with their partial samples) before exiting, or with --drain lets them finish first. Placement and
weight-sync options are those of the `rollout.coordination` config section (`--sync`, `--sync-mode`, ...).
With `--lora-rank` the engine serves LoRA adapters over --model and each published version is the
adapters alone (PEFT-named), as a trainer with `trainer.lora` publishes them.
The trajectory server must serve `take_surplus` besides dispatch/finish/abort/fail/needs_sync, and
should serve `renew` and `release_worker`: without `renew` the worker cannot keep its leases, so its groups
go back to the queue after the service's `lease_s` (a later finish of one is refused and logged).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from jaxflow.coordination import Coordination, Coordinator
from jaxflow.coordination.config import SYNC_MODES
from jaxflow.models.lora import LORA_TARGETS, LoRASpec
from jaxflow.transport import rpc
from jaxflow.transport.param_client import ParameterClient
from rollout_bridge.engine import SamplingParams
from rollout_bridge.factory import make_engine

log = logging.getLogger("jaxflow.jobs.rollout_worker")


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one rollout worker against served data services.")
    parser.add_argument("--trajectories", type=_address, required=True, help="HOST:PORT of the trajectory service")
    parser.add_argument("--params", type=_address, required=True, help="HOST:PORT of the parameter service")
    parser.add_argument("--model", required=True, help="HF directory the engine starts from")
    parser.add_argument("--engine", default="jax", choices=["jax", "vllm"])
    parser.add_argument("--name", default=f"worker-{os.getpid()}")
    parser.add_argument("--reward", default=None, help="module:function scoring (response, meta); "
                                                       "omit to leave rewarding to the trainer's pool")
    parser.add_argument("--max-running", type=int, default=None,
                        help="requests kept on the engine (default: --slots)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    parser.add_argument("--decode-chunk", type=int, default=16, help="tokens a JAX engine decodes a call")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="a vLLM engine's KV cache in GiB")
    parser.add_argument("--sync", default="all", choices=["all", "selective"],
                        help="all: take each new version at once; selective: when idle or lagging")
    parser.add_argument("--sync-idle-below", type=int, default=0)
    parser.add_argument("--sync-max-lag", type=int, default=1)
    parser.add_argument("--sync-mode", default="keep", choices=list(SYNC_MODES))
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="serve LoRA adapters of this rank over --model (0: none); each version is then the "
                             "adapters alone, as a trainer with trainer.lora publishes them")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                        help="comma-separated projections the adapters sit on")
    parser.add_argument("--drain", action="store_true",
                        help="on SIGTERM/SIGINT let the groups in flight finish instead of handing them back")
    args = parser.parse_args(argv)
    if args.decode_chunk < 1:
        parser.error(f"--decode-chunk must be >= 1, got {args.decode_chunk}")
    if not args.kv_cache_gib > 0:
        parser.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
    lora = None
    if args.lora_rank:
        try:
            lora = LoRASpec(args.lora_rank, args.lora_alpha, tuple(t for t in args.lora_targets.split(",") if t))
        except ValueError as e:
            parser.error(f"--lora-*: {e}")
    try:
        # Stuck buffers are the trainer's side's business (one worker sees one engine): "wait", so that
        # eta, which only that strategy reads, does not matter here.
        strategy = Coordination(max_running=args.max_running or args.slots, sync=args.sync,
                                sync_idle_below=args.sync_idle_below, sync_max_lag=args.sync_max_lag,
                                sync_mode=args.sync_mode, stuck="wait")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    token = os.environ.get("JAXFLOW_TOKEN")
    trajectories = rpc.Client(args.trajectories, token=token)
    params = ParameterClient(rpc.Client(args.params, token=token))
    engine = make_engine(args.engine, args.model, args.max_len, args.slots, seed=args.seed,
                         decode_chunk=args.decode_chunk, kv_cache_gib=args.kv_cache_gib, lora=lora)
    reward_fn = None
    if args.reward:
        from jaxflow.rewards import resolve
        from jaxflow.tokenizer import Tokenizer

        score, tokenizer = resolve(args.reward), Tokenizer.from_dir(args.model)

        def reward_fn(task, samples):
            return [float(score(tokenizer.decode(s.tokens), task.meta)) for s in samples]

    worker = Coordinator(args.name, [engine], trajectories, params, strategy=strategy, eta=0,
                         sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
                         reward_fn=reward_fn)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker.load_weights()
    log.info("worker %s serving with the %s engine at version %d", args.name, args.engine, engine.version)
    worker.start()
    failed = False
    try:
        while not stop.wait(0.5):
            if worker.error is not None:  # its engine failed: exit non-zero, so a supervisor can restart it
                log.error("worker %s: %s", args.name, worker.error)
                failed = True
                break
    finally:
        worker.stop(abort_in_flight=not args.drain)
        engine.close()
        params.close()  # the service may write into the segments this process mapped again
        log.info("worker %s stopped: %s", args.name, dict(worker.counts))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
