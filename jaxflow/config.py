"""Loading an experiment config file and applying command-line overrides.

A config file defines `get_config(arg=None) -> ml_collections.ConfigDict`; `path:arg` selects a variant.
Overrides are `--config.a.b=value`, parsed by the type of the existing field. A key that does not exist
is an error naming it and the nearest valid keys, never a silently added field. Jobs validate the
loaded config before they change anything and raise `ConfigError` listing every bad key at once; the
helpers below (`check_int`, `check_float`, `check_choice`, `check_bool`, `number_problems`) give their
range, type and finiteness checks one wording. A config file that raises while it is imported or in
get_config is a `ConfigError` naming the file and the exception, not a traceback.

Each config section is a `Section`: a frozen dataclass whose fields are the section's keys and defaults,
whose `problems()` names every bad value by its dotted key, whose `from_config` names unknown keys with
their nearest valid ones, and whose `section(**overrides)` generates the ConfigDict a config file holds.

Why not `ml_collections.config_flags`? Tried (ml_collections 1.1): it cannot set an optional field back
to None (`--config.trainer.behav_weight_cap=None` is refused: "could not convert string to float"),
its unknown-key error is an AttributeError with one "Did you mean" and not the section's valid keys,
and it parses into absl's process-global FLAGS, which a notebook calling `load_config` does not have.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import numbers
import pathlib
import re
import types
import typing
from typing import Any, ClassVar

import ml_collections
from ml_collections.config_dict import FieldReference


class ConfigError(ValueError):
    """A config file or override that cannot be applied; the message names the file or key. `problems`:
    one message per bad key, when the error lists several."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]


def _load_module(path: pathlib.Path):
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"jaxflow_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- whatever the user's file raises (or a sys.exit)
        raise ConfigError(f"config file {path} raised {_describe(e)} while it was loaded") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config(arg=None)")
    return module


def base_config(path: str | pathlib.Path, arg: str | None = None) -> ml_collections.ConfigDict:
    """`get_config(arg)` of the config file `path`, unlocked: what a config file built on another one
    starts from (e.g. configs/arithmetic_tools_tiny.py on configs/arithmetic_tiny.py)."""
    return _load_module(pathlib.Path(path)).get_config(arg)


def _describe(error: BaseException) -> str:
    if isinstance(error, SyntaxError):
        return f"SyntaxError: {error.msg} (line {error.lineno})"
    return f"{type(error).__name__}: {error}"


# Integers beyond this are typos, not counts, steps or sizes (and overflow the int32 counters on device).
INT_LIMIT = 2 ** 31 - 1


def check_int(problems: list[str], key: str, value, low: int, high: int = INT_LIMIT, *,
              optional: bool = False) -> None:
    """Appends why `value` is not an integer in [low, high] (naming `key`) to `problems`; with `optional`,
    None is allowed too."""
    if optional and value is None:
        return
    must = f"{key} must be {'None or ' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # NumPy's integers too
        problems.append(f"{must}an integer, got {value!r}")
    elif value < low:
        problems.append(f"{must}>= {low}, got {value}")
    elif value > high:
        problems.append(f"{must}<= {high}, got {value}")


def check_float(problems: list[str], key: str, value, low: float, high: float = math.inf, *,
                open_low: bool = False, open_high: bool = False, optional: bool = False) -> None:
    """Appends why `value` is not a finite number in [low, high] (open at either end with open_low /
    open_high), naming `key`; with `optional`, None is allowed too."""
    if optional and value is None:
        return
    must = f"{key} must be {'None or ' if optional else ''}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        problems.append(f"{must}a number, got {value!r}")
    elif not math.isfinite(value):
        problems.append(f"{must}a finite number, got {value}")
    elif value < low or (open_low and value == low):
        problems.append(f"{must}{'>' if open_low else '>='} {low}, got {value}")
    elif value > high or (open_high and value == high):
        problems.append(f"{must}{'<' if open_high else '<='} {high}, got {value}")


def check_choice(problems: list[str], key: str, value, choices) -> None:
    """Appends why `value` is not one of `choices`, naming `key`."""
    if value not in choices:
        problems.append(f"{key} {value!r} is not one of {tuple(choices)}")


