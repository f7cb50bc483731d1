"""benchmarks/prefix_reuse.py's core on tiny engines: the same agent episodes prefill fewer prompt tokens when
every turn goes to the engine that served the turn before than when turns alternate between two engines,
and each turn's counts add up (prompt positions = reused + prefilled, turns one at a time)."""

import pathlib
import sys

import pytest

from jaxflow.config import load_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import prefix_reuse  # noqa: E402

pytestmark = pytest.mark.slow  # JAX engines compiled and run end to end

# The small agent job's base (tests/jobs/test_agent_job.py): one warm start per test run for both.
CONFIG = "configs/arithmetic_agent_tiny.py:async,small"


def test_affinity_prefills_fewer_prompt_tokens_than_round_robin(tmp_path, shared_base):
    config = load_config(CONFIG, {"base.dir": str(tmp_path / "base")})
    model_dir = shared_base(config, tmp_path / "base")
    tasks = prefix_reuse.tasks_of(3)
    # The small base writes mostly noise: stopping at a space or a "+" too ends most of its turns early, and a
    # turn that stops keeps its row (one cut at max_tokens keeps none). Not at a newline: each prompt ends with
    # the assistant header's, and a prompt that ends at a stop token is a finished turn before it starts.
    counts = {mode: prefix_reuse.run_mode(mode, model_dir, tasks, max_tokens=24, stop=("</tool>", " ", "+"),
                                          slots=4) for mode in ("affinity", "round_robin")}
    for mode, turns in counts.items():
        assert [t.turn for t in turns] == [1, 2, 3, 4] * len(tasks), mode
        assert all(t.context > 0 for t in turns), mode  # every turn was admitted and counted
        assert all(t.context == t.reused + t.prefilled for t in turns), mode  # nothing shared: one at a time
        assert all(t.reused == 0 for t in turns if t.turn == 1), mode
    affinity, round_robin = counts["affinity"], counts["round_robin"]
    # The same conversations both ways (the same seeds): the same prompts, turn for turn.
    assert [t.context for t in affinity] == [t.context for t in round_robin]
    # With affinity every turn after one that stopped extends its kept row; round robin's turn 2 never can.
    assert all(t.reused > 0 for t, before in zip(affinity[1:], affinity)
               if t.turn > 1 and before.finish_reason == "stop")
    assert all(t.reused == 0 for t in round_robin if t.turn == 2)
    figures = prefix_reuse.summarize(counts)
    assert figures["prefill_tokens_affinity"] < figures["prefill_tokens_round_robin"]
    assert figures["prefix_hit_frac_affinity"] > figures["prefix_hit_frac_round_robin"]
