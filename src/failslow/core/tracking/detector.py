"""Fail-slow detection on iteration times: BOCD plus verification (greyhound 4.2, "BOCD+V").

BOCD (:mod:`.bocd`) proposes change points on log iteration time: when it puts at least
``confidence`` (0.9, as in the paper) of its run-length posterior on runs that began since the
last accepted change, the start of every such run holding >= 5% of the posterior is a
candidate. BOCD's posterior can trail a clean step by several iterations while its mass is
still spread over runs that began in the noise before it, so the start of a trailing run of
points above the current level by the threshold (and the next two points, for a slowdown that
ramps up) is a candidate too, even while BOCD is not confident of any run in the current
regime (right after a compound onset its mass still sits on runs from before it). A candidate
becomes a report only after *verification*: the iteration time after the change must differ
from the time before it by at least 10% (the paper's rule). Verification uses robust
statistics, so that the normal life of a training job - GC pauses and bursts, allocator
misses, uneven sequence lengths, its periodic eval, checkpoint and logging steps of 1-3
iterations, sub-10% level shifts - cannot pass it:

- "before" is the median of up to ``ref_window`` iterations before the candidate, within the
  current regime; nothing is reported in the first ``warmup`` (32) iterations;
- with ``n >= min_post`` (4) points after the candidate, the median after must clear the 10%
  line by ``margin_z`` (1.5) standard errors of a median of ``n`` points, with the noise scale
  measured robustly (successive differences, over at least half of ``ref_window``, so that
  a young regime's GC spikes are not taken for its noise): a 7% shift seen through 4% noise
  does not pass, and the margin shrinks as points accumulate;
- until ``settle`` (12) points, the slowdown must also have outlasted a periodic step and look
  like one new level: the newest point is beyond the line, no point is back near the old
  level (within half the threshold), at most one in six points (none before 7) is under the
  line, and the points - less one spike in four - lie within six noise scales of each other
  (the upper two thirds within four). Four points are needed because an eval or checkpoint
  step lasts up to three; a burst of GC spikes every other iteration fails "no point back";
  a slowdown of :data:`FIRST_STEP` (2x) or more needs five while no slow step of its size is
  remembered (:meth:`.Rhythm.outlast` sets the count once one is): the job's first eval or
  checkpoint step (1.3-4x) with a GC spike beside it is four slow points in a row, while
  fail-slows are mostly far smaller (greyhound Table 1: 12-35% longer jobs on average);
- from ``settle`` points on, the median decides (a noisy, congested new level is still
  reported), provided at most one point in ten is back near the old level and the newer half
  of the points still clears the line; an onset is verified within ``ref_window`` (64)
  points of its candidate or not at all (a level that crept past the line over more points
  than the "before" window holds is drift: a healthy job's 7% shift plus drift did);
- a relief needs the *upper tercile* after the candidate back within 10% of the baseline.
The reported "after" is the median of the points after the change.

Special steps (:mod:`.special`): where the tracker gives each iteration's collective-call count,
an iteration whose count is not the usual step's (an eval, checkpoint or logging step making
calls of its own) is left out of the series before anything else sees it - its first
occurrence included, which the rhythm cannot know yet.

The job's rhythm (:mod:`.rhythm`): once a slow step has recurred four times with one period,
its later occurrences are left out of the series altogether - no BOCD update, no place in any
window - so a fail-slow that begins beside an eval step is judged on its own iterations. Slow
points in a predicted slot are held until their run ends. A run that outlasts a one-iteration
slot (a logging step every 10-50 iterations: many onsets begin in one) was a slowdown that
began there, and its held points are fed after all (the report is not delayed: the detector
catches up in one update); the points of a multi-iteration slot (eval, checkpoint) stay the
rhythm's, so a GC spike right after an eval step is judged alone. A well-confirmed step's
own iterations are left out even inside a run that began before its slot (:mod:`.rhythm`).
Events keep the job's iteration indices.

State: a healthy baseline ``B`` (frozen at an onset). An *onset* is a verified >= 10% slowdown
versus the level before it (``B`` when healthy, the current slow level during a fail-slow, so a
further >= 10% step is reported as a compound onset). A *relief* is reported once iteration
time is back within 10% of ``B`` (or half the slowdown is gone: ``B`` drifts on a shared
machine), and ``B`` becomes the level after it; a partial recovery only moves the current slow
level.

Slow drift never produces a BOCD run that clears verification, and sub-10% level shifts are
rejected by it; both are absorbed by the rolling "before" window.

Detection v3 (issue 47): what is reported is what is worth acting on.

- Fail-slows that are not one new level: a slowdown whose median over the newest ``sustain``
  (20) points clears the line, newer half too, is an onset even when the one-level rules turn
  it down (flapping congestion: slow a few iterations, then not, slow on average); a climb
  over three windows of 20 points from the window before them is one too (a ramp:
  :meth:`FailSlowDetector._ramp`, judged on the climb's level now). A ramp fast enough for the
  one-level rules is verified as a step once enough of it clears the line; its change point
  is moved back to where its 5-point median crossed, if the points before it climb
  (:meth:`FailSlowDetector._crossed`).
- Actionable onsets (:mod:`.persistence`): a verified onset is held until the slowdown has
  persisted past the job's own transients (10-14 points, learned per job); shorter episodes are
  recorded as transients and never reported. The onset keeps its change point; its
  ``detected_at`` says when it was reported. Events come in live order.
- A restart's re-warm-up (:meth:`FailSlowDetector.restarted`): the node layer says when it
  restarted or hot-updated the rank; the level is learned afresh.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from failslow.core.arrays import median
from failslow.core.tracking.bocd import RunLengthPosterior
from failslow.core.tracking.persistence import Persistence, Transient
from failslow.core.tracking.rhythm import Rhythm
from failslow.core.tracking.special import SpecialSteps

RAMP_RISE = 0.15
"""The least rise, as a share of the threshold, from each window of ``sustain`` points to the
next in a climb (:meth:`FailSlowDetector._ramp`): 0.15 x 10% over 20 iterations is 0.07% per
iteration, more than twice the steepest healthy drift of the corpora (3% per hundred)."""

FIRST_STEP = math.log(2.0)
"""A slowdown at least this large (log) needs one more point than ``min_post`` while no slow
step of its size is remembered (module docstring)."""


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """A reported onset or relief of a fail-slow."""

    type: Literal["onset", "relief"]
    iteration: int  # 0-based index of the first iteration of the new regime
    before_s: float  # typical iteration time before the change
    after_s: float  # typical iteration time after it
    change: float  # after_s / before_s - 1
    detected_at: int = -1  # index of the iteration whose update() reported the event


def check_time(x: float) -> float:
    """Validate one iteration time (seconds) and return it as a float."""
    try:
        value = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"iteration time must be a number of seconds, got {x!r}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"iteration time must be positive and finite, got {x!r}")
    return value


class Detector(abc.ABC):
    """What every detector offers: feed one iteration time, get the events it completes."""

    name: str = "detector"
    _slow: bool = False
    history: LogHistory

    @abc.abstractmethod
    def update(self, x_seconds: float, calls: int | None = None) -> list[ChangeEvent]:
        """Absorb the next iteration time (and its collective-call count, where the detector
        uses it); return events reported at this iteration."""

    @property
    def slow(self) -> bool:
        """True while a reported fail-slow has not been relieved."""
        return self._slow

    @property
    def calm(self) -> bool:
        """Nothing is under way that the next iterations could turn into an event (a reader
        may then look less often). Unless a detector knows better: never."""
        return False

    def _observe(self, x_seconds: float) -> tuple[float, int]:
        """Validate and record one iteration time; returns (log time, its index)."""
        y = math.log(check_time(x_seconds))
        t = self.history.n
        self.history.append(y)
        return y, t


class LogHistory:
    """Bounded history of log iteration times, addressable by absolute index.

    The index counts appended points; each point also keeps the job's iteration index it came
    from (``at``), which differs once a detector leaves iterations out (:mod:`.rhythm`).
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._buf = np.empty(2 * keep)
        self._at = np.empty(2 * keep, dtype=np.int64)
        self._len = 0
        self.n = 0  # points appended

    def append(self, y: float, at: int | None = None) -> None:
        if self._len == self._buf.size:
            self._buf[: self.keep] = self._buf[self._len - self.keep : self._len]
            self._at[: self.keep] = self._at[self._len - self.keep : self._len]
            self._len = self.keep
        self._buf[self._len] = y
        self._at[self._len] = self.n if at is None else at
        self._len += 1
        self.n += 1

    @property
    def last(self) -> float:
        """The newest point (the history must not be empty)."""
        return float(self._buf[self._len - 1])

    def at(self, i: int) -> int:
        """The job's iteration index of point ``i`` (``i`` itself if it is no longer kept)."""
        first = self.n - self._len
        return int(self._at[i - first]) if first <= i < self.n else i

    def window(self, start: int, stop: int) -> np.ndarray:
        """Log times of iterations ``start <= i < stop`` (clipped to what is kept)."""
        first = self.n - self._len
        start, stop = max(start, first, self.n - self.keep), min(stop, self.n)
        if stop <= start:
            return self._buf[:0]
        return self._buf[start - first : stop - first]


