"""Real-time checks on the training metrics a job already logs (byterobust 4.1).

byterobust's monitor gathers "workload-specific training metrics, including loss, gradient
norm" and treats "significant changes in them as the faulty signals, e.g., 5x increase in
loss/gradient norms, NaN values". :class:`MetricCheck` is that rule, per rank and pure:

- a loss or gradient norm (:func:`watched`: a name ending in ``loss``, or naming a gradient
  norm) that is NaN or infinite is an incident at once;
- a finite one at least ``jump`` times its robust recent level - the median of the last
  ``window`` finite values of the same metric, once ``warmup`` of them were seen, and only when
  that level is positive - is an incident too (a loss that falls, however fast, never is).

Other metrics (learning rate, throughput, loss scale) are not checked: they move by design.
Per call the work is O(window) for each watched metric, whatever the job's size.
"""

from __future__ import annotations

import collections
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NAN, INF, JUMP = "nan", "inf", "jump"


@dataclass(kw_only=True, slots=True)
class ChecksConfig:
    """The ``checks`` section of :class:`failslow.config.FailslowConfig`: the metric rule that
    ``failslow.report_metrics`` applies on every rank."""

    jump: float = 5.0
    """An incident when a loss or gradient norm reaches this many times its recent level
    (byterobust's 5x); 0: only NaN and Inf are incidents."""
    window: int = 32
    """The recent level is the median of this many last values of the metric."""
    warmup: int = 8
    """Values of a metric seen (since the process started) before a jump can count."""


_GRAD_NORM = re.compile(r"grad[\s_\-]?norm", re.IGNORECASE)


def watched(name: str) -> bool:
    """Whether metric ``name`` is a loss or a gradient norm (``loss``, ``train/loss``,
    ``lm loss``, ``grad_norm``, ``grad-norm``; not ``loss_scale``)."""
    return name.strip().lower().endswith("loss") or bool(_GRAD_NORM.search(name))


@dataclass(frozen=True, slots=True)
class MetricIncident:
    """A watched metric that is NaN, infinite, or jumped against its recent level."""

    step: int
    metric: str
    value: float
    kind: str
    """:data:`NAN`, :data:`INF` or :data:`JUMP`."""
    level: float | None = None
    """The robust recent level a jump was measured against (None for NaN/Inf)."""

    def describe(self) -> str:
        if self.kind == JUMP:
            return (
                f"{self.metric} {self.value:.4g} at step {self.step} is "
                f"{self.value / (self.level or 1.0):.1f}x its recent level {self.level:.4g}"
            )
        return f"{self.metric} is {self.value} at step {self.step}"

    def to_dict(self) -> dict[str, object]:
        value: object = self.value if math.isfinite(self.value) else str(self.value)
        return {"step": self.step, "metric": self.metric, "value": value, "kind": self.kind,
                "level": self.level, "why": self.describe()}  # fmt: skip


def judge(value: float, level: float | None, jump: float) -> str | None:
    """The 4.1 rule for one value: :data:`NAN`, :data:`INF`, :data:`JUMP` (at least ``jump``
    times a positive ``level``; ``jump`` 0 or ``level`` None: never), else None."""
    if math.isnan(value):
        return NAN
    if math.isinf(value):
        return INF
    if jump and level is not None and level > 0 and value >= jump * level:
        return JUMP
    return None


class MetricCheck:
    """The 4.1 rule over one rank's stream of metrics (see the module doc)."""

    def __init__(self, *, jump: float = 5.0, window: int = 32, warmup: int = 8) -> None:
        if jump and jump <= 1.0:
            raise ValueError(f"jump={jump}: a jump factor must be > 1 (0 turns the check off)")
        if window < 1 or not 1 <= warmup <= window:
            raise ValueError(f"window={window}, warmup={warmup}: need 1 <= warmup <= window")
        self.jump = jump
        self.window = window
        self.warmup = warmup
        self._recent: dict[str, collections.deque[float]] = {}

    def history(self) -> dict[str, list[float]]:
        """The recent values of every watched metric (kept in the rank's snapshots: a
        restarted rank checks against the level the job had, not from scratch)."""
        return {name: list(values) for name, values in self._recent.items()}

    def load(self, history: Mapping[str, Sequence[float]]) -> None:
        """Take up :meth:`history` as it was (the values of a resumed snapshot)."""
        self._recent = {
            str(name): collections.deque((float(v) for v in values), maxlen=self.window)
            for name, values in history.items()
        }

    def observe(self, step: int, metrics: Mapping[str, float]) -> MetricIncident | None:
        """Check one step's metrics (any of them; unwatched names are ignored); the first
        incident found, else None. Values of an incident do not enter the level."""
        for name, raw in metrics.items():
            if not watched(name):
                continue
            value = float(raw)
            recent = self._recent.setdefault(name, collections.deque(maxlen=self.window))
            warm = math.isfinite(value) and self.jump and len(recent) >= self.warmup
            level = statistics.median(recent) if warm else None
            kind = judge(value, level, self.jump)
            if kind is not None:
                return MetricIncident(step, name, value, kind, level if kind == JUMP else None)
            recent.append(value)
        return None
