"""The RL job's bookkeeping, shared by its embedded and cluster forms: the ledger of trained groups, where
every group went (`accounting`), the reward pools' settings (`reward_pool_options`), reward failures made
visible (`RewardErrors`, `check_first_batch`), and Ctrl-C handling (`StopRequest`)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import sys

from jaxflow.rewards import RewardPool

# Reward calls that failed (each scored 0), by kind: the reward pool's counts, cumulative, in every step's
# metrics and in result.json's accounting as reward_<kind>.
REWARD_FAILURES = ("raised", "timed_out", "crashed", "invalid")
# Distinct reward errors printed; any more are counted only.
_MAX_PRINTED_REWARD_ERRORS = 5


def reward_pool_options(rollout) -> dict:
    """The `RewardPool` arguments of the `rollout` config section, the same for every pool a job builds:
    `reward_workers` processes, `reward_timeout_s` per call, `reward_memory_mb` of address space each (None:
    the pool's share of the machine's memory), and 0 for a failed call."""
    return {"num_workers": rollout.reward_workers, "timeout_s": rollout.reward_timeout_s, "failed_value": 0.0,
            "memory_limit_mb": rollout.get("reward_memory_mb")}


class RewardErrors:
    """The reward pool's `on_failure`: prints the first occurrence of each distinct reward error to stderr,
    and remembers the first one for the error that stops a run whose reward never works."""

    def __init__(self, failed_value: float):
        self.failed_value, self.seen, self.first = failed_value, 0, None

    def __call__(self, message: str) -> None:
        self.seen += 1
        self.first = self.first or message
        if self.seen <= _MAX_PRINTED_REWARD_ERRORS:
            print(f"jaxflow: {message}; the sample scores {self.failed_value:g} and the run goes on (more "
                  f"failures with this message are counted in the metrics as reward_*, not printed)",
                  file=sys.stderr, flush=True)
        elif self.seen == _MAX_PRINTED_REWARD_ERRORS + 1:
            print("jaxflow: more distinct reward errors: counted in the metrics, not printed",
                  file=sys.stderr, flush=True)


class RewardNeverWorked(RuntimeError):
    """The reward function failed on every sample of the run's first batch: training would learn nothing."""


class StopRequest:
    """First Ctrl-C: finish the step in progress, checkpoint, exit. Second: stop at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            print("\njaxflow: stopping after this step and saving a checkpoint (Ctrl-C again to stop now)",
                  file=sys.stderr, flush=True)

        with contextlib.suppress(ValueError):  # not the main thread: no handler
            self._previous = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class Ledger:
    """ledger.jsonl: per trained step, the ids of the groups it consumed. Resuming drops the steps that
    will be redone, so the file always describes the run whose parameters survive."""

    def __init__(self, path: pathlib.Path, start_step: int):
        self.path = path
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] < start_step]
        path.write_text("".join(ln + "\n" for ln in kept))
        self._file = path.open("a")

    def record(self, step: int, group_ids: list[int]) -> None:
        self._file.write(json.dumps({"step": step, "groups": group_ids}) + "\n")
        self._file.flush()

    def group_ids(self) -> list[int]:
        return [g for ln in self.path.read_text().splitlines() if ln.strip()
                for g in json.loads(ln)["groups"]]

    def close(self) -> None:
        self._file.close()


def accounting(service, ledger: Ledger, pool: RewardPool) -> dict[str, int]:
    """Where every group went (created = consumed + in flight + failed + surplus), how many the ledger
    trained (and twice), the tokens that groups of dead rollout workers kept (`recovered_tokens`: resumed,
    not generated again), and the reward calls by outcome (rollouts and evals; a failed call scored 0)."""
    stats = service.stats()
    ids = ledger.group_ids()
    counts = stats["counts"]
    rewards = pool.stats()
    return {
        "created": counts["created"], "consumed": counts["consumed"], "failed": counts["failed"],
        "surplus": counts["surplus"], "recovered_tokens": counts["recovered_tokens"],
        "in_flight": sum(v for k, v in stats["groups"].items() if k not in ("consumed", "failed", "surplus")),
        "ledger_groups": len(ids), "ledger_duplicates": len(ids) - len(set(ids)),
        "reward_calls": rewards["submitted"], "reward_scored": rewards["scored"],
        **{f"reward_{k}": rewards[k] for k in REWARD_FAILURES}}


def check_first_batch(pool: RewardPool, before: dict[str, int], batch_samples: int, errors: RewardErrors,
                       fn_ref: str) -> None:
    """Raises RewardNeverWorked if not one reward call since `before` (the pool's stats when rollouts
    started) scored, though at least a batch's worth of them finished."""
    now = pool.stats()
    finished = sum(now[k] - before[k] for k in ("scored", *REWARD_FAILURES))
    if now["scored"] == before["scored"] and finished >= batch_samples:
        raise RewardNeverWorked(
            f"the reward function {fn_ref} failed on all {finished} samples of the first batch "
            f"({batch_samples} samples): {errors.first or 'see the errors above'}; fix it and rerun")


