"""Tests for jaxflow.tokenizer and the tiny tokenizer of jaxflow.models.tiny, against transformers as reference."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jinja2
import pytest

from jaxflow.models.tiny import ENDOFTEXT, IM_END, IM_START, MIN_VOCAB_SIZE, write_tiny_tokenizer
from jaxflow.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

COUNTDOWN = ("Using the numbers [3, 7, 25], create an equation that equals 46. Show your work in <think> </think> "
             "tags.\n<think> 25 - 7 = 18, 18 * 3 = 54 </think>\n<answer> (25 - 7) * 3 - 8 </answer>")
TEXTS = [
    COUNTDOWN,
    "What is 1234567 * 89? The answer is 109876463.",
    "héllo wörld  \n\n  x\ttabs, e\u0301 (decomposed é), 😀 and Ω",
    f"{IM_START}user\nhi{IM_END}\n{ENDOFTEXT}",
    "   leading and trailing spaces   ",
    "",
]
CONVERSATIONS = {
    "system+user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": COUNTDOWN},
    ],
    "multi-turn": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<answer> 4 </answer>"},
        {"role": "user", "content": "And 3 * 7?"},
        {"role": "assistant", "content": "<answer> 21 </answer>"},
    ],
    "single user": [{"role": "user", "content": "Using the numbers [1, 2] make 3."}],
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def _reference(directory: pathlib.Path):
    """transformers' tokenizer for `directory`, built from the file directly (not AutoTokenizer, which may swap
    the class for a model-specific one)."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if config.get(k) is not None}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), chat_template=config.get("chat_template"), **special)


# --- the tiny tokenizer -------------------------------------------------------------------------------------------

def test_tiny_tokenizer_is_deterministic(tmp_path, tiny_dir):
    write_tiny_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tiny_dir / name).read_bytes()
    # Another process with another hash seed: catches output that depends on set or hash-map iteration order.
    code = f"from jaxflow.models.tiny import write_tiny_tokenizer; write_tiny_tokenizer({str(tmp_path / 'sub')!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=pathlib.Path(__file__).parents[1])
    assert (tmp_path / "sub" / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()

    write_tiny_tokenizer(tmp_path / "other_seed", seed=1)
    assert (tmp_path / "other_seed" / "tokenizer.json").read_bytes() != (tiny_dir / "tokenizer.json").read_bytes()


def test_tiny_tokenizer_vocab(tmp_path, tiny):
    assert MIN_VOCAB_SIZE < tiny.vocab_size <= 512
    assert tiny.vocab_size == tiny.backend.get_vocab_size(with_added_tokens=True)
    small = write_tiny_tokenizer(tmp_path / "small", vocab_size=300)
    assert small.vocab_size <= 300
    with pytest.raises(ValueError, match="below 259"):
        write_tiny_tokenizer(tmp_path / "too_small", vocab_size=258)


def test_tiny_special_tokens_are_single_ids(tiny):
    assert [tiny.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    for token in (ENDOFTEXT, IM_START, IM_END):
        assert tiny.encode(token) == [tiny.token_to_id(token)]
        assert tiny.encode(f"x{token}y")[1:-1] == [tiny.token_to_id(token)]
    assert tiny.eos_id == tiny.token_to_id(IM_END)
    assert tiny.pad_id == tiny.token_to_id(ENDOFTEXT)
    assert tiny.bos_id is None


def test_tiny_round_trips_countdown_text(tiny):
    ids = tiny.encode(COUNTDOWN)
    assert tiny.decode(ids) == COUNTDOWN
    assert len(ids) < len(COUNTDOWN) / 2  # the merges learned the task's words
    # Digits are single tokens, so every number tokenizes digit by digit.
    assert tiny.encode("1234567") == [tiny.token_to_id(d) for d in "1234567"]
    assert tiny.decode(tiny.encode("anything: ünïcödé 😀")) == "anything: ünïcödé 😀"


def test_tiny_chat_template(tiny):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tiny.apply_chat_template(messages)
    assert prompt == (f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi{IM_END}\n{IM_START}assistant\n")
    assert tiny.apply_chat_template(messages, add_generation_prompt=False) == prompt.removesuffix(
        f"{IM_START}assistant\n")
    ids = tiny.encode_chat(messages)
    assert ids[0] == tiny.token_to_id(IM_START) and ids.count(tiny.eos_id) == 2
    assert tiny.decode(ids, skip_special_tokens=False) == prompt
    assert tiny.decode(ids) == "system\nBe brief.\nuser\nHi\nassistant\n"


# --- parity with transformers ---------------------------------------------------------------------------------------

def test_encode_decode_match_transformers(tiny_dir, tiny):
    reference = _reference(tiny_dir)
    assert len(reference) == tiny.vocab_size
    assert reference.eos_token_id == tiny.eos_id and reference.pad_token_id == tiny.pad_id
    for text in TEXTS:
        ids = tiny.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tiny.encode(text, add_special_tokens=True) == reference.encode(text, add_special_tokens=True), text
        assert tiny.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
        assert tiny.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False), text
    assert tiny.encode_batch(TEXTS) == [reference.encode(t, add_special_tokens=False) for t in TEXTS]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tiny_dir, tiny, conversation, add_generation_prompt):
    reference = _reference(tiny_dir)
    messages = CONVERSATIONS[conversation]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tiny.apply_chat_template(messages, add_generation_prompt) == expected
    expected_ids = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)["input_ids"]
    assert tiny.encode_chat(messages, add_generation_prompt) == expected_ids


