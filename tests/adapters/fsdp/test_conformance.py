"""FSDP2, HSDP and DDP pass the conformance suite (:mod:`failslow.conformance`; DESIGN.md
invariants 1-6 plus declared capabilities) in one spawned 4-rank gloo world: DDP 4, FSDP2 over
4 ranks with and without the unshard-once opt-in, HSDP 2 x 2 (``_conformance_harness.py``)."""

from __future__ import annotations

import pytest

from failslow.conformance import AbstractAdapterTests

from ._conformance_harness import FSDPHarness

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


class TestFSDPConformance(AbstractAdapterTests, FSDPHarness):
    pass
