"""DeepSpeed passes the conformance suite (:mod:`failslow.conformance`; DESIGN.md invariants
1, 2 and 6 plus declared capabilities) in layouts ZeRO 0/1/2/3 (DP 4) and the pipeline engine
(2 stages x DP 2, ZeRO 0 and 1) and ZeRO 1 in the user's own forward/backward/step loop (with
a plain and a prefetching loader), all in one spawned 4-rank gloo world
(``_conformance_harness.py``; ~60 s, most of it imports)."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from failslow.conformance import AbstractAdapterTests

from ._conformance_harness import DeepSpeedHarness

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


class TestDeepSpeedConformance(AbstractAdapterTests, DeepSpeedHarness):
    pass
