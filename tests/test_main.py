"""The command line: config loading, overrides, errors that name the bad key, and the main job."""

import pathlib

import pytest

from jaxflow.config import ConfigError, load_config
from jaxflow.main import main

CONFIG = str(pathlib.Path(__file__).parents[1] / "configs" / "tiny_model.py")


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
