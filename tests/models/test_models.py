"""The model family against transformers: logits parity, exact HF round trip, sharded load, bad input."""

import json

import jax
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from flax import nnx
from hf_reference import CASES, hf_logits, make_hf_model, padded_batch

from jaxflow import sharding
from jaxflow.models.config import ModelConfigError
from jaxflow.models.hf_io import export_model, load_model
from jaxflow.models.safetensors_io import CheckpointError, SafetensorsFile, write_safetensors
from jaxflow.models.transformer import positions_from_mask

pytestmark = pytest.mark.slow  # the model against transformers and PEFT


@nnx.jit
def _forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


def jax_logits(model, tokens, mask):
    return np.asarray(_forward(model, tokens, positions_from_mask(mask), mask))


@pytest.fixture(scope="module", params=[(c, t) for c in CASES for t in (False, True)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def hf_case(request, tmp_path_factory):
    case, tied = request.param
    directory = tmp_path_factory.mktemp(f"{case}-{tied}")
    return make_hf_model(case, tied, directory), directory


def test_logits_match_transformers(hf_case):
    hf_model, directory = hf_case
    model = load_model(directory)
    tokens, mask, positions = padded_batch()
    ref = hf_logits(hf_model, tokens, mask, positions)
    ours = jax_logits(model, tokens, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - ref[real]).max() < 1e-4
    # Without padding too (default positions and segments).
    full = np.asarray(model(tokens))
    ref_full = hf_logits(hf_model, tokens, np.ones_like(mask), np.broadcast_to(np.arange(12), mask.shape))
    assert np.abs(full - ref_full).max() < 1e-4


def test_round_trip_is_bit_identical(hf_case, tmp_path):
    hf_model, directory = hf_case
    out = export_model(load_model(directory), tmp_path / "export")
    original = safetensors.torch.load_file(directory / "model.safetensors")
    exported = safetensors.torch.load_file(out / "model.safetensors")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, mask, positions = padded_batch(seed=1)
    np.testing.assert_array_equal(hf_logits(reloaded, tokens, mask, positions),
                                  hf_logits(hf_model, tokens, mask, positions))


def test_bfloat16_round_trip(tmp_path):
    make_hf_model("qwen3", False, tmp_path / "bf16", dtype=torch.bfloat16)
    model = load_model(tmp_path / "bf16")
    assert model.embed[...].dtype == jax.numpy.bfloat16
    out = export_model(model, tmp_path / "export")
    original = safetensors.torch.load_file(tmp_path / "bf16" / "model.safetensors")
    exported = safetensors.torch.load_file(out / "model.safetensors")
    for name, tensor in original.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name], tensor), name


def test_sharded_load_matches_one_device(tmp_path):
    make_hf_model("qwen2", False, tmp_path / "m")
    # A sharded (multi-file) checkpoint, loaded onto fsdp=4 x tensor=2.
    export_model(load_model(tmp_path / "m"), tmp_path / "sharded", max_shard_bytes=64_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    mesh = sharding.make_mesh(data=1, fsdp=4, tensor=2)
    sharded = load_model(tmp_path / "sharded", mesh=mesh)
    single = load_model(tmp_path / "m")
    q = sharded.layers.q_proj[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 16, 2, 16)
    tokens, mask, _ = padded_batch(seed=2)
    np.testing.assert_allclose(jax_logits(sharded, tokens, mask), jax_logits(single, tokens, mask),
                               atol=2e-5, rtol=0)


def _rewrite(path, edit):
    with SafetensorsFile(path) as f:
        tensors = {n: np.array(f.get(n)) for n in f.names()}
    edit(tensors)
    write_safetensors(path, tensors, {"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    make_hf_model("llama", False, tmp_path)
    _rewrite(tmp_path / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    make_hf_model("llama", False, tmp_path)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    _rewrite(tmp_path / "model.safetensors", shrink)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*k_proj\.weight.*\(16, 64\).*"
                                              r"expected \(32, 64\)"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    make_hf_model("llama", False, tmp_path)
    _rewrite(tmp_path / "model.safetensors",
             lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(16, np.float32)}))
    with pytest.raises(CheckpointError, match=r"q_norm\.weight"):
        load_model(tmp_path)


def test_unknown_architecture_is_named(tmp_path):
    make_hf_model("llama", False, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"], config["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"config\.json.*GPT2LMHeadModel.*supported: "
                                               r"LlamaForCausalLM"):
        load_model(tmp_path)


def test_corrupt_safetensors_is_named(tmp_path):
    make_hf_model("llama", False, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=str(path)):
        load_model(tmp_path)


def test_export_refuses_to_overwrite(tmp_path):
    make_hf_model("llama", True, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a model"):
        export_model(load_model(tmp_path), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_tiny_model_loads_in_transformers(architecture, tmp_path):
    # Our generated config.json and weights must mean the same model to transformers.
    from jaxflow.models.tiny import write_tiny_model

    write_tiny_model(tmp_path, architecture=architecture, tie_word_embeddings=architecture != "Qwen2ForCausalLM")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == architecture
    tokens, mask, positions = padded_batch(seed=3, vocab=hf_model.config.vocab_size)
    ref = hf_logits(hf_model, tokens, mask, positions)
    ours = jax_logits(load_model(tmp_path), tokens, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() < 1e-4
