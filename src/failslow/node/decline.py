"""An unexplained slowdown (an "MFU decline") localized by repeated stack aggregation
(byterobust 4.1 "MFU decline", 5.1 last paragraph; issue 18).

The controller's tracker saw the job's step time go up, yet its validation round found every
rank's GEMM and links healthy: nothing localized - a slow data loader, a CPU-bound rank, a
throttled host the benchmarks miss. byterobust then "repeats aggregation every 10 seconds,
flagging the parallel group with the most outliers at each round. The parallel group with the
highest cumulative flag count across 5 rounds is marked as the degrader for over-eviction." Here
the degrader must also have been flagged in more than half the rounds
(:meth:`~failslow.core.diagnosis.stacks.DeclineTally.degrader`).

:class:`DeclineWatch` does that on the node, from the launcher's loop. The controller's event
of a healthy validation round for a new onset triggers it (:meth:`DeclineWatch.trigger`); a
relief, or a diagnosis that did localize the slowdown, cancels it. Every ``every_s`` it dumps
every rank's process and its children with py-spy (:mod:`failslow.node.stacks`), aggregates
them (:func:`failslow.core.diagnosis.stacks.aggregate`) and counts the round in a
:class:`~failslow.core.diagnosis.stacks.DeclineTally`; after ``rounds`` rounds the most
flagged group's ranks are returned for eviction (the launcher evicts them like hung ones and
restarts the job from memory without them). When no group was flagged in most rounds nothing
is evicted: the decline is only logged. Every round is a line of ``declines.jsonl`` in the
state directory; per round, one py-spy dump per local process, O(local ranks). Off unless
``failslow run --decline-every S``.
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
    rounds: int = 5
    state_dir: Path | None = None
    topology: Callable[[], Any] = lambda: None
    """The job's topology when known (the control store's job record), else None."""
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    _due: threading.Event = field(default_factory=threading.Event)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _tally: Any = None
    _next: float = 0.0
    _why: str = ""

    def trigger(self, why: str) -> None:
        """The step time is up and nothing was localized (any thread: the controller's)."""
        self._why = why
        self._cancelled.clear()
        self._due.set()

    def cancel(self) -> None:
        """The step time came back (any thread)."""
        self._cancelled.set()

    @property
    def active(self) -> bool:
        return self._tally is not None or self._due.is_set()

    def check(self, pids: Mapping[int, int]) -> list[int] | None:
        """One call from the launcher's loop with the running launch's ranks (rank -> pid):
        the ranks to evict once the rounds named a degrader, else None."""
        from failslow.core.diagnosis.stacks import DeclineTally

        if self._cancelled.is_set():
            self._cancelled.clear()
            self._due.clear()
            if self._tally is not None:
                self.say(f"decline: the step time came back after {self._tally.seen} rounds")
                self._tally = None
            return None
        if self._due.is_set():
            self._due.clear()
            if self._tally is None:
                self._tally = DeclineTally(rounds=self.rounds)
                self._next = self.clock()
                self.say(f"decline: {self._why} - stack aggregation every {self.every_s:g} s, "
                         f"{self.rounds} rounds")  # fmt: skip
        if self._tally is None or self.clock() < self._next:
            return None
        self._next = self.clock() + self.every_s
        return self._round(pids)

    def reset(self) -> None:
        """A new launch: its ranks are other processes (a decline is looked for again when
        the controller sees one)."""
        self._tally = None
        self._due.clear()
        self._cancelled.clear()

    def _round(self, pids: Mapping[int, int]) -> list[int] | None:
        from failslow.core.diagnosis.stacks import aggregate
        from failslow.node.stacks import capture

        tally = self._tally
        started = time.monotonic()
        stacks = capture(pids, native=False)
        try:
            topology = self.topology()
        except Exception:  # the store may be gone; ranks then name themselves
            topology = None
        if topology is not None and topology.world_size != len(pids):
            topology = None
        found = aggregate(stacks, topology)
        flagged = tally.add(found, topology)
        took = time.monotonic() - started
        self._record(tally.seen, flagged, took, found.to_dict())
        self.say(
            f"decline: round {tally.seen} of {tally.rounds} ({took:.2f} s): "
            + (f"flags {flagged[0]} {list(flagged[1])}" if flagged[1] else "nothing stands out")
        )
        if not tally.done:
            return None
        self._tally = None
        degrader = tally.degrader()
        if degrader is None:
            self.say(
                f"decline: no group flagged in more than half of {tally.rounds} rounds "
                f"({dict((f'{k} {list(g)}', n) for (k, g), n in tally.flags.items())}) - "
                "nothing evicted"
            )
            return None
        kind, ranks = degrader
        self.say(
            f"decline: {kind} {list(ranks)} flagged in {tally.flags[degrader]} of "
            f"{tally.rounds} rounds - evicting ranks {list(ranks)}"
        )
        return list(ranks)

    def _record(
        self, n: int, flagged: tuple[str, tuple[int, ...]], took: float, found: dict[str, Any]
    ) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        line = {"wall": time.time(), "round": n, "flagged": [flagged[0], list(flagged[1])],
                "aggregation_s": took, "why": self._why, **found}  # fmt: skip
        with open(self.state_dir / LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
