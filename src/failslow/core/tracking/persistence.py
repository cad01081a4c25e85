"""Actionable onsets: a verified slowdown is reported once it has outlasted the job's transients.

Issue 47 (detection v3; greyhound 4.2 R2, 5.1). Verification (:mod:`.detector`) proves that a
slowdown of at least the threshold began at a change point; it says nothing about whether the
slowdown will last. Real jobs have healthy episodes that pass it - a noisy neighbour for a few
iterations, the tail of an asynchronous checkpoint, a data-loader stall with its catch-up - and
each reported onset starts a profiling round and can pause the job for validation (about a
second in the CPU jobs seen, greyhound 4.3's "brief pause"). An episode that is over before
anything can be localized and acted on cannot repay that pause. So a verified onset is held
*pending* until the episode has persisted:

- for ``need`` points after its change point, where ``need`` is the largest of
  ``min_points``, the iterations that the cost of acting takes (``act_cost_s`` over the healthy
  step time: on a 0.2 s job a 1 s pause is 5 iterations) and the length of the longest of the
  job's recent short episodes plus two (learned per job, from its transients and from
  reported episodes that were over within twice ``max_points``: a job whose excursions last 9
  iterations waits 11), capped at ``max_points`` so that a real fail-slow is still reported
  promptly;
- and it is still under way: the median of the newer half of its points is above the
  threshold line and at least a third of the way from the level before to the episode's
  level (a 2x burst followed by a few points 10-20% slow on a busy machine is over), and the
  median of its newest three points is above the line.

A pending onset whose relief comes first is a :class:`Transient`: recorded (``analyze --json``,
the report), never reported as an onset, never the start of a validation pause. The reported
onset keeps the change point as its ``iteration``; its ``detected_at`` is the iteration that
confirmed it, so the reaction time stays visible. Events come out in live order: no relief
without the onset it ends, and a compound onset inside a pending episode comes out after it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transient:
    """A verified slowdown that was over before it persisted: not a fail-slow."""

    start: int  # the job's iteration of its change point
    end: int  # the first iteration of the relief's regime
    detected_at: int  # the iteration whose update saw it end
    before_s: float  # the level before it
    after_s: float  # its level

    @property
    def length(self) -> int:
        return max(0, self.end - self.start)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "start": self.start,
            "end": self.end,
            "detected_at": self.detected_at,
            "before_s": self.before_s,
            "after_s": self.after_s,
        }


class Persistence:
    """How long a verified slowdown must persist before it is reported (module docstring)."""

    def __init__(
        self,
        *,
        min_points: int = 10,
        max_points: int = 14,
        act_cost_s: float = 1.0,
        memory: int = 8,
        keep: int = 1000,
    ) -> None:
        if not 1 <= min_points <= max_points:
            raise ValueError(f"need 1 <= min_points <= max_points, got {min_points}, {max_points}")
        if act_cost_s < 0 or memory < 1:
            raise ValueError("act_cost_s must be >= 0 and memory >= 1")
        self.min_points, self.max_points, self.act_cost_s = min_points, max_points, act_cost_s
        self._recent: deque[int] = deque(maxlen=memory)  # lengths of the newest transients
        self.transients: deque[Transient] = deque(maxlen=keep)
        self.count = 0  # transients ever seen (``transients`` keeps the newest ``keep``)

    def need(self, step_s: float | None) -> int:
        """Points an episode must last, on a job whose healthy step takes ``step_s``."""
        cost = math.ceil(self.act_cost_s / step_s) if step_s and step_s > 0 else 0
        learned = max(self._recent) + 2 if self._recent else 0
        return min(self.max_points, max(self.min_points, cost, learned))

    def transient(self, item: Transient) -> None:
        """Record an episode that ended before it persisted; it lengthens ``need``."""
        self.transients.append(item)
        self.count += 1
        self.learn(item.length)

    def learn(self, length: int) -> None:
        """A healthy excursion of ``length`` iterations: a transient, or a reported episode
        that ended within twice ``max_points`` (it outlasted the wait, not the job's life)."""
        self._recent.append(length)
