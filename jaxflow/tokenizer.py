"""Tokenizers loaded straight from `tokenizer.json` with the `tokenizers` library, plus HF-style chat templates.

We do not use transformers' `AutoTokenizer`: in transformers 5 it swaps in a model-specific class chosen from the
directory's config (e.g. `Qwen2Tokenizer` for a Qwen2 model), which rebuilds the tokenizer and can change the ids of
a `tokenizer.json` that was trained locally. Loading the file with `tokenizers` gives exactly the ids the file
defines, the same ones `transformers.PreTrainedTokenizerFast(tokenizer_file=...)` and vLLM see.

Chat templates are rendered the way transformers renders them: a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now`, a `tojson` filter that does not escape HTML, loop
controls, `{% generation %}` blocks, and the special tokens (`bos_token`, `eos_token`, ...) as variables.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# transformers >= 4.50 saves a single chat template here, and named ones under chat_templates/<name>.jinja; both take
# priority over the template in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "chat_templates"
DEFAULT_TEMPLATE_NAME = "default"

# The named special tokens transformers passes to chat templates, when set.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _GenerationBlocks(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body unchanged.

    transformers uses these blocks to find assistant tokens for masks; some templates contain them, so they must
    parse, but rendering ignores them.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a HF chat template in an environment equivalent to transformers' for rendering.

    Args:
      source: the jinja2 template text.

    Returns:
      a template whose `render(messages=..., add_generation_prompt=..., **special_tokens)` gives the prompt text.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any, where: str) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content", or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an object with \"content\", got {value!r}")


def _templates_from_config(value: Any, where: str) -> dict[str, str]:
    """name -> template, from tokenizer_config.json's chat_template (a string or a list of {name, template})."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE_NAME: value}
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template of its HF directory.

    Build one with `Tokenizer.from_dir`. Ids are exactly those of `tokenizer.json`; padding and truncation settings
    stored in the file are switched off, since jaxflow pads and truncates token arrays itself.

    Args:
      backend: the loaded `tokenizers.Tokenizer`.
      special_tokens: named special tokens ("bos_token", "eos_token", "pad_token", ...) -> their text; None or
        absent when unset.
      chat_templates: template name -> jinja2 source; the one named "default" is used.
      source: where the tokenizer came from, for error messages.
    """

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: dict[str, str | None] | None = None,
                 chat_templates: dict[str, str] | None = None, source: str = "<in memory>"):
        self.backend = backend
        self.backend.no_padding()
        self.backend.no_truncation()
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_templates = dict(chat_templates or {})
        self._compiled: jinja2.Template | None = None
        self._ids: dict[str, int | None] = {}
        for name in ("bos_token", "eos_token", "pad_token"):
            token = self.special_tokens.get(name)
            token_id = None if token is None else backend.token_to_id(token)
            if token is not None and token_id is None:
                raise ValueError(f"{source}: {name} {token!r} is not in the vocabulary")
            self._ids[name] = token_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads `tokenizer.json`, and `tokenizer_config.json` and chat template files when present.

        Args:
          path: an HF model or tokenizer directory.

        Raises:
          FileNotFoundError: `path/tokenizer.json` does not exist.
          ValueError: the config is malformed, or names a special token that is not in the vocabulary.
        """
        directory = pathlib.Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} at {tokenizer_file}; jaxflow needs the fast-tokenizer file (slow "
                "sentencepiece/vocab-only tokenizers are not supported)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))

        config_file = directory / CONFIG_FILE
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: expected a JSON object")
        special_tokens = {name: _token_content(config.get(name), f"{config_file}: {name}")
                          for name in _SPECIAL_TOKEN_NAMES}

        templates = _templates_from_config(config.get("chat_template"), str(config_file))
        if (directory / CHAT_TEMPLATE_FILE).is_file():
            templates[DEFAULT_TEMPLATE_NAME] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        if (directory / CHAT_TEMPLATE_DIR).is_dir():
            for template_file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
                templates[template_file.stem] = template_file.read_text(encoding="utf-8")
        return cls(backend, special_tokens, templates, source=str(directory))

    @property
    def vocab_size(self) -> int:
        """The number of embedding rows the ids need: 1 + the largest id, added tokens included.

        Equal to the number of tokens unless the file leaves gaps in the ids. A model's vocab size (often rounded
        up for efficiency) must be >= this.
        """
        return 1 + max(self.backend.get_vocab(with_added_tokens=True).values())

    @property
    def bos_id(self) -> int | None:
        """The id of bos_token, or None if the tokenizer has none (Qwen, ChatML tokenizers)."""
        return self._ids["bos_token"]

    @property
    def eos_id(self) -> int:
        """The id of eos_token: generation stops there.

        Raises:
          ValueError: tokenizer_config.json sets no eos_token.
        """
        if self._ids["eos_token"] is None:
            raise ValueError(f"{self.source}: no eos_token is set (tokenizer_config.json missing or without one)")
        return self._ids["eos_token"]

    @property
    def pad_id(self) -> int:
        """The id of pad_token, falling back to eos_id when no pad token is set."""
        return self._ids["pad_token"] if self._ids["pad_token"] is not None else self.eos_id

    @property
    def chat_template(self) -> str | None:
        """The template `apply_chat_template` uses (the one named "default"), or None."""
        return self.chat_templates.get(DEFAULT_TEMPLATE_NAME)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token's text (e.g. "<|im_end|>"), or None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The text of a token id in the vocabulary's own form (byte-level BPE shows spaces as "Ġ")."""
        return self.backend.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`.

        Args:
          text: the text; special tokens written in it (e.g. "<|im_end|>") become their single ids.
          add_special_tokens: apply the file's post-processor (e.g. prepend bos for Llama); off by default
            because chat templates already write the special tokens.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts at once, in parallel threads inside the tokenizers library."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids (a list or a 1-d integer array); special tokens are dropped by default."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Renders a conversation with the chat template, as transformers' `apply_chat_template(tokenize=False)`.

        Args:
          messages: [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...].
          add_generation_prompt: end with the header that starts an assistant turn, for sampling a reply.
          **template_kwargs: further template variables (e.g. `enable_thinking=False` for Qwen3); they override
            the special-token variables of the same name.

        Raises:
          ValueError: the tokenizer has no chat template.
          jinja2.TemplateError: the template called `raise_exception` (e.g. roles out of order).
        """
        if self._compiled is None:
            if self.chat_template is None:
                names = sorted(self.chat_templates)
                detail = f"it has templates {names} but none named {DEFAULT_TEMPLATE_NAME!r}" if names else (
                    f"neither {CONFIG_FILE} nor {CHAT_TEMPLATE_FILE} provides one")
                raise ValueError(f"{self.source}: no chat template: {detail}")
            self._compiled = compile_chat_template(self.chat_template)
        # transformers always defines `tools` and `documents` (None when unused); templates test them with
        # `is not none`, which an undefined variable would pass.
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
                    ) -> list[int]:
        """Token ids of the rendered conversation; no post-processor, since the template writes special tokens."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_kwargs))

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"
