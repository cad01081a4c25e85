"""Hang detection on the node, and the stack aggregation that names whom to evict (byterobust
4.1 "hang", 5.1; issue 18).

A hung job logs nothing until its collectives time out (10-30 minutes). Its ranks' rings show
it at once: each committed collective advances the ring's ``write_index``, and a job whose
every rank has committed none for ``hang_after_s`` - while none is parked in a validation
pause (the ring's ``parked`` word) and every process is alive - is hung. The launcher checks
the headers of its own ranks' rings (two words each, O(local ranks) per check, from the
launcher's loop, at most every ``every_s``) once every rank of the launch has finished a first
optimizer step (a step marker in its ring): a restore from memory, a framework's start-up or a
compilation before it are quiet without being hung.

A hang is then localized by stack aggregation (:mod:`failslow.core.diagnosis.stacks`): every
rank's process and its children dumped with py-spy (:mod:`failslow.node.stacks`), grouped,
the outliers' shared parallel group named. Only when something stands out is it acted on (the
group's ranks evicted: :meth:`failslow.node.rank_group.RankGroup.hang`); a job whose ranks all show
one stack (a long checkpoint write, say) is logged and watched on - the next look comes another
``hang_after_s`` later. Every look is one line of ``hangs.jsonl`` in the state directory.

On several nodes (``exchange``, :mod:`failslow.node.stack_exchange`) one node's stacks cannot
name anyone: all of its ranks wait alike while the stuck rank is elsewhere. Node 0's watch then
opens a look the other nodes answer with their ranks' quiet time and stacks, aggregates the
union with the job's topology and publishes the verdict; each node evicts the named ranks it
holds. A node whose ranks still progress makes the look "not hung". The other nodes' watches
only track their ranks' quiet time (:attr:`HangWatch.quiet`), which their answers carry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.ring import HEADER_DTYPE

_KIND_NAMES = {"pp": "pipeline(s)", "dp": "DP group(s)", "tp": "TP group(s)",
               "host": "machine(s)", "ranks": "ranks"}  # fmt: skip


@dataclass
class HangWatch:
    ring_dir: Path
    hang_after_s: float
    state_dir: Path | None = None
    topology: Callable[[], Any] = lambda: None
    """The job's topology when known (the control store's job record), else None."""
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    every_s: float = 0.5
    """Rings are read at most this often (the launcher's loop calls :meth:`check` more)."""
    _last: dict[int, tuple[int, float]] = field(default_factory=dict)
    _next_look: float = 0.0
    _checked: float = float("-inf")
    _stepped: set[int] = field(default_factory=set)
    """Ranks whose ring holds a step marker (training runs there)."""
    _readers: dict[Path, Any] = field(default_factory=dict)
    exchange: Any = None
    """Stack aggregation across the job's nodes (:class:`~failslow.node.stack_exchange.
    StackExchange`; None: one node)."""
    quiet: float | None = None
    """How long this node's ranks have committed no collective, as of the last check (None:
    not every rank finished a first step)."""

    def check(self, pids: Mapping[int, int]) -> list[int] | None:
        """One check of the ranks ``pids`` (rank -> pid): the ranks to evict when they hang
        and stack aggregation names them, else None."""
        now = self.clock()
        if now - self._checked < self.every_s:
            return None
        self._checked = now
        quiet = self.quiet = self._quiet(pids, now)
        if self.exchange is not None and not self.exchange.leads:
            return None  # node 0 looks; this node answers (its exchange, with ``quiet``)
        if quiet is None or quiet < self.hang_after_s or now < self._next_look:
            return None
        self._next_look = now + self.hang_after_s  # look again later if nothing stood out
        return self._localize(pids, quiet)

    def _quiet(self, pids: Mapping[int, int], now: float) -> float | None:
        """How long no rank of ``pids`` committed a collective (0 when one just did; None
        before every rank finished a first step)."""
        if not self._armed(pids):
            return None
        progressed = False
        for rank, pid in pids.items():
            words = _header(self.ring_dir, rank, pid)
            if words is None:
                continue
            written, parked = words
            last = self._last.get(rank)
            if parked or last is None or last[0] != written:  # a pause holds the ranks
                self._last[rank] = (written, now)
                progressed = True
        if progressed:
            self._next_look = max(self._next_look, now + self.hang_after_s)
            return 0.0
        if not self._last:
            return None
        return now - max(t for _, t in self._last.values())

    def _armed(self, pids: Mapping[int, int]) -> bool:
        """Whether every rank finished an optimizer step in this launch (reads each ring's
        records only until its first step marker)."""
        from failslow.core.events import is_marker
        from failslow.core.ring import RingFormatError, RingReader

        for rank, pid in pids.items():
            if rank in self._stepped:
                continue
            for path in Path(self.ring_dir).glob(f"rank{rank:05d}-pid{pid}*.ring"):
                try:
                    reader = self._readers.get(path) or RingReader(path)
                except (OSError, RingFormatError):
                    continue
                self._readers[path] = reader
                if is_marker(reader.poll()).any():
                    self._stepped.add(rank)
            if rank not in self._stepped:
                return False
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        return True

    def _localize(self, pids: Mapping[int, int], quiet: float) -> list[int] | None:
        from failslow.core.diagnosis.stacks import aggregate
        from failslow.node.stack_exchange import HANG
        from failslow.node.stacks import capture

        started = time.monotonic()
        exchange = self.exchange
        look = exchange.ask(HANG, self.hang_after_s / 2) if exchange is not None else None
        stacks = capture(pids, native=False)
        world = len(pids)
        other: dict[str, Any] = {}
        if look is not None:
            stacks, answers = exchange.gather(look, stacks)
            world *= exchange.nodes.options.nnodes
            other = {"look": look, "missing": answers["missing"], "busy": [
                k for k, q in answers["quiet"].items() if q is None or q < self.hang_after_s / 2
            ]}  # fmt: skip
        try:
            topology = self.topology()
        except Exception:  # the store may be gone with the job; ranks then name themselves
            topology = None
        if topology is not None and topology.world_size != world:
            topology = None
        found = aggregate(stacks, topology)
        took = time.monotonic() - started
        suspects = found.suspects if not other.get("busy") else None
        where = f"{len(stacks)} processes"
        if look is not None:
            nnodes = exchange.nodes.options.nnodes
            where += f" on {nnodes - len(other['missing'])} of {nnodes} nodes"
            if other["missing"]:
                where += f" (nodes {other['missing']} did not answer)"
        head = f"hang: no collective on any rank for {quiet:.1f} s"
        if other.get("busy"):
            self.say(f"{head}, but the ranks of nodes {other['busy']} still progress - watching on")
        elif suspects is None:
            what = "nothing stands out" if not found.undecided else "no dominant stack"
            self.say(f"{head}; stack aggregation of {where} in {took:.2f} s: {what} - watching on")
        else:
            self.say(
                f"{head}; stack aggregation of {where} in {took:.2f} s: outliers "
                f"{list(found.outliers)}, sharing {_KIND_NAMES.get(suspects.kind, suspects.kind)} "
                f"{[list(g) for g in suspects.groups]} - evicting ranks {list(suspects.ranks)}"
            )
        named = list(suspects.ranks) if suspects is not None else []
        if look is not None:
            exchange.decide(look, named, "hung")
        self._record(quiet, took, {**found.to_dict(), **other})
        mine = [r for r in named if r in pids]
        return mine or None

    def _record(self, quiet: float, took: float, aggregation: dict[str, Any]) -> None:
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        line = {"wall": time.time(), "quiet_s": quiet, "aggregation_s": took, **aggregation}
        with open(self.state_dir / "hangs.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def _header(ring_dir: Path, rank: int, pid: int) -> tuple[int, int] | None:
    """``(write_index, parked)`` of the rank's rings (the C shim's and the hook's, summed), or
    None when it has none yet."""
    found = None
    for path in Path(ring_dir).glob(f"rank{rank:05d}-pid{pid}*.ring"):
        try:
            with open(path, "rb") as f:
                header = np.frombuffer(f.read(HEADER_DTYPE.itemsize), dtype=HEADER_DTYPE)
        except (OSError, ValueError):
            continue
        if len(header):
            written, parked = int(header["write_index"][0]), int(header["parked"][0])
            found = (written, parked) if found is None else (found[0] + written, found[1] or parked)
    return found
