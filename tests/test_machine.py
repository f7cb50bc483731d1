"""The machine's physical memory (jaxflow/machine.py), which the default memory limits are shares of: sysconf's
answer, else psutil's, else a fixed fallback when neither can say."""

import os

import psutil
import pytest

from jaxflow import machine


def test_physical_memory_is_sysconfs_answer():
    assert machine.physical_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _no_sysconf(name):
    raise ValueError(f"unrecognized configuration name {name!r}")


def test_without_sysconf_psutil_answers(monkeypatch):
    monkeypatch.setattr(os, "sysconf", _no_sysconf)
    assert machine.physical_memory_bytes() == psutil.virtual_memory().total


def test_when_nothing_answers_the_fallback_stands_in(monkeypatch):
    monkeypatch.setattr(os, "sysconf", _no_sysconf)

    def broken():
        raise OSError("no /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    assert machine.physical_memory_bytes() == machine.FALLBACK_MEMORY_BYTES


@pytest.mark.parametrize("pages", [0, -1])
def test_a_nonsense_sysconf_answer_is_not_believed(monkeypatch, pages):
    monkeypatch.setattr(os, "sysconf", lambda name: pages if name == "SC_PHYS_PAGES" else 4096)
    assert machine.physical_memory_bytes() == psutil.virtual_memory().total
