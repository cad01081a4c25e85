"""Stack aggregation: which parallel group a hang or an MFU decline sits in (byterobust 5.1).

When a job hangs, or slows down everywhere at once, no metric names a machine. byterobust then
takes the stack traces of every training process and of its children (data loader workers,
checkpoint processes) and, assuming most healthy processes show the same stack under a single
implicit failure:

1. groups them by string matching (:func:`signature`: each frame's function and file, innermost
   first; line numbers and native addresses, which differ between identical states, dropped);
2. takes the dominant group of each process kind (training processes, children) as healthy and
   every other group as outliers - a tie for the largest leaves the kind undecided, and nothing
   is evicted on it (half a cluster is not over-evicted on a coin toss);
3. finds the parallel group the outliers share and marks it for over-eviction
   (:func:`shared_group`): of the TP, PP and DP groups and the machines, the kind whose groups
   holding an outlier span the fewest machines (then ranks) - one PP group in the paper's
   Fig. 7, where a stalled last stage leaves its pipeline in ``isend``/``irecv`` and
   ``all_gather``.

For an MFU decline the aggregation is repeated every few seconds; each round (here: a few
stack samples) flags the group with the most outliers and, after ``rounds`` rounds, the most
flagged group is the degrader if it was flagged in more than half of them (:class:`DeclineTally`,
5.1's last paragraph).

Cost: one pass over the stacks (a dict of signatures) and O(outliers + groups touched) for the
shared group; 1,024 ranks' stacks aggregate in milliseconds (benchmarks/stack_aggregation.py).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from failslow.core.topology import Topology

RANK = "rank"
"""The kind of a training process (the rank itself); its children are ``child``."""
CHILD = "child"
_ADDRESS = re.compile(r"^(0x[0-9a-fA-F]+|\?\?)$")
KINDS = ("pp", "dp", "tp", "host")
"""Parallel-group kinds a shared group may be, in the order that breaks ties."""


@dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int = 0


@dataclass(frozen=True, slots=True)
class ProcessStack:
    """One process's stack as captured (py-spy), innermost frame first."""

    rank: int
    pid: int
    kind: str
    """:data:`RANK` or :data:`CHILD`."""
    frames: tuple[Frame, ...]
    """The main thread's frames, innermost first."""
    error: str = ""
    """Why no stack was read ("" when one was)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON for another node's aggregation (:meth:`from_dict` reads it back)."""
        frames = [[f.function, f.file, f.line] for f in self.frames]
        return {"rank": self.rank, "pid": self.pid, "kind": self.kind, "frames": frames,
                "error": self.error}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProcessStack:
        frames = tuple(Frame(str(fn), str(file), int(line)) for fn, file, line in d["frames"])
        return cls(int(d["rank"]), int(d["pid"]), str(d["kind"]), frames, str(d.get("error", "")))


def signature(frames: Iterable[Frame]) -> str:
    """The string stacks are matched on: ``function (file)`` per frame, innermost first, native
    frames that are only an address left out."""
    kept = (f"{f.function} ({f.file})" for f in frames if not _ADDRESS.match(f.function))
    return " <- ".join(kept)


@dataclass(frozen=True, slots=True)
class StackGroup:
    kind: str
    signature: str
    ranks: tuple[int, ...]
    """The ranks with a process of this group (each once)."""
    processes: int
    healthy: bool | None
    """True: the dominant group of its kind; False: an outlier; None: its kind had a tie."""
    frames: tuple[Frame, ...]
    """One member's frames (for display)."""


@dataclass(frozen=True, slots=True)
class SharedGroup:
    kind: str
    """``pp``, ``dp``, ``tp``, ``host``, or ``ranks`` when no topology is known."""
    groups: tuple[tuple[int, ...], ...]
    """The groups of that kind holding an outlier."""
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "groups": [list(g) for g in self.groups],
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
        }


