"""Human-readable logging of a training run: TensorBoard, a JSON-lines file, a console line and plots.

One `RunLog` per training process writes, under its workdir:

  <workdir>/metrics.jsonl   one JSON object per train step or eval point, flushed per line:
                            {"step": 12, "time_s": 34.2, "reward_mean": 0.41, ..., "staleness": {"0": 70}}
  <workdir>/tensorboard/    tensorboardX event files, one scalar tag per metric name
  <workdir>/plots/*.png     written by `plot()` (and by `close()`) from metrics.jsonl

Steps are 0-based train-step indices. `start_step` is the first step this process runs (the restored
checkpoint's TrainState.step, 0 for a fresh run); a resumed run drops the records of steps it will redo.
Not thread-safe: call it from the training loop's thread.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Self

log = logging.getLogger(__name__)

# Metrics shown on the console line when present, in order: (metric key, label, formatter name).
# Every other key goes only to TensorBoard and metrics.jsonl.
LINE_FIELDS = (
    ("reward_mean", "reward", "num"),
    ("loss", "loss", "num"),
    ("grad_norm", "gnorm", "num"),
    ("trained_tokens_per_s", "tok/s", "num"),
    ("trainer_idle_frac", "idle_train", "pct"),
    ("rollout_idle_frac", "idle_roll", "pct"),
)
_RESERVED = frozenset({"step", "time_s", "staleness"})


def _num(x: float) -> str:
    """A number in at most ~4 characters of precision: 0.012, 0.41, 12.3, 5.1k, 2.3M."""
    if not math.isfinite(x):
        return str(x)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _pct(x: float) -> str:
    """A fraction in [0, 1] as a whole percentage."""
    return f"{100 * x:.0f}%" if math.isfinite(x) else str(x)


def _duration(seconds: float) -> str:
    """Wall time as 34s, 12m05s or 3h02m."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in file order; [] if it does not exist.

    A line that is not valid JSON (the half-written last line of a crashed run) is skipped with a warning.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return []
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: skipping a line that is not valid JSON", path, n)
    return records


def staleness_totals(records: list[Mapping[str, Any]]) -> Counter[int]:
    """Trained tokens per staleness (in policy versions), summed over the records' "staleness" dicts."""
    total: Counter[int] = Counter()
    for r in records:
        for k, v in r.get("staleness", {}).items():
            total[int(k)] += int(v)
    return total


