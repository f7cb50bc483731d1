"""`jaxflow.refs.resolve`: a "module:attr" reference becomes its object, or one RefError says what is wrong."""
import sys

import pytest

from jaxflow import refs
from jaxflow.refs import RefError

VALUE = 3


class Holder:
    class Inner:
        pass

    @staticmethod
    def make() -> int:
        return 1


def test_a_reference_resolves_through_a_dotted_attribute_path():
    assert refs.resolve(f"{__name__}:Holder.make")() == 1
    assert refs.resolve(f"{__name__}:Holder.Inner", expect="class") is Holder.Inner
    assert refs.resolve(f"{__name__}:VALUE", expect="any") == 3
    assert refs.parse("a.b:c.d") == ("a.b", "c.d")


@pytest.mark.parametrize("ref", ["no_colon", "a:b:c", ":f", "m:", "m:f.", "m-x:f", None, 3])
def test_a_malformed_reference_is_refused_before_anything_imports(ref):
    with pytest.raises(RefError, match=r"reward ref .* is not of the form 'module:function'") as e:
        refs.resolve(ref, what="reward ref")
    assert e.value.ref == ref


@pytest.mark.parametrize("ref, says", [
    ("no_such_module_qq:f", "module 'no_such_module_qq' is not found: ModuleNotFoundError: No module named "
                            "'no_such_module_qq'"),
    ("jaxflow.no_such_module_qq:f", "module 'jaxflow.no_such_module_qq' is not found"),
    (f"{__name__}:Holdr", f"module '{__name__}' has no function 'Holdr'; nearest: Holder"),
    (f"{__name__}:Holder.mak", f"has no function 'Holder.mak' ({__name__}:Holder has no 'mak'); nearest: make"),
    (f"{__name__}:VALUE", "names an object of type int, not a function"),
])
def test_a_reference_naming_nothing_usable_says_what_is_wrong(ref, says):
    with pytest.raises(RefError) as e:
        refs.resolve(ref, what="thing")
    assert f"thing {ref!r}" in str(e.value) and says in str(e.value)


def test_a_class_is_checked_when_asked_for():
    with pytest.raises(RefError, match="names an object of type function, not a class"):
        refs.resolve(f"{__name__}:test_a_class_is_checked_when_asked_for", expect="class")


def test_a_module_that_raises_while_importing_is_named_with_what_it_raised(tmp_path, monkeypatch):
    (tmp_path / "refs_boom_qq.py").write_text("raise KeyError('no config')\n")
    (tmp_path / "refs_dep_qq.py").write_text("import refs_missing_dependency_qq\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RefError, match=r"module 'refs_boom_qq' raised while importing: KeyError: 'no config'") as e:
        refs.resolve("refs_boom_qq:f")
    assert isinstance(e.value.__cause__, KeyError)
    # A module that is there but imports a missing one is not "not found": what it raised is named.
    with pytest.raises(RefError, match=r"'refs_dep_qq' raised while importing: ModuleNotFoundError: "
                                       r"No module named 'refs_missing_dependency_qq'"):
        refs.resolve("refs_dep_qq:f")
    for name in ("refs_boom_qq", "refs_dep_qq"):
        sys.modules.pop(name, None)


def test_ref_error_is_a_value_error():
    assert issubclass(RefError, ValueError)


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_module_that_exits_while_importing_is_a_named_error_not_an_exit(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "refs_exits_qq", "import sys\nsys.exit(0)\n")
    with pytest.raises(RefError, match=r"module 'refs_exits_qq' called sys.exit\(0\) while importing") as e:
        refs.resolve(f"{name}:reward", what="task.reward_ref")
    assert "task.reward_ref 'refs_exits_qq:reward'" in str(e.value)


def test_a_module_that_never_finishes_importing_is_a_named_timeout(tmp_path, monkeypatch):
    # The module waits on a file that the test writes afterwards, so that its import thread ends.
    release = tmp_path / "release"
    name = _module(tmp_path, monkeypatch, "refs_hangs_qq",
                   f"import pathlib, time\nwhile not pathlib.Path({str(release)!r}).exists():\n    time.sleep(0.01)\n")
    try:
        with pytest.raises(refs.ImportHung, match=r"module 'refs_hangs_qq' did not finish importing within 0.2s"):
            refs.resolve(f"{name}:f", what="environment reference", timeout_s=0.2)
        assert name in refs.hung_imports()
    finally:
        release.write_text("")
    assert issubclass(refs.ImportHung, RefError)


def test_the_import_time_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(refs.TIMEOUT_ENV, "2.5")
    assert refs.import_timeout_s() == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv(refs.TIMEOUT_ENV, bad)
        with pytest.raises(RefError, match=refs.TIMEOUT_ENV):
            refs.import_timeout_s()


def reward_of_two(response, meta):
    return 1.0


def reward_of_one(response):
    return 1.0


@pytest.mark.parametrize("ref, says", [
    ("builtins:eval", "names a builtin"),
    ("operator:add", "names a builtin"),  # takes two arguments: refused for what it is, not its arity
    ("math:sqrt", "names a builtin"),
    (f"{__name__}:Holder", "names a class"),
    (f"{__name__}:reward_of_one", r"has the signature \(response\), which cannot be called with 2"),
])
def test_a_reward_function_must_be_a_python_function_taking_response_and_meta(ref, says):
    from jaxflow.rewards import resolve
    with pytest.raises(RefError, match=says):
        resolve(ref)
    assert resolve(f"{__name__}:reward_of_two") is reward_of_two
