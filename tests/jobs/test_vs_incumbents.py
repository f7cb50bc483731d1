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

pytestmark = pytest.mark.slow  # builds the benchmark's setup: tasks, tokenizer, transformers


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
    assert out["speedup_vs_trl_floor_seeds"] == [] and out["jaxflow_missed_seeds"] == []
    assert out["systems"]["trl"]["median_step_s"] == pytest.approx(3.0)
    # Seed 1 (first batches keep the base at 0.35): jaxflow reaches 0.40 at 1 s, TRL never does in its 6 s.
    # Its 6 s / 1 s is a floor, so the median over seeds is one: at least median(0.75, 6.0).
    runs += [run("jaxflow", 1, [0.40], 1.0), run("trl", 1, [0.30, 0.30], 3.0)]
    out = vs_incumbents.summarise(runs, window=1)
    assert out["systems"]["trl"]["median_time_to_target_s"] is None and "speedup_vs_trl" not in out
    assert out["speedup_vs_trl_per_seed"] == {"0": pytest.approx(0.75), "1": pytest.approx(6.0)}
    assert out["speedup_vs_trl_at_least"] == pytest.approx(3.375) and out["speedup_vs_trl_floor_seeds"] == ["1"]
    # A seed jaxflow itself missed has no speed-up, and is named.
    runs += [run("jaxflow", 2, [0.30, 0.30], 1.0), run("trl", 2, [0.40], 3.0)]
    out = vs_incumbents.summarise(runs, window=1)
    assert out["jaxflow_missed_seeds"] == [2] and "2" not in out["speedup_vs_trl_per_seed"]
    # One that never reached it in its time: only a floor, its training time over jaxflow's.
    out = vs_incumbents.summarise([runs[0], run("trl", 0, [0.30, 0.32, 0.33, 0.34], 3.0)], window=1)
    assert runs[0]["steps_to_target"] == 2 and "speedup_vs_trl" not in out
    assert out["speedup_vs_trl_at_least"] == pytest.approx(12.0 / 4.0)


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


def test_an_incumbent_without_its_own_python_is_not_run_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXFLOW_TRL_PYTHON", raising=False)
    path, why = vs_incumbents.incumbent_python(None, "JAXFLOW_TRL_PYTHON")
    assert path is None and "--trl-python" in why and "JAXFLOW_TRL_PYTHON" in why
    path, why = vs_incumbents.incumbent_python(str(tmp_path / "nope" / "python"), "JAXFLOW_TRL_PYTHON")
    assert path is None and "does not exist" in why
    monkeypatch.setenv("JAXFLOW_TUNIX_PYTHON", sys.executable)
    assert vs_incumbents.incumbent_python(None, "JAXFLOW_TUNIX_PYTHON")[0] == sys.executable


def test_an_incumbents_run_reads_the_setup_logs_steps_and_scores_with_the_tasks_reward(tmp_path, monkeypatch):
    """incumbent_io.Run, what TRL's and Tunix's runners share (standard library only), driven as they
    drive it, with a stand-in for the incumbent's trainer and generator."""
    import incumbent_io

    from jaxflow.models.tiny import write_tiny_model
    from jaxflow.tokenizer import Tokenizer

    base = write_tiny_model(tmp_path / "base")
    setup = vs_incumbents.write_setup(tmp_path / "setup", 0, 0.5, base)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["runner", "--setup", str(setup), "--out", str(out), "--seed", "7"])
    run = incumbent_io.Run("a runner")
    assert run.seed == 7 and run.settings["batch_prompts"] == 32 and len(run.held_out) == 256
    tokenizer = Tokenizer.from_dir(base)
    run.check_tokenizer(lambda text: tokenizer.encode(text, add_special_tokens=False), "jaxflow's own")
    with pytest.raises(SystemExit, match="off-by-one's tokenizer gives"):
        run.check_tokenizer(lambda text: tokenizer.encode(text)[1:], "off-by-one")
    run.begin()
    elapsed = [run.log_step(0.25, 100), run.log_step(0.5, 90)]
    # The task's reward: a response with the right answer scores 1, a wrong one 0, meta as dict or JSON.
    right = [f"<answer>{p['meta']['answer']}</answer>" for p in run.held_out]
    assert run.reward(right[0], run.held_out[0]["meta"]) == 1.0
    assert run.reward(right[0], json.dumps(run.held_out[0]["meta"])) == 1.0
    answers = iter(right[:128] + ["<answer>x</answer>"] * 128)
    assert run.accuracy(lambda chunk: [next(answers) for _ in chunk]) == 0.5
    run.finish("stand-in", 0.5, {"stand-in": "0"}, {"loss": "none"})
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and [s["reward_mean"] for s in steps] == [0.25, 0.5]
    assert [s["time_s"] for s in steps] == [round(t, 3) for t in elapsed]  # log_step returns what it logged
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 2 and result["seed"] == 7 and result["eval_accuracy"] == 0.5
    assert result["first_step_s"] == steps[0]["time_s"] and result["train_s"] == steps[1]["time_s"]