def check_bool(problems: list[str], key: str, value) -> None:
    """Appends why `value` is not True or False, naming `key`."""
    if not isinstance(value, bool):
        problems.append(f"{key} must be True or False, got {value!r}")


# Any integer in a config must fit an int64 (numpy, JAX and the wire formats hold nothing wider).
_ANY_INT_LIMIT = 2 ** 63 - 1


def _leaves(config: ml_collections.ConfigDict, prefix: str = ""):
    """(dotted key, value) of every leaf, read from the fields directly: a validation pass over all keys
    is not a use of them (tests record which keys a job reads through ConfigDict's accessors)."""
    for name, field in config._fields.items():
        value = field.get() if isinstance(field, FieldReference) else field
        if isinstance(value, ml_collections.ConfigDict):
            yield from _leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def number_problems(config: ml_collections.ConfigDict, already: list[str] = ()) -> list[str]:
    """Every float leaf must be finite and every integer leaf must fit an int64; keys that a message in
    `already` names are skipped (one message per key)."""
    named = " ".join(already)
    problems = []
    for key, value in _leaves(config):
        if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", named):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key} must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _ANY_INT_LIMIT:
            problems.append(f"{key}={value} is out of range (an int64 holds |value| <= {_ANY_INT_LIMIT})")
    return problems


def flat_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf key of `config` as a dotted path."""
    keys = []
    for name, value in config.items():
        key = f"{prefix}{name}"
        if isinstance(value, ml_collections.ConfigDict):
            keys.extend(flat_keys(value, key + "."))
        else:
            keys.append(key)
    return keys


def _unknown(config, dotted: str) -> ConfigError:
    keys = flat_keys(config)
    near = difflib.get_close_matches(dotted, keys, n=3, cutoff=0.5)
    if not near:  # a wrong leaf under a right section: suggest that section's keys
        section = dotted.rsplit(".", 1)[0] + "."
        near = [k for k in keys if k.startswith(section)][:5]
    hint = f"; nearest valid keys: {', '.join(near)}" if near else ""
    return ConfigError(f"unknown config key {dotted!r}{hint}")


def _parse(raw: str, current, dotted: str):
    """Converts the override text `raw` to the type of the field's current value."""
    kind = current.get_type() if isinstance(current, FieldReference) else type(current)
    if isinstance(current, FieldReference) and raw.lower() == "none":  # a field that may be unset
        return None
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if kind in (int, float, str):
            return kind(raw)
        if current is None:
            return ast.literal_eval(raw)
        value = ast.literal_eval(raw)
        if kind in (tuple, list):
            return kind(value)
        return value
    except (ValueError, SyntaxError):
        raise ConfigError(f"config key {dotted!r} expects a value of type {kind.__name__}, got {raw!r}") from None


def apply_override(config: ml_collections.ConfigDict, dotted: str, raw: str) -> None:
    """Sets `config.<dotted>` from the text `raw`, refusing keys that do not exist."""
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise _unknown(config, dotted)
        node = node[part]
    if leaf not in node or isinstance(node[leaf], ml_collections.ConfigDict):
        raise _unknown(config, dotted)
    field = node.get_ref(leaf) if isinstance(node._fields[leaf], FieldReference) else node[leaf]
    with node.unlocked():
        node[leaf] = _parse(raw, field, dotted)


