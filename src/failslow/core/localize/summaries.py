"""Per-node group summaries: what a node's analyzer publishes for cross-group profiling.

greyhound 4.3 (Profiling): every worker node measures "the execution time of each communication
group" and the master's GlobalAnalyzer compares groups; falcon 4.3: those measurements must tell
waiting from transfer. :func:`summarize` turns one rank's records into :class:`GroupSummary`
records - one per (group, op, bytes), each with a bounded list of recent calls (when each call
could run, how long it took) that the controller lines up per collective instance
(:mod:`failslow.core.localize.profiling`). :class:`GroupSummarizer` keeps a bounded history of
one rank's final (issue-ordered) records and summarizes its last iterations on request, cheap
enough for once per iteration. Raw events never leave the node. The iteration boundaries come
from the rank's :class:`~failslow.core.tracking.IterationTracker`; until it has found them, the
last ``seconds`` of history are summarized instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.arrays import median, one_of
from failslow.core.events import (
    MARKER_OPS,
    RECORD_DTYPE,
    CommEvent,
    Flags,
    GroupInfo,
    OpCode,
    events_to_records,
)
from failslow.core.group_files import groups_path, read_groups
from failslow.core.topology import host_name

P2P = "p2p"
_P2P_OPS = (int(OpCode.SEND), int(OpCode.RECV))
_NEEDED = ("t_start_ns", "t_end_ns", "nbytes", "group_key", "call_index", "op", "flags", "peer")
_SKIPPED_OPS = (int(OpCode.UNKNOWN), int(OpCode.GROUP_START), int(OpCode.GROUP_END), *MARKER_OPS)


def op_label(op: int) -> str:
    """The op name used in summaries: send and recv are both ``"p2p"`` (two ends of one call)."""
    if int(op) in _P2P_OPS:
        return P2P
    return OpCode(int(op)).label if int(op) in OpCode._value2member_map_ else "unknown"


# -- per-rank summaries ---------------------------------------------------------------------------


@dataclass(slots=True)
class GroupSummary:
    """What one rank measured for one kind of call (group, op, bytes) over a recent window.

    Plain data, JSON-serialisable (:meth:`to_json`): this is what a node publishes to the
    controller instead of raw events. The per-call lists hold the most recent calls of the window
    (at most ``max_calls``), enough for the controller to line members up per instance.
    """

    rank: int  # global rank that measured
    group_key: int
    op: str  # OpCode label; "p2p" for send and recv
    nbytes: int  # payload bytes per call (this rank's input)
    group_size: int  # members of the group (2 for a p2p link); 0 if unknown
    member: int = -1  # this rank's position in the group's rank order, -1 if unknown
    peer: int = -1  # p2p: the other end's global rank
    role: str | None = None
    host: str = ""  # clock domain of start_ns; "" = compare durations only
    calls: int = 0  # calls of this kind in the window (the lists may hold fewer)
    iterations: int = 0  # iterations the window spans; 0 when the window is time-based
    iteration_s: float = 0.0  # this rank's median iteration time in the window; 0 if unknown
    window_s: float = 0.0
    median_duration_s: float = 0.0  # what the rank saw: waiting plus transfer
    min_duration_s: float = 0.0  # a lower bound of the transfer time from this rank alone
    arrival_offset_s: float = 0.0  # median arrival after the iteration anchor; 0 if unknown
    call_index: list[int] = field(default_factory=list)
    start_ns: list[int] = field(default_factory=list)  # arrival: when the call could run
    duration_ns: list[int] = field(default_factory=list)  # end - arrival

    @property
    def link(self) -> tuple[int, int] | None:
        if self.op != P2P or self.peer < 0:
            return None
        return (min(self.rank, self.peer), max(self.rank, self.peer))

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name in ("call_index", "start_ns", "duration_ns"):  # copies, as asdict makes
            out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> GroupSummary:
        known = cls.__dataclass_fields__
        unknown = sorted(set(obj) - set(known))
        if unknown:
            raise ValueError(
                f"GroupSummary: unknown field(s) {unknown}; expected some of {sorted(known)}"
            )
        return cls(**dict(obj))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> GroupSummary:
        return cls.from_dict(json.loads(text))


def _as_records(events: np.ndarray | Sequence[CommEvent]) -> np.ndarray:
    if isinstance(events, np.ndarray):
        missing = [f for f in _NEEDED if f not in (events.dtype.names or ())]
        if missing:
            raise ValueError(f"records must have RECORD_DTYPE fields; missing {missing}")
        return events
    return events_to_records(events)


def _ready_times(starts: np.ndarray, ends: np.ndarray, keys: np.ndarray, coll: np.ndarray) -> Any:
    """When each call could run: a communicator runs its collectives in issue order, so a call
    issued while the previous one of its group is still running starts when that one ends."""
    ready = starts.copy()
    for key in np.unique(keys[coll]):
        idx = np.flatnonzero(coll & (keys == key))  # already in start order
        if idx.size > 1:
            prev_end = np.maximum.accumulate(ends[idx])[:-1]
            ready[idx[1:]] = np.maximum(starts[idx[1:]], prev_end)
    return ready


def summarize(
    events: np.ndarray | Sequence[CommEvent],
    groups: Mapping[int, GroupInfo],
    *,
    window: tuple[int, int],
    rank: int,
    host: str = "",
    iteration_ends_ns: Sequence[int] | np.ndarray | None = None,
    max_calls: int = 32,
) -> list[GroupSummary]:
    """One rank's :class:`GroupSummary` records for the calls it issued inside ``window``.

    ``events`` are the rank's records (ring records or CommEvents, any order; earlier records
    than the window help to place the first calls), ``groups`` its GroupInfo by key, ``window``
    ``(start_ns, end_ns)`` on the rank's monotonic clock, ``iteration_ends_ns`` the anchor times
    that close its iterations (from the iteration tracker), if known. Calls without an end time
    or that failed are left out.
    """
    if max_calls <= 0:
        raise ValueError(f"max_calls must be positive, got {max_calls}")
    recs = _as_records(events)
    ok = (recs["t_end_ns"] > 0) & ((recs["flags"] & int(Flags.FAILED)) == 0)
    ok &= ~one_of(recs["op"], _SKIPPED_OPS)
    recs = recs[ok]
    recs = recs[np.argsort(recs["t_start_ns"], kind="stable")]
    if not len(recs):
        return []
    starts = recs["t_start_ns"].astype(np.int64)
    ends = recs["t_end_ns"].astype(np.int64)
    keys = recs["group_key"].astype(np.uint64)
    ops = recs["op"].astype(np.int64)
    is_p2p = one_of(ops, _P2P_OPS)
    ready = _ready_times(starts, ends, keys, ~is_p2p)
    t0, t1 = int(window[0]), int(window[1])
    inside = (starts >= t0) & (starts < t1)
    if not inside.any():
        return []
    anchors = np.asarray(iteration_ends_ns if iteration_ends_ns is not None else [], np.int64)
    in_window = anchors[(anchors >= t0) & (anchors <= t1)]
    iterations = max(0, in_window.size - 1)
    iteration_s = median(np.diff(in_window)) / 1e9 if iterations else 0.0

    labels = np.where(is_p2p, -1, ops)  # send and recv are one kind
    peers = np.where(is_p2p, recs["peer"].astype(np.int64), -1)
    nbytes = recs["nbytes"].astype(np.int64)
    sel = np.flatnonzero(inside)
    kinds = np.empty(sel.size, dtype=[("g", "<u8"), ("op", "<i8"), ("b", "<i8"), ("p", "<i8")])
    kinds["g"], kinds["op"] = keys[sel], labels[sel]
    kinds["b"], kinds["p"] = nbytes[sel], peers[sel]
    uniq, inverse = np.unique(kinds, return_inverse=True)
    inverse = inverse.ravel()
    out = []
    for k, (gkey, op, nb, peer) in enumerate(uniq.tolist()):
        idx = sel[inverse == k]
        info = groups.get(int(gkey))
        first_op = int(ops[idx[0]])
        dur = ends[idx] - ready[idx]
        tail = idx[-max_calls:]
        offset = 0.0
        if anchors.size:
            pos = np.searchsorted(anchors, ready[idx], side="right") - 1
            has = pos >= 0
            if has.any():
                offset = median(ready[idx][has] - anchors[pos[has]]) / 1e9
        if op == -1:
            size, member = 2, (0 if rank < peer else 1)
        else:
            size = info.size if info is not None else 0
            member = info.ranks.index(rank) if info is not None and rank in info.ranks else -1
        out.append(
            GroupSummary(
                rank=rank,
                group_key=int(gkey),
                op=op_label(first_op),
                nbytes=int(nb),
                group_size=size,
                member=member,
                peer=int(peer),
                role=info.role if info is not None else None,
                host=host,
                calls=int(idx.size),
                iterations=iterations,
                iteration_s=iteration_s,
                window_s=(t1 - t0) / 1e9,
                median_duration_s=median(dur) / 1e9,
                min_duration_s=float(dur.min()) / 1e9,
                arrival_offset_s=offset,
                call_index=[int(c) for c in recs["call_index"][tail]],
                start_ns=ready[tail].tolist(),
                duration_ns=(ends[tail] - ready[tail]).tolist(),
            )
        )
    return out


# -- the node's side ------------------------------------------------------------------------------


class _Tail:
    """The newest ``size`` items of a stream of arrays, appended at O(new items) amortized:
    a buffer of twice the size whose live part is moved down once it fills (never a copy of
    the whole history per append - the analyzer adds to it on every poll)."""

    def __init__(self, size: int, dtype: Any) -> None:
        self.size = size
        self._buf = np.empty(2 * size, dtype=dtype)
        self._len = 0

    def add(self, items: np.ndarray) -> None:
        n = len(items)
        if n >= self.size:
            self._buf[: self.size] = items[-self.size :]
            self._len = self.size
            return
        if self._len + n > len(self._buf):
            keep = self.size - n
            self._buf[:keep] = self._buf[self._len - keep : self._len]
            self._len = keep
        self._buf[self._len : self._len + n] = items
        self._len += n

    def clear(self) -> None:
        self._len = 0

    def view(self) -> np.ndarray:
        """The newest ``size`` items, oldest first (a view: valid until the next add)."""
        return self._buf[max(0, self._len - self.size) : self._len]


class GroupSummarizer:
    """Recent records and iteration boundaries of one rank; summaries on demand."""

    def __init__(
        self,
        rank: int,
        ring: str | os.PathLike[str] | None = None,
        *,
        host: str | None = None,
        max_records: int = 1 << 14,
        max_anchors: int = 256,
        max_calls: int = 32,
    ) -> None:
        self.rank = rank
        self.ring = Path(ring) if ring is not None else None
        self.host = host_name() if host is None else host
        self.max_records = max_records
        self.max_anchors = max_anchors
        self.max_calls = max_calls
        self._records = _Tail(max_records, RECORD_DTYPE)
        self._anchors = _Tail(max_anchors, np.int64)
        self._groups: dict[int, GroupInfo] = {}
        self._groups_stat: tuple[int, int] | None = None

    def add(self, records: np.ndarray, iteration_ends_ns: np.ndarray | None = None) -> None:
        """Take the rank's newest final records and the anchors of iterations they closed."""
        if len(records):
            self._records.add(records)
        if iteration_ends_ns is not None and len(iteration_ends_ns):
            self._anchors.add(np.asarray(iteration_ends_ns, dtype=np.int64))

    def reset_iterations(self) -> None:
        """Forget iteration boundaries (the tracker re-detected the call pattern)."""
        self._anchors.clear()

    @property
    def groups(self) -> dict[int, GroupInfo]:
        """The rank's published groups, re-read only when the groups file changed."""
        if self.ring is None:
            return self._groups
        try:
            st = groups_path(self.ring).stat()
        except FileNotFoundError:
            return self._groups
        stamp = (st.st_size, st.st_mtime_ns)
        if stamp != self._groups_stat:
            self._groups = read_groups(self.ring)
            self._groups_stat = stamp
        return self._groups

    def set_groups(self, groups: dict[int, GroupInfo]) -> None:
        self._groups = dict(groups)

    def window(self, iterations: int = 5, seconds: float = 10.0) -> tuple[int, int, bool]:
        """``(start_ns, end_ns, by_iterations)`` of the last ``iterations`` whole iterations,
        or of the last ``seconds`` of history when fewer boundaries are known."""
        anchors, records = self._anchors.view(), self._records.view()
        if iterations > 0 and anchors.size > iterations:
            return int(anchors[-iterations - 1]), int(anchors[-1]), True
        if not len(records):
            return 0, 0, False
        newest = int(records["t_start_ns"].max())
        return newest - int(seconds * 1e9), newest + 1, False

    def summaries(self, *, iterations: int = 5, seconds: float = 10.0) -> list[GroupSummary]:
        """GroupSummary records of the last ``iterations`` iterations (or ``seconds``)."""
        t0, t1, by_iterations = self.window(iterations, seconds)
        if t1 <= t0:
            return []
        records = self._records.view()
        # Only calls that ended at or after the window's start can matter: a call that ended
        # before it can neither be in it nor delay a call in it (:func:`_ready_times`). The
        # history is kept long (``max_records``); the summary costs O(window), not O(history).
        records = records[records["t_end_ns"] >= t0]
        return summarize(
            records,
            self.groups,
            window=(t0, t1),
            rank=self.rank,
            host=self.host,
            iteration_ends_ns=self._anchors.view() if by_iterations else None,
            max_calls=self.max_calls,
        )