@pytest.mark.parametrize("flag", ["--minutes", "--incumbent-minutes"])
@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_time_budget_that_is_not_a_positive_number_is_refused_by_name(flag, value, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vs_incumbents.py", flag, value])
    with pytest.raises(SystemExit):
        vs_incumbents.main()
    assert f"{flag} must be a positive number of minutes" in capsys.readouterr().err


def test_the_report_names_floors_per_seed_and_the_json_holds_them(tmp_path, monkeypatch, capsys):
    """main() with stand-ins for the runs: TRL reaches the target on seed 0 and not on seed 1, in its own
    (longer) time budget; the report says which speed-ups are floors."""
    from jaxflow.jobs import warm_start

    def curve(rewards, step_s):
        return [((i + 1) * step_s, r) for i, r in enumerate(rewards)]
    jaxflow_curves = {0: [0.3, 0.4, 0.4], 1: [0.4]}
    trl_curves = {0: [0.4] * 5, 1: [0.3, 0.3]}
    budgets = []
    monkeypatch.setattr(warm_start, "ensure_base_model", lambda config: tmp_path / "base")
    monkeypatch.setattr(vs_incumbents, "write_setup",
                        lambda directory, seed, minutes, base: budgets.append(minutes) or directory)
    monkeypatch.setattr(vs_incumbents, "run_jaxflow", lambda seed, minutes, workdir, base: {
        "system": "jaxflow", "seed": seed, "compile_s": 0.0, "curve": curve(jaxflow_curves[seed], 1.0),
        "eval_accuracy": 0.5, "first_step_s": 1.0})
    monkeypatch.setattr(vs_incumbents, "run_incumbent", lambda name, python, setup, seed, workdir: {
        "system": name, "seed": seed, "curve": curve(trl_curves[seed], 3.0), "eval_accuracy": 0.5,
        "first_step_s": 3.0})
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["vs_incumbents.py", "--seeds", "0,1", "--minutes", "2", "--incumbent-minutes",
                                      "5", "--window", "1", "--systems", "jaxflow,trl", "--trl-python",
                                      sys.executable, "--workdir", str(tmp_path / "w"), "--json", str(out)])
    vs_incumbents.main()
    printed = capsys.readouterr().out
    assert budgets == [5, 5]  # the incumbents' setup carries their own budget
    assert "2 seed(s), 2 min (TRL, Tunix: 5 min) of training each" in printed
    # Base 0.35, target 0.40: seed 0 jaxflow at 2 s, TRL at 3 s; seed 1 jaxflow at 1 s, TRL never (6 s).
    assert "at least 3.75x sooner than trl" in printed and "seed 0: 1.50x, seed 1: >= 6.00x" in printed
    figures = json.loads(out.read_text())
    assert figures["speedup_vs_trl_at_least"] == pytest.approx(3.75) and figures["incumbent_minutes"] == 5
    assert len(figures["runs"]) == 4 and len((tmp_path / "w" / "runs.jsonl").read_text().splitlines()) == 4
