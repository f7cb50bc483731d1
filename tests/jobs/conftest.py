"""Fixtures of the job tests: the small run's base model (tests/small_runs.py), one copy per module."""

import pytest
from small_runs import small_config

from jaxflow.jobs import warm_start


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, shared_base):
    """The module's copy of the small base (built once per test run: tests/shared_bases.py)."""
    directory = tmp_path_factory.mktemp("base") / "model"
    config = small_config(tmp_path_factory.mktemp("unused"), directory)
    info = warm_start.read_info(shared_base(config, directory))
    assert 0.0 <= info["eval_accuracy"] <= 1.0 and info["fingerprint"] == warm_start.fingerprint(config)
    return directory