class RunLog:
    """Per-step logging of one training run to TensorBoard, metrics.jsonl, the console and PNG plots.

    workdir: the run's directory (created if missing). total_steps: steps in the whole run, for the
    progress bar. start_step: first step this process runs. quiet: no progress bar and no console lines.
    resume: continue an existing metrics.jsonl, dropping its records with step >= start_step and carrying
    on its wall clock; without it a non-empty metrics.jsonl is an error, so two runs never mix.
    """

    def __init__(self, workdir: str | os.PathLike, *, total_steps: int, start_step: int = 0,
                 quiet: bool = False, resume: bool = False):
        from tensorboardX import SummaryWriter
        from tqdm import tqdm

        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.total_steps = total_steps
        self.quiet = quiet
        self._closed = False

        time_offset = 0.0
        kept: list[dict[str, Any]] = []
        if self.metrics_path.exists() and self.metrics_path.stat().st_size > 0:
            if not resume:
                raise ValueError(
                    f"{self.metrics_path} already holds records of a run; pass resume=True to continue it, "
                    "or use another workdir")
            records = read_records(self.metrics_path)
            # Wall time already spent, including steps this process redoes, so time_s stays wall time.
            time_offset = max((float(r.get("time_s", 0.0)) for r in records), default=0.0)
            kept = [r for r in records if r.get("step", -1) < start_step]
            self._rewrite(kept)
        accuracies = [r["eval_accuracy"] for r in kept if "eval_accuracy" in r]
        # Latest eval accuracy, shown on every console line until the next eval.
        self._last_accuracy: float | None = accuracies[-1] if accuracies else None
        # Run total of trained tokens per staleness, including the resumed records.
        self.staleness_total = staleness_totals(kept)

        self._t0 = time.monotonic() - time_offset
        self._file = self.metrics_path.open("a")
        # purge_step hides events of redone steps that an earlier process already wrote.
        self._writer = SummaryWriter(str(self.workdir / "tensorboard"),
                                     purge_step=start_step if resume else None)
        # disable=None turns the bar off when stderr is not a TTY; metric lines still print.
        self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                         disable=True if quiet else None)

    def _rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replaces metrics.jsonl with `records`, atomically."""
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, self.metrics_path)

    def elapsed_s(self) -> float:
        """Wall seconds since the run started, across resumes."""
        return time.monotonic() - self._t0

    def _append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _print(self, line: str) -> None:
        if not self.quiet:
            from tqdm import tqdm
            tqdm.write(line)

    def log_step(self, step: int, metrics: Mapping[str, float], *,
                 staleness: Mapping[int, int] | None = None) -> None:
        """Records train step `step`: scalar metrics, and optionally its staleness histogram.

        metrics: name -> scalar (Python, numpy or 0-d jax values). staleness: policy-version lag ->
        number of trained tokens with that lag in this step.
        """
        if bad := _RESERVED.intersection(metrics):
            raise ValueError(f"metric names {sorted(bad)} are reserved by RunLog")
        values = {k: float(v) for k, v in metrics.items()}
        record: dict[str, Any] = {"step": step, "time_s": round(self.elapsed_s(), 3), **values}
        for k, v in values.items():
            self._writer.add_scalar(k, v, step)
        hist = {int(k): int(v) for k, v in (staleness or {}).items()}
        if hist:
            record["staleness"] = {str(k): v for k, v in sorted(hist.items())}
            self.staleness_total.update(hist)
            self._log_staleness_tb(step, hist)
        if "eval_accuracy" in values:
            self._last_accuracy = values["eval_accuracy"]
        self._append(record)
        if step + 1 > self._bar.n:
            self._bar.update(step + 1 - self._bar.n)
        self._print(self._line(step, values, hist, record["time_s"]))

    def _log_staleness_tb(self, step: int, hist: dict[int, int]) -> None:
        """The staleness histogram as a TensorBoard histogram (one bucket per lag) and its mean."""
        lags = sorted(hist)
        n = sum(hist.values())
        if n <= 0:
            return
        total = sum(k * c for k, c in hist.items())
        self._writer.add_histogram_raw(
            "staleness", min=lags[0], max=lags[-1], num=n, sum=total,
            sum_squares=sum(k * k * c for k, c in hist.items()),
            bucket_limits=[k + 0.5 for k in lags], bucket_counts=[hist[k] for k in lags],
            global_step=step)
        self._writer.add_scalar("staleness_mean", total / n, step)

    def _line(self, step: int, values: dict[str, float], hist: dict[int, int], time_s: float) -> str:
        """The console line: step 12/200 | reward 0.41 | acc - | loss 0.012 | stale 0:70% 1:30% | 34s."""
        fmt = {"num": _num, "pct": _pct}
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, kind in LINE_FIELDS:
            if key in values:
                parts.append(f"{label} {fmt[kind](values[key])}")
            if key == "reward_mean":
                acc = self._last_accuracy
                parts.append("acc " + ("-" if acc is None else _num(acc)))
        if hist and sum(hist.values()) > 0:
            n = sum(hist.values())
            parts.append("stale " + " ".join(f"{k}:{_pct(c / n)}" for k, c in sorted(hist.items())))
        parts.append(_duration(time_s))
        return " | ".join(parts)

    def log_eval(self, step: int, accuracy: float, **extra: float) -> None:
        """Records an evaluation after train step `step`: accuracy in [0, 1] and other eval scalars.

        Extra names are stored with an "eval_" prefix unless they have one already.
        """
        values = {"eval_accuracy": float(accuracy)}
        values.update({k if k.startswith("eval_") else f"eval_{k}": float(v) for k, v in extra.items()})
        for k, v in values.items():
            self._writer.add_scalar(k, v, step)
        self._last_accuracy = values["eval_accuracy"]
        time_s = round(self.elapsed_s(), 3)
        self._append({"step": step, "time_s": time_s, **values})
        self._print(f"eval step {step} | " + " | ".join(f"{k[5:]} {_num(v)}" for k, v in values.items())
                    + f" | {_duration(time_s)}")

    def plot(self, path: str | os.PathLike | None = None) -> list[pathlib.Path]:
        """Writes PNG plots from metrics.jsonl into `path` (default <workdir>/plots); returns their paths.

        reward.png: reward_mean against wall time and against step, eval accuracy on a second axis.
        staleness.png: fraction of trained tokens per staleness over the whole run.
        A plot with no data to show is not written.
        """
        # Figure without pyplot renders with Agg and leaves matplotlib's global backend alone.
        from matplotlib.figure import Figure

        if not self._closed:
            self._file.flush()
        out = pathlib.Path(path) if path is not None else self.workdir / "plots"
        out.mkdir(parents=True, exist_ok=True)
        records = read_records(self.metrics_path)
        train = [r for r in records if "reward_mean" in r]
        evals = [r for r in records if "eval_accuracy" in r]
        written = []
        if train or evals:
            t_max = max(r["time_s"] for r in train + evals)
            t_div, t_unit = (3600, "h") if t_max > 7200 else (60, "min") if t_max > 120 else (1, "s")
            x_of = {"time_s": lambda r: r["time_s"] / t_div, "step": lambda r: r["step"]}
            fig = Figure(figsize=(11, 4), layout="constrained")
            for ax, x_key, x_label in zip(fig.subplots(1, 2), ("time_s", "step"),
                                          (f"wall time ({t_unit})", "step")):
                if train:
                    ax.plot([x_of[x_key](r) for r in train], [r["reward_mean"] for r in train],
                            color="tab:blue", label="reward_mean")
                ax.set_xlabel(x_label)
                ax.set_ylabel("reward_mean", color="tab:blue")
                ax.grid(alpha=0.3)
                if evals:
                    acc_ax = ax.twinx()
                    acc_ax.plot([x_of[x_key](r) for r in evals], [r["eval_accuracy"] for r in evals],
                                "o-", color="tab:orange", label="eval_accuracy")
                    acc_ax.set_ylabel("eval accuracy", color="tab:orange")
            fig.suptitle(f"reward — {self.workdir.name}")
            written.append(out / "reward.png")
            fig.savefig(written[-1], dpi=100)
        totals = staleness_totals(records)
        n = sum(totals.values())
        if n > 0:
            fig = Figure(figsize=(5, 4), layout="constrained")
            ax = fig.subplots()
            lags = sorted(totals)
            ax.bar(lags, [totals[k] / n for k in lags], color="tab:green")
            ax.set_xticks(lags)
            ax.set_xlabel("staleness (policy versions)")
            ax.set_ylabel("fraction of trained tokens")
            ax.set_title(f"staleness — {n:,} tokens")
            written.append(out / "staleness.png")
            fig.savefig(written[-1], dpi=100)
        return written

    def close(self) -> list[pathlib.Path]:
        """Closes the progress bar, the TensorBoard writer and the file, then plots; returns the plots."""
        if self._closed:
            return []
        self._bar.close()
        self._writer.close()
        self._file.close()
        self._closed = True
        return self.plot()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
