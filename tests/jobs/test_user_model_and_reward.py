"""The RL job on a model and a reward of the user's: an HF directory the warm start did not build is used as
given, `task.reward_ref` replaces the task's reward (checked before anything starts), and reward failures show
in the run (one printed line per distinct error, counts in the metrics and the accounting, and a reward that
never works stops the run before it trains on zeros)."""

import json
import pathlib
import shutil
import textwrap

import pytest
from small_runs import records, small_config

from jaxflow.config import ConfigError
from jaxflow.jobs import rl, warm_start
from jaxflow.tasks import get_task

pytestmark = pytest.mark.slow  # runs of the RL job end to end

# A reward of the user's: the task's own reward, but every other call in a worker raises (a realistic bug:
# a missing key), so about half of a run's samples fail. `always` fails every call.
REWARD_MODULE = """
import itertools

from jaxflow.tasks import reward as task_reward

_calls = itertools.count()


def flaky(response, meta):
    if next(_calls) % 2:
        return meta["answer_tag"]
    return task_reward(response, meta)


def always(response, meta):
    return {}["answer_tag"]
"""


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A module `user_rewards` in a directory on sys.path (spawned reward workers inherit sys.path)."""
    directory = tmp_path / "user_code"
    directory.mkdir()
    (directory / "user_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(directory))
    return "user_rewards"


def given_model(tmp_path, base_dir):
    """A copy of the warm-started model without base_info.json: as a downloaded HF checkpoint looks."""
    mine = tmp_path / "my_model"
    shutil.copytree(base_dir, mine)
    (mine / warm_start.INFO_FILE).unlink()
    return mine


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_hf_model_the_warm_start_did_not_build_is_used_as_given(tmp_path, base_dir):
    mine = given_model(tmp_path, base_dir)
    before = snapshot(mine)
    # Settings the model was not built with, and building allowed: still used as given, never rebuilt.
    config = small_config(tmp_path, mine, **{"base.steps": "3", "model.num_layers": "1"})
    said = []
    assert warm_start.ensure_base_model(config, log=said.append) == mine
    assert len(said) == 1 and "using it as given" in said[0] and str(mine) in said[0]
    assert "2 layers" in said[0] and f"no {warm_start.INFO_FILE}" in said[0]
    assert snapshot(mine) == before
    # The warm-start job itself still refuses to build over it.
    with pytest.raises(FileExistsError, match="no warm start built"):
        warm_start.build_base_model(config, mine)
    assert snapshot(mine) == before


@pytest.mark.parametrize("remove, says", [
    (["tokenizer.json"], "no tokenizer.json"),
    (["model.safetensors"], "no weights (model.safetensors or model.safetensors.index.json)"),
    (["config.json", "tokenizer.json"], "no config.json, no tokenizer.json"),
])
def test_an_incomplete_model_directory_is_named_with_what_it_lacks(tmp_path, base_dir, capsys, remove,
                                                                   says):
    mine = given_model(tmp_path, base_dir)
    for name in remove:
        (mine / name).unlink()
    before = snapshot(mine)
    config = small_config(tmp_path, mine)
    with pytest.raises(warm_start.BaseModelMissing, match=f"base.dir {mine} holds no complete HF model") as e:
        warm_start.ensure_base_model(config, log=lambda *_: None)
    assert says in str(e.value)
    assert rl.run(config) == 2
    assert says in capsys.readouterr().err
    assert snapshot(mine) == before


def test_a_warm_start_that_died_half_way_is_rebuilt_not_taken_as_given(tmp_path, base_dir):
    half = tmp_path / "half"
    shutil.copytree(base_dir, half)
    (half / warm_start.INFO_FILE).write_text(json.dumps({"fingerprint": None, "building": True}))
    config = small_config(tmp_path, half, **{"base.build_if_missing": "False"})
    with pytest.raises(warm_start.BaseModelMissing, match="built with other settings"):
        warm_start.ensure_base_model(config)


def test_reward_ref_replaces_the_tasks_reward_and_not_the_base_models_fingerprint(tmp_path):
    assert get_task("arithmetic").reward_ref == "jaxflow.tasks.arithmetic:reward"
    assert get_task("arithmetic", reward_ref="user_rewards:flaky").reward_ref == "user_rewards:flaky"
    with pytest.raises(ValueError, match="reward_ref 'no_colon' is not of the form 'module:function'"):
        get_task("arithmetic", reward_ref="no_colon")
    plain = small_config(tmp_path, tmp_path / "base")
    mine = small_config(tmp_path, tmp_path / "base", **{"task.reward_ref": "user_rewards:flaky"})
    assert warm_start.make_task(mine).reward_ref == "user_rewards:flaky"
    assert warm_start.fingerprint(mine) == warm_start.fingerprint(plain)


def test_the_warm_start_scores_its_base_with_the_tasks_own_reward(tmp_path, user_rewards):
    config = small_config(tmp_path, tmp_path / "base", **{"task.reward_ref": f"{user_rewards}:always",
                                                          "base.steps": "2", "eval.num_prompts": "2"})
    info = warm_start.build_base_model(config, tmp_path / "base", log=lambda *_: None)
    assert info["eval_prompts"] == 2 and info["fingerprint"] == warm_start.fingerprint(config)


@pytest.mark.parametrize("ref, says", [
    ("no_such_module_here:reward", "task.reward_ref: reward function reference 'no_such_module_here:reward': module "
                                   "'no_such_module_here' is not found: ModuleNotFoundError: No module named "
                                   "'no_such_module_here'"),
    ("user_rewards:flakyy", "task.reward_ref: reward function reference 'user_rewards:flakyy': module "
                            "'user_rewards' has no function 'flakyy'"),
    ("user_rewards", "task.reward_ref: reward function reference 'user_rewards' is not of the form"),
])
def test_a_bad_reward_ref_is_one_config_error_before_anything_starts(tmp_path, user_rewards, capsys, ref, says):
    config = small_config(tmp_path, tmp_path / "base", **{"task.reward_ref": ref})
    with pytest.raises(ConfigError, match="bad config: ") as e:
        rl.check_config(config)
    assert says in str(e.value)
    assert rl.run(config) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "base").exists() and not (tmp_path / "run").exists()


def test_reward_failures_are_printed_once_counted_and_the_run_goes_on(tmp_path, base_dir, user_rewards,
                                                                      capsys):
    config = small_config(tmp_path, given_model(tmp_path, base_dir),
                          **{"task.reward_ref": f"{user_rewards}:flaky", "trainer.steps": "2", "eval.every": "100"})
    assert rl.run(config) == 0
    captured = capsys.readouterr()
    line = ("jaxflow: reward function user_rewards:flaky raised KeyError: 'answer_tag'; the sample scores 0 and the "
            "run goes on")
    assert captured.err.count(line) == 1, captured.err
    steps = [r for r in records(pathlib.Path(config.workdir)) if "loss" in r]
    assert len(steps) == 2 and 0 < steps[0]["reward_raised"] <= steps[1]["reward_raised"]
    assert all(r["reward_timed_out"] == r["reward_crashed"] == r["reward_invalid"] == 0 for r in steps)
    a = json.loads((pathlib.Path(config.workdir) / "result.json").read_text())["accounting"]
    assert a["reward_raised"] >= steps[1]["reward_raised"] and a["reward_scored"] > 0
    assert a["reward_calls"] >= a["reward_scored"] + a["reward_raised"]
    assert a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]
    assert f"reward calls {a['reward_calls']}: scored {a['reward_scored']}, failed (scored 0) raised " \
           f"{a['reward_raised']}, timed out 0, crashed 0, invalid 0" in captured.out


def test_a_reward_that_fails_on_the_whole_first_batch_stops_the_run(tmp_path, base_dir, user_rewards,
                                                                    capsys):
    config = small_config(tmp_path, base_dir, **{"task.reward_ref": f"{user_rewards}:always", "trainer.steps": "3"})
    assert rl.run(config) == 2
    err = capsys.readouterr().err
    assert "jaxflow: error: the reward function user_rewards:always failed on all " in err
    assert ("samples of the first batch (8 samples): reward function user_rewards:always raised KeyError: "
            "'answer_tag'; fix it and rerun") in err
    workdir = pathlib.Path(config.workdir)
    assert not [r for r in records(workdir) if "loss" in r]  # not one update on the zeros
    result = json.loads((workdir / "result.json").read_text())
    a = result["accounting"]
    assert "first batch" in result["error"] and a["reward_scored"] == 0 and a["reward_raised"] >= 8
    assert a["ledger_groups"] == 0 and a["created"] == a["consumed"] + a["in_flight"] + a["failed"] + a["surplus"]


def test_the_jsonl_config_needs_its_data_file_and_checks_it_first(tmp_path, capsys):
    from jaxflow.config import load_config
    from jaxflow.main import main
    args = ["--config=configs/jsonl_qa_tiny.py", f"--config.workdir={tmp_path / 'run'}",
            f"--config.base.dir={tmp_path / 'base'}"]
    assert main(args) == 2
    assert "task: jsonl_qa: no data file given (set task.path" in capsys.readouterr().err
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}\n{"question": "x"}\n')
    assert main(args + [f"--config.task.path={data}"]) == 2
    assert f"task: {data}:2: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "base").exists()
    data.write_text("".join(f'{{"question": "What is {i} + 3?", "answer": "{i} + 3 = {i + 3}\\n#### {i + 3}"}}\n'
                            for i in range(50)))
    config = load_config("configs/jsonl_qa_tiny.py", {"task.path": str(data)})
    rl.check_config(config)
    assert warm_start.make_task(config).reward_ref == "jaxflow.tasks.jsonl_qa:reward"
