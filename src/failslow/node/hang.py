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

On several nodes (``nodes``, :mod:`failslow.node.nodes`) one node's stacks cannot name anyone:
all of its ranks wait alike while the stuck rank is elsewhere. Node 0's watch then opens a look
the other nodes answer with their ranks' quiet time and stacks, aggregates the union with the
job's topology and publishes the verdict; each node evicts the named ranks it holds. A node
whose ranks still progress makes the look "not hung". The other nodes' watches never open a
look; they read node 0's look counter at each check (one store read).
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
    nodes: Any = None
    """The job's other nodes (:class:`failslow.node.nodes.NodeGroup`; None: one node)."""
    launch: int = 0
    """The launch watched (its looks are keyed by it)."""
    answer_timeout_s: float = 20.0
    """How long node 0 waits for the other nodes' answers to a look (each dumps its own ranks'
    stacks, py-spy's timeout being 10 s)."""
    _answered: int = 0
    _pending: tuple[int, float] | None = None
    """The look this node answered and awaits node 0's verdict on, and when."""
    _trouble: bool = False

    def check(self, pids: Mapping[int, int]) -> list[int] | None:
        """One check of the ranks ``pids`` (rank -> pid): the ranks to evict when they hang
        and stack aggregation names them, else None."""
        now = self.clock()
        if now - self._checked < self.every_s:
            return None
        self._checked = now
        quiet = self._quiet(pids, now)
        if self.nodes is not None and self.nodes.node_rank != 0:
            return self._follow(pids, quiet, now)
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

    def _follow(self, pids: Mapping[int, int], quiet: float | None, now: float) -> list[int] | None:
        """Another node than 0: answer node 0's new look, then act on its verdict."""
        from failslow.errors import FailslowError
        from failslow.node.stacks import capture

        nodes = self.nodes
        try:
            if self._pending is not None:
                look, since = self._pending
                verdict = nodes.hang_verdict(self.launch, look)
                if verdict is None:
                    if now - since > 2 * self.answer_timeout_s:
                        self._pending = None  # node 0 gave up on it
                    return None
                self._pending = None
                named = [int(r) for r in verdict.get("ranks", [])]
                mine = [r for r in named if r in pids]
                if mine:
                    self.say(f"hang: node 0's look {look} named ranks {named}: evicting this "
                             f"node's {mine}")  # fmt: skip
                return mine or None
            look = nodes.hang_looks(self.launch)
            if look <= self._answered:
                return None
            self._answered = look
            stuck = quiet is not None and quiet >= self.hang_after_s / 2
            stacks = capture(pids, native=False) if stuck else []
            answer = {"quiet_s": quiet, "stacks": [s.to_dict() for s in stacks]}
            nodes.answer_hang_look(self.launch, look, answer)
            self._pending = (look, now)
        except (FailslowError, ValueError) as exc:
            self._store_trouble(exc)
        return None

    def _store_trouble(self, exc: Exception) -> None:
        if not self._trouble:
            self._trouble = True
            self.say(f"hang: the job's store is away ({exc}): this node's own view only")

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
        from failslow.node.stacks import capture

        started = time.monotonic()
        look = self._open_look()
        stacks = capture(pids, native=False)
        world = len(pids)
        other: dict[str, Any] = {}
        if look is not None:
            stacks, other = self._gather(look, stacks)
            world *= self.nodes.options.nnodes
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
            answered = self.nodes.options.nnodes - len(other["missing"])
            where += f" on {answered} of {self.nodes.options.nnodes} nodes"
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
            self._decide(look, named)
            other["look"] = look
        self._record(quiet, took, {**found.to_dict(), **other})
        mine = [r for r in named if r in pids]
        return mine or None

    def _open_look(self) -> int | None:
        """Node 0 of several: the number of the look it opens (None: one node, or no store)."""
        from failslow.errors import FailslowError

        if self.nodes is None:
            return None
        try:
            return int(self.nodes.open_hang_look(self.launch))
        except (FailslowError, ValueError) as exc:
            self._store_trouble(exc)
            return None

    def _gather(self, look: int, stacks: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """This node's ``stacks`` and the other nodes' answers to ``look``: every stack, and
        which nodes did not answer (``missing``) or still progress (``busy``)."""
        from failslow.core.diagnosis.stacks import ProcessStack
        from failslow.errors import FailslowError

        nnodes = self.nodes.options.nnodes
        try:
            answers = self.nodes.hang_answers(self.launch, look, self.answer_timeout_s)
        except (FailslowError, ValueError) as exc:
            self._store_trouble(exc)
            answers = {}
        busy = []
        for node, answer in sorted(answers.items()):
            quiet = answer.get("quiet_s")
            if quiet is None or float(quiet) < self.hang_after_s / 2:
                busy.append(node)
            stacks = stacks + [ProcessStack.from_dict(d) for d in answer.get("stacks", [])]
        missing = [k for k in range(1, nnodes) if k not in answers]
        return stacks, {"busy": busy, "missing": missing}

    def _decide(self, look: int, named: list[int]) -> None:
        from failslow.errors import FailslowError

        try:
            self.nodes.decide_hang_look(self.launch, look, {"ranks": named})
        except (FailslowError, ValueError) as exc:
            self._store_trouble(exc)

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
