"""The rhythm of a training job: its recurring slow steps, learned from iteration indices.

Every real job has periodic steps that are slower than the rest and are not fail-slows: an
evaluation every 50-250 iterations, a checkpoint every few hundred, a logging step every 10-50
(greyhound 4.2 R2 lists them among the fluctuations a detector must ignore). Each lasts 1-3
iterations at 1.1x-4x. A detector that reports them will be switched off by its users; one that
merely tolerates them still lets them into its statistics, and a fail-slow that starts next to
an eval step then looks like noise.

:class:`Rhythm` learns them from the iteration index alone. An *excursion* is a run of at most
``max_burst`` consecutive iterations above the current level by the detector's threshold,
followed by one that is not. When an excursion starts at ``s`` and, for some earlier excursion
start ``s - P``, excursions also started at ``s - 2P`` ... ``s - repeats * P`` (each within
``tolerance`` iterations, for the odd iteration a capture layer missed), and all of them are
*alike* (lengths within one iteration, sizes within :data:`ALIKE`: one slow step's
occurrences differ by its +-15% and the noise, while a GC spike in line with three eval steps
is a coincidence), the job has a rhythm of period ``P`` and phase ``s mod P``. A rhythm's
*slots* are the iterations it predicts: ``[phase + k*P - tolerance, phase + k*P + duration +
tolerance)``. A high iteration is explained by a rhythm when its run of high iterations began
in the same slot; a slowdown that began before the slot is not, except for the step's own
iterations (the slot without its tolerance) once the rhythm has been confirmed ``2 * (repeats
+ 1)`` times: a GC spike or a noise point just before a well-known eval step must not make the
eval step part of an onset. A rhythm that predicts a slot and finds no excursion in it twice
in a row is forgotten (an eval schedule that changed, or a coincidence of GC spikes). At most
``max_rhythms`` are kept (log, eval and checkpoint, plus one); learning costs O(``keep``) per
excursion and prediction O(rhythms) per iteration.

Four aligned occurrences are needed because isolated GC spikes (up to 1% of iterations) and
noise excursions line up by chance; with ``keep`` (128) remembered excursions - enough to span
four eval periods of a noisy job - such chance rhythms still appear now and then, but die at
their first two empty slots (in the tests, under 1% of random spikes are ever explained).
In a noisy job (10-20% jitter, as on shared cores) every tenth iteration is an excursion, four
aligned ones are certain at some period, and chance rhythms filled ``max_rhythms`` and
explained a fifth of the iterations away (``benchmarks/noise_false_alarms.py``). So the
occurrences asked for grow with the density of the excursions alike to the new one: with
``n`` of them over the remembered span, a slot of ``2 * tolerance + 1`` iterations holds one
by chance with probability ``q``, and a rhythm needs the least ``k >= repeats`` earlier
occurrences with ``n * q**k <= CHANCE`` (none is learned when ``q >= 1`` or ``k >= n``). A
logging step every 10 iterations among 5% spikes of its size is then explained from its 10th
occurrence instead of its 5th. A rhythm whose every slot a shorter one predicts (a multiple
of its period, in its phase, a step no longer: a *harmonic*) is learned while the base rhythm
is unknown - forgotten while a fail-slow hid it - and is dropped when the base is learned
again, so it does not take the place of a rarer rhythm (a checkpoint's) in ``max_rhythms``.
Before a rhythm is known, the detector's own rules apply: a slowdown must outlast a burst, and
one the size of a remembered multi-iteration excursion must outlast it (:meth:`Rhythm.outlast`,
:mod:`.detector`). A run the detector reported as a change of level still counts for the
rhythm (a periodic step too long for the burst rule is reported until it is learned) but is
not remembered as a slow step, nor are excursions while a fail-slow lasts (they are its
congestion): before this, every onset left its own 4-8 points behind as a "slow step", and
every later onset of its size waited two points more. While a fail-slow lasts, only
excursions of at least :data:`LARGE` can start a new rhythm: every congestion point over the
slow level is an excursion, and a 3000-iteration congested fail-slow otherwise filled
``max_rhythms`` with chance rhythms and pushed out the job's checkpoint and eval rhythms.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

LARGE = 0.25  # log excess (1.28x): smaller excursions are the noise's, not slow steps
ALIKE = 0.4  # log: one slow step's occurrences differ by up to +-15% plus the noise
CHANCE = 0.01  # the accepted expected number of chance alignments behind a learned rhythm


@dataclass(slots=True)
class Excursion:
    """A short run of slow iterations: where it started, how long and how slow (log)."""

    start: int
    length: int
    size: float  # mean log excess over the level
    periodic: bool = False  # explained by a learned rhythm
    reported: bool = False  # the detector reported it as a change of level


@dataclass(slots=True)
class Period:
    """One learned rhythm: excursions every ``period`` iterations, starting at ``phase``."""

    period: int
    phase: int  # iteration index of the newest excursion start of this rhythm
    duration: int  # the longest of the aligned excursions it was learned from
    misses: int = 0  # consecutive slots that held no excursion
    hits: int = 0  # slots that held one (learning counts as ``repeats + 1``)

    def slot(self, t: int, tolerance: int) -> bool:
        """Is iteration ``t`` inside one of this rhythm's predicted slots?"""
        offset = (t - self.phase + tolerance) % self.period
        return offset < self.duration + 2 * tolerance