@dataclass(frozen=True, slots=True)
class Aggregation:
    groups: tuple[StackGroup, ...]
    """Largest first within each kind."""
    outliers: tuple[int, ...]
    """Ranks with a process in an outlier group."""
    undecided: tuple[str, ...] = ()
    """Kinds whose largest groups tied (no healthy group known)."""
    suspects: SharedGroup | None = None
    """What to over-evict: None when nothing stands out, or a kind was undecided."""
    unreadable: tuple[tuple[int, int, str], ...] = ()
    """``(rank, pid, why)`` of processes whose stack could not be read."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [
                {
                    "kind": g.kind,
                    "healthy": g.healthy,
                    "processes": g.processes,
                    "ranks": list(g.ranks),
                    "signature": g.signature,
                }
                for g in self.groups
            ],
            "outliers": list(self.outliers),
            "undecided": list(self.undecided),
            "suspects": None if self.suspects is None else self.suspects.to_dict(),
            "unreadable": [list(u) for u in self.unreadable],
        }


def aggregate(stacks: Sequence[ProcessStack], topology: Topology | None = None) -> Aggregation:
    """Group ``stacks`` by :func:`signature` per process kind, mark the dominant group of each
    kind healthy and find the parallel group the outliers share (see the module)."""
    members: dict[tuple[str, str], list[ProcessStack]] = collections.defaultdict(list)
    unreadable = []
    for s in stacks:
        if s.error:
            unreadable.append((s.rank, s.pid, s.error))
            continue
        members[(s.kind, signature(s.frames))].append(s)
    by_kind: dict[str, list[tuple[str, list[ProcessStack]]]] = collections.defaultdict(list)
    for (kind, sig), procs in members.items():
        by_kind[kind].append((sig, procs))
    groups: list[StackGroup] = []
    undecided: list[str] = []
    outliers: set[int] = set()
    for kind in sorted(by_kind, key=lambda k: (k != RANK, k)):
        entries = sorted(by_kind[kind], key=lambda e: (-_weight(e[1]), e[0]))
        tie = len(entries) > 1 and _weight(entries[0][1]) == _weight(entries[1][1])
        if tie:
            undecided.append(kind)
        for i, (sig, procs) in enumerate(entries):
            healthy = None if tie else i == 0
            ranks = tuple(sorted({p.rank for p in procs}))
            if healthy is False:
                outliers.update(ranks)
            groups.append(StackGroup(kind, sig, ranks, len(procs), healthy, procs[0].frames))
    suspects = None
    if outliers and not undecided:
        suspects = shared_group(sorted(outliers), topology)
    return Aggregation(
        groups=tuple(groups),
        outliers=tuple(sorted(outliers)),
        undecided=tuple(undecided),
        suspects=suspects,
        unreadable=tuple(unreadable),
    )


def _weight(procs: Sequence[ProcessStack]) -> int:
    """A group's size: its distinct ranks (a rank's several workers count once)."""
    return len({p.rank for p in procs})


def group_of(topology: Topology, kind: str, rank: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s group of ``kind`` (``pp``, ``dp``, ``tp`` or ``host``)."""
    t, d, p = topology.coords[rank]
    if kind == "pp":
        return tuple(topology.pp_group(t, d))
    if kind == "dp":
        return tuple(topology.dp_group(t, p))
    if kind == "tp":
        return tuple(topology.tp_group(d, p))
    if kind == "host":
        return tuple(topology.ranks_on(topology.hosts[rank]))
    raise ValueError(f"unknown group kind {kind!r}")


