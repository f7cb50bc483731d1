"""What the incumbents' runners (incumbent_trl.py, incumbent_tunix.py) share: their command line, the setup
`vs_incumbents.py` writes for them, the reward, and the files they write back.

Standard library only (results_meta.py too): it runs in the incumbents' own environments, not jaxflow's.
The reward is `jaxflow.tasks.reward` (also standard library only), so every system scores responses the
same way.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import results_meta

ROOT = pathlib.Path(__file__).resolve().parents[1]
QUICK_TIME_LIMIT_S = 90  # --quick: the plumbing, not a measurement


def build_parser(description: str) -> argparse.ArgumentParser:
    """An incumbent runner's command line: `--setup DIR --out DIR [--seed N] [--quick] [--json PATH]`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--setup", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help=f"train at most {QUICK_TIME_LIMIT_S} s whatever the setup's time limit")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="also write result.json's figures with their meta block here")
    return parser


class Run:
    """One incumbent's run: `--setup DIR --out DIR --seed N`, the setup's files read, the step log open.

    setup: SETUP_DIR/setup.json (model_dir, prompts, eval, seed, settings); settings: its "settings";
    prompts, held_out: {"prompt": ids, "meta": dict, "text": str} each, in the order to use them.
    """

    def __init__(self, description: str, argv: list[str] | None = None):
        args = build_parser(description).parse_args(argv)
        self.meta_started = results_meta.begin(argv)
        self.out, self.seed, self.json = args.out, args.seed, args.json
        self.setup = json.loads((args.setup / "setup.json").read_text())
        self.settings = self.setup["settings"]
        if args.quick:
            self.settings = {**self.settings, "time_limit_s": min(self.settings["time_limit_s"], QUICK_TIME_LIMIT_S)}
        self.model_dir = self.setup["model_dir"]
        self.prompts = _jsonl(pathlib.Path(self.setup["prompts"]))
        self.held_out = _jsonl(pathlib.Path(self.setup["eval"]))
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = open(self.out / "metrics.jsonl", "w")
        self.start: float | None = None
        self.steps = 0

    @staticmethod
    def reward(response: str, meta: dict | str) -> float:
        """The task's reward (meta as a dict or its JSON text)."""
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from jaxflow.tasks import reward
        return reward(response, json.loads(meta) if isinstance(meta, str) else meta)

    def check_tokenizer(self, encode, system: str) -> None:
        """Stops unless `encode(prompt text)` gives the very ids jaxflow samples from (the first 200 train
        prompts and every held-out one)."""
        for p in self.prompts[:200] + self.held_out:
            ids = encode(p["text"])
            if ids != p["prompt"]:
                raise SystemExit(f"{system}'s tokenizer gives {ids[:12]}... for prompt {p['text']!r}, "
                                 f"jaxflow {p['prompt'][:12]}...")

    def begin(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def log_step(self, reward_mean: float | None, completion_tokens: int) -> float:
        """Appends the step that just ended; returns the seconds since `begin`."""
        elapsed = self.elapsed()
        self._log.write(json.dumps({"step": self.steps, "time_s": round(elapsed, 3), "reward_mean": reward_mean,
                                    "completion_tokens": completion_tokens}) + "\n")
        self._log.flush()
        self.steps += 1
        return elapsed

    def accuracy(self, generate, batch: int = 64) -> float:
        """Held-out greedy accuracy: generate(list of prompt records) -> their response texts."""
        correct = 0
        for i in range(0, len(self.held_out), batch):
            chunk = self.held_out[i:i + batch]
            correct += sum(self.reward(t, p["meta"]) >= 1.0 for t, p in zip(generate(chunk), chunk))
        return correct / len(self.held_out)

    def finish(self, system: str, eval_accuracy: float, versions: dict, settings: dict) -> None:
        """result.json, and its figures on one line."""
        self._log.close()
        steps = _jsonl(self.out / "metrics.jsonl")
        result = {"system": system, "seed": self.seed, "steps": len(steps),
                  "first_step_s": steps[0]["time_s"] if steps else None,
                  "train_s": steps[-1]["time_s"] if steps else None, "eval_accuracy": eval_accuracy,
                  "versions": versions, "settings": settings}
        (self.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        if self.json:
            results_meta.write_json(self.json, result, self.meta_started)
        print(json.dumps({k: result[k] for k in ("steps", "first_step_s", "train_s", "eval_accuracy")}))


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
