"""A real-size RL run end to end on this machine: Qwen3-0.6B's shape with random weights, on one engine.

Runs `configs/qwen3_gsm8k.py:cpu_smoke` (28 layers, hidden 1,024, vocab 151,936; a randomly initialised
model written on first use) as a user would, with `python -m jaxflow.main`, in three phases:

  1. train: the first `--steps-before` steps, then the job ends (a checkpoint after its last step);
  2. resume: the same command with `--steps` steps, in the same workdir: it must say it resumes from
     the checkpoint and train the steps left;
  3. export: the exported policy (workdir/export) loaded by transformers and by jaxflow, their logits on a
     few prompts compared, and its weights compared with the base's (training moved them).

Checks: each phase exits 0; every trained version reached the engine (`coordination.syncs` in result.json
>= the steps that phase trained); the resume line; the export's logits equal within float32 tolerance;
the export differs from the base. Memory: the peak RSS of the whole process tree (the job, vLLM's engine
processes, the reward workers), sampled every 0.5 s, against the machine's total; and the largest single
process's (getrusage of the children). The JSON has the wall time of each phase, the peak RSS and which
checks held.

    .venv/bin/python benchmarks/realsize_e2e.py --engine jax --json benchmarks/results/realsize_e2e.json
    .venv/bin/python benchmarks/realsize_e2e.py --engine vllm --set trainer.param_dtype=bfloat16 \
        --set rollout.kv_cache_gib=0.125 --set trainer.logprob_chunk=32 --set trainer.remat=true \
        --json benchmarks/results/realsize_e2e.json
    .venv/bin/python benchmarks/realsize_e2e.py --engine jax --quick

A second engine's run merges into an existing JSON file (one entry per engine under "engines", each with
a meta block of its own). Run one at a time. The random model is written in its published bfloat16; the
config computes in bfloat16 (`model.compute_dtype`: the update's matmuls and both engines) over float32
master weights and float32 AdamW moments (`trainer.param_dtype` float32, the default). `--set KEY=VALUE`
(repeatable) overrides one config key in both runs, e.g. `--set trainer.param_dtype=bfloat16` for bfloat16
master weights (AdamW's moments stay float32) or `--set rollout.kv_cache_gib=0.25`; the entry records the
overrides and the dtypes, engine limits and KV cache they gave.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import results_meta
from async_vs_sync import parse_overrides

ROOT = results_meta.ROOT
CONFIG = "configs/qwen3_gsm8k.py:cpu_smoke"
PROMPTS = ("What is 3 + 4?", "Qwen3 at real size: 28 layers, 1,024 wide.", "12 * 7 - 5 =")


class TreeRss:
    """Samples the summed RSS of a process and all its descendants every `every_s` seconds; `peak` in bytes."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.every_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_job(workdir: pathlib.Path, engine: str, steps: int, log_path: pathlib.Path,
            overrides: dict[str, str] | None = None) -> dict:
    """One `jaxflow.main` run of the cpu_smoke config (with `overrides`, {dotted key: text}); its exit code,
    wall time, peak tree RSS and output."""
    cmd = [sys.executable, "-m", "jaxflow.main", f"--config={CONFIG}", f"--config.rollout.engine={engine}",
           f"--config.workdir={workdir}", f"--config.trainer.steps={steps}",
           *(f"--config.{key}={value}" for key, value in (overrides or {}).items())]
    print("  $ " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = TreeRss(proc.pid)
        for line in proc.stdout:  # echoed, so a long run shows its progress
            out.write(line)
            print("    " + line.rstrip(), flush=True)
        rc = proc.wait()
    peak = sampler.stop()
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "peak_tree_rss_gib": round(peak / 2**30, 2),
            "command": " ".join(cmd[1:]), "log": log_path.read_text()}


