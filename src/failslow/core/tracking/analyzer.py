"""The node's LocalAnalyzer (greyhound 4.1-4.2): rings -> iteration times -> onset/relief.

One analyzer watches the rings of the ranks on one node. For each rank it keeps an online
:class:`IterationTracker` (ACF period over the call sequence) and a :class:`FailSlowDetector`
(BOCD + verification); the rings of one process (the C shim's and, beside it, the Python
hook's) are read as one stream. ``poll()`` reads whatever the capture layer committed since the
last call and returns the new iteration times and change events per rank. Its cost per call is
proportional to the new records of the node's own ranks only - never to the world size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from failslow.core.localize.summaries import GroupSummarizer, GroupSummary
from failslow.core.ring import RingFormatError, RingReader, find_rings, ring_process
from failslow.core.tracking import ChangeEvent, FailSlowDetector, IterationTracker
from failslow.core.tracking.persistence import Transient
from failslow.core.tracking.reorder import ReorderBuffer


@dataclass
class RankState:
    rank: int
    reader: RingReader
    """The ring of the rank's process (the first one found)."""
    tracker: IterationTracker
    detector: FailSlowDetector
    reorder: ReorderBuffer = field(default_factory=ReorderBuffer)
    iterations: int = 0
    iteration_times: list[float] = field(default_factory=list)  # empty unless keep_history
    events: list[ChangeEvent] = field(default_factory=list)
    summarizer: GroupSummarizer | None = None  # recent records for per-group summaries
    more: list[RingReader] = field(default_factory=list)
    """Other rings of the same process: under the C shim, the Python hook writes its calls
    and step markers beside the shim's ring (:func:`failslow.core.ring.ring_path`)."""
    carried: int | None = None
    """A restarted rank that goes on with its predecessor's detector (:meth:`LocalAnalyzer.
    carry_over`): the predecessor's calls per iteration (None where they were not known), kept
    until this process's tracker finds its pattern - the same count, the same detector."""
    skip: int = 0
    """Iterations not fed to the detector yet (a restart's first, with its restore)."""
    earlier_transients: int = 0
    """Transients of the rank's detectors before the current one (a pattern found again or a
    restart starts a fresh detector; the count the node publishes only grows)."""

    @property
    def transients(self) -> int:
        """Verified slowdowns on the rank over before they persisted, ever (issue 47)."""
        rule = self.detector.persistence
        return self.earlier_transients + (0 if rule is None else rule.count)

    @property
    def readers(self) -> list[RingReader]:
        return [self.reader, *self.more]

    def read(self) -> tuple[np.ndarray, int | None]:
        """What the process's rings committed since the last read, and the time before which
        every call they record has started and been committed (None: a ring does not say)."""
        if not self.more:
            settled = self.reader.settled_ns  # before the records (RingReader)
            return self.reader.poll(), settled or None
        every = [r.settled_ns for r in self.readers]
        known = min(every) if all(every) else None
        return np.concatenate([r.poll() for r in self.readers]), known


@dataclass
class RankUpdate:
    """What one poll learned about one rank."""

    rank: int
    new_times: np.ndarray
    first_iteration: int  # index of new_times[0] in the rank's iteration sequence
    events: list[ChangeEvent]
    reported_at: list[int]  # iteration index at which each event was reported (its latency)
    transients: list[Transient] = field(default_factory=list)
    """Slowdowns this poll saw end before they persisted (issue 47): recorded, never events."""