@pytest.mark.slow  # imports transformers
def test_vllm_style_auto_tokenizer_gives_the_same_ids(tmp_path, tiny_dir, tiny):
    """vLLM loads tokenizers with AutoTokenizer, which for a qwen2 model swaps in Qwen2Tokenizer and rebuilds the
    tokenizer from vocab and merges with Qwen2's own pre-tokenizer. The tiny tokenizer uses that same pre-tokenizer
    so rollout ids agree; a GPT-2-style pre-tokenizer would not (numbers would tokenize differently)."""
    shutil.copytree(tiny_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert auto.encode(text, add_special_tokens=False) == tiny.encode(text), text
    messages = CONVERSATIONS["system+user"]
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tiny.apply_chat_template(messages)


RICH_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}{{ raise_exception('first message must be system') }}{% endif %}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
{% else %}[{{ message['role'] | upper }}] {{ message['content'] | tojson }}
{% endif %}
{% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if tools is not none %}TOOLS {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""


def test_template_features_match_transformers(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path)
    config = {"bos_token": {"content": ENDOFTEXT, "special": True}, "eos_token": IM_END,
              "chat_template": [{"name": "default", "template": RICH_TEMPLATE}, {"name": "other", "template": "x"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.bos_id == 0 and ours.pad_id == ours.eos_id
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token=ENDOFTEXT, eos_token=IM_END,
        chat_template=RICH_TEMPLATE)
    messages = [{"role": "system", "content": "<b>&'quotes'</b> ü"}, {"role": "user", "content": "2 < 3"},
                {"role": "assistant", "content": "  yes  "}, {"role": "user", "content": "a"},
                {"role": "user", "content": "never rendered: loop broke"}]
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
    with pytest.raises(jinja2.TemplateError, match="first message must be system"):
        ours.apply_chat_template(messages[1:])


# --- loading ------------------------------------------------------------------------------------------------------

def test_from_dir_errors(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)

    shutil.copy(tiny_dir / "tokenizer.json", tmp_path)
    bare = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json: ids work, eos and template do not
    assert bare.encode(COUNTDOWN) == Tokenizer.from_dir(tiny_dir).encode(COUNTDOWN)
    with pytest.raises(ValueError, match=f"{tmp_path}: no eos_token"):
        _ = bare.eos_id
    with pytest.raises(ValueError, match=f"{tmp_path}: no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])

    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({"eos_token": "<|not a token|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|not a token\|>' is not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)

    config_file.write_text(json.dumps({"eos_token": IM_END, "chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ValueError, match=r"templates \['tool_use'\] but none named 'default'"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])


def test_chat_template_file_takes_priority(tmp_path, tiny_dir):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": IM_END, "chat_template": "config"}))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "config"
    (tmp_path / "chat_template.jinja").write_text("file {{ eos_token }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == f"file {IM_END}"


def test_padding_and_truncation_in_the_file_are_ignored(tmp_path, tiny_dir):
    # tokenizer.json can carry padding/truncation settings, which would silently change encode()'s output.
    content = json.loads((tiny_dir / "tokenizer.json").read_text())
    content["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0}
    content["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                          "pad_id": 0, "pad_type_id": 0, "pad_token": ENDOFTEXT}
    (tmp_path / "tokenizer.json").write_text(json.dumps(content))
    assert Tokenizer.from_dir(tmp_path).encode(COUNTDOWN) == Tokenizer.from_dir(tiny_dir).encode(COUNTDOWN)
