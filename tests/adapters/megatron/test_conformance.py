"""Megatron-core passes the conformance suite (:mod:`failslow.conformance`; DESIGN.md
invariants 1-6 plus declared capabilities) on TP1/PP2/DP2 and TP2/PP1/DP2, with
and without the distributed optimizer, in one spawned 4-rank gloo world
(``_conformance_harness.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "megatron.core", reason="needs the Megatron extra: pip install failslow[megatron]"
)

from failslow.conformance import AbstractAdapterTests

from ._conformance_harness import MegatronHarness

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]


class TestMegatronConformance(AbstractAdapterTests, MegatronHarness):
    pass
