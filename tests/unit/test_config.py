"""A RunConfig that cannot run is refused at once, with the key named."""

from __future__ import annotations

import pytest

from diloco.config import RunConfig
from diloco.config_parse import ConfigError


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("sync", "outer_warmup_rounds", -1),
        ("sync", "max_staleness", -1),
        ("sync", "mix_alpha", 1.0),
        ("sync", "stale_decay", 0.0),
        ("sync", "stale_decay", 1.5),
        ("sync", "fragments", 0),
    ],
)
def test_a_bad_sync_value_is_refused_naming_its_key(section: str, key: str, value: object) -> None:
    config = RunConfig()
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=f"{section}.{key}"):
        config.validate()


def test_the_defaults_and_an_outer_warmup_are_valid() -> None:
    config = RunConfig()
    config.validate()
    config.sync.outer_warmup_rounds = 10
    config.validate()
