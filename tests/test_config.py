"""The config loader: one dataclass tree from a dict, the environment and overrides."""

from __future__ import annotations

import pytest

from failslow.config import FailslowConfig, load_config
from failslow.errors import ConfigError


def test_defaults_and_precedence() -> None:
    config = load_config(
        {"detection": {"threshold": 1.3}, "planner": {"min_gain": 0.1}},
        environ={"FAILSLOW__DETECTION__THRESHOLD": "1.4", "FAILSLOW_STORE": "tcp://h:1"},
        overrides={"planner.min_gain": "0.2"},
    )
    assert config.detection.threshold == 1.4  # environment over the dict
    assert config.planner.min_gain == 0.2  # overrides over everything
    assert config.store == "tcp://h:1"
    assert config.validation == FailslowConfig().validation
    assert load_config({}, environ={}) == FailslowConfig()


def test_the_dict_wins_over_failslow_store_env() -> None:
    config = load_config({"store": "redis://r:1/0"}, environ={"FAILSLOW_STORE": "tcp://h:1"})
    assert config.store == "redis://r:1/0"


def test_values_are_coerced_from_strings() -> None:
    config = load_config(
        {},
        environ={
            "FAILSLOW__CAPTURE": "false",
            "FAILSLOW__VALIDATION__LINK_MB": "4",
            "FAILSLOW__PLANNER__STRATEGIES": "S2,S4",
            "FAILSLOW__LOG_DIR": "none",
        },
    )
    assert config.capture is False
    assert config.validation.link_mb == 4
    assert config.planner.strategies == ("S2", "S4")
    assert config.log_dir is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"detecton": {}}, "ds_config['failslow']: unknown key 'detecton'; allowed: enabled,"),
        (
            {"detection": {"treshold": 1}},
            "unknown key 'treshold' in section 'detection'; allowed: threshold, cooldown_s",
        ),
        ({"detection": 3}, "'detection' is a section: expected a mapping, got 3"),
        ({"validation": {"link_mb": 1.5}}, "'validation.link_mb' must be an integer, got 1.5"),
        ({"validation": {"link_mb": "x"}}, "'validation.link_mb' must be a number (int)"),
        ({"capture": "maybe"}, "'capture' must be true or false, got 'maybe'"),
        ({"planner": {"strategies": ["S9"]}}, "unknown strategy 'S9'; allowed: S2, S3, S4"),
        ({"planner": {"min_gain": -1}}, "'planner.min_gain' must be >= 0, got -1.0"),
        ({"validation": {"pause_timeout_s": 0}}, "'validation.pause_timeout_s' must be > 0"),
        ({"store": 5}, "'store' must be a string, got 5"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(data, source="ds_config['failslow']", environ={})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_environment_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="environment variable FAILSLOW__DETECTION__X: unknown"):
        load_config({}, environ={"FAILSLOW__DETECTION__X": "1"})


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="expected a mapping of settings, got list"):
        load_config([1], environ={})  # type: ignore[arg-type]


def test_to_dict_round_trips() -> None:
    config = load_config({"planner": {"strategies": ["S2"]}}, environ={})
    assert load_config(config.to_dict(), environ={}) == config
