"""LoRA adapters (jaxflow/models/lora.py): fresh adapters compute the base; trained-looking adapters
exported in PEFT's format give, loaded by PEFT over the base in transformers, the logits jaxflow computes;
the merged export too; and adapters of another rank, target or model are refused with nothing changed."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import forward_terms, sum_atol

from jaxflow.models import hf_io, lora
from jaxflow.models.lora import LoRASpec
from jaxflow.models.tiny import write_tiny_model

pytestmark = pytest.mark.slow  # the model against transformers and PEFT


SPEC = LoRASpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lora") / "base", num_layers=2)


def randomize(model, seed=1, std=0.05):
    """Adapters as training leaves them: B no longer zero."""
    key = jax.random.key(seed)
    for t in model.layers.lora.targets:
        for w in "ab":
            var = getattr(model.layers, f"{t}_lora_{w}")
            key, sub = jax.random.split(key)
            var[...] = (std * jax.random.normal(sub, var[...].shape)).astype(var[...].dtype)
    return model


def tokens():
    return jnp.asarray(np.random.default_rng(0).integers(3, 200, (2, 12)), jnp.int32)


def test_fresh_adapters_compute_the_base(base_dir):
    base = hf_io.load_model(base_dir)
    adapted = hf_io.load_model(base_dir, lora=SPEC)
    expected = np.asarray(base(tokens()))
    # B = 0 adds exact zeros, but the adapted model is another program: its matmuls may round differently
    # (they do at some LLVM optimisation levels).
    atol = sum_atol(forward_terms(base.config), np.abs(expected).max())
    np.testing.assert_allclose(np.asarray(adapted(tokens())), expected, rtol=0, atol=atol)
    assert np.abs(np.asarray(randomize(adapted)(tokens())) - expected).max() > 100 * atol


def test_peft_loads_the_exported_adapter_and_gives_the_same_logits(base_dir, tmp_path):
    import torch
    import transformers
    from peft import PeftModel

    model = randomize(hf_io.load_model(base_dir, lora=SPEC))
    lora.write_adapter(tmp_path / "adapter", SPEC, lora.peft_tensors(model.layers), base_model=str(base_dir))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7
    ours = np.asarray(model(tokens()))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(np.array(tokens()))).logits.numpy()
    base_logits = np.asarray(hf_io.load_model(base_dir)(tokens()))
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapters matter
    # fp32 against fp32: differences are summation order, far below the adapters' effect.
    np.testing.assert_allclose(ours, theirs, atol=2e-5 * max(1.0, np.abs(ours).max()), rtol=0)
    # The merged export is the model as it computes: transformers loads it and agrees with PEFT's merge.
    hf_io.export_model(model, tmp_path / "merged", tokenizer_dir=base_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                               attn_implementation="eager")
    with torch.no_grad():
        from_merged = merged(torch.from_numpy(np.array(tokens()))).logits.numpy()
    np.testing.assert_allclose(from_merged, theirs, atol=2e-5 * max(1.0, np.abs(ours).max()), rtol=0)


def test_an_adapter_read_back_restores_the_same_model(base_dir, tmp_path):
    model = randomize(hf_io.load_model(base_dir, lora=SPEC))
    lora.write_adapter(tmp_path / "a", SPEC, lora.peft_tensors(model.layers))
    spec, tensors = lora.read_adapter(tmp_path / "a")
    assert spec == SPEC
    fresh = hf_io.load_model(base_dir, lora=spec)
    for name, value in lora.adapter_arrays(fresh.layers, tensors, source="test").items():
        getattr(fresh.layers, name)[...] = value
    assert jnp.array_equal(model(tokens()), fresh(tokens()))


@pytest.mark.parametrize("other, match", [
    (dict(rank=8), r"shape \(8, 64\), expected \(4, 64\)"),
    (dict(targets=("q_proj", "v_proj")), "missing"),
])
def test_adapters_of_another_rank_or_target_are_refused(base_dir, other, match):
    model = hf_io.load_model(base_dir, lora=SPEC)
    spec = LoRASpec(**{"rank": 4, "alpha": 8.0, **other})
    wrong = lora.peft_tensors(randomize(hf_io.load_model(base_dir, lora=spec)).layers)
    with pytest.raises(ValueError, match=match):
        lora.adapter_arrays(model.layers, wrong, source="adapter x")


def test_adapters_of_another_base_model_are_refused(base_dir, tmp_path):
    other = write_tiny_model(tmp_path / "deeper", num_layers=3)
    wrong = lora.peft_tensors(randomize(hf_io.load_model(other, lora=SPEC)).layers)
    with pytest.raises(ValueError, match="unexpected, e.g. 'base_model.model.model.layers.2"):
        lora.adapter_arrays(hf_io.load_model(base_dir, lora=SPEC).layers, wrong, source="adapter x")


@pytest.mark.parametrize("rank, alpha, targets, match", [
    (-1, 8.0, ("q_proj",), "lora.rank must be an int >= 0"),
    (0, 8.0, ("q_proj",), "lora.rank must be >= 1 for adapters"),
    (4, 0.0, ("q_proj",), "lora.alpha must be a number > 0"),
    (4, 8.0, ("qproj",), "'qproj' not a projection"),
    (4, 8.0, (), "targets is empty"),
])
def test_bad_settings_are_named(rank, alpha, targets, match):
    with pytest.raises(ValueError, match=match):
        LoRASpec(rank, alpha, targets)
