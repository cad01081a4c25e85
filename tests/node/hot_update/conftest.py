"""Fixtures of the hot-update tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _launcher import Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    job = Launcher(tmp_path)
    yield job
    job.stop_now()
