"""jaxflow.setup_env refuses a first install on a disk without room for it, before installing anything."""

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
