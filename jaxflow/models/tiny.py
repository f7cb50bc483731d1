"""Tiny HF-format models and tokenizers, built locally, for tests, demos and benchmarks.

Everything here is generated in code and written to a directory in the layout transformers and vLLM load
(`tokenizer.json`, `tokenizer_config.json`, ...); nothing is downloaded from the hub.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Iterator

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from jaxflow.tokenizer import Tokenizer

# ChatML, as Qwen writes it: <|im_end|> ends every turn, <|endoftext|> ends documents and pads.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's template without its default system prompt: a conversation renders exactly as its messages.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split: every digit is its own token, so numbers of any size tokenize the same way
# (arithmetic tasks are easier to learn) and the tiny vocab is not spent on multi-digit merges.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# 256 byte tokens + the special tokens: the smallest vocab that can encode any text.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_TASK_WORDS = (
    "the a an of to and in is it that for with as on be by this are or your you can each only once number numbers "
    "using use make create equation equals target answer final result solve problem question step steps think "
    "reasoning show work tags return example basic arithmetic operations add subtract multiply divide plus minus "
    "times divided sum difference product quotient total correct incorrect wrong right check verify first then next "
    "so therefore because let we need find what how many much left remaining more less than greater smaller value "
    "values list given must exactly all not try another way works does doesn't it's I'll let's count countdown "
    "game puzzle math compute calculate expression parentheses order integer integers positive remainder format "
    "system user assistant helpful harmless honest respond please thank hello sure here"
).split()

_COUNTDOWN_PROMPTS = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.",
    "Using the numbers {numbers} make {target}. Use each number once.",
    "Target: {target}. Numbers: {numbers}. Find an expression using +, -, * and / that equals the target.",
)


def _expression(rng: random.Random, numbers: list[int]) -> tuple[str, int]:
    """A random expression over `numbers` (all >= 1) with its value; division only where it is exact."""
    text, value = str(numbers[0]), numbers[0]
    for n in numbers[1:]:
        op = rng.choice("+-*/" if value % n == 0 else "+-*")
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]
        # Parentheses make the text mean the left-to-right value under the usual precedence.
        text = f"({text}) {op} {n}" if op in "*/" and " " in text else f"{text} {op} {n}"
    return text, value


def _corpus(rng: random.Random, n_lines: int = 1500) -> Iterator[str]:
    """Synthetic training text shaped like jaxflow's RL tasks: countdown, arithmetic, tags, chat turns."""
    for _ in range(n_lines):
        numbers = [rng.randint(1, 100) for _ in range(rng.randint(2, 6))]
        expression, value = _expression(rng, numbers)
        kind = rng.randrange(5)
        if kind == 0:
            yield rng.choice(_COUNTDOWN_PROMPTS).format(numbers=numbers, target=value)
        elif kind == 1:
            steps = " ".join(f"{a} + {b} = {a + b}." for a, b in zip(numbers, numbers[1:]))
            yield f"<think> Let me try. {steps} </think>\n<answer> {expression} </answer>"
        elif kind == 2:
            a, b = numbers[:2]
            yield rng.choice((f"What is {a} * {b}? The answer is {a * b}.", f"{a} - {b} = {a - b}",
                              f"Compute {expression}.\n#### {value}", f"{a} + {b} = {a + b}"))
        elif kind == 3:
            yield " ".join(rng.choice(_TASK_WORDS) for _ in range(rng.randint(5, 20))).capitalize() + "."
        else:
            question = " ".join(rng.choice(_TASK_WORDS) for _ in range(rng.randint(3, 10)))
            yield (f"system\nYou are a helpful assistant.\nuser\n{question}?\n"
                   f"assistant\nThe answer is <answer> {value} </answer>\n")


