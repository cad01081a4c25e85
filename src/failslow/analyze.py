"""Offline analysis of a trace: iteration times (greyhound 4.2 ACF) and fail-slow events (BOCD+V).

Used by ``failslow analyze``. For collective-event logs each rank's iteration times are derived
from its own call sequence; because training synchronizes every step, the job's iteration time is
the per-iteration median over ranks (aligned at the most recent iteration), which keeps one
rank's measurement noise out of the job series.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from failslow.core.tracking import ChangeEvent, FailSlowDetector, detect, iteration_times
from failslow.core.tracking.persistence import Transient
from failslow.traceio import Trace


@dataclass
class Analysis:
    path: str
    iteration_times: np.ndarray
    period_calls: int | None
    events: list[ChangeEvent] = field(default_factory=list)
    ranks: int = 0
    left_out: int = 0  # iterations the detector left out: the job's periodic slow steps ...
    special_steps: int = 0  # ... of which steps that made other calls (eval, checkpoint, log)
    transients: list[Transient] = field(default_factory=list)
    """Verified slowdowns over before they persisted: not fail-slows (issue 47)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "iterations": len(self.iteration_times),
            "period_calls": self.period_calls,
            "left_out": self.left_out,
            "special_steps": self.special_steps,
            "events": [
                {
                    "type": e.type,
                    "iteration": int(e.iteration),
                    "before_s": round(float(e.before_s), 6),
                    "after_s": round(float(e.after_s), 6),
                    "change": round(float(e.change), 6),
                    "reported_at": int(e.detected_at),
                }
                for e in self.events
            ],
            "transients": [
                {k: round(v, 6) if isinstance(v, float) else v for k, v in t.as_dict().items()}
                for t in self.transients
            ],
        }


def job_steps(trace: Trace) -> tuple[np.ndarray, int | None, np.ndarray | None]:
    """The job's iteration times in seconds, the call period of the lowest rank (if any), and
    the collective calls of each iteration on the lowest rank that completed any (None for a
    trace of iteration times): an eval, checkpoint or logging step makes other calls than the
    usual step (:mod:`failslow.core.tracking.special`)."""
    if trace.iteration_times is not None:
        return trace.iteration_times, None, None
    per_rank = []
    calls: np.ndarray | None = None
    period: int | None = None
    for rank in sorted(trace.records_by_rank):
        result = iteration_times(trace.records_by_rank[rank])
        if period is None:
            period = result.period_calls
        if len(result.seconds):
            per_rank.append(np.asarray(result.seconds, dtype=np.float64))
            if calls is None:
                calls = result.calls
    if not per_rank:
        return np.empty(0), period, None
    n = min(len(s) for s in per_rank)
    stacked = np.stack([s[len(s) - n :] for s in per_rank])
    return np.median(stacked, axis=0), period, None if calls is None else calls[len(calls) - n :]


def analyze_trace(trace: Trace) -> Analysis:
    times, period, calls = job_steps(trace)
    detector = FailSlowDetector()
    events = detect(times, detector, calls) if len(times) else []
    return Analysis(
        path=trace.path,
        iteration_times=times,
        period_calls=period,
        events=events,
        ranks=len(trace.records_by_rank),
        left_out=detector.skipped,
        special_steps=detector.special_skipped,
        transients=detector.transients,
    )
