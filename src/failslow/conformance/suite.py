"""Every invariant of the conformance suite in one mixin (DESIGN.md, "Invariants the
conformance suite checks for every adapter": 1-6, plus declared capabilities).

An adapter opts in with one class::

    class TestDeepSpeedConformance(AbstractAdapterTests, DeepSpeedHarness):
        pass

Capability-gated checks (micro-batch plans, topology swaps, snapshots) skip with the reason the
adapter declared (:func:`failslow.conformance.fixtures.require`).
"""

from __future__ import annotations

from failslow.conformance.capabilities import AbstractCapabilityTests
from failslow.conformance.capture import AbstractCaptureTests
from failslow.conformance.microbatch import AbstractMicroBatchPlanTests
from failslow.conformance.pause import AbstractPauseResumeTests
from failslow.conformance.snapshot import AbstractSnapshotTests
from failslow.conformance.topology import AbstractTopologySwapTests


class AbstractAdapterTests(
    AbstractCaptureTests,
    AbstractMicroBatchPlanTests,
    AbstractPauseResumeTests,
    AbstractTopologySwapTests,
    AbstractSnapshotTests,
    AbstractCapabilityTests,
):
    """Invariants 1-6 and the capability checks, on one world per test class."""
