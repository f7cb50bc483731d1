"""Config values are checked at load time, before anything expensive: ranges, finiteness and integer types
(each bad key named), a config file that raises, and a workdir that cannot be written."""

import json
import re

import ml_collections
import pytest

from jaxflow.config import ConfigError, load_config
from jaxflow.jobs import rl
from jaxflow.main import main

CONFIG = "configs/arithmetic_tiny.py"


@pytest.mark.parametrize("key, raw, says", [
    ("trainer.lr", "nan", "trainer.lr"),
    ("trainer.lr", "inf", "trainer.lr"),
    ("trainer.eta", str(10 ** 23), "trainer.eta"),
    ("trainer.steps", str(2 ** 70), "trainer.steps"),
    ("rollout.reward_workers", "0", "rollout.reward_workers must be >= 1"),
    ("checkpoint.every", "0", "checkpoint.every must be >= 1"),
    ("checkpoint.max_to_keep", "0", "checkpoint.max_to_keep must be >= 1"),
    ("eval.every", "0", "eval.every must be >= 1"),
    ("rollout.max_slots", "0", "rollout.max_slots must be >= 1"),
    ("rollout.temperature", "nan", "rollout.temperature"),
    ("rollout.temperature", "-1.0", "rollout.temperature must be >= 0"),
    ("rollout.reward_timeout_s", "inf", "rollout.reward_timeout_s"),
    ("rollout.reward_timeout_s", "0", "rollout.reward_timeout_s must be > 0"),
    ("rollout.reward_memory_mb", "-1", "rollout.reward_memory_mb must be None or >= 0"),
    ("trainer.time_limit_s", "-5", "trainer.time_limit_s must be >= 0"),
    ("trainer.time_limit_s", "inf", "trainer.time_limit_s"),
    ("trainer.loss.kl_coef", "inf", "trainer.loss.kl_coef"),
    ("data.train_prompts", "0", "data.train_prompts must be >= 1"),
    ("seed", "-1", "seed must be >= 0"),
])
def test_bad_value_is_named(key, raw, says):
    """Refused when loaded (nan, inf, beyond int64: whatever the job) or by the rl job's check."""
    with pytest.raises(ConfigError, match="bad config.*: .*" + says.replace(".", r"\.")) as e:
        rl.check_config(load_config(CONFIG, {key: raw}))
    assert key in str(e.value)


@pytest.mark.parametrize("key, value", [("lr", float("inf")), ("lr", float("nan")), ("adam_eps", float("inf")),
                                        ("max_grad_norm", float("inf")), ("eta", 10 ** 23), ("steps", 2 ** 40)])
def test_check_config_also_catches_values_set_in_code(key, value):
    config = load_config(CONFIG)
    with config.trainer.unlocked():
        config.trainer[key] = value
    with pytest.raises(ConfigError, match=rf"bad config: .*trainer\.{key}\b"):
        rl.check_config(config)


@pytest.mark.parametrize("section, key, says", [
    ("trainer", "etaa", "trainer.etaa is not a key of trainer (nearest: eta"),
    ("rollout", "group_sizes", "rollout.group_sizes is not a key of rollout (nearest: group_size"),
    ("eval", "evry", "eval.evry is not a key of eval (nearest: every"),
])
def test_a_key_added_in_code_is_named_with_the_nearest(section, key, says):
    """load_config refuses unknown keys of the command line; check_config those a config file or code adds."""
    config = load_config(CONFIG)
    with config[section].unlocked():
        config[section][key] = 1
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(config)


def test_load_refuses_non_finite_and_int64_overflow_for_any_job():
    with pytest.raises(ConfigError, match=r"bad config configs/arithmetic_tiny\.py: ") as e:
        load_config(CONFIG, {"base.lr": "nan", "seed": str(2 ** 64)})
    assert "base.lr must be a finite number, got nan" in str(e.value)
    assert f"seed={2 ** 64} is out of range" in str(e.value)


def test_every_problem_at_once_and_good_config_passes():
    rl.check_config(load_config(CONFIG))
    config = load_config(CONFIG, {"trainer.eta": "-1", "checkpoint.every": "0", "rollout.reward_workers": "0",
                                  "base.steps": "0", "model.num_layers": "0"})
    with pytest.raises(ConfigError) as e:
        rl.check_config(config)
    assert all(k in str(e.value) for k in ("trainer.eta", "checkpoint.every", "rollout.reward_workers",
                                           "base.steps", "model.num_layers"))


