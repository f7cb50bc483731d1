"""jaxflow.setup_env refuses a first install on a disk without room for it, before installing anything, and
installs with uv given pip's own indexes, wheel folders and constraints (with pip where uv does not install)."""

import collections

import pytest

from jaxflow import setup_env


def test_first_install_on_a_full_disk_stops_with_the_free_space_and_the_need(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_env, "STAMP", tmp_path / "no-stamp")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(setup_env.shutil, "disk_usage", lambda path: usage(100e9, 99.7e9, 0.3e9))
    ran = []
    monkeypatch.setattr(setup_env, "_run", lambda args, what: ran.append(what))
    with pytest.raises(SystemExit, match=r"only 0\.3 GB free .* needs about 2\.5 GB"):
        setup_env.main(["--no-vllm"])
    assert ran == []


def test_enough_room_goes_on_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_env, "STAMP", tmp_path / "no-stamp")
    monkeypatch.setattr(setup_env, "VENV", tmp_path / "venv")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(setup_env.shutil, "disk_usage", lambda path: usage(100e9, 50e9, 50e9))
    ran = []
    monkeypatch.setattr(setup_env, "_run", lambda args, what: ran.append(what))
    assert setup_env.main(["--no-vllm"]) == 0
    assert any("installing" in what for what in ran)


def test_uv_installs_with_pips_indexes_and_constraints_and_pip_takes_over_without_uv(monkeypatch):
    settings = {"find-links": ["/opt/wheels"], "constraint": ["/etc/c.txt"], "cert": ["/etc/ca.crt"],
                "extra-index-url": ["file:///a/simple", "file:///b/simple"]}
    monkeypatch.setattr(setup_env, "_pip_settings", lambda pip: settings)
    installed = []

    def run(args, **kwargs):
        installed.append(args[-1])
        return collections.namedtuple("done", "returncode")(returncode)

    monkeypatch.setattr(setup_env.subprocess, "run", run)
    returncode = 0
    uv = setup_env._installer(["python", "-m", "pip"])
    assert installed == ["uv"] and uv[1:3] == ["pip", "install"] and uv[0].endswith("uv")
    pairs = list(zip(uv, uv[1:]))
    for pair in [("--find-links", "/opt/wheels"), ("--constraint", "/etc/c.txt"),
                 ("--extra-index-url", "file:///a/simple"), ("--extra-index-url", "file:///b/simple"),
                 ("--index-strategy", "unsafe-best-match")]:  # pip's rule: the best version on any index
        assert pair in pairs, uv
    assert "--compile-bytecode" in uv  # read, never written, by processes under PYTHONDONTWRITEBYTECODE
    returncode = 1  # pip could not install uv (an offline machine without it, say)
    assert setup_env._installer(["python", "-m", "pip"]) == ["python", "-m", "pip", "install", "-q"]


def test_pips_settings_are_read_from_its_config_list_the_variables_winning(monkeypatch):
    listed = (":env:.find-links='/srv/wheels'\nglobal.find-links='/opt/wheels'\nuser.find-links='/home/w'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n")
    monkeypatch.setattr(setup_env.subprocess, "run",
                        lambda *a, **k: collections.namedtuple("done", "stdout")(listed))
    settings = setup_env._pip_settings(["pip"])
    assert settings["find-links"] == ["/srv/wheels"]
    assert settings["extra-index-url"] == ["file:///a/simple", "file:///b/simple"]
