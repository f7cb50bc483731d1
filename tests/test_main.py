"""The command line: config loading, overrides, errors that name the bad key, and the main job."""

import os
import pathlib
import subprocess
import sys

import pytest

from jaxflow import refs
from jaxflow.config import ConfigError, load_config
from jaxflow.main import main

REPO = pathlib.Path(__file__).parents[1]
CONFIG = str(REPO / "configs" / "tiny_model.py")


def test_overrides_are_typed():
    config = load_config(CONFIG + ":llama", {"model.num_layers": "3", "mesh.tensor": "2",
                                             "model.tie_word_embeddings": "false"})
    assert config.model.architecture == "LlamaForCausalLM"
    assert config.model.num_layers == 3 and config.mesh.tensor == 2
    assert config.model.tie_word_embeddings is False


@pytest.mark.parametrize("key, nearest", [("model.num_layer", "model.num_layers"),
                                          ("modle.hidden_size", "model.hidden_size"),
                                          ("mesh.fsdpp", "mesh.fsdp")])
def test_unknown_key_names_nearest(key, nearest):
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}'; nearest valid keys: .*{nearest}"):
        load_config(CONFIG, {key: "1"})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"'model.num_layers' expects a value of type int, got 'two'"):
        load_config(CONFIG, {"model.num_layers": "two"})


def test_main_reports_errors_without_traceback(capsys):
    assert main([f"--config={CONFIG}", "--config.modle.hidden_size=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxflow: error: unknown config key 'modle.hidden_size'")
    assert main(["--config=configs/nope.py"]) == 2
    assert "configs/nope.py does not exist" in capsys.readouterr().err


@pytest.mark.slow  # writes and reloads a tiny model, twice
def test_main_job_runs(tmp_path, capsys):
    assert main([f"--config={CONFIG}:llama", f"--config.workdir={tmp_path}", "--config.repeats=1"]) == 0
    out = capsys.readouterr().out
    assert "tensors bit-identical to the original: True" in out
    assert "reloaded log-probs identical: True" in out
    # Second run reuses the model it wrote.
    assert main([f"--config={CONFIG}:llama", f"--config.workdir={tmp_path}", "--config.repeats=1"]) == 0
    assert "reusing tiny model" in capsys.readouterr().out


# --- user code that exits or hangs while it imports: a named error, exit code 2, before any JAX compile ------

MINIMAL = """import ml_collections

def get_config(arg=None):
    config = ml_collections.ConfigDict()
    config.job = "rl"
    config.task = ml_collections.ConfigDict({"reward_ref": arg})
    return config
"""
USER_MODULES = {
    "uc_sys_exit": "import sys\nsys.exit(0)\n",
    "uc_os_exit": "import os\nos._exit(0)\n",
    "uc_hangs": "import time\nwhile True:\n    time.sleep(0.01)\n",
}


def _main_process(tmp_path, *args) -> subprocess.CompletedProcess:
    (tmp_path / "minimal.py").write_text(MINIMAL)
    for name, body in USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(refs.TIMEOUT_ENV, None)
    # The timeout is a safety net against a hang of the test itself, not a speed requirement.
    return subprocess.run([sys.executable, "-m", "jaxflow.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("ref, says", [
    ("uc_sys_exit:reward", "task.reward_ref 'uc_sys_exit:reward': module 'uc_sys_exit' called sys.exit(0)"),
    ("uc_os_exit:reward", "task.reward_ref 'uc_os_exit:reward' ended the process while importing, exit code 0"),
    ("uc_hangs:reward", "task.reward_ref 'uc_hangs:reward': module 'uc_hangs' did not finish importing within 0.5s"),
])
def test_a_reward_module_that_exits_or_hangs_at_import_is_named(tmp_path, ref, says):
    done = _main_process(tmp_path, f"--config={tmp_path / 'minimal.py'}:{ref}", "--import_timeout_s=0.5")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("body, says", [
    ("import sys\nsys.exit(0)\n", "raised SystemExit: 0 while it was loaded"),
    ("import os\nos._exit(0)\n", "ended the process while importing, exit code 0"),
    ("import time\nwhile True:\n    time.sleep(0.01)\n", "did not finish importing within 0.5s"),
])
def test_a_config_file_that_exits_or_hangs_at_import_is_named(tmp_path, body, says):
    (tmp_path / "bad_config.py").write_text(body)
    done = _main_process(tmp_path, f"--config={tmp_path / 'bad_config.py'}", "--import_timeout_s=0.5")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"config file {tmp_path / 'bad_config.py'}" in done.stderr and says in done.stderr


def test_a_bad_import_time_limit_is_named(capsys, monkeypatch):
    assert main([f"--config={CONFIG}", "--import_timeout_s=never"]) == 2
    assert "--import_timeout_s='never'" in capsys.readouterr().err
    monkeypatch.setenv(refs.TIMEOUT_ENV, "0")
    assert main([f"--config={CONFIG}"]) == 2
    assert refs.TIMEOUT_ENV in capsys.readouterr().err


def test_the_import_check_searches_the_callers_sys_path(tmp_path, monkeypatch, capsys):
    """A module on a path the caller added (a notebook, a test) is found by the child too."""
    (tmp_path / "minimal.py").write_text(MINIMAL)
    (tmp_path / "uc_fine.py").write_text("def reward(response, meta):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from jaxflow import preflight
    assert preflight.check(f"{tmp_path / 'minimal.py'}:uc_fine:reward", {}) is None
    assert "uc_missing_qq" in preflight.check(f"{tmp_path / 'minimal.py'}:uc_missing_qq:reward", {})
