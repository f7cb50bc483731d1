"""configs/qwen3_gsm8k.py: every variant builds and passes the RL job's config checks (nothing runs, no model
is made), and the random-model maker writes a tokenizer of exactly the asked vocab size."""

import json

import pytest

from jaxflow.config import ConfigError, load_config
from jaxflow.jobs import rl
from jaxflow.models import presets
from jaxflow.models.random_hf import write_filler_tokenizer
from jaxflow.models.tiny import ENDOFTEXT, IM_END, IM_START

CONFIG = "configs/qwen3_gsm8k.py"


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys 3 more. How many now?",
             "answer": f"{i} + 3 = <<{i}+3={i + 3}>>{i + 3}\n#### {i + 3}"} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("variant", ["gpu_node", "ray_cluster", "tpu_pod"])
def test_the_accelerator_variants_pass_the_checks(variant, gsm8k_file, tmp_path):
    pytest.importorskip("ray")
    config = load_config(f"{CONFIG}:{variant}", {"task.path": str(gsm8k_file), "base.dir": str(tmp_path / "m")})
    rl.check_config(config)
    assert config.cluster.mode == "ray" and config.rollout.engine == ("jax" if variant == "tpu_pod" else "vllm")


def test_the_accelerator_variants_need_the_data_file():
    with pytest.raises(ConfigError, match="task"):
        rl.check_config(load_config(f"{CONFIG}:gpu_node", {"base.dir": "somewhere"}))


def test_cpu_smoke_passes_the_checks_and_names_a_preset():
    config = load_config(f"{CONFIG}:cpu_smoke")
    rl.check_config(config)
    assert config.base.random_preset in presets.preset_names()
    with pytest.raises(ConfigError, match="base.random_preset"):
        rl.check_config(load_config(f"{CONFIG}:cpu_smoke", {"base.random_preset": "qwen3-7b"}))


def test_cpu_smoke_on_vllm_with_the_settings_it_ran_with_passes_the_checks():
    # configs/qwen3_gsm8k.py's vLLM command: bfloat16 master weights, a smaller vLLM KV cache, shorter
    # log-prob chunks and remat.
    config = load_config(f"{CONFIG}:cpu_smoke", {"rollout.engine": "vllm", "trainer.param_dtype": "bfloat16",
                                                 "rollout.kv_cache_gib": "0.125", "trainer.logprob_chunk": "32",
                                                 "trainer.remat": "true"})
    rl.check_config(config)
    assert (config.trainer.param_dtype, config.model.compute_dtype) == ("bfloat16", "bfloat16")


def test_filler_tokenizer_has_the_asked_vocab_and_encodes_any_text(tmp_path):
    tokenizer = write_filler_tokenizer(tmp_path, 700, special_ids={ENDOFTEXT: 690, IM_START: 691, IM_END: 692})
    assert tokenizer.vocab_size == 700
    assert (tokenizer.eos_id, tokenizer.pad_id) == (692, 690)
    text = "What is 12 + 7? héllo 😀"
    ids = tokenizer.encode(text)
    assert max(ids) < 256 and tokenizer.decode(ids) == text
    assert tokenizer.encode(f"{IM_START}user{IM_END}")[0] == 691
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).encode(text) == ids
    with pytest.raises(ValueError, match="special_ids"):
        write_filler_tokenizer(tmp_path, 700, special_ids={ENDOFTEXT: 5, IM_START: 691, IM_END: 692})
    with pytest.raises(ValueError, match="vocab_size"):
        write_filler_tokenizer(tmp_path, 100)


def test_a_missing_base_dir_gets_the_random_preset_not_a_warm_start(tmp_path, monkeypatch):
    """base.random_preset: ensure_base_model hands a missing base.dir to the random-model maker (stubbed here: a
    0.6B model is a benchmark's to write, not a test's) and never builds one by warm start."""
    from jaxflow.jobs import warm_start
    from jaxflow.models import random_hf

    made = []
    monkeypatch.setattr(random_hf, "make_random_hf_model", lambda d, preset, log=print: made.append((d, preset)))
    monkeypatch.setattr(warm_start, "build_base_model", lambda *a, **k: pytest.fail("warm start ran"))
    config = load_config(f"{CONFIG}:cpu_smoke", {"base.dir": str(tmp_path / "model")})
    assert warm_start.ensure_base_model(config, log=lambda line: None) == tmp_path / "model"
    assert made == [(tmp_path / "model", "qwen3-0.6b")]
    assert warm_start.fingerprint(config) == warm_start.fingerprint(
        load_config(f"{CONFIG}:cpu_smoke", {"base.dir": str(tmp_path / "model"), "base.random_preset": "qwen3-8b"}))
