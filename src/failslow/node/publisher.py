"""The node side of the controller channel: onsets, reliefs and group summaries, never events.

greyhound 4.1: a LocalAnalyzer per node tracks its ranks' iteration times and reports change
points; the GlobalAnalyzer (the controller) asks for per-group profiles only when it profiles.
:class:`NodePublisher` wraps a :class:`~failslow.core.tracking.analyzer.LocalAnalyzer` and writes:

- ``{prefix}/onsets`` (a counter) and ``{prefix}/onsets/{n}`` (one JSON record per detected
  onset or relief: rank, type, iteration, levels, wall time);
- ``{prefix}/transients`` (a counter) and ``{prefix}/transients/{n}`` (one JSON record per
  transient: a slowdown the rank's detector verified that was over before it persisted, issue
  47 - rank, ``start``, ``end``, ``detected_at``, levels, wall time; never an onset, so no
  controller acts on it: it reaches the run's journal and report);
- ``{prefix}/summaries/{rank}`` (the rank's :class:`~failslow.core.localize.summaries.GroupSummary`
  list over its last iterations; each rank's key is overwritten, so the store does not grow) -
  only when the controller asks, as greyhound's GlobalAnalyzer does when it profiles. It adds
  one to ``{prefix}/profile`` (:data:`~failslow.core.control.keys.PROFILE`); each publisher
  sees the counter move at its next poll, publishes its ranks' summaries of that moment and
  adds its number of ranks to ``{prefix}/profile/{n}/ranks``, which
  :meth:`~failslow.core.control.controller.Controller.request_summaries` waits for. Summaries
  made every second whatever happened were a quarter of the node's tracking CPU (479 us to
  summarize 4 ranks, 182 us for their keys; ~1.3 ms under the ranks' load), and were up to a
  second old when read: more than the five iterations they cover in a job of short steps, so
  another node's window need not overlap the slow one's;
- ``{prefix}/ranks/{rank}`` (the rank's tracker state, every ``states_every_s``: iterations so
  far, the last iteration's time and the median of the recent ones, slow since an onset not
  yet relieved) - what ``failslow top`` and the metrics exporter show per rank.

Per poll, store traffic is one counter read plus O(events + local ranks / state period): it
does not grow with the world size on any node, and raw events never leave the node.
:meth:`NodePublisher.run` is the one publishing loop: ``failslow node`` runs it in the
foreground, the launcher that hosts a controller on a thread (:mod:`failslow.node.control`).
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from failslow.core.control import keys
from failslow.core.control.store import Store
from failslow.core.tracking.analyzer import LocalAnalyzer, RankUpdate
from failslow.core.tracking.persistence import Transient

log = logging.getLogger(__name__)

RECENT = 9
"""Iteration times kept per local rank for its published median."""
CALM_ITERATIONS = 3
"""Iterations between polls while every local rank is calm (:meth:`NodePublisher.next_wait`)."""
CALM_S = 0.45
"""The longest wait between polls while calm: under the controller's 0.75 s summary wait."""


