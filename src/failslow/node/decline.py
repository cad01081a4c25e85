"""An unexplained slowdown (an "MFU decline") localized by repeated stack aggregation
(byterobust 4.1 "MFU decline", 5.1 last paragraph; issue 18).

The controller's tracker saw the job's step time go up, yet its validation round found every
rank's GEMM and links healthy: nothing localized - a slow data loader, a CPU-bound rank, a
throttled host the benchmarks miss. byterobust then "repeats aggregation every 10 seconds,
flagging the parallel group with the most outliers at each round. The parallel group with the
highest cumulative flag count across 5 rounds is marked as the degrader for over-eviction."

:class:`DeclineWatch` does that on the node, from the launcher's loop. The controller's event
of a healthy validation round for a new onset triggers it (:meth:`DeclineWatch.trigger`); a
relief, or a diagnosis that did localize the slowdown, cancels it. Every ``every_s`` a round
dumps every rank's process and its children with py-spy (:mod:`failslow.node.stacks`)
``samples`` times, ``sample_gap_s`` apart, aggregates each sample
(:func:`failslow.core.diagnosis.stacks.aggregate`) and counts the round in a
:class:`~failslow.core.diagnosis.stacks.DeclineTally`. After ``rounds`` rounds the degrader's
ranks are returned for eviction (the launcher evicts them like hung ones and restarts the job
from memory without them) - under three guards, because every job has a slowest rank and
stack aggregation will name it whether or not it is why the job slowed down:

- the degrader must be flagged in more than half the rounds (:meth:`DeclineTally.degrader`);
- the step time must still be up when the rounds end: the node's current step time (the
  median of its ranks' recent iterations) nearer the onset's slow level than its old one. A
  slowdown that went away (a restart's warm-up, a transient the relief has not confirmed yet)
  evicts nobody;
- rounds start no sooner than ``settle_s`` after a launch: a trigger in a restart's first
  seconds waits, since the new ranks' warm-up is not the decline.

When the step time stays up and no group stands out, another tally starts, ``attempts`` in
all; then the decline is left to a person, said once. Every round is a line of
``declines.jsonl`` in the state directory; per sample, one py-spy dump per local process,
O(local ranks). Off unless ``failslow run --decline-every S``. On several nodes the controller
(node 0's) triggers node 0's watch, and each of its samples asks every node for its ranks'
stacks (:mod:`failslow.node.stack_exchange`); the nodes holding the degrader's ranks evict them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG = "declines.jsonl"


@dataclass
class DeclineWatch:
    every_s: float = 10.0
    """A round starts this often."""
    rounds: int = 5
    samples: int = 5
    """Stack samples per round."""
    sample_gap_s: float = 0.25
    attempts: int = 3
    """Tallies of ``rounds`` rounds while the step time stays up and no group stands out."""
    settle_s: float = 15.0
    """Rounds start no sooner than this after a launch (:meth:`reset`)."""
    state_dir: Path | None = None
    topology: Callable[[], Any] = lambda: None
    """The job's topology when known (the control store's job record), else None."""
    step_time: Callable[[], float | None] = lambda: None
    """The node's current step time in seconds (None: not known)."""
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    _pending: tuple[str, float | None, float | None] | None = None
    _cancelled: bool = False
    _tally: Any = None
    _samples: list[Any] = field(default_factory=list)
    _round_started: float = 0.0
    _next: float = 0.0
    _attempt: int = 0
    _levels: tuple[float | None, float | None] = (None, None)
    _why: str = ""
    _launched: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock)
    exchange: Any = None
    """Stack aggregation across the job's nodes (:class:`~failslow.node.stack_exchange.
    StackExchange`; None: one node): node 0's samples hold every node's ranks."""

    def trigger(
        self, why: str, before_s: float | None = None, after_s: float | None = None
    ) -> None:
        """The step time went from ``before_s`` to ``after_s`` and nothing was localized (any
        thread: the controller's). Rounds already under way go on."""
        with self._lock:
            self._cancelled, self._pending = False, (why, before_s, after_s)

    def cancel(self) -> None:
        """The step time came back, or the fail-slow path localized it (any thread)."""
        with self._lock:
            self._cancelled = True

    @property
    def active(self) -> bool:
        return self._tally is not None or self._pending is not None

    def reset(self) -> None:
        """A new launch: its ranks are other processes; the rounds of the last one end, and a
        decline is looked for again when the controller sees one."""
        with self._lock:
            self._tally, self._pending, self._cancelled = None, None, False
        self._samples = []
        self._launched = self.clock()

    def check(self, pids: Mapping[int, int]) -> list[int] | None:
        """One call from the launcher's loop with the running launch's ranks (rank -> pid):
        the ranks to evict once the rounds named a degrader, else None."""
        now = self.clock()
        with self._lock:
            cancelled, pending = self._cancelled, self._pending
            if cancelled:
                self._cancelled, self._pending = False, None
            elif pending is not None:
                if self._tally is None and now < self._launched + self.settle_s:
                    return None  # a restart's warm-up is not the decline: start after it
                self._pending = None
                if self._tally is not None:
                    pending = None  # rounds are under way: they answer it
        if cancelled:
            if self._tally is not None:
                self.say(f"decline: the step time came back after {self._tally.seen} rounds")
                self._tally, self._samples = None, []
            return None
        if pending is not None:
            why, before, after = pending
            self._why, self._levels, self._attempt = why, (before, after), 1
            self._start(now)
            self.say(
                f"decline: {why} - {self.rounds} rounds of stack aggregation, "
                f"{self.every_s:g} s apart, {self.samples} samples each"
            )
        if self._tally is None or now < self._next:
            return None
        return self._sample(pids, now)

    def _start(self, now: float) -> None:
        from failslow.core.diagnosis.stacks import DeclineTally

        self._tally, self._samples, self._next = DeclineTally(rounds=self.rounds), [], now

    def _sample(self, pids: Mapping[int, int], now: float) -> list[int] | None:
        from failslow.core.diagnosis.stacks import aggregate
        from failslow.node.stack_exchange import DECLINE
        from failslow.node.stacks import capture

        if not self._samples:
            self._round_started = now
        started = time.monotonic()
        exchange = self.exchange
        look = exchange.ask(DECLINE) if exchange is not None else None
        stacks = capture(pids, native=False)
        world = len(pids)
        if look is not None:
            stacks, _ = exchange.gather(look, stacks)
            world *= exchange.nodes.options.nnodes
        topology = self._topology(world)
        self._samples.append((aggregate(stacks, topology), time.monotonic() - started))
        named = None
        if len(self._samples) < self.samples:
            self._next = self.clock() + self.sample_gap_s
        else:
            named = self._round(topology)
        if look is not None:  # every look gets its verdict; the last of a tally may name
            exchange.decide(look, named or [], "declined")
            named = [r for r in named or [] if r in pids] or None
        return named

    def _topology(self, ranks: int) -> Any:
        try:
            topology = self.topology()
        except Exception:  # the store may be gone; ranks then name themselves
            return None
        return topology if topology is not None and topology.world_size == ranks else None

    def _round(self, topology: Any) -> list[int] | None:
        tally, samples = self._tally, [a for a, _ in self._samples]
        took = sum(s for _, s in self._samples)
        self._samples = []
        self._next = max(self.clock(), self._round_started + self.every_s)
        flagged = tally.add(samples, topology)
        self._record(tally.seen, flagged, took, samples)
        self.say(
            f"decline: round {tally.seen} of {tally.rounds} ({len(samples)} samples, "
            f"{took:.2f} s of dumps): "
            + (f"flags {flagged[0]} {list(flagged[1])}" if flagged[1] else "nothing stands out")
        )
        if not tally.done:
            return None
        return self._decide(tally)

    def _decide(self, tally: Any) -> list[int] | None:
        flags = ", ".join(f"{k} {list(g)}: {n}" for (k, g), n in tally.flags.most_common())
        still, level = self._still_slow()
        if still is False:
            self._tally = None
            before, _ = self._levels
            self.say(
                f"decline: the step time came back ({level:.3f} s, {before:.3f} s before the "
                f"onset) - nothing evicted (flags: {flags or 'none'})"
            )
            return None
        degrader = tally.degrader()
        if degrader is not None:
            self._tally = None
            kind, ranks = degrader
            self.say(
                f"decline: {kind} {list(ranks)} flagged in {tally.flags[degrader]} of "
                f"{tally.rounds} rounds - evicting ranks {list(ranks)}"
            )
            return list(ranks)
        if self._attempt < self.attempts:
            self._attempt += 1
            self._start(self.clock())
            self.say(
                f"decline: no group flagged in more than half of {tally.rounds} rounds "
                f"({flags or 'none'}) - another {self.rounds} rounds (attempt {self._attempt} "
                f"of {self.attempts})"
            )
            return None
        self._tally = None
        self.say(
            f"decline: needs a person - the step time is still up and no parallel group stood "
            f"out in {self.attempts} x {self.rounds} rounds (flags of the last: {flags or 'none'})"
        )
        return None

    def _still_slow(self) -> tuple[bool | None, float | None]:
        """Whether the node's step time is still nearer the onset's slow level than its old
        one (None: not known - no level, or no onset's levels)."""
        before, after = self._levels
        try:
            level = self.step_time()
        except Exception:
            level = None
        if level is None or before is None or after is None or not after > before:
            return None, level
        return level >= (before + after) / 2, level

    def _record(
        self, n: int, flagged: tuple[str, tuple[int, ...]], took: float, samples: list[Any]
    ) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        line = {
            "wall": time.time(),
            "round": n,
            "attempt": self._attempt,
            "flagged": [flagged[0], list(flagged[1])],
            "aggregation_s": took,
            "why": self._why,
            "samples": [s.to_dict() for s in samples],
        }
        with open(self.state_dir / LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
