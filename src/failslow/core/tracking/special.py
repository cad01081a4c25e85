"""Special steps: iterations whose collective calls are not the job's usual step's.

An evaluation step runs forward passes with no gradient reduction; a checkpoint step adds the
barriers and gathers of a save; a logging step all-reduces a loss or a norm. They are slower
than the rest, and on iteration times alone the *first* of them is four slow points in a row
that no rhythm explains yet (:mod:`.rhythm`, the remaining false alarms of the life corpus,
benchmarks/README.md "Detection accuracy"). greyhound 4.2 derives iteration times from the
collective-call sequence; the same sequence says which iterations made other calls than the
usual step. A fail-slow never does: it slows the same calls (greyhound 3: computation and
communication slowdowns), so leaving such iterations out of the series costs the detector
nothing it needs.

:class:`SpecialSteps` judges each iteration by its call count (the tracker's calls between step
markers, or between anchor calls; :meth:`.IterationTracker.feed_steps`), not by its tokens:
a count is robust to calls whose sizes vary from step to step.

- The *usual* count is the first one seen, or a count that ran ``adopt`` (4) iterations in a
  row: a periodic step lasts at most three, while a topology change, a new micro-batch
  assignment (S2 moves pipeline micro-batches, and their send/recv calls with them) or a
  resumed job with another schedule makes every later step differ. When a count is adopted,
  its run's held iterations are given back (:class:`Verdict`), so the detector is late by
  nothing but the wait.
- An iteration with another count is held until the usual count comes back; then it is left
  out (the caller counts it as skipped). The detector feeds a one-iteration special step after
  all when the slowdown outlasts it: onsets often begin in a logging step.
- A job whose count varies from step to step (data-dependent calls) carries no signal: while
  more than ``max_share`` (1/4) of the last ``window`` (64) iterations had another count than
  the usual one, every iteration is regular (and the newest count is the usual one).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class Verdict(NamedTuple):
    """What to do with an iteration, and with the iterations held before it."""

    drop: int  # held iterations to leave out for good (their run of another count ended)
    release: bool  # give the held iterations back, in order, before this one
    hold: bool  # hold this iteration (another count than the usual step's)


@dataclass(slots=True)
class SpecialSteps:
    """Online judge of call counts; :meth:`judge` once per iteration, in order."""

    adopt: int = 4
    window: int = 64
    max_share: float = 0.25
    usual: int | None = None
    held: int = 0  # iterations held now: one run of one other count
    _run_count: int | None = None
    _recent: deque[bool] = field(default_factory=deque)  # other count, last ``window`` judged
    _mismatches: int = 0

    def __post_init__(self) -> None:
        if self.adopt < 1 or self.window < 1 or not 0.0 < self.max_share < 1.0:
            raise ValueError("need adopt >= 1, window >= 1 and 0 < max_share < 1")

    def judge(self, calls: int | None) -> Verdict:
        """Judge the next iteration by its call count (None: not known, so regular)."""
        if calls is None:
            return self._regular(release=True)
        self._note(self.usual is not None and calls != self.usual)
        if self.usual is None or self._noisy():
            self.usual = calls  # no signal: every iteration is regular
            return self._regular(release=True)
        if calls == self.usual:
            return self._regular(release=False)
        drop = 0
        if calls != self._run_count:  # a run of another count ended: it stays out
            drop, self.held, self._run_count = self.held, 0, calls
        self.held += 1
        if self.held < self.adopt:
            return Verdict(drop, False, True)
        self.usual = calls  # a new usual step: its run is given back
        return self._regular(release=True, also=drop)

    def _regular(self, *, release: bool, also: int = 0) -> Verdict:
        """This iteration is regular; the held ones are given back or left out."""
        held, self.held, self._run_count = self.held, 0, None
        if release:
            return Verdict(also, held > 0, False)
        return Verdict(also + held, False, False)

    def _note(self, mismatch: bool) -> None:
        self._recent.append(mismatch)
        self._mismatches += mismatch
        if len(self._recent) > self.window:
            self._mismatches -= self._recent.popleft()

    def _noisy(self) -> bool:
        """More than ``max_share`` of the recent iterations had another count than the usual
        step (at least half a window seen): the count carries no signal in this job."""
        return len(self._recent) >= self.window // 2 and (
            self._mismatches > self.max_share * len(self._recent)
        )