class NodePublisher:
    def __init__(
        self,
        analyzer: LocalAnalyzer,
        store: Store,
        *,
        prefix: str = keys.NODE,
        states_every_s: float = 1.0,
        summary_iterations: int = 5,
    ) -> None:
        self.analyzer = analyzer
        self.store = store
        self.prefix = prefix
        self.states_every_s = states_every_s
        self.summary_iterations = summary_iterations
        self._last_states = 0.0
        self._answered = 0  # the last summary request answered
        self.iterations: dict[int, int] = {}
        """Iterations seen so far per local rank (the analyzer's count)."""
        self.recent: dict[int, collections.deque[float]] = {}
        """The last iteration times (seconds) per local rank."""
        self.slow: dict[int, bool] = {}
        """Per local rank: an onset was reported and no relief since."""
        self.latest_states: dict[int, dict[str, Any]] = {}
        """The last published :meth:`rank_states` (the metrics exporter reads it)."""
        self._iteration_s = 0.0  # median recent iteration time over the local ranks
        self.on_event: Callable[[], None] | None = None
        """Called after a poll that wrote onsets or reliefs (a controller in the same process
        wakes on it: :attr:`failslow.core.control.controller.Controller.wake`)."""
        self.wake = threading.Event()
        """Set to end :meth:`run`'s wait at once."""
        self.asked_here = False
        """The job's controller runs in this process and calls :meth:`ask`: then no poll reads
        the request counter (one store round trip, ~20 us idle and ~100 us under the ranks'
        load - a third of what the summaries it replaces cost)."""
        self._asked = threading.Event()
        self.polls = 0
        """Polls made so far (:meth:`run` counts them)."""

    def run(
        self,
        stop: Callable[[], bool],
        poll_s: float = 0.05,
        idle_s: float = 0.2,
        calm_s: float = CALM_S,
    ) -> None:
        """Poll until ``stop()``; a failing poll is logged, never raised (the publisher must
        not take its launcher down). After a poll that read records the next one comes about
        one iteration later (:meth:`next_wait`); while polls find no new record (a job between
        steps, stopped or not started) the wait doubles up to ``idle_s``."""
        wait = poll_s
        while not stop():
            try:
                self.poll()
                self.polls += 1
                idle = self.analyzer.records_seen == 0
            except Exception:
                log.warning("failslow: node publisher poll failed", exc_info=True)
                idle = False
            wait = min(2 * wait, idle_s) if idle else self.next_wait(poll_s, idle_s, calm_s)
            if self.wake.wait(wait):
                self.wake.clear()

    def step_time(self) -> float | None:
        """The node's current step time: the median of its ranks' recent iteration times
        (None before any is known)."""
        return self._iteration_s or None

    def next_wait(self, poll_s: float, idle_s: float, calm_s: float = CALM_S) -> float:
        """The wait after a poll that read records: one of this node's iterations (the median
        of its ranks' recent ones), within ``[poll_s, idle_s]``, so that a poll reads about one
        iteration's records. Much of a poll's cost is per poll, not per record - a few array
        operations per rank whatever their length, and on a node whose cores are busy with
        ranks, waking a thread whose caches they emptied - so polling several times per
        iteration only multiplies the analyzer's CPU (the job of ``benchmarks/analyzer_cost.py``
        on an idle machine: 110 us per rank and step polled twice per step, 100 once, 70 every
        two steps). Several iterations always would save more, but an onset then reaches the
        store up to that many iterations after the ranks wrote it, and so does every answer of
        the profiling that follows it: with two, the controller e2e's onset -> diagnosis went
        from a median of 8-10 iterations to 10-16 (``reaction_time.py``, 35 ms iterations).
        So the wait is :data:`CALM_ITERATIONS` (3) iterations only while every local rank is
        calm (:attr:`LocalAnalyzer.quiet`: the newest iteration within the threshold, nothing
        held, nothing slow): an onset's first slow iteration is then read at most two healthy
        iterations late (less than one of its own slow iterations at 3x), and from it on the
        polls come every iteration. A poll costs mostly per wake-up, not per record: the
        thread wakes cold (on this machine, 0.32-0.39 ms of CPU per 4-rank poll back to back,
        1.0-1.1 ms after 0.1 s asleep, 1.3 ms for two iterations after 0.1 s). The wait stays
        within ``[poll_s, idle_s]``; while calm, its cap is the larger of ``calm_s`` (0.45 s)
        and ``idle_s``: a calm node answers a remote controller's request for summaries at
        its next poll, and that controller waits at most 0.75 s
        (:attr:`~failslow.core.control.controller.Controller.summary_wait_s`). Before any
        iteration time is known: ``poll_s``."""
        if not self._iteration_s:
            return poll_s
        if self.analyzer.quiet:
            calm = CALM_ITERATIONS * self._iteration_s
            return min(max(calm, poll_s), max(calm_s, idle_s))
        return min(max(self._iteration_s, poll_s), idle_s)

    def poll(self) -> list[RankUpdate]:
        updates = self.analyzer.poll()
        for update in updates:
            self.iterations[update.rank] = update.first_iteration + len(update.new_times)
            times = self.recent.setdefault(update.rank, collections.deque(maxlen=RECENT))
            times.extend(update.new_times.tolist())
            for event, reported in zip(update.events, update.reported_at, strict=True):
                self.slow[update.rank] = event.type == "onset"
                self._publish_event(update.rank, event, reported)
            for transient in update.transients:
                self._publish_transient(update.rank, transient)
        if self.on_event is not None and any(update.events for update in updates):
            self.on_event()
        recent = [t for ts in self.recent.values() for t in ts] if updates else None
        if recent:
            self._iteration_s = statistics.median(recent)
        if self._asked.is_set() or not self.asked_here:
            self._asked.clear()
            self._answer_requests()
        now = time.monotonic()
        if now - self._last_states >= self.states_every_s:
            self._last_states = now
            self.publish_states()
        return updates

    def ask(self) -> None:
        """A controller in this process asked for summaries
        (:meth:`~failslow.core.control.controller.Controller.request_summaries`): the waiting
        :meth:`run` wakes and answers at once."""
        self._asked.set()
        self.wake.set()

    def _answer_requests(self) -> None:
        requested = self.store.add(f"{self.prefix}/{keys.PROFILE}", 0)
        if requested != self._answered:  # lower: a store that restarted counts from 0 again
            self._answered = requested
            if requested <= 0:
                return
            self.publish_summaries()
            answer = f"{self.prefix}/{keys.PROFILE}/{requested}/ranks"
            self.store.add(answer, len(self.analyzer.ranks))

    def _publish_event(self, rank: int, event: Any, reported: int) -> None:
        record = {
            "rank": rank,
            "type": event.type,
            "iteration": int(event.iteration),
            "reported_at": int(reported),
            "before_s": float(event.before_s),
            "after_s": float(event.after_s),
            "wall": time.time(),
        }
        n = self.store.add(f"{self.prefix}/onsets", 1)
        self.store.set_json(f"{self.prefix}/onsets/{n}", record)

    def _publish_transient(self, rank: int, transient: Transient) -> None:
        record = {"rank": rank, **transient.as_dict(), "wall": time.time()}
        n = self.store.add(f"{self.prefix}/{keys.TRANSIENTS}", 1)
        self.store.set_json(f"{self.prefix}/{keys.TRANSIENTS}/{n}", record)

    def publish_summaries(self) -> None:
        """Every local rank's group summaries over its last ``summary_iterations``."""
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for summary in self.analyzer.group_summaries(iterations=self.summary_iterations):
            by_rank.setdefault(summary.rank, []).append(summary.to_dict())
        for rank, items in by_rank.items():
            self.store.set_json(f"{self.prefix}/summaries/{rank}", items)

    def publish_states(self) -> None:
        """Every local rank's tracker state (:meth:`rank_states`)."""
        self.latest_states = self.rank_states()  # replaced whole: other threads read it
        for rank, state in self.latest_states.items():
            self.store.set_json(f"{self.prefix}/ranks/{rank}", state)

    def rank_states(self) -> dict[int, dict[str, Any]]:
        """Each local rank's tracker state (the ``{prefix}/ranks/{rank}`` records)."""
        wall = time.time()
        ranks = self.analyzer.ranks
        return {
            rank: {
                "rank": rank,
                "iterations": self.iterations.get(rank, 0),
                "last_s": times[-1],
                "median_s": statistics.median(times),
                "slow": self.slow.get(rank, False),
                "transients": ranks[rank].transients if rank in ranks else 0,
                "wall": wall,
            }
            for rank, times in self.recent.items()
            if times
        }