class FailSlowDetector(Detector):
    """BOCD + verification (greyhound's BOCD+V), online."""

    name = "BOCD+V"

    def __init__(
        self,
        *,
        threshold: float = 0.10,
        confidence: float = 0.9,
        min_post: int = 4,
        min_ref: int = 10,
        ref_window: int = 64,
        hazard: float = 1.0 / 250.0,
        max_run: int = 256,
        prior_scale: float = 0.1,
        min_spread: float = 0.04,
        settle: int = 12,
        candidate_mass: float = 0.05,
        margin_z: float = 1.5,
        rhythm: bool = True,
        special: bool = True,
        warmup: int = 32,
        persistence: Persistence | bool = True,
        sustain: int = 20,
    ) -> None:
        """``persistence``: hold a verified onset until it has outlasted the job's transients
        (:mod:`.persistence`; ``True``: the default rule, ``False``: report it at once, as
        before issue 47)."""
        if threshold <= 0:
            raise ValueError(f"threshold must be positive, got {threshold!r}")
        if min_post < 1 or min_ref < 1 or ref_window < min_ref:
            raise ValueError("need min_post >= 1, min_ref >= 1 and ref_window >= min_ref")
        self.log_threshold = math.log1p(threshold)
        self.confidence, self.min_post, self.min_ref = confidence, min_post, min_ref
        self.ref_window, self.min_spread, self.settle = ref_window, min_spread, settle
        self.candidate_mass, self.margin_z = candidate_mass, margin_z
        self.bocd = RunLengthPosterior(hazard=hazard, max_run=max_run, prior_scale=prior_scale)
        self.history = LogHistory(max(4 * max_run, 2 * ref_window))
        self._slow = False
        self._seg_start = 0  # first iteration of the current regime
        self._baseline: float | None = None  # log of the healthy level (frozen at an onset)
        self._level: float | None = None  # log of the current level (prior mean for BOCD)
        self._slow_level = 0.0  # log of the level at the first onset of the current fail-slow
        self.warmup = warmup  # no change is reported before this many points (start-up)
        self.rhythm = Rhythm() if rhythm else None
        self.iterations = 0  # iterations fed (the history holds those not skipped)
        self.skipped = 0  # iterations left out: predicted periodic slow steps, special steps
        self.special_skipped = 0  # of those, steps that made other calls than the usual step
        self._held: list[tuple[float, int]] = []  # slow points in a slot, until the run ends
        self._held_step = 0  # duration of the rhythm whose slot holds them
        self.special = SpecialSteps() if special else None
        self._special_held: list[tuple[float, int]] = []  # iterations of another call count
        self._newest = 0.0  # log time of the newest iteration (fed, held or left out)
        if persistence is True:
            persistence = Persistence()
        self.persistence = persistence or None
        self._pending: list[ChangeEvent] = []  # a verified onset that has not persisted yet
        self._episode = 0  # history index of the change point of the current fail-slow
        self._onset_c = 0  # ... of the newest onset (a compound step's, within one)
        self._pending_from = 0  # ... of the pending episode
        self._reported = False  # an onset was reported and its relief was not
        self._reported_from = (0, 1.0)  # the reported fail-slow's change point and level before
        self._blind_until = warmup  # no change is looked for before this history index
        self.sustain = sustain  # window of the rule for slowdowns that are not one level (0: off)
        self._relieved_at: int | None = None  # history index where the newest relief was entered

    @property
    def slow(self) -> bool:
        """True while a *reported* fail-slow has not been relieved (a pending onset is not
        reported yet: :mod:`.persistence`)."""
        return self._reported if self.persistence is not None else self._slow

    @property
    def transients(self) -> list[Transient]:
        """Verified slowdowns that ended before they persisted (the newest 1,000)."""
        return [] if self.persistence is None else list(self.persistence.transients)

    def restarted(self) -> None:
        """The node layer restarted or hot-updated this rank (issue 47): the iterations after
        a restart run a re-warm-up (compilation, cold caches, allocator growth) that is the
        job's healthy life, not a fail-slow. Like a job's start, the next ``warmup`` points
        look for no change and the level is learned afresh; an episode pending confirmation
        is dropped, and a reported fail-slow stays reported until its relief shows."""
        self._blind_until = self.history.n + self.warmup
        self._seg_start = self.history.n
        self._level = None
        self._relieved_at = None
        self._held.clear()
        self._pending = []
        if self._slow and not self._reported:
            self._slow = False
        if not self._slow:
            self._baseline = None

    @property
    def baseline_s(self) -> float | None:
        return None if self._baseline is None else math.exp(self._baseline)

    def _ref(self, c: int, min_points: int) -> float | None:
        pre = self.history.window(max(self._seg_start, c - self.ref_window), c)
        return median(pre) if pre.size >= min_points else None

    def update(self, x_seconds: float, calls: int | None = None) -> list[ChangeEvent]:
        """The next iteration's time, and the collective calls it made if known: an iteration
        whose count is not the usual step's (an eval, checkpoint or logging step) is left out
        (:mod:`.special`). Events carry this iteration's index as ``detected_at``; an onset
        comes out once it has persisted (:mod:`.persistence`)."""
        y = math.log(check_time(x_seconds))
        self._newest = y
        it = self.iterations
        self.iterations += 1
        events = self._update(y, it, calls)
        if self.persistence is None:
            return events
        return self._persisted(events, it)

    def _persisted(self, events: list[ChangeEvent], it: int) -> list[ChangeEvent]:
        """Hold a verified onset - a fail-slow's first or a compound step on a reported one -
        until it has persisted; drop it as a transient if the relief comes first, or (a
        compound step) if it is over while the fail-slow under it goes on
        (:mod:`.persistence`)."""
        assert self.persistence is not None
        out: list[ChangeEvent] = []
        for e in events:
            if e.type == "onset" and not self._pending:
                self._pending, self._pending_from = [e], self._onset_c
            elif e.type == "onset":
                self._pending.append(e)
            else:  # relief: the job is back to its healthy level
                if self._pending:  # over before it persisted: a transient
                    self._transient(it)
                if self._reported:
                    start, before = self._reported_from
                    length = self._episode_end(before, self._episode) - start
                    if length < 2 * self.persistence.max_points:  # it taught the job's scale
                        self.persistence.learn(length)
                    self._reported = False
                    out.append(e)
        if self._pending:
            points = self.history.window(self._pending_from, self.history.n)
            n = points.size
            first = self._pending[0]
            before, level = math.log(first.before_s), math.log(first.after_s)
            line = before + self.log_threshold
            still = median(points[n // 2 :]) >= max(line, before + (level - before) / 3)
            need = self.persistence.need(self.baseline_s)
            if n > self.ref_window or (n >= need and still and median(points[-3:]) >= line):
                newest = median(points[-3:])
                for e in self._pending[1:]:  # a compound step held with it, and over since
                    if newest - math.log(e.before_s) < self.log_threshold:
                        self._pending.remove(e)
                        end = self._episode_end(e.before_s, self._pending_from)
                        self.persistence.transient(
                            Transient(e.iteration, end, it, e.before_s, e.after_s)
                        )
                out += [dataclasses.replace(e, detected_at=it) for e in self._pending]
                if not self._reported:
                    self._reported_from = (first.iteration, first.before_s)
                self._pending = []
                self._reported = True
            elif self._reported and n >= 2 * self.persistence.max_points and not still:
                self._transient(it)  # a compound step that is over; the fail-slow goes on
        return out

    def _transient(self, it: int) -> None:
        """The pending episode ended before it persisted: record it (it ends after its last
        point above the line; a settled relief's own change point is the segment's start)."""
        assert self.persistence is not None
        first, self._pending = self._pending[0], []
        end = self._episode_end(first.before_s, self._pending_from)
        self.persistence.transient(
            Transient(first.iteration, end, it, first.before_s, first.after_s)
        )

    def _episode_end(self, before_s: float, start: int) -> int:
        """The job's iteration after the last point above the threshold line over
        ``before_s`` since history index ``start``."""
        line = math.log(before_s) + self.log_threshold
        points = self.history.window(start, self.history.n)
        high = np.flatnonzero(points >= line)
        return self.history.at(start + (int(high[-1]) if high.size else 0)) + 1

    def _update(self, y: float, it: int, calls: int | None) -> list[ChangeEvent]:
        """The verified change points (before :meth:`_persisted`)."""
        events: list[ChangeEvent] = []
        if self.special is not None:
            verdict = self.special.judge(calls)
            if verdict.drop:  # a special step ended: its iterations stay out, unless ...
                ended = self._special_held[: verdict.drop]
                del self._special_held[: verdict.drop]
                if len(ended) == 1 and not verdict.hold and self._high(y):
                    # ... it was one iteration and the slowdown outlasts it (a logging step:
                    # onsets often begin in one, as for the rhythm's one-iteration slots)
                    events += self._point(*ended[0])
                else:
                    self.skipped += len(ended)
                    self.special_skipped += len(ended)
            if verdict.release:  # the usual step changed: they were regular after all
                held, self._special_held = self._special_held, []
                for held_y, held_it in held:
                    events += self._point(held_y, held_it)
            if verdict.hold:
                self._special_held.append((y, it))
                return events
        events += self._point(y, it)
        if not events:  # nearly every iteration
            return events
        return [
            e if e.detected_at == it else dataclasses.replace(e, detected_at=it) for e in events
        ]

    @property
    def calm(self) -> bool:
        """No fail-slow reported and none begun, as far as the newest iteration shows: the
        level is known, nothing is slow, no iteration is held (a rhythm's slot, a special
        step) and the newest one is within the threshold of the level. An onset needs
        ``min_post`` slow points after that, so the node's publisher may poll every other
        iteration while every rank is calm (:meth:`failslow.node.publisher.NodePublisher.
        next_wait`) and see the first slow one at most an iteration later."""
        return not (
            self._slow
            or self._held
            or self._special_held
            or self._level is None
            or self._high(self._newest)
        )

    def _high(self, y: float) -> bool:
        """Is log time ``y`` above the current level by the threshold?"""
        return self._level is not None and y - self._level >= self.log_threshold

    def _point(self, y: float, it: int) -> list[ChangeEvent]:
        """One regular iteration: the rhythm's slots, then BOCD and the verification."""
        events: list[ChangeEvent] = []
        if self.rhythm is not None and self._level is not None:
            excess = y - self._level
            high = excess >= self.log_threshold
            if self.rhythm.observe(it, high, excess):
                self._held.append((y, it))  # the job's own periodic slow step, so far
                self._held_step = self.rhythm.step_length
                return []
            if self._held and high and self._held_step < 2:
                # a slowdown that outlasted a one-iteration slot (a logging step every few
                # iterations: onsets often start in one) - the held points were its own
                # (at most duration + 2 tolerance = 3 held points: fewer than any
                # verification needs, so no event comes out with a held point's index)
                for held_y, held_it in self._held:
                    events += self._feed(held_y, held_it)
            else:
                self.skipped += len(self._held)
            self._held.clear()
        events += self._feed(y, it)
        if events and self.rhythm is not None:
            self.rhythm.reported(slow=self._slow)
        return events

    def _feed(self, y: float, it: int) -> list[ChangeEvent]:
        """One point into BOCD and the verification (``it``: the job's iteration index)."""
        t = self.history.n
        self.history.append(y, it)
        probs = self.bocd.update(y, self._level)
        if self._level is None or t % 8 == 0:
            seg = self.history.window(max(self._seg_start, t - self.ref_window), t + 1)
            level, floor = median(seg), self._floor(t)
            if floor is None or level - floor < self.log_threshold:
                self._level = level
        if t < self._blind_until:
            return self._settled_relief(t) if self._slow else []
        for c in self._candidates(probs, t):
            events = self._verify(c, t)
            if events is not None:
                return events
        if not self._slow and self.sustain:
            events = self._sustained(t) or self._ramp(t)
            if events:
                return events
        if self._slow:
            return self._settled_relief(t)
        return []

    def _recovered(self, level: float) -> bool:
        """Is ``level`` (log) a recovery from the current fail-slow?

        Back within the threshold of the healthy baseline, or - since a shared machine's healthy
        level drifts while a fail-slow lasts - at least half of the slowdown (in log terms) gone.
        A smaller drop is a partial recovery: a new, lower slow level.
        """
        assert self._baseline is not None
        allowed = max(self.log_threshold, 0.5 * (self._slow_level - self._baseline))
        return level - self._baseline <= allowed

    def _settled_relief(self, t: int) -> list[ChangeEvent]:
        """Relief without a fresh change point: the current segment has settled back.

        A recovery can first look like a partial one (a few noisy points just above the line),
        which re-bases the segment at what is in fact the healthy level; no later change point
        then exists to verify. Once the segment holds ``settle`` points whose median is back
        within the threshold of the baseline by half a standard error, that is the relief.
        """
        c = self._seg_start
        n = t - c + 1
        if n < self.settle or self._baseline is None:
            return []
        raw = self.history.window(c, t + 1)
        after = median(raw)
        scale = 1.0489 * median(np.abs(np.diff(raw)))
        margin = 0.5 * self.margin_z * 1.2533 * scale / math.sqrt(n)
        if not self._recovered(after + margin):
            return []
        self._slow = False
        return [self._enter(c, t, "relief", self._slow_level, after)]

    def _floor(self, t: int) -> float | None:
        """The level a relief settled at, while it is recent (within ``ref_window`` points) and
        nothing is slow: the regime after a relief starts at its change point, and where a
        fail-slow goes on past an early relief (flapping congestion after a checkpoint's tail
        ended as a transient) the regime's median climbs to the slow level within a few
        points - the level and the reference of :meth:`_sustained` must not follow it there
        without an onset (a seed-2 call log of a DDP job: the level took the 1.29x flapping
        level 12 points after the relief and nothing was ever reported)."""
        if self._slow or self._baseline is None or self._relieved_at is None:
            return None
        if t - self._relieved_at > self.ref_window:
            return None
        return self._baseline

    def _sustained(self, t: int) -> list[ChangeEvent]:
        """An onset that is not one new level (issue 47): a ramp (thermal throttling) or
        flapping congestion (slow for a few iterations, then not, slow on average), which
        the verification's one-level rules turn down. The median of the newest ``sustain``
        points clears the threshold line over the median before them (within the regime) by
        ``margin_z`` standard errors, and so does their newer half; the change point is the
        first of them above the line. The job's healthy life stays under this: its
        excursions are short (a window median needs half the window slow) and its drift slow
        (a few percent per hundred iterations)."""
        if self._level is None or self.history.last - self._level < self.log_threshold:
            return []  # the newest point is not slow: the usual case, nothing to compute
        w = self.sustain
        start = t + 1 - w
        if start <= self._seg_start:
            return []
        ref = self._ref(start, self.min_ref)
        if ref is None:
            return []
        floor = self._floor(t)
        if floor is not None:
            ref = min(ref, floor)
        raw = self.history.window(start, t + 1)
        after = median(raw)
        margin = self.margin_z * 1.2533 * self._noise(start) / math.sqrt(w)
        if after - ref - self.log_threshold < margin:
            return []
        if median(raw[w // 2 :]) - ref < self.log_threshold:
            return []
        high = np.flatnonzero(raw - ref >= self.log_threshold)
        self._baseline = ref
        return [self._enter(start + int(high[0]), t, "onset", ref, after)]

    def _ramp(self, t: int) -> list[ChangeEvent]:
        """An onset that builds up over tens of iterations (issue 47: thermal throttling):
        measured against the window just before it, a climb never clears the line, since that
        reference climbs with it. Here the reference is the median of the ``sustain`` points
        before the newest three windows of ``sustain`` points; the climb's level now must clear
        the line over it by ``margin_z`` standard errors (the newest window's median is its
        level ``sustain / 2`` points ago: it is carried to the newest point along the line
        through the medians of the first and the newest window, Tukey's resistant line, which
        reports a ramp 6-10 iterations sooner), the newest five points too, and each window
        must be higher than the one before by :data:`RAMP_RISE` of the threshold and by
        ``margin_z`` standard errors of the difference - a climb, not a healthy drift of a
        few percent per hundred iterations, nor a sub-threshold shift on top of one (one
        large rise, not three). The change point is where the climb last crossed the line
        (5-point medians: an earlier crossing is the noise before it, and the regime from
        there would settle back at once - an onset and its relief on consecutive
        iterations).

        Not caught in time: ramps slower than about 0.07% per iteration (benchmarks/README.md,
        "Detection v3")."""
        if self._level is None or self.history.last - self._level < 0.5 * self.log_threshold:
            return []
        w = self.sustain
        first = t + 1 - 4 * w
        if first <= self._seg_start:
            return []
        raw = self.history.window(first, t + 1)
        if raw.size < 4 * w:
            return []
        floor, m1, m2, m3 = (median(raw[k * w : (k + 1) * w]) for k in range(4))
        scale = self.margin_z * 1.2533 * self._noise(first + w)
        # the level now: the newest window's median is the climb's level ``w / 2`` points ago,
        # carried to the newest point along the line through the medians of windows 1 and 3
        # (Tukey's resistant line); its standard error is 1.26 times the median's
        lead = (w - 1) / (4 * w)
        now = m3 + lead * (m3 - m1)
        noise = math.hypot(1 + lead, lead) * scale / math.sqrt(w)
        if (
            now - floor - self.log_threshold < noise
            or median(raw[-5:]) - floor < self.log_threshold
        ):
            return []
        # each rise: a share of the threshold, and clear of the noise (margin_z standard
        # errors of a difference of two medians of w points)
        rise = max(RAMP_RISE * self.log_threshold, scale * math.sqrt(2 / w))
        if m3 - m2 < rise or m2 - m1 < rise or m1 - floor < rise:
            return []
        smooth = np.array([median(raw[max(0, k - 2) : k + 3]) for k in range(raw.size)])
        below = np.flatnonzero(smooth - floor < self.log_threshold)  # the climb's last crossing
        c = first + (int(below[-1]) + 1 if below.size else 0)
        if c > t:
            c = t + 1 - w
        self._baseline = floor
        return [self._enter(c, t, "onset", floor, m3)]

    def _candidates(self, probs: np.ndarray, t: int) -> list[int]:
        """Change points BOCD is confident about, most recent first.

        BOCD must put ``confidence`` of its mass on runs that started within the current regime
        (a change since the last accepted one); every such run start holding at least
        ``candidate_mass`` of the posterior (at most three) is then verified. Looking past the
        single most probable run matters when a GC spike just before a real change started a
        young, wide run that shadows the change. The trailing run of slow points
        (:meth:`_high_run`) is a candidate whether or not BOCD is confident.
        """
        young = min(t - self._seg_start, self.bocd.max_run)  # slots 1..young-1 start later
        if young <= self.min_post:
            return []
        head = probs[self.min_post : young]
        if probs[1:young].sum() < self.confidence or head.size == 0:
            return list(self._high_run(t))
        top = np.flatnonzero(head >= self.candidate_mass)
        if top.size > 3:
            top = top[np.argsort(head[top])[-3:]]
        found = [t + 1 - (self.min_post + int(k)) for k in np.sort(top)]
        return found + [c for c in self._high_run(t) if c not in found]

    def _high_run(self, t: int) -> range:
        """Starts of a trailing run of at least ``min_post`` points above the current level by
        the threshold - its first point, or one of the next two (a slowdown that ramps up
        over a few iterations). BOCD's posterior can trail a clean step by several iterations
        while it still spreads its mass over runs that began in the noise before it."""
        if self._level is None or self.history.last - self._level < self.log_threshold:
            return range(0)  # the newest point is not slow: no trailing run (the usual case)
        tail = self.history.window(max(self._seg_start, t + 1 - self.ref_window), t + 1)
        low = np.flatnonzero(tail - self._level < self.log_threshold)
        start = t + 1 - tail.size + (int(low[-1]) + 1 if low.size else 0)
        if start <= self._seg_start:
            return range(0)
        return range(start, min(start + 3, t + 2 - self.min_post))

    def _verify(self, c: int, t: int) -> list[ChangeEvent] | None:
        """The paper's verification of a change at ``c``, with robust statistics."""
        n = t - c + 1
        raw = self.history.window(c, t + 1)
        post = np.sort(raw)
        upper = post[n - 1 - (n - 1) // 3]
        after = 0.5 * float(post[(n - 1) // 2] + post[n // 2])
        if not self._slow:
            ref = self._ref(c, self.min_ref)
            if ref is None and self._baseline is not None:
                ref = self._baseline
            if ref is not None and self._confirmed(c, raw, post, ref):
                self._baseline = ref
                return [self._enter(self._crossed(c, ref, after), t, "onset", ref, after)]
            return None
        assert self._baseline is not None
        ref = self._ref(c, 1)
        before = ref if ref is not None else self._baseline
        # Relief: two thirds of the points are back within the threshold of the baseline (fast,
        # for clean series), or - for noisy ones, where even a healthy level's upper tercile can
        # sit above the line - the drop from the slow level is verified like an onset in reverse
        # and the median is back within the threshold.
        back = self._recovered(after)
        dropped = ref is not None and self._confirmed(c, -raw, np.sort(-raw), -ref, onset=False)
        if upper - self._baseline <= self.log_threshold or (back and dropped):
            self._slow = False
            return [self._enter(c, t, "relief", before, after)]
        if ref is not None and self.history.window(self._seg_start, c).size >= self.min_post:
            if self._confirmed(c, raw, post, ref):
                return [self._enter(c, t, "onset", ref, after)]
            if ref - upper >= self.log_threshold:  # a clear drop from the slow level
                if back:  # ... to within the threshold of the baseline: relief
                    self._slow = False
                    return [self._enter(c, t, "relief", before, after)]
                self._seg_start = c  # partial recovery: a new, lower slow level
                self._level = after
                return []
        return None

    def _crossed(self, c: int, ref: float, after: float) -> int:
        """Where a slowdown verified at ``c`` first crossed the line, if it climbed to it.

        A ramp (thermal throttling) is verified as a step only once enough of it clears the
        line, 3-11 iterations after it crossed; the points before ``c`` whose 5-point median is
        already above the line belong to it, and its persistence counts from there. They do
        only if they climb: the step lands near the line (under twice the threshold: a slow
        climb's top, where the noise hides the rise), or the 5-point median rose at least
        half the way from the crossing to the step's level. A burst on a busy machine's 10-20%
        (flat before it, then 2x) is a step of its own and keeps ``c``; so does a step whose
        points before it are below the line (the usual case)."""
        line = ref + self.log_threshold
        lo = max(self._seg_start, c - self.sustain)
        if c - lo < 3:
            return c
        x = self.history.window(lo, c + 3)
        smooth = [median(x[j - 2 : j + 3]) for j in range(2, c - lo)]  # points lo+2 .. c-1
        above = 0
        while above < len(smooth) and smooth[-1 - above] >= line:
            above += 1
        if not above:
            return c
        first, last = smooth[-above], smooth[-1]
        near = after - ref < 2 * self.log_threshold
        if not near and last - first < 0.5 * (after - first):
            return c
        return c - above

    def _noise(self, c: int) -> float:
        """Robust noise scale (log units) before ``c``, from successive differences.

        Within the current regime, but over at least half the reference window: a regime a
        few points old with a GC spike or two in it would make the spikes the noise (a level
        step adds one large difference, which the median ignores)."""
        start = min(max(self._seg_start, c - self.ref_window), c - self.ref_window // 2)
        pre = self.history.window(start, c)
        if pre.size < 3:
            return 0.0
        return 1.0489 * median(np.abs(np.diff(pre)))  # sigma of y; trend- and step-proof

    def _confirmed(
        self, c: int, raw: np.ndarray, post: np.ndarray, ref: float, *, onset: bool = True
    ) -> bool:
        """Is the slowdown after ``c`` (``raw`` in order, ``post`` sorted) a verified onset?

        The rules are the module docstring's. ``z = margin_z * 1.2533 * noise / sqrt(n)`` is
        ``margin_z`` standard errors of a median of ``n`` points; the median after ``c`` must
        clear the threshold line by ``z``. Before ``settle`` points the noise is measured
        before ``c``; from then on the larger of the noise before and after ``c`` is used.
        A drop (``onset=False``: ``raw`` negated, for a relief) is not compared with the job's
        slow steps.
        """
        n = post.size
        if onset and n > self.ref_window:
            return False  # longer than the window before it: a level that crept up is drift
        after = 0.5 * float(post[(n - 1) // 2] + post[n // 2])
        scale = self._noise(c)
        if n >= self.settle:
            scale = max(scale, 1.0489 * median(np.abs(np.diff(raw))))
        if after - ref - self.log_threshold < self.margin_z * 1.2533 * scale / math.sqrt(n):
            return False
        back = int(np.count_nonzero(raw - ref < 0.5 * self.log_threshold))
        if n >= self.settle:
            return back <= n // 10 and median(raw[n // 2 :]) - ref >= self.log_threshold
        below = int(np.count_nonzero(raw - ref < self.log_threshold))
        if back or below > (n - 1) // 6 or raw[-1] - ref < self.log_threshold:
            return False
        if onset and self.rhythm is not None:
            need = self.rhythm.outlast(after - ref)  # as large as the job's own slow steps
            if not need and after - ref >= FIRST_STEP:  # as large as its first one may be
                need = self.min_post + 1
            if n < need:
                return False  # must outlast them
        top = post[n - 1 - n // 4]  # up to one spike in four points is let through
        if top - post[0] > max(6.0 * scale, self.min_spread):
            return False  # not one level: a burst and the iterations around it
        return top - post[(n - 1) // 3] <= max(4.0 * scale, self.min_spread)

    def _enter(self, c: int, t: int, kind: str, before: float, after: float) -> ChangeEvent:
        if kind == "onset":
            if not self._slow:  # the level of the fail-slow itself, not of a compound step
                self._slow_level = after
                self._episode = c
            self._onset_c = c
            self._slow = True
        elif self._baseline is not None:
            # The healthy level is what the job runs at now: over a long fail-slow it drifts,
            # and a stale baseline would make the recovered level look like a new onset.
            self._baseline = after
        if kind == "relief":
            self._relieved_at = t
        self._seg_start = c
        self._level = after
        return ChangeEvent(
            type=kind,  # type: ignore[arg-type]
            iteration=self.history.at(c),
            before_s=math.exp(before),
            after_s=math.exp(after),
            change=math.exp(after - before) - 1.0,
            detected_at=self.history.at(t),
        )


def detect(
    times: Sequence[float] | np.ndarray,
    detector: Detector | None = None,
    calls: Sequence[int] | np.ndarray | None = None,
) -> list[ChangeEvent]:
    """Run a detector (default: :class:`FailSlowDetector`) over a whole series of times, with
    each iteration's collective-call count where known (``calls``, as long as ``times``)."""
    det = FailSlowDetector() if detector is None else detector
    if calls is not None and len(calls) != len(times):
        raise ValueError(f"{len(calls)} call counts for {len(times)} iteration times")
    counts = [None] * len(times) if calls is None else [int(c) for c in calls]
    events: list[ChangeEvent] = []
    for x, n in zip(times, counts, strict=True):
        events.extend(det.update(x, n))
    return events
