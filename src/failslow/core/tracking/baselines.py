"""Baseline detectors of greyhound section 7.2, for comparison with BOCD+V.

- :class:`BOCDDetector` - classical BOCD without verification: a change point is reported as
  soon as the posterior puts more than ``confidence`` (0.9) on a run that started within the
  last few iterations (``P(r_t <= 2) > 0.9``), as onset or relief by the sign of the change.
- :class:`SlidingWindowDetector` - "reports a fail-slow if there's a >10% performance change in
  the sliding window from the current median": the median of the last ``window`` iterations is
  compared with the median of the ``history`` iterations before them.

Both share :class:`~failslow.core.tracking.detector.Detector`'s interface, events and
bad-input errors.
"""

from __future__ import annotations

import math

import numpy as np

from failslow.core.arrays import median
from failslow.core.tracking.bocd import RunLengthPosterior
from failslow.core.tracking.detector import ChangeEvent, Detector, LogHistory


def _event(kind: str, c: int, t: int, before: float, after: float) -> ChangeEvent:
    return ChangeEvent(
        type=kind,  # type: ignore[arg-type]
        iteration=c,
        before_s=math.exp(before),
        after_s=math.exp(after),
        change=math.exp(after - before) - 1.0,
        detected_at=t,
    )


class BOCDDetector(Detector):
    """BOCD change points reported straight away (no verification)."""

    name = "BOCD"

    def __init__(
        self,
        *,
        confidence: float = 0.9,
        recent: int = 3,
        ref_window: int = 64,
        hazard: float = 1.0 / 250.0,
        max_run: int = 256,
        prior_scale: float = 0.1,
    ) -> None:
        self.confidence, self.recent, self.ref_window = confidence, recent, ref_window
        self.bocd = RunLengthPosterior(hazard=hazard, max_run=max_run, prior_scale=prior_scale)
        self.history = LogHistory(max(2 * ref_window, 64))
        self._slow = False
        self._seg_start = 0
        self._armed = True
        self._level: float | None = None

    def update(self, x_seconds: float, calls: int | None = None) -> list[ChangeEvent]:
        y, t = self._observe(x_seconds)
        probs = self.bocd.update(y, self._level)
        seg = self.history.window(max(self._seg_start, t - self.ref_window), t + 1)
        self._level = median(seg)
        recent_mass = float(probs[1 : self.recent + 1].sum())
        if recent_mass < 0.5:
            self._armed = True
        if t == 0 or not self._armed or recent_mass <= self.confidence:
            return []
        self._armed = False
        j = 1 + int(np.argmax(probs[1 : self.recent + 1]))
        c = t - j + 1
        pre = self.history.window(max(self._seg_start, c - self.ref_window), c)
        if pre.size == 0:
            return []
        before = median(pre)
        after = median(self.history.window(c, t + 1))
        kind = "onset" if after > before else "relief"
        if kind == "relief" and not self._slow:
            self._seg_start = c
            return []
        self._slow = kind == "onset"
        self._seg_start = c
        return [_event(kind, c, t, before, after)]


class SlidingWindowDetector(Detector):
    """>10% change of the recent-window median versus the median before it."""

    name = "SlidingWindow"

    def __init__(self, *, threshold: float = 0.10, window: int = 10, history: int = 50) -> None:
        if window < 1 or history < 1:
            raise ValueError(f"window and history must be >= 1, got {window}, {history}")
        self.log_threshold = math.log1p(threshold)
        self.window, self.history_len = window, history
        self.history = LogHistory(window + history + 8)
        self._slow = False
        self._baseline = 0.0
        self._quiet_until = 0

    def update(self, x_seconds: float, calls: int | None = None) -> list[ChangeEvent]:
        _, t = self._observe(x_seconds)
        c = t + 1 - self.window
        if c - self.history_len < 0 or t < self._quiet_until:
            return []
        current = median(self.history.window(c, t + 1))
        ref = median(self.history.window(c - self.history_len, c))
        if current - ref >= self.log_threshold:
            if not self._slow:
                self._baseline = ref
            self._slow = True
            self._quiet_until = t + self.window
            return [_event("onset", c, t, ref, current)]
        if self._slow and current - self._baseline <= self.log_threshold:
            self._slow = False
            self._quiet_until = t + self.window
            return [_event("relief", c, t, ref, current)]
        return []