class LocalAnalyzer:
    """Tracks every ring in a ring directory (the ranks of one node)."""

    def __init__(
        self,
        ring_dir: str | os.PathLike[str],
        *,
        detector_factory: Callable[[], FailSlowDetector] = FailSlowDetector,
        tracker_factory: Callable[[], IterationTracker] = IterationTracker,
        keep_history: bool = True,
        summaries: bool = True,
    ) -> None:
        self.ring_dir = Path(ring_dir)
        self._detector_factory = detector_factory
        self._tracker_factory = tracker_factory
        self._keep_history = keep_history
        self._summaries = summaries
        self.ranks: dict[int, RankState] = {}
        self.records_seen = 0  # records the last poll read (0: the publisher may sleep longer)
        self._seen: set[Path] = set()
        self._dir_mtime: int | None = None
        self._incomplete = False
        self._carry = False

    SKIP_AFTER_RESTART = 2
    """A carried-over rank's first iterations, left out: the first step after a restore runs
    what a restart adds (lazy allocations, the restore's last copies, cold caches)."""

    def carry_over(self, carry: bool) -> None:
        """Whether ranks restarted from now on go on with their predecessors' detectors - the
        launcher says so when the job restarts in the same world with the same code (a
        fail-stop onto a standby, or in place): the baseline then stays the job's, so a standby
        that is slower is a change the detector sees at once, and the restart costs no warm-up
        (:attr:`FailSlowDetector.warmup` iterations blind). After a hot update, a new layout or
        a smaller world the times measure something else: fresh detectors."""
        self._carry = carry

    def discover(self) -> None:
        """Open rings that appeared since the last call (a restarted rank gets a fresh state).

        The directory is listed only when its modification time changed (a ring was created
        or renamed into it), a ring seen before was not complete yet, or the last change is
        under a second old (file systems keep coarse timestamps: a second ring created in the
        same tick as the first leaves the time unchanged). A poll with nothing new costs one
        ``stat``, not a directory listing."""
        try:
            mtime = os.stat(self.ring_dir).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self._dir_mtime and not self._incomplete:
            return
        self._dir_mtime = mtime
        self._incomplete = time.time_ns() - mtime < 1_000_000_000  # not settled yet
        for path in find_rings(self.ring_dir):
            if path in self._seen:
                continue
            try:
                reader = RingReader(path)
            except (RingFormatError, FileNotFoundError):
                self._incomplete = True  # not complete yet; retried on the next poll
                continue
            self._seen.add(path)
            old = self.ranks.get(reader.global_rank)
            if old is not None and ring_process(old.reader.path) == ring_process(path):
                old.more.append(reader)  # the same process's other ring
                continue
            if old is not None:  # a restarted rank
                for stale in old.readers:
                    stale.close()
            state = RankState(
                rank=reader.global_rank,
                reader=reader,
                tracker=self._tracker_factory(),
                detector=self._detector_factory(),
                summarizer=GroupSummarizer(reader.global_rank, path) if self._summaries else None,
            )
            if old is not None and self._carry and old.iterations:
                state.detector, state.iterations = old.detector, old.iterations
                state.earlier_transients = old.earlier_transients  # the same detector goes on
                state.carried = old.tracker.period_calls or 0
                state.skip = self.SKIP_AFTER_RESTART
            elif old is not None:  # a fresh detector: the old one's transients stay counted
                state.earlier_transients = old.transients
            self.ranks[reader.global_rank] = state

    def poll(self) -> list[RankUpdate]:
        self.discover()
        updates = []
        self.records_seen = 0
        for rank in sorted(self.ranks):
            state = self.ranks[rank]
            fresh, settled = state.read()
            self.records_seen += len(fresh)
            if not len(fresh) and not state.reorder.held:
                continue  # nothing arrived and nothing waits: a poll costs the header reads
            records = state.reorder.push(fresh, settled_ns=settled)
            if not len(records):
                continue
            epoch = state.tracker.epoch
            ends, times, calls = state.tracker.feed_steps(records)
            if state.tracker.epoch != epoch and state.iterations:
                # The call pattern was re-detected (more data, or a topology change): times
                # before and after measure different things, so the baseline starts afresh -
                # unless this is a carried-over rank's first pattern, the one it had before.
                carried, state.carried = state.carried, None
                if carried is None or carried != state.tracker.period_calls:
                    state.earlier_transients = state.transients
                    state.detector = self._detector_factory()
            if state.summarizer is not None:
                if state.tracker.epoch != epoch:
                    state.summarizer.reset_iterations()
                state.summarizer.add(records, ends)
            first = state.iterations
            events: list[ChangeEvent] = []
            reported_at: list[int] = []
            skip = min(state.skip, len(times))  # a carried-over rank's first iterations
            state.skip -= skip
            rule = state.detector.persistence
            seen = 0 if rule is None else rule.count
            transients: list[Transient] = []
            for i, (t, n) in enumerate(zip(times.tolist(), calls.tolist(), strict=True)):
                if i < skip:
                    continue
                new = state.detector.update(t, n)  # n: the calls it made (special steps)
                events.extend(new)
                reported_at.extend([first + i] * len(new))
                if rule is not None and rule.count != seen:  # rare: a transient just ended
                    transients += list(rule.transients)[seen - rule.count :]
                    seen = rule.count
            state.iterations += len(times)
            if self._keep_history:
                state.iteration_times.extend(times.tolist())
            state.events.extend(events)
            if len(times) or events:
                updates.append(RankUpdate(rank, times, first, events, reported_at, transients))
        return updates

    @property
    def quiet(self) -> bool:
        """Every rank's detector is calm (:attr:`FailSlowDetector.calm`): no event is on its
        way, so the next poll may come later."""
        return bool(self.ranks) and all(s.detector.calm for s in self.ranks.values())

    def group_summaries(self, *, iterations: int = 5, seconds: float = 10.0) -> list[GroupSummary]:
        """Per-group summaries of every local rank over its last ``iterations`` iterations
        (the last ``seconds`` while its iterations are not known yet): what the node publishes
        for cross-group profiling (greyhound 4.3) instead of raw events."""
        out: list[GroupSummary] = []
        for rank in sorted(self.ranks):
            summarizer = self.ranks[rank].summarizer
            if summarizer is not None:
                out.extend(summarizer.summaries(iterations=iterations, seconds=seconds))
        return out

    def dropped(self) -> int:
        """Records lost: lapped by the writer, abandoned by it, or arriving too late to order."""
        return sum(
            sum(r.dropped + r.writer_dropped for r in s.readers) + s.reorder.late
            for s in self.ranks.values()
        )

    def close(self) -> None:
        for state in self.ranks.values():
            for reader in state.readers:
                reader.close()