def _with(config, section, key, value):
    """A copy of `config` with a field of another type (what a config file may write)."""
    d = config.to_dict()
    d[section][key] = value
    return ml_collections.ConfigDict(d)


@pytest.mark.parametrize("value", [1e23, 4.0, True, "4"])
def test_an_integer_field_given_another_type(value):
    config = _with(load_config(CONFIG), "trainer", "eta", value)
    with pytest.raises(ConfigError, match=re.escape(f"trainer.eta must be an integer, got {value!r}")):
        rl.check_config(config)


@pytest.mark.parametrize("body, says", [
    ("def get_config(arg=None):\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import no_such_module_here\n", "ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def get_config(arg=None:\n", "SyntaxError"),
    ("def get_config(arg=None):\n    return {}['x']\n", "KeyError: 'x'"),
])
def test_a_config_file_that_raises_is_a_config_error(tmp_path, capsys, body, says):
    path = tmp_path / "broken.py"
    path.write_text(body)
    with pytest.raises(ConfigError, match=f"config file {path}") as e:
        load_config(str(path))
    assert says in str(e.value)
    assert main([f"--config={path}"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and says in err and "Traceback" not in err


def test_a_bad_variant_names_the_file():
    with pytest.raises(ConfigError, match=r"arithmetic_tiny\.py.*unknown variant 'fast'"):
        load_config(CONFIG + ":fast")


def test_unwritable_workdir_fails_before_the_base_model(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = load_config(CONFIG, {"workdir": str(blocker / "run"), "base.dir": str(tmp_path / "base"),
                                  "base.build_if_missing": "False"})
    assert rl.run(config) == 2
    err = capsys.readouterr().err
    assert f"workdir {blocker / 'run'} cannot be written" in err and "base" not in err.split("written")[1]
    assert not (tmp_path / "base").exists()


@pytest.mark.parametrize("overrides, says", [
    ({"cluster.mode": "slurm"}, "cluster.mode 'slurm' is not one of ('embedded', 'ray')"),
    ({"cluster.address": "10.0.0.1:6379"}, "cluster.address is set but cluster.mode is 'embedded'"),
    ({"cluster.mode": "ray", "cluster.address": ""}, "cluster.address must be None"),
    ({"cluster.rollout_actors": "2"}, "cluster.rollout_actors=2 needs cluster.mode=ray"),
    ({"cluster.mode": "ray", "cluster.rollout_actors": "-1"}, "cluster.rollout_actors must be >= 0, got -1"),
    ({"cluster.trainer_processes": "2"}, "cluster.trainer_processes=2 needs cluster.mode=ray"),
    ({"cluster.mode": "ray", "cluster.trainer_processes": "2"},
     "cluster.trainer_processes=2 needs cluster.rollout_actors >= 1"),
    ({"cluster.mode": "ray", "cluster.trainer_processes": "-1"}, "cluster.trainer_processes must be >= 0, got -1"),
    ({"cluster.mode": "ray", "cluster.trainer_cpu_devices": "0"},
     "cluster.trainer_cpu_devices must be None or >= 1, got 0"),
    ({"cluster.mode": "ray", "cluster.trainer_mesh.tensor": "0"}, "cluster.trainer_mesh.tensor must be >= 1, got 0"),
    ({"cluster.mode": "ray", "cluster.node_resource.trainer": " "}, "cluster.node_resource.trainer must be None"),
    ({"cluster.mode": "ray", "cluster.rollout_actors": "2", "cluster.trainer_processes": "2",
      "cluster.trainer_cpu_devices": "4", "cluster.trainer_mesh.fsdp": "3", "cluster.trainer_mesh.tensor": "2"},
     "cluster.trainer_mesh fsdp 3 x expert 1 x tensor 2 does not cover the 8 devices of 2 trainer processes x 4"),
])
def test_bad_cluster_section_is_named(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(load_config(CONFIG, overrides))


def test_ray_mode_without_ray_says_how_to_install_it(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ConfigError, match=r"cluster\.mode 'ray' needs Ray.*\[cluster\]"):
        rl.check_config(load_config(CONFIG, {"cluster.mode": "ray"}))


@pytest.mark.parametrize("overrides, says", [
    ({"trainer.lora.rank": "-2"}, "trainer.lora.rank must be an int >= 0 (0: no LoRA), got -2"),
    ({"trainer.lora.rank": "4", "trainer.lora.alpha": "0"}, "trainer.lora.alpha must be a number > 0, got 0.0"),
    ({"trainer.lora.rank": "4", "trainer.lora.targets": "('q_proj', 'qkv')"},
     "trainer.lora.targets: 'qkv' not a projection"),
    ({"trainer.lora.rank": "4", "trainer.lora.targets": "()"}, "trainer.lora.targets is empty"),
])
def test_bad_lora_settings_are_named_before_anything_starts(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(load_config(CONFIG, overrides))


@pytest.mark.parametrize("ref", ["builtins:eval", "builtins:dict", "jaxflow.tasks.arithmetic:ArithmeticTask"])
def test_a_reward_ref_that_names_no_reward_function_is_refused(ref):
    """task.reward_ref must name a Python function taking (response, meta), read from its signature: a builtin
    such as eval (which would run each response as code) or a class is refused before anything starts."""
    with pytest.raises(ConfigError, match=r"task\.reward_ref") as e:
        rl.check_config(load_config(CONFIG, {"task.reward_ref": ref}))
    assert ref in str(e.value)


@pytest.mark.parametrize("overrides, says", [
    ({}, "rollout.exact_logprobs needs trainer.pack = False"),
    ({"trainer.pack": "False", "trainer.share_prompts": "False", "trainer.prox": "loglinear"},
     "rollout.exact_logprobs needs trainer.prox = 'recompute'"),
    ({"trainer.pack": "False", "trainer.share_prompts": "False", "rollout.engine": "vllm"},
     "rollout.exact_logprobs needs rollout.engine = 'jax'"),
    ({"trainer.pack": "False", "trainer.share_prompts": "False", "cluster.mode": "ray",
      "cluster.rollout_actors": "1"}, "rollout.exact_logprobs needs the engines in the job's process"),
    ({"rollout.exact_logprobs": "maybe"}, "rollout.exact_logprobs"),
])
def test_exact_logprobs_is_refused_where_it_cannot_hold(overrides, says):
    overrides = {"rollout.exact_logprobs": "True", **overrides}
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(load_config(CONFIG, overrides))


def test_exact_logprobs_with_unpacked_rows_passes():
    rl.check_config(load_config(CONFIG, {"rollout.exact_logprobs": "True", "trainer.pack": "False",
                                         "trainer.share_prompts": "False"}))


@pytest.mark.parametrize("config, overrides, says", [
    ("configs/arithmetic_tools_tiny.py", {"trainer.moe.routing_replay": "rollout"},
     "needs a mixture-of-experts policy; model.architecture 'Qwen3ForCausalLM' is dense"),
    ("configs/arithmetic_tools_tiny.py:moe", {"rollout.engine": "vllm"},
     "needs an engine that records each token's experts \\(jax\\); rollout.engine = 'vllm' does not"),
    ("configs/arithmetic_tools_tiny.py:moe", {"rollout.exact_logprobs": "True", "trainer.pack": "False",
                                              "trainer.share_prompts": "False"},
     "rollout.exact_logprobs cannot run with trainer.moe.routing_replay = 'rollout'"),
    ("configs/arithmetic_tools_tiny.py:moe", {"trainer.moe.routing_replay": "always"},
     "trainer.moe.routing_replay"),
    ("configs/arithmetic_tools_tiny.py:moe", {"model.num_experts": "0"}, "model.num_experts"),
])
def test_routing_replay_is_refused_where_it_cannot_hold(config, overrides, says):
    with pytest.raises(ConfigError, match=says):
        rl.check_config(load_config(config, overrides))
    rl.check_config(load_config("configs/arithmetic_tools_tiny.py:moe", {}))  # the demo's own variant passes


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from jaxflow.models.tiny import write_tiny_reward_model
    return write_tiny_reward_model(tmp_path_factory.mktemp("reward_model"))


@pytest.mark.parametrize("overrides, says", [
    ({"rollout.reward_model.batch_size": "0"}, "rollout.reward_model.batch_size must be >= 1"),
    ({"rollout.reward_model.timeout_s": "0"}, "rollout.reward_model.timeout_s must be > 0"),
    ({"rollout.reward_model.failed_value": "inf"}, "rollout.reward_model.failed_value"),
    ({"rollout.reward_model.dir": "{missing}"}, "rollout.reward_model.dir: no config.json in"),
    ({"rollout.reward_model.dir": "{rm}", "rollout.env.ref": "jaxflow.envs.calculator:CalculatorEnv"},
     "episodes (rollout.env.ref) are scored by their environments"),
])
def test_a_reward_model_that_cannot_score_the_run_is_refused(overrides, says, reward_model_dir, tmp_path):
    overrides = {k: v.format(rm=reward_model_dir, missing=tmp_path / "nothing") for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(load_config(CONFIG, overrides))


def test_a_causal_lm_is_not_a_reward_model_and_a_classifier_passes(reward_model_dir, tmp_path):
    from jaxflow.models.tiny import write_tiny_model
    causal = write_tiny_model(tmp_path / "causal")
    with pytest.raises(ConfigError, match=re.escape(f"rollout.reward_model.dir: {causal} is not a reward model")):
        rl.check_config(load_config(CONFIG, {"rollout.reward_model.dir": str(causal)}))
    # A classifier's config.json over a causal LM's weights: refused from the tensors' names, none read.
    with open(causal / "config.json") as f:
        hf = json.load(f)
    hf.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"})
    (causal / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=re.escape(f"rollout.reward_model.dir: checkpoint {causal} has no "
                                                    "'score.weight'")):
        rl.check_config(load_config(CONFIG, {"rollout.reward_model.dir": str(causal)}))
    rl.check_config(load_config(CONFIG, {"rollout.reward_model.dir": str(reward_model_dir)}))
    # With rollout actors too: it runs in the scorers' Ray actor (jaxflow.jobs.scorers).
    rl.check_config(load_config(CONFIG, {"rollout.reward_model.dir": str(reward_model_dir), "cluster.mode": "ray",
                                         "cluster.rollout_actors": "1"}))


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    from jaxflow.models.tiny import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("judge"))


@pytest.mark.parametrize("overrides, says", [
    ({"rollout.judge.timeout_s": "0"}, "rollout.judge.timeout_s must be > 0"),
    ({"rollout.judge.failed_value": "nan"}, "rollout.judge.failed_value"),
    ({"rollout.judge.engine": "sglang"}, "rollout.judge.engine 'sglang' is not one of ('jax', 'vllm')"),
    ({"rollout.judge.max_tokens": "128", "rollout.judge.max_len": "128"},
     "rollout.judge.max_tokens (128) must be below rollout.judge.max_len (128)"),
    ({"rollout.judge.parse_ref": "nothing"}, "rollout.judge.parse_ref 'nothing' is not of the form 'module:function'"),
    ({"rollout.judge.dir": "{judge}", "rollout.judge.prompt_ref": "jaxflow.rewards.judging:judge_promt"},
     "rollout.judge.prompt_ref 'jaxflow.rewards.judging:judge_promt': module 'jaxflow.rewards.judging' has no "
     "function 'judge_promt'"),
    ({"rollout.judge.dir": "{judge}", "rollout.judge.parse_ref": "no_such_module_here:parse"},
     "rollout.judge.parse_ref 'no_such_module_here:parse': module 'no_such_module_here' is not found"),
    ({"rollout.judge.dir": "{missing}"}, "rollout.judge.dir: no config.json in"),
    ({"rollout.judge.dir": "{judge}", "rollout.reward_model.dir": "{judge}"},
     "rollout.reward_model.dir and rollout.judge.dir are both set"),
    ({"rollout.judge.dir": "{judge}", "rollout.env.ref": "jaxflow.envs.calculator:CalculatorEnv"},
     "rollout.judge scores single answers; episodes (rollout.env.ref) are scored by their environments"),
])
def test_a_judge_that_cannot_score_the_run_is_refused(overrides, says, judge_dir, tmp_path):
    overrides = {k: v.format(judge=judge_dir, missing=tmp_path / "nothing") for k, v in overrides.items()}
    with pytest.raises(ConfigError, match=re.escape(says)):
        rl.check_config(load_config(CONFIG, overrides))


def test_a_judge_needs_a_causal_lm_with_a_chat_template(judge_dir, reward_model_dir, tmp_path):
    rl.check_config(load_config(CONFIG, {"rollout.judge.dir": str(judge_dir)}))
    rl.check_config(load_config(CONFIG, {"rollout.judge.dir": str(judge_dir), "cluster.mode": "ray",
                                         "cluster.rollout_actors": "2", "cluster.trainer_processes": "2"}))
    # A reward model is no judge: the JAX engine serves causal LMs.
    with pytest.raises(ConfigError, match=re.escape(f"rollout.judge.dir: {reward_model_dir}/config.json: architecture "
                                                    "'Qwen3ForSequenceClassification' (model_type 'qwen3') is not "
                                                    "supported")):
        rl.check_config(load_config(CONFIG, {"rollout.judge.dir": str(reward_model_dir)}))
    import shutil
    bare = shutil.copytree(judge_dir, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(f"rollout.judge.dir: the tokenizer of {bare} has no chat "
                                                    "template")):
        rl.check_config(load_config(CONFIG, {"rollout.judge.dir": str(bare)}))
