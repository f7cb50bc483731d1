"""References to Python objects by name, "package.module:attr.path": how configs name code to import.

A run's config names the code it runs by reference: a reward function (`task.reward_ref`), an environment
factory (`rollout.env.ref`), a task class (the task registry), the factory of an object served from its own
process. `resolve` is the one way such a reference becomes the object, with one error type, `RefError`, that
names the reference and says what is wrong with it:

    resolve("jaxflow.tasks.arithmetic:reward", what="reward function reference")
    resolve("jaxflow.envs.calculator:CalculatorEnv", what="environment reference", expect="class")

This module imports nothing from jaxflow: every layer may use it.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Literal

__all__ = ["RefError", "parse", "resolve"]

Expect = Literal["callable", "class", "any"]

# expect -> (the form a reference takes, what its attribute is called in messages).
_WORDS: dict[str, tuple[str, str]] = {
    "callable": ("module:function", "function"),
    "class": ("module:Class", "class"),
    "any": ("module:attribute", "attribute"),
}


class RefError(ValueError):
    """A "module:attr" reference that names nothing usable: malformed, its module not found or raising while
    it imports, its attribute missing, or its object not of the kind asked for. The message names the
    reference; `ref` holds it. When importing the module raised, that exception is the `__cause__`."""

    def __init__(self, message: str, ref: Any):
        super().__init__(message)
        self.ref = ref


def parse(ref: Any, *, what: str = "reference", expect: Expect = "callable") -> tuple[str, str]:
    """(module, attribute path) of a "package.module:attr.path" reference, without importing anything.

    what: how messages name the reference, e.g. "reward function reference". expect: the kind of object
    it should name (only the form the message shows depends on it). Raises RefError unless `ref` is a string
    with exactly one ":" and a dotted name on each side.
    """
    module, sep, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not sep or not _dotted(module) or not _dotted(attr):
        raise RefError(f"{what} {ref!r} is not of the form {_WORDS[expect][0]!r}", ref)
    return module, attr


def resolve(ref: Any, *, what: str = "reference", expect: Expect = "callable") -> Any:
    """The object a "package.module:attr.path" reference names: imports the module, walks the attribute path.

    what: how messages name the reference, e.g. "reward function reference". expect: "callable" (the
    default: a function, a class or any other callable), "class", or "any" (no check).

    Raises:
      RefError: `ref` is malformed; its module is not found; its module raised while importing (the message
        says what it raised); an attribute on the path is missing (the message lists the nearest names); or
        the object is not of the `expect`ed kind.
    """
    module_name, attr_path = parse(ref, what=what, expect=expect)
    noun = _WORDS[expect][1]
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # whatever the user's module raises is this reference's fault
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and _is_prefix(e.name, module_name)
        problem = "is not found" if missing else "raised while importing"
        raise RefError(f"{what} {ref!r}: module {module_name!r} {problem}: {type(e).__name__}: {e}", ref) from e
    parts = attr_path.split(".")
    for depth, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = f" ({module_name}:{'.'.join(parts[:depth])} has no {part!r})" if depth else ""
            raise RefError(f"{what} {ref!r}: module {module_name!r} has no {noun} {attr_path!r}{where}"
                           f"{_nearest(part, obj)}", ref) from None
    if (expect == "class" and not isinstance(obj, type)) or (expect == "callable" and not callable(obj)):
        raise RefError(f"{what} {ref!r} names an object of type {type(obj).__name__}, not a {noun}", ref)
    return obj


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _is_prefix(missing: str, module_name: str) -> bool:
    """Whether the module not found is `module_name` or a package on its path (not one it imports)."""
    return module_name == missing or module_name.startswith(missing + ".")


def _nearest(name: str, obj: Any) -> str:
    close = difflib.get_close_matches(name, [n for n in dir(obj) if not n.startswith("__")], n=3)
    return f"; nearest: {', '.join(close)}" if close else ""
