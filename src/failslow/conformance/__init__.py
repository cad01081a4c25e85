"""The conformance suite every adapter must pass, shipped in the package (DESIGN.md,
"Invariants the conformance suite checks for every adapter"; fsspec's abstract tests and
SQLAlchemy's requirements are the model).

- :class:`AdapterHarness` / :class:`AdapterJob` / :class:`Collective`: what an adapter provides
  (:mod:`failslow.conformance.harness`).
- ``Abstract*Tests``: the test mixins (import pytest; loaded on first access):
  :class:`AbstractCaptureTests` (invariant 1), :class:`AbstractMicroBatchPlanTests` (2),
  :class:`AbstractTopologySwapTests` (3), :class:`AbstractSnapshotTests` (4, 5),
  :class:`AbstractPauseResumeTests` (6), :class:`AbstractCapabilityTests` (declared
  capabilities fail loudly), and :class:`AbstractAdapterTests` combining them.
- :mod:`failslow.conformance.world` spawns the world, :mod:`failslow.conformance.worker` is one
  rank of it, :mod:`failslow.conformance.scenarios` what each rank runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from failslow.conformance.harness import AdapterHarness, AdapterJob, Collective

_MIXINS = {
    "AbstractAdapterTests": "failslow.conformance.suite",
    "AbstractCaptureTests": "failslow.conformance.capture",
    "AbstractMicroBatchPlanTests": "failslow.conformance.microbatch",
    "AbstractPauseResumeTests": "failslow.conformance.pause",
    "AbstractCapabilityTests": "failslow.conformance.capabilities",
    "AbstractSnapshotTests": "failslow.conformance.snapshot",
    "AbstractTopologySwapTests": "failslow.conformance.topology",
}

__all__ = ["AdapterHarness", "AdapterJob", "Collective", *_MIXINS]


def __getattr__(name: str) -> Any:
    if name in _MIXINS:
        return getattr(importlib.import_module(_MIXINS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
