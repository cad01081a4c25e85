"""Every invariant of the conformance suite in one mixin (DESIGN.md, "Invariants the
conformance suite checks for every adapter": 1, 2, 4, 5 and 6 so far, plus declared
capabilities).

An adapter opts in with one class::

    class TestDeepSpeedConformance(AbstractAdapterTests, DeepSpeedHarness):
        pass

Invariant 3 (topology swap) joins as a further mixin here, capability-gated with
:func:`failslow.conformance.fixtures.require`.
"""

from __future__ import annotations

from failslow.conformance.capabilities import AbstractCapabilityTests
from failslow.conformance.capture import AbstractCaptureTests
from failslow.conformance.microbatch import AbstractMicroBatchPlanTests
from failslow.conformance.pause import AbstractPauseResumeTests
from failslow.conformance.snapshot import AbstractSnapshotTests


class AbstractAdapterTests(
    AbstractCaptureTests,
    AbstractMicroBatchPlanTests,
    AbstractPauseResumeTests,
    AbstractSnapshotTests,
    AbstractCapabilityTests,
):
    """Invariants 1, 2, 4, 5, 6 and the capability checks, on one world per test class."""