def shared_group(outliers: Sequence[int], topology: Topology | None) -> SharedGroup:
    """The parallel group the ``outliers`` share: of the kinds in :data:`KINDS` (but those of a
    dimension of size 1, whose groups are single ranks), the one whose groups that hold an
    outlier span the fewest machines, then the fewest ranks (ties in :data:`KINDS` order);
    every machine of those ranks is to be over-evicted. Without a topology: the outliers
    themselves. O(outliers x group size)."""
    if topology is None:
        return SharedGroup("ranks", (tuple(outliers),), tuple(outliers), ())
    best: tuple[int, int, int, str, tuple[tuple[int, ...], ...]] | None = None
    for order, kind in enumerate(KINDS):
        if kind != "host" and len(group_of(topology, kind, outliers[0])) == 1:
            continue  # a dimension of size 1 (PP 1, say): its "groups" are single ranks
        found: dict[tuple[int, ...], None] = {}
        for rank in outliers:
            found.setdefault(group_of(topology, kind, rank), None)
        covered = {r for g in found for r in g}
        machines = len({topology.hosts[r] for r in covered})
        key = (machines, len(covered), order, kind, tuple(found))
        if best is None or key[:3] < best[:3]:
            best = key
    assert best is not None
    kind, chosen = best[3], best[4]
    ranks = tuple(sorted({r for g in chosen for r in g}))
    hosts = tuple(sorted({topology.hosts[r] for r in ranks}))
    return SharedGroup(kind, chosen, ranks, hosts)


@dataclass
class DeclineTally:
    """byterobust 5.1 for an MFU decline: every round flags the parallel group with the most
    outliers; after ``rounds`` rounds the most flagged one is the degrader.

    A round here is several stack samples (:meth:`add` takes them together): one dump of a
    rank that alternates between waiting and computing lands in either phase by chance, while
    a degrader is an outlier in most of them, so a round sums the outliers of its samples per
    group before it flags one. A round whose two most-outlying groups tie flags nobody."""

    rounds: int = 5
    flags: collections.Counter[tuple[str, tuple[int, ...]]] = field(
        default_factory=collections.Counter
    )
    seen: int = 0

    def add(
        self, samples: Sequence[Aggregation], topology: Topology | None
    ) -> tuple[str, tuple[int, ...]]:
        """Count one round of one or more samples; returns the group it flags
        (``("none", ())`` if nothing stood out, or two groups tied)."""
        self.seen += 1
        flagged = round_flag(samples, topology)
        if flagged[1]:
            self.flags[flagged] += 1
        return flagged

    @property
    def done(self) -> bool:
        return self.seen >= self.rounds

    def degrader(self) -> tuple[str, tuple[int, ...]] | None:
        """The most flagged group once ``rounds`` rounds ran - None before, or when no group
        was flagged in more than half of them: on a shared machine a round now and then flags
        a healthy group, and an over-eviction on it costs a restart."""
        if not self.done or not self.flags:
            return None
        group, flags = max(self.flags.items(), key=lambda kv: (kv[1], -min(kv[0][1])))
        return group if flags * 2 > self.rounds else None


def round_flag(
    samples: Sequence[Aggregation], topology: Topology | None
) -> tuple[str, tuple[int, ...]]:
    """The group one round flags: per sample, each outlier counts for its group of the kind
    the sample's outliers share (:func:`shared_group`); the group with the most counts over
    the samples, ``("none", ())`` when no sample had a decided outlier or the top two tie."""
    per_group: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()
    for sample in samples:
        if not sample.outliers or sample.undecided:
            continue
        kind = (sample.suspects or shared_group(sample.outliers, topology)).kind
        for rank in sample.outliers:
            key = group_of(topology, kind, rank) if topology and kind in KINDS else (rank,)
            per_group[(kind, key)] += 1
    ranked = per_group.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return ("none", ())
    return ranked[0][0]


def frames_from_py_spy(threads: Sequence[Mapping[str, Any]], pid: int) -> tuple[Frame, ...]:
    """The main thread's frames of one ``py-spy dump --json`` process (innermost first); the
    first thread when none is the main one (py-spy lists threads it can read)."""
    if not threads:
        return ()
    main = next((t for t in threads if t.get("os_thread_id") == pid), threads[0])
    return tuple(
        Frame(
            str(f.get("name", "?")),
            str(f.get("short_filename") or f.get("filename") or "?"),
            int(f.get("line") or 0),
        )
        for f in main.get("frames", ())
    )