def compare_export(export_dir: pathlib.Path, base_dir: pathlib.Path) -> dict:
    """transformers' and jaxflow's logits of the exported policy on PROMPTS, and how far it moved from the base."""
    import jax.numpy as jnp
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxflow.models.hf_io import load_model
    from jaxflow.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(export_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(export_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    hf_model.eval()
    model = load_model(export_dir, param_dtype=jnp.float32)
    max_abs, scale, same_tokens = 0.0, 0.0, True
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        same_tokens &= hf_tok.encode(text) == ids
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().numpy()
        ours = np.asarray(model(jnp.asarray([ids], jnp.int32))[0], np.float32)
        max_abs = max(max_abs, float(np.abs(ours - ref).max()))
        scale = max(scale, float(np.abs(ref).max()))
    del hf_model, model
    moved = 0.0
    exported, base = load_file(str(export_dir / "model.safetensors")), load_file(str(base_dir / "model.safetensors"))
    for name, array in exported.items():
        moved = max(moved, float(np.abs(array.astype(np.float32) - base[name].astype(np.float32)).max()))
    return {"logits_max_abs_diff": max_abs, "logits_max_abs": scale, "same_token_ids": bool(same_tokens),
            "max_weight_change_from_base": moved, "tensors": len(exported)}


def settings(config) -> dict:
    """What the run's memory depends on, as the job resolves it: dtypes, engine limits, KV cache, batch."""
    r, t = config.rollout, config.trainer
    return {"compute_dtype": config.model.compute_dtype, "param_dtype": t.param_dtype, "adamw_moments": "float32",
            "engine": r.engine, "max_slots": r.max_slots, "max_len": r.max_len, "max_tokens": r.max_tokens,
            "kv_cache_gib": r.kv_cache_gib, "group_size": r.group_size, "batch_groups": t.batch_groups,
            "micro_batch_rows": t.micro_batch_rows, "eval_prompts": config.eval.num_prompts}


def _result(workdir: pathlib.Path) -> dict:
    path = workdir / "result.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="jax", choices=("jax", "vllm"))
    parser.add_argument("--steps-before", type=int, default=2, help="steps of the first run (then it stops)")
    parser.add_argument("--steps", type=int, default=3, help="steps in all: the resumed run trains the rest")
    parser.add_argument("--workdir", default=None, help="default: runs/realsize_e2e_<engine>, emptied first")
    parser.add_argument("--quick", action="store_true", help="1 step, then 1 more after the resume")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for both runs, e.g. trainer.param_dtype=bfloat16 (repeatable)")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    if args.quick:
        args.steps_before, args.steps = 1, 2
    if not 1 <= args.steps_before < args.steps:
        raise SystemExit(f"need 1 <= --steps-before ({args.steps_before}) < --steps ({args.steps})")
    overrides = parse_overrides(args.overrides)
    from jaxflow.config import ConfigError, load_config

    try:  # a misspelt key or a bad value stops here, before anything runs
        config = load_config(CONFIG, {"rollout.engine": args.engine, **overrides})
    except ConfigError as e:
        raise SystemExit(f"--set: {e}") from e
    workdir = ROOT / (args.workdir or f"runs/realsize_e2e_{args.engine}")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    t0 = time.perf_counter()

    base_dir = ROOT / config.base.dir
    if not (base_dir / "config.json").is_file():  # the job would write it too; done here to time it apart
        from jaxflow.models.random_hf import make_random_hf_model

        make_random_hf_model(base_dir, config.base.random_preset)
    checks: dict[str, bool] = {}
    phases = {}
    print(f"phase 1: {args.steps_before} steps on the {args.engine} engine", flush=True)
    phases["train"] = run_job(workdir, args.engine, args.steps_before, workdir.parent / f"{workdir.name}_train.log",
                              overrides)
    first = _result(workdir)
    checks["train_exit_0"] = phases["train"]["rc"] == 0
    checks["train_synced_each_version"] = first.get("coordination", {}).get("syncs", 0) >= args.steps_before
    checks["checkpoint_written"] = any((workdir / "checkpoints").glob("*")) if (workdir / "checkpoints").is_dir() \
        else False

    print(f"phase 2: resume to {args.steps} steps", flush=True)
    phases["resume"] = run_job(workdir, args.engine, args.steps, workdir.parent / f"{workdir.name}_resume.log",
                               overrides)
    second = _result(workdir)
    checks["resume_exit_0"] = phases["resume"]["rc"] == 0
    checks["resumed_from_checkpoint"] = bool(
        re.search(rf"resuming .* from step {args.steps_before}\b", phases["resume"]["log"]))
    checks["resume_synced_each_version"] = (second.get("coordination", {}).get("syncs", 0)
                                            >= args.steps - args.steps_before)
    steps_logged = [json.loads(line).get("step") for line in (workdir / "metrics.jsonl").read_text().splitlines()
                    if '"loss"' in line] if (workdir / "metrics.jsonl").is_file() else []
    checks["every_step_trained_once"] = sorted(steps_logged) == list(range(args.steps))

    print("phase 3: the export, loaded by transformers and by jaxflow", flush=True)
    export = {}
    if (workdir / "export" / "config.json").is_file():
        export = compare_export(workdir / "export", base_dir)
        tolerance = 1e-4 * max(1.0, export["logits_max_abs"])  # float32 sums over 1,024-3,072 terms, 28 layers
        export["tolerance"] = tolerance
        checks["export_same_logits_in_transformers"] = export["logits_max_abs_diff"] <= tolerance
        checks["export_same_token_ids"] = export["same_token_ids"]
        checks["export_moved_from_base"] = export["max_weight_change_from_base"] > 0
    else:
        checks["export_same_logits_in_transformers"] = False
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    peak_tree = max(p["peak_tree_rss_gib"] for p in phases.values())
    total_gib = psutil.virtual_memory().total / 2**30
    wall = time.perf_counter() - t0
    for phase in phases.values():
        phase.pop("log")
    entry = {"engine": args.engine, "all_checks_held": all(checks.values()), "checks": checks,
             "wall_s": round(wall, 1), "peak_rss_gib": peak_tree, "peak_rss_frac_of_machine": peak_tree / total_gib,
             "machine_memory_gib": round(total_gib, 1), "largest_child_rss_gib": round(child_rss / 2**30, 2),
             "self_rss_gib": round(self_rss / 2**30, 2), "phases": phases, "export": export,
             "steps": args.steps, "steps_before_resume": args.steps_before,
             "train_step_compile_s": second.get("train_step_compile_s"),
             "model": {"preset": config.base.random_preset,
                       "dtype": json.loads((base_dir / "config.json").read_text()).get("torch_dtype")},
             "overrides": overrides, "settings": settings(config)}
    print(f"\n{args.engine}: {'all checks held' if entry['all_checks_held'] else 'CHECKS FAILED'} in {wall:.0f} s; "
          f"peak RSS {peak_tree:.1f} GiB of {total_gib:.0f} GiB")
    for name, ok in checks.items():
        print(f"  {'ok ' if ok else 'BAD'} {name}")
    if args.json:
        path = pathlib.Path(args.json)
        previous = json.loads(path.read_text()) if path.is_file() else {}
        engines = previous.get("engines", {})
        engines[args.engine] = {**entry, "meta": results_meta.finish(started)}
        results_meta.write_json(path, {"engines": engines, "all_checks_held": all(
            e["all_checks_held"] for e in engines.values()), "peak_rss_gib": max(
            e["peak_rss_gib"] for e in engines.values())}, started)
        print(f"wrote {args.json}")
    return 0 if entry["all_checks_held"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
