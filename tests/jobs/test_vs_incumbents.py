"""benchmarks/vs_incumbents.py: the target and speed-up arithmetic, the setup an incumbent's runner reads
(the prompts in jaxflow's draw order, text that tokenizes back to the same ids), and its word when an
incumbent is not installed."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vs_incumbents  # noqa: E402


def test_time_to_target_is_the_first_window_mean_reaching_it():
    curve = [(1.0, 0.2), (2.0, 0.2), (3.0, 0.5), (4.0, 0.2), (5.0, 0.5)]
    assert vs_incumbents.time_to_target(curve, 0.3, window=2) == 3.0  # (0.2 + 0.5) / 2 = 0.35
    assert vs_incumbents.time_to_target(curve, 0.4, window=3) is None  # best 3-step mean is 0.4 - 1/30
    assert vs_incumbents.time_to_target(curve, 0.2, window=1) == 1.0


def test_summary_shares_one_base_and_adds_jaxflows_compile():
    def run(system, seed, rewards, step_s, compile_s=0.0):
        return {"system": system, "seed": seed, "compile_s": compile_s, "eval_accuracy": 0.5,
                "curve": [((i + 1) * step_s, r) for i, r in enumerate(rewards)]}
    runs = [run("jaxflow", 0, [0.30, 0.40, 0.40], 1.0, compile_s=2.0),
            run("trl", 0, [0.40, 0.40, 0.40, 0.40, 0.45], 3.0)]
    out = vs_incumbents.summarise(runs, window=1)
    assert out["base_reward"] == pytest.approx(0.35)  # every run's first batch, from the base model
    assert out["target_reward"] == pytest.approx(0.40)
    # jaxflow reaches 0.40 at its second step (2 s) plus its 2 s compile; TRL at its first step (3 s).
    assert runs[0]["time_to_target_s"] == pytest.approx(4.0) and runs[1]["time_to_target_s"] == pytest.approx(3.0)
    assert out["speedup_vs_trl"] == pytest.approx(0.75) and out["speedup_vs_trl_per_seed"] == {"0": 0.75}
    assert out["systems"]["trl"]["median_step_s"] == pytest.approx(3.0)
    # A system that missed the target on some seed has no median time to it, and no speed-up is claimed.
    runs.append(run("trl", 1, [0.0, 0.0], 3.0))
    out = vs_incumbents.summarise(runs, window=1)
    assert out["systems"]["trl"]["median_time_to_target_s"] is None and "speedup_vs_trl" not in out


def test_setup_holds_jaxflows_prompts_in_draw_order_as_text_that_tokenizes_back(tmp_path):
    from jaxflow.config import load_config
    from jaxflow.data.prompt_source import PromptSource
    from jaxflow.jobs import warm_start
    from jaxflow.models.tiny import write_tiny_model
    from jaxflow.tokenizer import Tokenizer

    base = write_tiny_model(tmp_path / "base")
    setup = vs_incumbents.write_setup(tmp_path / "setup", 3, 0.5, base)
    info = json.loads((setup / "setup.json").read_text())
    assert info["settings"]["time_limit_s"] == 30 and info["model_dir"] == str(base.resolve())
    prompts = [json.loads(line) for line in (setup / "prompts.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (setup / "eval.jsonl").read_text().splitlines()]
    config = load_config(vs_incumbents.CONFIG, {"seed": "3"})
    assert len(prompts) == config.data.train_prompts and len(held_out) == 256
    # The RL job's prompt source for seed 3 hands them out in this order.
    task, tokenizer = warm_start.make_task(config), Tokenizer.from_dir(base)
    source = PromptSource(task.to_prompt_records(task.examples("train", config.data.train_prompts, seed=1003),
                                                 tokenizer), seed=3, num_epochs=1)
    assert [p["prompt"] for p in prompts[:50]] == [source.next()["prompt"] for _ in range(50)]
    # An incumbent tokenizes the text with transformers' tokenizer of the same directory: the same ids.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(base)
    for p in prompts[:100] + held_out[:20]:
        assert hf(text=p["text"])["input_ids"] == p["prompt"]
        assert vs_incumbents.SETTINGS["eval_prompts"] == len(held_out)


def test_an_incumbent_without_its_own_python_is_not_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXFLOW_TRL_PYTHON", raising=False)
    path, why = vs_incumbents.incumbent_python(None, "JAXFLOW_TRL_PYTHON")
    assert path is None and "--trl-python" in why and "JAXFLOW_TRL_PYTHON" in why
    path, why = vs_incumbents.incumbent_python(str(tmp_path / "nope" / "python"), "JAXFLOW_TRL_PYTHON")
    assert path is None and "does not exist" in why
    monkeypatch.setenv("JAXFLOW_TUNIX_PYTHON", sys.executable)
    assert vs_incumbents.incumbent_python(None, "JAXFLOW_TUNIX_PYTHON")[0] == sys.executable
