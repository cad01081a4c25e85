"""Diagnosis records and fail-stop sizing (DESIGN.md: diagnosis/)."""

from __future__ import annotations

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.diagnosis.standby import standby_count, window_failure_probability

__all__ = [
    "Diagnosis",
    "Kind",
    "SlowLink",
    "SlowRank",
    "standby_count",
    "window_failure_probability",
]
