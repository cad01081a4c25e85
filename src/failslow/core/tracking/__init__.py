"""Tracking: iteration times from collective calls, and fail-slow detection on them.

greyhound section 4.2: ACF period -> iteration times (:mod:`.acf`, :mod:`.iteration`), BOCD
(:mod:`.bocd`) plus verification (:mod:`.detector`), and the section 7.2 baselines
(:mod:`.baselines`).
"""

from __future__ import annotations

from failslow.core.tracking.acf import Pattern, acf, dominant_pattern, find_period
from failslow.core.tracking.baselines import BOCDDetector, SlidingWindowDetector
from failslow.core.tracking.bocd import RunLengthPosterior
from failslow.core.tracking.detector import ChangeEvent, Detector, FailSlowDetector, detect
from failslow.core.tracking.iteration import (
    IterationTimes,
    IterationTracker,
    TokenCoder,
    iteration_times,
)

__all__ = [
    "BOCDDetector",
    "ChangeEvent",
    "Detector",
    "FailSlowDetector",
    "IterationTimes",
    "IterationTracker",
    "Pattern",
    "RunLengthPosterior",
    "SlidingWindowDetector",
    "TokenCoder",
    "acf",
    "detect",
    "dominant_pattern",
    "find_period",
    "iteration_times",
]
