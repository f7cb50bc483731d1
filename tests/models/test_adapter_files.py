"""PEFT adapter directories read by `lora.read_adapter` (adapter_config.json + adapter_model.safetensors): a good
one reads back; a config that is malformed, mistyped or disagrees with its tensors, and tensors holding NaN or
inf, are refused with a ValueError naming the file. Tiny hand-written files: no model is built."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy

from jaxflow.models import lora
from jaxflow.models.lora import LoRASpec

STEM = "base_model.model.model.layers.0.self_attn.q_proj"
RANK, IN, OUT = 2, 8, 4


def tensors(rank=RANK, dtype=np.float32):
    rng = np.random.default_rng(0)
    return {f"{STEM}.lora_A.weight": rng.normal(size=(rank, IN)).astype(dtype),
            f"{STEM}.lora_B.weight": rng.normal(size=(OUT, rank)).astype(dtype)}


def config(**changes):
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "target_modules": ["q_proj"], "use_rslora": False,
           "use_dora": False}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not ...}  # `...`: leave the key out


def write(directory, cfg=None, weights=None, *, config_text=None):
    directory.mkdir(parents=True, exist_ok=True)
    text = config_text if config_text is not None else json.dumps(config() if cfg is None else cfg)
    (directory / lora.ADAPTER_CONFIG).write_text(text)
    safetensors_numpy.save_file(tensors() if weights is None else weights, str(directory / lora.ADAPTER_WEIGHTS))
    return directory


def test_a_good_adapter_reads_back(tmp_path):
    spec, read = lora.read_adapter(write(tmp_path / "a"))
    assert spec == LoRASpec(RANK, 4.0, ("q_proj",))
    for name, value in tensors().items():
        np.testing.assert_array_equal(read[name], value)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_tensor_with_nan_or_inf_is_refused_by_name(tmp_path, dtype, bad):
    weights = tensors(dtype=dtype)
    weights[f"{STEM}.lora_B.weight"][1, 0] = bad
    directory = write(tmp_path / "a", weights=weights)
    with pytest.raises(ValueError, match=f"{lora.ADAPTER_WEIGHTS}.*{STEM}.lora_B.weight"):
        lora.read_adapter(directory)


@pytest.mark.parametrize("rank", ["2", 2.7, 2.0, True, 0, -1, None], ids=repr)
def test_r_must_be_an_int_of_at_least_1(tmp_path, rank):
    with pytest.raises(ValueError, match=f"{lora.ADAPTER_CONFIG}.*r must be an int"):
        lora.read_adapter(write(tmp_path / "a", config(r=rank)))


@pytest.mark.parametrize("config_rank, tensor_rank", [(4, 2), (1, 2), (2, 3)])
def test_r_must_be_the_tensors_rank(tmp_path, config_rank, tensor_rank):
    directory = write(tmp_path / "a", config(r=config_rank), tensors(rank=tensor_rank))
    with pytest.raises(ValueError, match=f"{lora.ADAPTER_WEIGHTS}.*{STEM}.lora_A.weight"):
        lora.read_adapter(directory)


def test_an_a_and_b_of_different_ranks_are_refused(tmp_path):
    weights = tensors()
    weights[f"{STEM}.lora_B.weight"] = np.zeros((OUT, RANK + 1), np.float32)
    with pytest.raises(ValueError, match=f"{STEM}.lora_B.weight"):
        lora.read_adapter(write(tmp_path / "a", weights=weights))


MALFORMED = {
    "a list": "[1, 2]",
    "a string": '"r=2"',
    "null": "null",
    "not JSON": "{r: 2",
    "not UTF-8": b"\xff\xfe{}",
    "nested 100k deep": '{"r": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "an object nested 100k deep": '{"x": ' * 100_000 + "1" + "}" * 100_000,
    "r missing": json.dumps(config(r=...)),
    "lora_alpha missing": json.dumps(config(lora_alpha=...)),
    "target_modules missing": json.dumps(config(target_modules=...)),
    "lora_alpha a string": json.dumps(config(lora_alpha="16")),
    "lora_alpha NaN": json.dumps(config(lora_alpha=float("nan"))),
    "target_modules a number": json.dumps(config(target_modules=3)),
    "target_modules of numbers": json.dumps(config(target_modules=[1, 2])),
    "target_modules unknown": json.dumps(config(target_modules=["qkv"])),
    "use_dora a string": json.dumps(config(use_dora="no")),
    "rank_pattern set": json.dumps(config(rank_pattern={"q_proj": 4})),
    "alpha_pattern set": json.dumps(config(alpha_pattern={"q_proj": 8})),
    "peft_type a list": json.dumps(config(peft_type=["LORA"])),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_config_is_a_value_error_naming_the_file(tmp_path, case):
    text = MALFORMED[case]
    directory = tmp_path / "a"
    write(directory)
    path = directory / lora.ADAPTER_CONFIG
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(ValueError, match=lora.ADAPTER_CONFIG) as info:
        lora.read_adapter(directory)
    assert str(path) in str(info.value)
    assert len(str(info.value)) < 1000  # a huge value is not copied into the message
