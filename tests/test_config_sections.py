"""Every config section is a `jaxflow.config.Section`: its generator round-trips, an unknown key is named with
the nearest valid one, a bad value is named by its dotted key, and fields that may be None stay settable from
the command line."""

import pathlib

import ml_collections
import pytest

from jaxflow.cluster.config import ClusterConfig, NodeResources, TrainerMesh
from jaxflow.config import ConfigError, Section, load_config
from jaxflow.coordination import Coordination, CostModel
from jaxflow.envs.config import EnvConfig
from jaxflow.jobs.config import BaseConfig, CheckpointConfig, DataConfig, EvalConfig, ModelSection, RolloutConfig
from jaxflow.rewards.judge_config import JudgeConfig
from jaxflow.rewards.model_config import RewardModelConfig
from jaxflow.trainer.losses import LossConfig
from jaxflow.trainer.rl_trainer import LoraOptions, TrainerConfig

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "arithmetic_tiny.py")

# (section, a misspelt key, the key it should suggest, a key given a bad value, that value)
SECTIONS = [
    (Coordination, "max_runing", "max_running", "queue", "lifo"),
    (CostModel, "step", "step_s", "per_kv_s", -1.0),
    (LossConfig, "eps_hihg", "eps_high", "eps_low", 1.5),
    (EnvConfig, "max_turn", "max_turns", "step_timeout_s", 0.0),
    (RewardModelConfig, "batchsize", "batch_size", "compile_timeout_s", -1.0),
    (JudgeConfig, "parse_fn", "parse_ref", "max_slots", 0),
    (ClusterConfig, "rollout_actor", "rollout_actors", "mode", "slurm"),
    (TrainerMesh, "tensr", "tensor", "fsdp", 0),
    (NodeResources, "trainers", "trainer", "rollout", " "),
    (TrainerConfig, "etaa", "eta", "schedule", "linear"),
    (LoraOptions, "rnk", "rank", "rank", -2),
    (DataConfig, "train_prompt", "train_prompts", "train_prompts", 0),
    (RolloutConfig, "group_sise", "group_size", "engine", "sglang"),
    (EvalConfig, "num_prompt", "num_prompts", "every", 0),
    (CheckpointConfig, "max_keep", "max_to_keep", "every", 0),
    (BaseConfig, "batchsize", "batch_size", "lr", 0.0),
    (ModelSection, "num_layer", "num_layers", "num_heads", 0),
]
IDS = [s[0].__name__ for s in SECTIONS]


@pytest.mark.parametrize("section", [s[0] for s in SECTIONS], ids=IDS)
def test_the_generator_round_trips(section):
    generated = section.section()
    assert isinstance(generated, ml_collections.ConfigDict)
    assert section.from_config(generated) == section()
    assert section.from_config(section().to_section()) == section()


@pytest.mark.parametrize("section, typo, nearest, _key, _value", SECTIONS, ids=IDS)
def test_an_unknown_key_is_named_with_the_nearest(section, typo, nearest, _key, _value):
    with pytest.raises(ConfigError) as e:
        section.from_config({typo: 1})
    assert f"{section.SECTION}.{typo} is not a key of {section.SECTION} (nearest: {nearest}" in str(e.value)


@pytest.mark.parametrize("section, _typo, _nearest, key, value", SECTIONS, ids=IDS)
def test_a_bad_value_is_named_by_its_dotted_key(section, _typo, _nearest, key, value):
    with pytest.raises(ConfigError) as e:
        section.from_config({key: value})
    assert f"{section.SECTION}.{key}" in str(e.value)
    assert section.config_problems({key: value}) == e.value.problems
    assert section.config_problems({}) == []


def test_every_problem_of_nested_sections_at_once():
    problems = RolloutConfig.config_problems({
        "group_size": 1, "coordination": {"routng": "x", "max_running": 0, "cost": {"per_kv_s": -1.0}},
        "env": {"max_turns": 0}})
    for key in ("rollout.group_size", "rollout.coordination.routng", "rollout.coordination.max_running",
                "rollout.coordination.cost.per_kv_s", "rollout.env.max_turns"):
        assert any(p.startswith(key) for p in problems), (key, problems)


def test_a_section_is_a_frozen_dataclass_that_checks_itself():
    assert issubclass(LossConfig, Section)
    with pytest.raises(ConfigError, match=r"trainer\.loss\.kl_coef must be >= 0\.0, got -1") as e:
        LossConfig(kl_coef=-1.0, tis_floor=5.0)
    assert len(e.value.problems) == 2 and "trainer.loss.tis_floor must be < 2.0, got 5.0" in e.value.problems


def test_the_config_file_sections_come_from_the_generators():
    config = load_config(CONFIG)
    assert LossConfig.from_config(config.trainer.loss) == LossConfig(behav_weight_cap=5.0)
    assert TrainerConfig.from_config(config.trainer) == TrainerConfig(micro_batch_rows=4,
                                                                      loss=LossConfig(behav_weight_cap=5.0))
    assert ClusterConfig.from_config(config.cluster) == ClusterConfig()
    assert EvalConfig.from_config(config.eval) == EvalConfig()
    assert RolloutConfig.from_config(config.rollout) == RolloutConfig(
        coordination=Coordination(max_running=128, sync="all", sync_mode="keep"))


@pytest.mark.parametrize("key, value", [("trainer.loss.dual_clip_c", "3.0"), ("trainer.loss.behav_weight_cap", "2.0"),
                                        ("cluster.address", "x:1"), ("cluster.node_resource.trainer", "node"),
                                        ("rollout.env.turn_stop", "</tool>"), ("rollout.reward_model.dir", "rm"),
                                        ("rollout.judge.dir", "judge")])
def test_optional_keys_can_be_set_and_unset_from_the_command_line(key, value):
    assert str(_leaf(load_config(CONFIG, {key: value}), key)) == value
    assert _leaf(load_config(CONFIG, {key: "None"}), key) is None


def _leaf(config, key):
    for part in key.split("."):
        config = config[part]
    return config
