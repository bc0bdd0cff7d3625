"""Every example config parses, validates, and names only known fields and registered choices."""

from pathlib import Path

import pytest

from klgrpo.config.schema import GRPOConfig
from klgrpo.core.rewards import RewardSpec

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = GRPOConfig.from_yaml(path)
    assert cfg.validate() == []  # no biased-KL warning in a config we recommend
    assert cfg.model.name_or_path and cfg.data.source
    for entry in cfg.rewards.functions:
        RewardSpec.parse(entry)  # built-in names resolve
