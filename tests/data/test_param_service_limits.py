"""Parameter-service limits: uncommitted reservations are capped in bytes, and a version number may not jump
far past the newest, so neither a huge `begin` nor a publish of version 2**63 can block the trainer; the cap's
default is a share of the machine's memory."""

import os

import numpy as np
import pytest

from jaxflow import machine
from jaxflow.data.param_service import ParameterService


def manifest(nbytes):
    return {"w": {"dtype": "uint8", "shape": [nbytes]}}


def test_uncommitted_reservations_are_capped():
    with ParameterService(keep=1, prefault=False, max_pending_bytes=1 << 20) as svc:
        with pytest.raises(ValueError, match="max_pending_bytes"):
            svc.begin(0, {"w": {"dtype": "float32", "shape": [1 << 40]}})  # 4 TiB
        svc.begin(0, manifest(600_000))
        with pytest.raises(ValueError, match="max_pending_bytes"):
            svc.begin(1, manifest(600_000))  # together over the cap
        assert svc.abort_publish(0)
        svc.publish(1, {"w": np.ones(600_000, np.uint8)})  # the room came back
        assert svc.latest() == 1


def test_a_version_may_not_jump_far_past_the_newest():
    with ParameterService(keep=1, prefault=False, max_version_jump=4) as svc:
        with pytest.raises(ValueError, match="version"):
            svc.publish(2 ** 63, {"w": np.ones(4, np.uint8)})
        svc.publish(10, {"w": np.ones(4, np.uint8)})  # the first version may be any (a resumed run)
        for bad in (15, 2 ** 63):
            with pytest.raises(ValueError, match=r"max_version_jump|below 2\*\*53"):
                svc.publish(bad, {"w": np.ones(4, np.uint8)})
            with pytest.raises(ValueError, match=r"max_version_jump|below 2\*\*53"):
                svc.begin(bad, manifest(4))
        svc.publish(11, {"w": np.ones(4, np.uint8)})  # the trainer's next publish is not blocked
        svc.publish(15, {"w": np.ones(4, np.uint8)})
        assert svc.latest() == 15


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, "1"])
def test_wait_timeouts_must_be_finite(timeout):
    with ParameterService(keep=1, prefault=False) as svc:
        with pytest.raises((TypeError, ValueError), match="timeout"):
            svc.poll_version(0, timeout)
        with pytest.raises((TypeError, ValueError), match="timeout"):
            svc.wait_for_version(0, timeout)


def test_the_pending_cap_defaults_to_half_the_machines_memory_and_is_overridable(monkeypatch):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with ParameterService(keep=1, prefault=False) as svc:
        assert 1 <= svc.max_pending_bytes <= physical  # the old default, 64 GiB, is more than many machines hold
    monkeypatch.setattr(machine, "physical_memory_bytes", lambda: 8 << 20)
    with ParameterService(keep=1, prefault=False) as svc:
        assert svc.max_pending_bytes == 4 << 20
        with pytest.raises(ValueError, match="max_pending_bytes"):
            svc.begin(0, manifest(5 << 20))
        svc.publish(0, {"w": np.ones(3 << 20, np.uint8)})
    with ParameterService(keep=1, prefault=False, max_pending_bytes=6 << 20) as svc:
        svc.publish(0, {"w": np.ones(5 << 20, np.uint8)})
        assert svc.latest() == 0