def write_tiny_tokenizer(directory: str | os.PathLike, vocab_size: int = 512, seed: int = 0, *,
                         model_max_length: int = 2048, extra_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """Trains a small byte-level BPE tokenizer for jaxflow's tasks and writes it as an HF tokenizer directory.

    The tokenizer is Qwen2-like: NFC normalization, Qwen2's pre-tokenizer split (single digits), byte-level BPE
    (any text encodes, nothing is unknown), ChatML chat template. Special tokens: <|endoftext|> (id 0, pad),
    <|im_start|> (1), <|im_end|> (2, eos: ends every chat turn). Same arguments give a byte-identical
    `tokenizer.json`.

    Args:
      directory: where to write `tokenizer.json` and `tokenizer_config.json`; created if missing.
      vocab_size: the most tokens to learn, special tokens included, >= 259. The trained vocab may be smaller if
        the corpus runs out of pairs to merge; a model using this tokenizer needs a vocab size (embedding rows)
        >= the returned tokenizer's `vocab_size`, not this argument.
      seed: seeds the synthetic corpus, and so the merges learned.
      model_max_length: written to the config as the longest sequence the model is meant for, in tokens.
      extra_tokens: strings that become one token each (ids after the learned vocab), decoded as text like
        any other (not special): markers a task needs as single tokens, e.g. a tool call's "</tool>".

    Returns:
      the written tokenizer, loaded back with `Tokenizer.from_dir`.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB_SIZE}: 256 bytes + {len(SPECIAL_TOKENS)} "
                         "special tokens")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(random.Random(seed)), trainer=trainer)
    bad = [t for t in extra_tokens if not isinstance(t, str) or not t or t in SPECIAL_TOKENS]
    if bad or len(set(extra_tokens)) != len(extra_tokens):
        raise ValueError(f"extra_tokens must be distinct non-empty strings other than the special tokens, got "
                         f"{list(extra_tokens)!r}")
    tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in extra_tokens])
    tokenizer.save(str(directory / "tokenizer.json"))

    # AutoTokenizer honours tokenizer_class only without a config.json: with one, transformers 5 picks the class
    # from model_type (Qwen2Tokenizer for qwen2), which rebuilds the tokenizer from vocab and merges with Qwen2's
    # pre-tokenizer. Using that same pre-tokenizer above keeps the ids equal either way.
    write_tokenizer_config(directory, model_max_length)
    return Tokenizer.from_dir(directory)


def write_tokenizer_config(directory: pathlib.Path, model_max_length: int) -> None:
    """tokenizer_config.json for a ChatML tokenizer.json in `directory`: the fast tokenizer class, <|im_end|> as
    EOS, <|endoftext|> as padding and the chat template, as transformers and vLLM read them."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def write_tiny_model(directory: str | os.PathLike, *, architecture: str = "Qwen3ForCausalLM",
                     hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                     num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                     tie_word_embeddings: bool = True, vocab_size: int = 512, seed: int = 0,
                     dtype: str = "float32", overwrite: bool = False,
                     extra_tokens: tuple[str, ...] = (), num_experts: int = 0, num_experts_per_tok: int = 2,
                     moe_intermediate_size: int = 0, mlp_only_layers: tuple[int, ...] = ()) -> pathlib.Path:
    """Writes a randomly initialised HF model plus the tiny tokenizer into `directory`.

    The model's vocab is the tokenizer's rounded up to a multiple of 64 (so it splits evenly over a
    tensor axis). head_dim defaults to 32: vLLM's CPU attention kernels reject 16. Refuses to replace a
    model already in `directory` unless `overwrite`. extra_tokens: as for `write_tiny_tokenizer`. num_experts,
    num_experts_per_tok, moe_intermediate_size, mlp_only_layers: a Qwen3MoeForCausalLM's experts (the
    other architectures have none). Returns the directory, which
    `jaxflow.models.hf_io.load_model`, transformers and vLLM all load.
    """
    # Imported here: the tokenizer half of this module must not pull in JAX.
    from flax import nnx

    from jaxflow.models.config import ModelConfig
    from jaxflow.models.hf_io import export_model
    from jaxflow.models.transformer import Transformer

    directory = pathlib.Path(directory)
    tokenizer = write_tiny_tokenizer(directory, vocab_size=vocab_size, seed=seed, extra_tokens=tuple(extra_tokens))
    cfg = ModelConfig(
        architecture=architecture, vocab_size=-(-tokenizer.vocab_size // 64) * 64,
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings, qkv_bias=architecture == "Qwen2ForCausalLM",
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), max_position_embeddings=2048,
        rope_theta=10000.0, dtype=dtype, eos_token_id=tokenizer.eos_id, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok if num_experts else 0, moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=bool(num_experts), mlp_only_layers=tuple(mlp_only_layers))
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    return export_model(model, directory, overwrite=overwrite)


def write_tiny_reward_model(directory: str | os.PathLike, *, architecture: str = "Qwen3ForSequenceClassification",
                            hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                            num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32, vocab_size: int = 512,
                            seed: int = 0, scale: float = 0.2, pad_token_id: int | None = 0) -> pathlib.Path:
    """Writes a random one-label HF sequence classifier (a scalar reward model) plus the tiny tokenizer.

    The layout is what transformers' `save_pretrained` writes for `architecture` (e.g.
    "Qwen3ForSequenceClassification"): the backbone's `model.*` tensors, `score.weight` [1, hidden], and a
    config.json with one label and `pad_token_id` (0 is the tiny tokenizer's <|endoftext|>). Weights are
    `scale` * N(0, 1) (norm scales 1 + N(0, 1) * scale), lively enough that scores differ between inputs.
    Returns the directory, which `jaxflow.models.classifier.load_sequence_classifier` and transformers'
    `AutoModelForSequenceClassification` both load.
    """
    import numpy as np
    from flax import nnx

    from jaxflow.models.classifier import SEQUENCE_CLASSIFIERS, SequenceClassifier, export_sequence_classifier
    from jaxflow.models.config import ModelConfig
    from jaxflow.models.hf_io import iter_hf_tensors, params_from_hf
    from jaxflow.models.transformer import Transformer

    if architecture not in SEQUENCE_CLASSIFIERS:
        raise ValueError(f"architecture {architecture!r} is not one of {', '.join(SEQUENCE_CLASSIFIERS)}")
    directory = pathlib.Path(directory)
    tokenizer = write_tiny_tokenizer(directory, vocab_size=vocab_size, seed=seed)
    causal = SEQUENCE_CLASSIFIERS[architecture]
    cfg = ModelConfig(
        architecture=causal, vocab_size=-(-tokenizer.vocab_size // 64) * 64, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, tie_word_embeddings=True, qkv_bias=causal == "Qwen2ForCausalLM",
        qk_norm=causal == "Qwen3ForCausalLM", max_position_embeddings=2048, eos_token_id=tokenizer.eos_id)
    rng = np.random.default_rng(seed)
    backbone = Transformer(cfg, rngs=nnx.Rngs(seed))
    tensors = {name: (1 + scale * rng.standard_normal(t.shape) if name.endswith("norm.weight")
                      else scale * rng.standard_normal(t.shape)).astype(np.float32)
               for name, t in iter_hf_tensors(backbone)}
    nnx.update(backbone, params_from_hf(cfg, tensors, None))
    score = (scale * rng.standard_normal((hidden_size, 1))).astype(np.float32)
    export_sequence_classifier(SequenceClassifier(backbone, score, pad_token_id), directory, overwrite=True)
    return directory
