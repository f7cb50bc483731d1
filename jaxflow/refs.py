"""References to Python objects by name, "package.module:attr.path": how configs name code to import.

A run's config names the code it runs by reference: a reward function (`task.reward_ref`), an environment
factory (`rollout.env.ref`), a task class (the task registry), the factory of an object served from its own
process. `resolve` is the one way such a reference becomes the object, with one error type, `RefError`, that
names the reference and says what is wrong with it:

    resolve("jaxflow.tasks.arithmetic:reward", what="reward function reference")
    resolve("jaxflow.envs.calculator:CalculatorEnv", what="environment reference", expect="class")

User code runs when its module imports, and may misbehave there. `resolve` imports a module that is not
imported yet in a thread of its own, with a time limit (`import_timeout_s`, default `IMPORT_TIMEOUT_S` or the
environment's JAXFLOW_IMPORT_TIMEOUT_S): a module that raises, calls `sys.exit`, or does not finish in time is
a RefError naming the reference (`ImportHung` for the last: the import thread cannot be stopped, so a caller
that gets it should say so and end the process with `os._exit`). What no in-process guard can catch is a
module calling `os._exit` while it imports: `jaxflow.main` imports a run's user code in a short child process
first (`jaxflow.preflight`), which names the module the child was importing when it vanished.

The import runs in another thread, so a module that installs a signal handler while it imports (which only
the main thread may do) fails there; import such a module before resolving references into it.

A reward function is asked for with `expect="function", arity=2`: a Python function (or callable object)
whose signature takes `(response, meta)`, checked with `inspect.signature` without calling it; builtins such
as `builtins:eval` and classes are refused.

This module imports nothing from jaxflow: every layer may use it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
import threading
from typing import Any, Literal

__all__ = ["IMPORT_TIMEOUT_S", "TIMEOUT_ENV", "ImportHung", "RefError", "hung_imports", "import_timeout_s", "parse",
           "parse_timeout", "resolve"]

Expect = Literal["callable", "function", "class", "any"]

# Seconds a user module may take to import before `resolve` gives up on it (ImportHung).
IMPORT_TIMEOUT_S = 60.0
# The environment variable that overrides it (`jaxflow.main --import_timeout_s` sets it for every child).
TIMEOUT_ENV = "JAXFLOW_IMPORT_TIMEOUT_S"
# Modules whose import thread outlived its limit in this process (ImportHung raised for them).
_HUNG: list[str] = []

# expect -> (the form a reference takes, what its attribute is called in messages).
_WORDS: dict[str, tuple[str, str]] = {
    "callable": ("module:function", "function"),
    "function": ("module:function", "function"),
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


class ImportHung(RefError):
    """A reference whose module did not finish importing within the time limit. Its import thread still
    runs (Python cannot stop it) and holds that module's import lock: end the process (`os._exit`)."""


def hung_imports() -> list[str]:
    """The modules whose import did not finish in time in this process: their threads still run, so the
    process should end with `os._exit` (a normal exit may wait on them)."""
    return list(_HUNG)


def import_timeout_s() -> float:
    """The time limit on importing a user module, seconds: $JAXFLOW_IMPORT_TIMEOUT_S, else IMPORT_TIMEOUT_S.
    Raises RefError for a value that is not a number > 0."""
    raw = os.environ.get(TIMEOUT_ENV)
    return IMPORT_TIMEOUT_S if raw is None else parse_timeout(raw, TIMEOUT_ENV)


def parse_timeout(raw: str, name: str) -> float:
    """`raw` (the text of setting `name`) as a time limit in seconds; RefError naming `name` unless it is a
    finite number > 0."""
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise RefError(f"{name}={raw!r} must be a number of seconds > 0", raw)
    return value


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


