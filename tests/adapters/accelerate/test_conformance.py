"""Accelerate passes the conformance suite (:mod:`failslow.conformance`; DESIGN.md invariants
1-6 plus declared capabilities) in its own ``accumulate`` loop, registered with one
``failslow.accelerate.attach(accelerator)``: DDP and Accelerate's FSDP2 plugin, with and without
the unshard-once opt-in, in one spawned 4-rank gloo world (``_conformance_harness.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "accelerate", reason="needs the Accelerate extra: pip install failslow[accelerate]"
)

from failslow.conformance import AbstractAdapterTests

from ._conformance_harness import AccelerateHarness

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.untimed,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]


class TestAccelerateConformance(AbstractAdapterTests, AccelerateHarness):
    pass
