"""The pytest fixtures every ``Abstract*Tests`` mixin shares (fsspec's ``AbstractFixtures``).

Tests are parametrized by the harness's layouts; one world runs every layout's scenarios once
per test class (cached for the session, so several mixins combined in one class share it) and
each test asserts on the cached results. A capability-gated test is skipped with the reason the
adapter declared (:func:`require`), while :mod:`failslow.conformance.capabilities` checks that
asking for that capability fails loudly.
"""

from __future__ import annotations

from typing import Any

import pytest

from failslow.conformance.harness import AdapterHarness
from failslow.conformance.world import LayoutRun, World, run_world

_WORLDS: dict[type[AdapterHarness], World] = {}


class ConformanceFixtures:
    """Base of the test mixins; the concrete test class also derives from an AdapterHarness."""

    _conformance_tests = True
    """Marks test classes, which AdapterHarness.harness_class skips."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "layout" in metafunc.fixturenames:
            layouts = list(self.layouts())  # type: ignore[attr-defined]
            metafunc.parametrize("layout", layouts, scope="class")

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_world(cls, tmp_path_factory: pytest.TempPathFactory) -> World:
        harness = cls.harness_class()  # type: ignore[attr-defined]
        if harness not in _WORLDS:
            tmp = tmp_path_factory.mktemp(f"conformance_{harness.__name__}")
            _WORLDS[harness] = run_world(harness, tmp, timeout_s=harness.world_timeout_s)
        return _WORLDS[harness]

    @pytest.fixture
    def layout_run(self, conformance_world: World, layout: str) -> LayoutRun:
        return conformance_world.layout(layout)


def require(layout_run: LayoutRun, capability: str) -> None:
    """Skip the calling test with the adapter's declared reason unless ``capability`` holds."""
    reason = layout_run.capabilities[capability]
    if reason:
        pytest.skip(f"{capability} unsupported in layout {layout_run.layout!r}: {reason}")


def describe(items: Any) -> str:
    return "\n".join(f"    {item}" for item in items) or "    (none)"