def load_config(spec: str, overrides: dict[str, str] | None = None) -> ml_collections.ConfigDict:
    """Loads `path[:arg]`, applies `{dotted key: text}` overrides, and returns the locked config.

    Raises ConfigError for a file that does not load, an unknown key or unparsable override, and any float
    that is not finite or integer beyond int64, each named by its key.
    """
    path, _, arg = spec.partition(":")
    module = _load_module(pathlib.Path(path))
    try:
        config = module.get_config(arg or None)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        raise ConfigError(f"config file {path}: get_config({arg or None!r}) raised {_describe(e)}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"get_config in {path} returned {type(config).__name__}, not a ConfigDict")
    config.lock()
    for dotted, raw in (overrides or {}).items():
        apply_override(config, dotted, raw)
    problems = number_problems(config)  # each job checks its ranges; no job has a use for nan, inf or 10**30
    if problems:
        raise ConfigError(f"bad config {path}: " + "; ".join(problems))
    return config


# ------------------------------------------------------------------------------------------------ sections

class Section:
    """Mixin for a frozen dataclass that is one config section: its fields are the section's keys and their
    defaults, its docstring says what each key means (one line per key).

    SECTION: the section's dotted place in a run config ("trainer.loss"), which every message names.
    A subclass writes `problems()` (one message per bad value, each naming `{SECTION}.{key}`); building an
    instance with a bad value raises one ConfigError listing them all. Fields whose type is another
    Section are nested sections.
    """

    SECTION: ClassVar[str] = ""

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ConfigError(f"bad {self.SECTION} config: " + "; ".join(problems), problems)

    def problems(self) -> list[str]:
        """One message per bad value, each naming its dotted key; [] when the section is good."""
        return []

    def key(self, name: str) -> str:
        """The dotted key of field `name` (what messages say)."""
        return f"{self.SECTION}.{name}"

    @classmethod
    def from_config(cls, section: ml_collections.ConfigDict | dict | None):
        """The instance a config section (or a plain dict) describes; keys it leaves out take the defaults.
        Raises ConfigError naming every unknown key (with the nearest valid ones) or bad value."""
        names = [f.name for f in dataclasses.fields(cls)]
        if section is not None and not isinstance(section, (ml_collections.ConfigDict, dict)):
            message = f"{cls.SECTION} must be a section of keys ({', '.join(names)}), got {section!r}"
            raise ConfigError(message, [message])
        items = {} if section is None else {k: section[k] for k in section}
        problems = [f"{cls.SECTION}.{k} is not a key of {cls.SECTION} ({_nearest(k, names)})"
                    for k in items if k not in names]
        nested = _nested(cls)
        values = {}
        for name, value in items.items():
            if name not in names:
                continue
            if name in nested and not isinstance(value, nested[name]):
                try:
                    value = nested[name].from_config(value)
                except ConfigError as e:  # the defaults stand in, so the other keys are checked too
                    problems += e.problems
                    continue
            elif isinstance(value, ml_collections.ConfigDict):
                value = value.to_dict()
            values[name] = value
        try:
            instance = cls(**values)
        except ConfigError as e:
            problems += e.problems
        except (TypeError, ValueError) as e:  # a value of a type the checks cannot even compare
            problems.append(f"{cls.SECTION}: {e}")
        if problems:
            raise ConfigError(f"bad {cls.SECTION} config: " + "; ".join(problems), problems)
        return instance

    @classmethod
    def config_problems(cls, section: ml_collections.ConfigDict | dict | None) -> list[str]:
        """What `from_config(section)` would refuse, one message per bad key ([] when it is good)."""
        try:
            cls.from_config(section)
        except ConfigError as e:
            return e.problems
        return []

    @classmethod
    def section(cls, **overrides: Any) -> ml_collections.ConfigDict:
        """The section as a ConfigDict for a config file: every field, with its default unless `overrides`
        (keys of this section; a nested section as a dict) say otherwise. Fields that may be None stay
        settable from the command line, None or not (`--config.<key>=...`)."""
        return cls.from_config(overrides).to_section()

    def to_section(self) -> ml_collections.ConfigDict:
        """This instance as a config section (the inverse of `from_config`)."""
        hints = typing.get_type_hints(type(self))
        section = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Section):
                section[f.name] = value.to_section()
            elif _optional(hints[f.name]) is not None:
                section[f.name] = FieldReference(value, field_type=_optional(hints[f.name]))
            else:
                section[f.name] = value
        return ml_collections.ConfigDict(section)


def _nearest(key: str, names: list[str]) -> str:
    near = difflib.get_close_matches(key, names, n=2, cutoff=0.5)
    return f"nearest: {', '.join(near)}" if near else f"valid: {', '.join(names)}"


def _nested(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section)}


def _optional(hint) -> type | None:
    """T for a field annotated `T | None` (one plain type T), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2 and isinstance(args[0], type):
            return args[0]
    return None