def _alike(a: Excursion, b: Excursion) -> bool:
    """Could ``a`` and ``b`` be two occurrences of one periodic step? Lengths within one
    iteration, sizes within ALIKE (log)."""
    return abs(a.length - b.length) <= 1 and abs(a.size - b.size) <= ALIKE


class Rhythm:
    """Online learner of a job's recurring slow iterations (see the module docstring)."""

    def __init__(
        self,
        *,
        max_burst: int = 8,
        repeats: int = 3,
        tolerance: int = 1,
        min_period: int = 5,
        keep: int = 128,
        max_rhythms: int = 4,
    ) -> None:
        if max_burst < 1 or repeats < 2 or tolerance < 0 or keep < repeats:
            raise ValueError("need max_burst >= 1, repeats >= 2, tolerance >= 0, keep >= repeats")
        if min_period <= 1 + 2 * tolerance:
            raise ValueError(
                f"min_period ({min_period}) must exceed 1 + 2 * tolerance ({1 + 2 * tolerance}): "
                "shorter rhythms would cover every iteration"
            )
        self.max_burst, self.repeats, self.tolerance = max_burst, repeats, tolerance
        self.min_period, self.max_rhythms = min_period, max_rhythms
        self._seen: deque[Excursion] = deque(maxlen=keep)
        self._starts: dict[int, Excursion] = {}  # the same excursions, by start
        self._large: deque[Excursion] = deque(maxlen=16)  # multi-iteration, >= LARGE
        self._run_sum = 0.0  # summed excess of the current run
        self._run_start = -1  # first iteration of the current run of high iterations
        self._run_len = 0
        self._failslow = False  # a reported fail-slow lasts (Rhythm.reported)
        self._run_reported = False
        self.periods: list[Period] = []
        self.step_length = 0  # duration of the rhythm that explained the last observed point

    def outlast(self, excess: float, similar: float = 0.25) -> int:
        """Points a slowdown of ``excess`` (log, over the level before it) must last before it
        can be told from this job's own slow steps: longer than the longest remembered
        multi-iteration excursion of a similar size (within ``similar`` of it, relatively)
        with a spike on one side (+2), or, once two such excursions are remembered (a
        pattern, not a one-off), with a spike on each side (+3); else 0. Only excursions of at
        least :data:`LARGE` count: smaller ones are the noise's, and the job's slow steps are
        larger.

        A 3-iteration checkpoint with a GC spike before and after it is five slow iterations
        at one level; before its rhythm is learned, only its size gives it away."""
        lengths = [
            e.length
            for e in self._large
            if not e.periodic and abs(e.size - excess) <= similar * max(e.size, excess)
        ]
        return max(lengths) + (3 if len(lengths) > 1 else 2) if lengths else 0

    def observe(self, t: int, high: bool, excess: float = 0.0) -> bool:
        """Record whether iteration ``t`` (fed in order) was above the current level (by
        ``excess``, log); return
        True if it is one of the job's periodic slow steps: high, and part of a run of high
        iterations that began in the same predicted slot as ``t``, or inside the step itself
        of a rhythm confirmed ``2 * (repeats + 1)`` times (see the module docstring)."""
        periodic = False
        if high:
            if self._run_len == 0:
                self._run_start, self._run_sum, self._run_reported = t, 0.0, False
            self._run_len += 1
            self._run_sum += excess
            tol = self.tolerance
            began = [  # the run began in the slot that holds t
                p
                for p in self.periods
                if p.slot(self._run_start, tol)
                and p.slot(t, tol)
                and (self._run_start - p.phase + tol) // p.period == (t - p.phase + tol) // p.period
            ]
            within = [  # t is a well-confirmed multi-iteration step's own iteration
                p
                for p in self.periods
                if p.duration > 1 and p.hits >= 2 * (self.repeats + 1) and p.slot(t, 0)
            ]
            owners = began + within
            periodic = bool(owners)
            self.step_length = max((p.duration for p in owners), default=0)
        elif self._run_len:
            if self._run_len <= self.max_burst:
                mean = self._run_sum / self._run_len
                self._excursion(
                    Excursion(self._run_start, self._run_len, mean, reported=self._run_reported)
                )
            self._run_len = 0
        self._expire(t)
        return periodic

    def reported(self, *, slow: bool) -> None:
        """The detector has just reported a change of level at the current run of high
        iterations. The run still counts towards the rhythm (a periodic step too long for
        the burst rule is reported until it is learned), but not for :meth:`outlast`: an
        onset's own points are not one of the job's slow steps. While ``slow`` (a fail-slow
        lasts), later excursions are not remembered for :meth:`outlast` either, and only
        those of at least :data:`LARGE` can start a rhythm: over the fail-slow's level, they
        are its congestion, not the job's slow steps."""
        self._run_reported = self._run_len > 0
        self._failslow = slow

    def _expire(self, t: int) -> None:
        """Count a miss for every rhythm whose slot ended long enough before ``t`` (an
        excursion is known once it has ended) and holds no excursion start."""
        tol = self.tolerance
        for p in self.periods:
            wait = min(p.duration + 2 * tol + self.max_burst, p.period - 1)
            slot_start = t - wait
            if (slot_start - p.phase + tol) % p.period or slot_start + tol <= p.phase:
                continue
            end = slot_start + p.duration + 2 * tol
            if not any(x in self._starts for x in range(slot_start, end)):
                p.misses += 1
        self.periods = [p for p in self.periods if p.misses < 2]

    def _excursion(self, new: Excursion) -> None:
        tol, s = self.tolerance, new.start
        for p in self.periods:
            if abs((s - p.phase + tol) % p.period - tol) <= tol:  # a predicted one
                p.phase, p.misses, p.hits = s, 0, p.hits + 1
                new.periodic = True
        self._remember(new)
        if new.periodic or (self._failslow and new.size < LARGE):
            return
        need = self._needed(new)
        if need is None:
            return
        for prev in reversed(self._seen):
            period = s - prev.start
            if period < self.min_period or not _alike(prev, new):
                continue
            aligned = [new]
            for k in range(1, need + 1):
                at = s - k * period
                near = [
                    self._starts[x]
                    for x in range(at - tol, at + tol + 1)
                    if x in self._starts and _alike(self._starts[x], new)
                ]
                if not near:
                    break
                aligned.append(near[0])
            else:
                duration = max(e.length for e in aligned)
                if period > duration + 2 * tol:  # its slots must leave iterations between them
                    for e in aligned:
                        e.periodic = True
                    self._learn(Period(period, s, duration, hits=self.repeats + 1))
                    return

    def _needed(self, new: Excursion) -> int | None:
        """Earlier aligned occurrences ``new`` needs to start a rhythm: ``repeats``, or more
        when the excursions alike to it are dense enough to line up by chance (see the
        module docstring); None when they are too dense to tell a rhythm at all."""
        alike = sum(1 for e in self._seen if e is not new and _alike(e, new))
        if alike <= self.repeats:
            return self.repeats
        span = new.start - self._seen[0].start + 1
        q = (2 * self.tolerance + 1) * alike / span
        if q >= 1.0:
            return None
        need = max(self.repeats, math.ceil(math.log(CHANCE / alike) / math.log(q)))
        return need if need < alike else None

    def _remember(self, new: Excursion) -> None:
        if len(self._seen) == self._seen.maxlen:
            old = self._seen[0]
            if self._starts.get(old.start) is old:
                del self._starts[old.start]
        self._seen.append(new)
        self._starts[new.start] = new
        if new.length > 1 and new.size >= LARGE and not self._failslow and not new.reported:
            self._large.append(new)

    def _learn(self, new: Period) -> None:
        tol = self.tolerance
        for p in self.periods:
            if abs(p.period - new.period) <= tol and p.slot(new.phase, tol):  # known, re-phased
                p.phase, p.misses = new.phase, 0
                p.duration = max(p.duration, new.duration)
                return
        self.periods = [p for p in self.periods if not self._harmonic(p, of=new)]
        self.periods.append(new)
        if len(self.periods) > self.max_rhythms:  # drop the least confirmed
            self.periods.remove(min(self.periods, key=lambda p: p.hits))

    def _harmonic(self, p: Period, *, of: Period) -> bool:
        """Does ``of`` predict every slot of ``p``: a period a multiple of its own (within
        the tolerance), a phase in its slot, and a step no longer? Such a rhythm is learned
        when the base one is not known (forgotten while a fail-slow hid it) and would only
        take a place among ``max_rhythms``."""
        m = round(p.period / of.period)
        return (
            m >= 2
            and abs(p.period - m * of.period) <= self.tolerance
            and of.slot(p.phase, self.tolerance)
            and p.duration <= of.duration
        )
