"""failslow.deepspeed.initialize reads the ds_config's "failslow" block and rejects a bad one
before DeepSpeed builds anything (no processes, no real engine)."""

from __future__ import annotations

import json
import re
import sys
import types

import pytest

import failslow.deepspeed
from failslow.errors import ConfigError


@pytest.fixture
def no_engine(monkeypatch):
    """A stand-in ``deepspeed`` whose initialize must never be reached."""
    fake = types.ModuleType("deepspeed")

    def initialize(**kwargs):
        raise AssertionError("deepspeed.initialize was called despite a bad failslow block")

    fake.initialize = initialize
    monkeypatch.setitem(sys.modules, "deepspeed", fake)


CONFIG = {"train_micro_batch_size_per_gpu": 2, "failslow": {"capture": False, "bogus": 1}}


def test_unknown_key_in_ds_config_block(no_engine):
    with pytest.raises(ConfigError) as info:
        failslow.deepspeed.initialize(model=None, config=CONFIG)
    message = str(info.value)
    assert "unknown key 'bogus'" in message and "'failslow' block" in message
    assert "allowed: enabled, store" in message and "\n" not in message


def test_unknown_key_in_ds_config_file(no_engine, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"failslow": {"detection": {"treshold": 1.2}}}))
    with pytest.raises(ConfigError, match=r"ds\.json: unknown key 'treshold' in section"):
        failslow.deepspeed.initialize(model=None, config=str(path))


def test_failslow_kwarg_overrides_the_block(no_engine):
    with pytest.raises(
        ConfigError, match=re.escape("initialize(failslow=...): unknown key 'nope'")
    ):
        failslow.deepspeed.initialize(model=None, config=CONFIG, failslow={"nope": 1})
    # a good kwarg replaces the bad block entirely: now the (fake) engine build is reached
    with pytest.raises(AssertionError, match=r"deepspeed\.initialize was called"):
        failslow.deepspeed.initialize(model=None, config=CONFIG, failslow={"capture": False})


def test_bad_value_and_unreadable_file(no_engine, tmp_path):
    with pytest.raises(ConfigError, match=re.escape("'detection.threshold' must be > 0")):
        failslow.deepspeed.initialize(config={"failslow": {"detection": {"threshold": -1}}})
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        failslow.deepspeed.initialize(config=str(tmp_path / "missing.json"))