def resolve(ref: Any, *, what: str = "reference", expect: Expect = "callable", arity: int | None = None,
            timeout_s: float | None = None) -> Any:
    """The object a "package.module:attr.path" reference names: imports the module, walks the attribute path.

    what: how messages name the reference, e.g. "reward function reference". expect: "callable" (the
    default: a function, a class or any other callable), "function" (a Python function or callable object,
    not a builtin and not a class), "class", or "any" (no check). arity: with "callable" or "function", the
    number of positional arguments the object is called with; its signature must accept them. timeout_s:
    the time limit on importing the module, seconds (default `import_timeout_s()`).

    Raises:
      RefError: `ref` is malformed; its module is not found; its module raised or exited (`sys.exit`) while
        importing (the message says what it raised); an attribute on the path is missing (the message lists
        the nearest names); or the object is not of the `expect`ed kind or signature.
      ImportHung (a RefError): the module did not finish importing within `timeout_s`.
    """
    module_name, attr_path = parse(ref, what=what, expect=expect)
    noun = _WORDS[expect][1]
    obj: Any = _import(module_name, ref, what, import_timeout_s() if timeout_s is None else timeout_s)
    parts = attr_path.split(".")
    for depth, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = f" ({module_name}:{'.'.join(parts[:depth])} has no {part!r})" if depth else ""
            raise RefError(f"{what} {ref!r}: module {module_name!r} has no {noun} {attr_path!r}{where}"
                           f"{_nearest(part, obj)}", ref) from None
    if (expect == "class" and not isinstance(obj, type)) or (expect in ("callable", "function")
                                                            and not callable(obj)):
        raise RefError(f"{what} {ref!r} names an object of type {type(obj).__name__}, not a {noun}", ref)
    if expect == "function" and (isinstance(obj, type) or inspect.isbuiltin(obj) or inspect.ismethoddescriptor(obj)
                                 or type(obj).__module__ == "builtins" and not inspect.isfunction(obj)):
        kind = "a class" if isinstance(obj, type) else f"a builtin ({type(obj).__name__})"
        raise RefError(f"{what} {ref!r} names {kind}, not a function defined in Python", ref)
    if arity is not None and expect in ("callable", "function"):
        _check_arity(obj, arity, ref, what)
    return obj


def _import(module_name: str, ref: Any, what: str, timeout_s: float) -> Any:
    """The module, imported in a thread with a deadline unless it is imported already (or its package is
    mid-import in this thread, where a second thread would wait on the package's import lock)."""
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise RefError(f"{what} {ref!r}: the import time limit {timeout_s!r} must be a number of seconds > 0", ref)
    if _imported_or_initialising(module_name):
        return _checked_import(module_name, ref, what, importlib.import_module)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["module"] = importlib.import_module(module_name)
        except BaseException as e:  # noqa: BLE001 -- SystemExit too: reported by the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"import {module_name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        _HUNG.append(module_name)
        raise ImportHung(f"{what} {ref!r}: module {module_name!r} did not finish importing within {timeout_s:g}s "
                         f"(set {TIMEOUT_ENV} or --import_timeout_s for a slower import)", ref)

    def result(_name: str) -> Any:
        if "error" in box:
            raise box["error"]
        return box["module"]

    return _checked_import(module_name, ref, what, result)


def _checked_import(module_name: str, ref: Any, what: str, do_import) -> Any:
    try:
        return do_import(module_name)
    except SystemExit as e:  # a module that exits while importing must not end the caller quietly
        raise RefError(f"{what} {ref!r}: module {module_name!r} called sys.exit({e.code!r}) while importing",
                       ref) from e
    except Exception as e:  # whatever the user's module raises is this reference's fault
        missing = isinstance(e, ModuleNotFoundError) and e.name is not None and _is_prefix(e.name, module_name)
        problem = "is not found" if missing else "raised while importing"
        raise RefError(f"{what} {ref!r}: module {module_name!r} {problem}: {type(e).__name__}: {e}", ref) from e


def _imported_or_initialising(module_name: str) -> bool:
    if module_name in sys.modules:
        return True
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        parent = sys.modules.get(".".join(parts[:i]))
        if parent is not None and getattr(getattr(parent, "__spec__", None), "_initializing", False):
            return True
    return False


def _check_arity(obj: Any, arity: int, ref: Any, what: str) -> None:
    """Refuses an object whose signature cannot take `arity` positional arguments (read, never called)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read (some C callables): nothing to check against
        return
    try:
        signature.bind(*range(arity))
    except TypeError as e:
        raise RefError(f"{what} {ref!r} has the signature {signature}, which cannot be called with {arity} "
                       f"positional argument(s): {e}", ref) from None


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def _is_prefix(missing: str, module_name: str) -> bool:
    """Whether the module not found is `module_name` or a package on its path (not one it imports)."""
    return module_name == missing or module_name.startswith(missing + ".")


def _nearest(name: str, obj: Any) -> str:
    close = difflib.get_close_matches(name, [n for n in dir(obj) if not n.startswith("__")], n=3)
    return f"; nearest: {', '.join(close)}" if close else ""
