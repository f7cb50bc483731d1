"""The architecture presets build valid configs whose parameter counts match the published ones."""

import pytest

from jaxflow.models import presets


@pytest.mark.parametrize("name", presets.preset_names())
def test_preset_parameter_count_matches_published(name):
    cfg = presets.preset(name)
    published = presets.PUBLISHED_PARAMS[name]
    # Published counts are rounded to three significant figures.
    assert abs(cfg.num_params() - published) / published < 0.01
    if name in presets.PUBLISHED_ACTIVE_PARAMS:  # a mixture of experts: what a token computes with, too
        active = presets.PUBLISHED_ACTIVE_PARAMS[name]
        assert abs(cfg.num_params(active=True) - active) / active < 0.02


def test_unknown_preset_is_named():
    with pytest.raises(KeyError, match="qwen9"):
        presets.preset("qwen9")
