"""Cross-group profiling: per-group summaries, comparable clusters, degraded groups, late ranks.

greyhound 4.3 (Profiling): "categorize communication profiles into *comparable clusters*, where
each communication group ... handles an identical data transfer volume"; a group is degraded
"if its execution time exceeds the median by over 10%". falcon 4.3 refines what is compared:
"a communication group that spent prolonged time in data transfer is likely experiencing
fail-slow degradation, while groups that eagerly wait for data (i.e., idling) suggest healthy
performance". A collective's duration on a rank includes waiting for the last member to arrive,
so this module separates the two:

* per collective instance (the same ``call_index`` of the same group on every member), the
  member that arrives last is found, the *transfer time* is measured from its arrival to the
  end, and every other member's extra duration is *waiting*;
* groups are compared on their transfer time (:func:`degraded_groups`, kind communication), so a
  group whose members mostly wait - long durations, short transfer - is healthy;
* a rank that is the last to arrive consistently across its groups is a compute suspect
  (:func:`late_ranks`, kind compute): everyone else waited for it.

Clocks. ``t_start_ns``/``t_end_ns`` are CLOCK_MONOTONIC of the writer's host: comparable between
ranks of one host, not across hosts. When every member of a group reported from the same host
(``clock="host"``) arrivals are the members' start times and the transfer time is the median
member end minus the last arrival. Otherwise (``clock="duration"``) only durations are used: the
members of one collective finish at about the same instant ``T`` (no one leaves before the data
of the last arrival went through), so member ``i`` arrived at ``T - d_i``; the last to arrive is
the member with the *shortest* duration, its duration is the transfer time, and member ``i``
waited ``d_i - d_min``. Neither needs synchronized clocks.

Scale: a node publishes one :class:`GroupSummary` (:mod:`failslow.core.localize.summaries`,
re-exported here) per (group, op, bytes) of each local rank - a bounded list of recent calls,
never raw events. :func:`group_profiles` is vectorized over all calls of all summaries (sorts,
segment reductions), so its cost is O(#calls log #calls) and never O(world^2);
:func:`degraded_groups` and :func:`late_ranks` are linear in the profiles.

Known gap: point-to-point calls merge across a pair only where ``call_index`` agrees on both
ends, that is on 2-rank groups (one communicator per pipeline link). Send/recv on a larger group
are summarized per link but their instances do not align, so such links get no profile.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from failslow.core.localize.summaries import P2P, GroupSummary, op_label, summarize

__all__ = [
    "P2P",
    "GroupProfile",
    "GroupSummary",
    "Suspect",
    "bytes_bucket",
    "comparable_clusters",
    "degraded_groups",
    "group_profiles",
    "late_ranks",
    "op_label",
    "summarize",
]


def bytes_bucket(nbytes: int) -> int:
    """Quarter-octave size class: equal sizes always share one, sizes within ~19% usually do."""
    return 0 if nbytes <= 0 else 1 + math.floor(4 * math.log2(nbytes))


# -- combining the members of each group ----------------------------------------------------------


@dataclass(slots=True)
class GroupProfile:
    """One group's calls of one kind, combined over all members that reported them."""

    group_key: int
    op: str
    nbytes: int
    group_size: int
    ranks: tuple[int, ...]  # members that reported, in group order where known
    link: tuple[int, int] | None  # p2p: the pair
    role: str | None
    clock: str  # "host" (start times compared) or "duration" (durations only)
    instances: int  # collective instances seen by at least two members
    complete: bool  # every instance had every member of the group
    transfer_s: float  # median over instances: end - arrival of the last member
    duration_s: float  # median over instances of the members' mean duration
    wait_s: float  # median over instances of the members' mean wait for the last arrival
    iteration_s: float  # median iteration time of the members; 0 if unknown
    last_counts: dict[int, int]  # rank -> instances at which it arrived last
    lateness_s: dict[int, float]  # rank -> mean lead of its arrival over the next-latest member
    wait_by_rank: dict[int, float] = field(default_factory=dict)  # rank -> mean wait per call
    calls_per_s: float = 0.0  # how often the group makes this call (members' median)

    @property
    def wait_fraction(self) -> float:
        """Share of the mean duration spent waiting (falcon 4.3: high = idling = healthy)."""
        return self.wait_s / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def cluster_key(self) -> tuple[str, int, int]:
        return (self.op, bytes_bucket(self.nbytes), self.group_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_counts"] = {str(k): v for k, v in self.last_counts.items()}
        d["lateness_s"] = {str(k): v for k, v in self.lateness_s.items()}
        d["wait_by_rank"] = {str(k): v for k, v in self.wait_by_rank.items()}
        return d


def _median_by_segment(seg: np.ndarray, values: np.ndarray, nseg: int) -> np.ndarray:
    """Median of ``values`` within each segment id 0..nseg-1 (every id present)."""
    order = np.lexsort((values, seg))
    v = values[order]
    counts = np.bincount(seg, minlength=nseg)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    lo = first + (counts - 1) // 2
    hi = first + counts // 2
    return (v[lo] + v[hi]) / 2.0


@dataclass(slots=True)
class _Calls:
    """Every call of every summary as flat arrays, and what is known per unit (a group, or
    one link of a group for point-to-point calls)."""

    unit: np.ndarray
    rank: np.ndarray
    opid: np.ndarray
    nbytes: np.ndarray
    call_index: np.ndarray
    start: np.ndarray
    duration: np.ndarray
    unit_keys: list[tuple[int, int, int]]  # (group_key, link lo, link hi) per unit
    unit_size: list[int]
    unit_host: list[str | None]  # the one host of every member, or None (duration clock)
    unit_role: list[str | None]
    unit_iters: list[list[float]]
    rates: dict[tuple[int, int, int], list[float]]  # (unit, op id, bytes) -> calls/s
    member_pos: dict[tuple[int, int], int]  # (unit, rank) -> position in the group
    op_ids: dict[str, int]


def _flatten(summaries: Iterable[GroupSummary]) -> _Calls | None:
    """The calls of every summary (each member's summary counted once), or None if none."""
    units: dict[tuple[int, int, int], int] = {}
    unit_size: list[int] = []
    unit_host: list[str | None] = []
    unit_role: list[str | None] = []
    unit_iters: list[list[float]] = []
    rates: dict[tuple[int, int, int], list[float]] = {}
    member_pos: dict[tuple[int, int], int] = {}
    op_ids: dict[str, int] = {}
    chunks_ci: list[list[int]] = []
    chunks_start: list[list[int]] = []
    chunks_dur: list[list[int]] = []
    per_summary: list[tuple[int, int, int, int]] = []  # unit, rank, op id, nbytes
    counts: list[int] = []
    seen: set[tuple[int, int, str, int, int]] = set()
    for s in summaries:
        calls = s.call_index
        n = len(calls)
        if n != len(s.start_ns) or n != len(s.duration_ns):
            n = min(n, len(s.start_ns), len(s.duration_ns))
            calls = calls[:n]
        who, op, peer = s.rank, s.op, s.peer
        ident = (who, s.group_key, op, s.nbytes, peer)
        if n == 0 or ident in seen:  # a summary published twice counts once
            continue
        seen.add(ident)
        p2p = op == P2P and peer >= 0
        ukey = (s.group_key, min(who, peer), max(who, peer)) if p2p else (s.group_key, -1, -1)
        u = units.get(ukey)
        if u is None:
            u = units[ukey] = len(unit_size)
            unit_size.append(2 if p2p else s.group_size)
            unit_host.append(s.host or None)
            unit_role.append(s.role)
            unit_iters.append([])
        elif unit_host[u] != s.host:
            unit_host[u] = None
        if s.iteration_s > 0:
            unit_iters[u].append(s.iteration_s)
        member_pos[(u, who)] = s.member if s.member >= 0 else 1 << 30
        o = op_ids.get(op)
        if o is None:
            o = op_ids[op] = len(op_ids)
        per_summary.append((u, who, o, s.nbytes))
        if s.window_s > 0:
            rates.setdefault((u, o, s.nbytes), []).append(s.calls / s.window_s)
        counts.append(n)
        chunks_ci.append(calls)
        chunks_start.append(s.start_ns if len(s.start_ns) == n else s.start_ns[:n])
        chunks_dur.append(s.duration_ns if len(s.duration_ns) == n else s.duration_ns[:n])
    if not counts:
        return None
    reps = np.asarray(counts, dtype=np.int64)
    meta = np.asarray(per_summary, dtype=np.int64)
    total = int(reps.sum())
    return _Calls(
        unit=np.repeat(meta[:, 0], reps),
        rank=np.repeat(meta[:, 1], reps),
        opid=np.repeat(meta[:, 2], reps),
        nbytes=np.repeat(meta[:, 3], reps),
        call_index=np.fromiter(itertools.chain.from_iterable(chunks_ci), np.int64, total),
        start=np.fromiter(itertools.chain.from_iterable(chunks_start), np.int64, total),
        duration=np.fromiter(itertools.chain.from_iterable(chunks_dur), np.int64, total),
        unit_keys=list(units),
        unit_size=unit_size,
        unit_host=unit_host,
        unit_role=unit_role,
        unit_iters=unit_iters,
        rates=rates,
        member_pos=member_pos,
        op_ids=op_ids,
    )


@dataclass(slots=True)
class _Instances:
    """Collective instances seen by at least two members: rows sorted by (unit, call_index,
    arrival), ``first``/``last`` index each instance's first and last-arriving row."""

    rank: np.ndarray  # per row
    arrival: np.ndarray  # per row
    row_inst: np.ndarray  # per row: its instance
    first: np.ndarray
    last: np.ndarray
    unit: np.ndarray  # per instance
    op: np.ndarray
    nbytes: np.ndarray
    transfer: np.ndarray  # ns: from the last arrival to the end
    mean_duration: np.ndarray
    wait: np.ndarray  # ns: members' mean wait for the last arrival
    margin: np.ndarray  # ns: the last arrival's lead over the next-latest
    complete: np.ndarray


def _instances(calls: _Calls) -> _Instances | None:
    """Line the calls up per instance; per instance find the last arrival, the transfer time
    and the members' waits, in the clock mode of its unit (module docstring)."""
    host_mode = np.asarray([h is not None for h in calls.unit_host], dtype=bool)
    hm = host_mode[calls.unit]
    start, dur = calls.start, calls.duration
    arrival = np.where(hm, start, -dur)  # duration mode: arrival = T - d, T common
    end = start + dur
    ci = calls.call_index
    order = np.lexsort((arrival, ci, calls.unit))
    unit, rank, opid, nb, ci, arrival, end, dur, hm = (
        a[order]
        for a in (calls.unit, calls.rank, calls.opid, calls.nbytes, ci, arrival, end, dur, hm)
    )
    new = np.ones(unit.size, dtype=bool)
    new[1:] = (unit[1:] != unit[:-1]) | (ci[1:] != ci[:-1])
    seg = np.cumsum(new) - 1
    seg_size = np.bincount(seg)
    shared = seg_size[seg] >= 2  # an instance seen by one member says nothing about the group
    unit, rank, opid, nb, arrival, end, dur, hm = (
        a[shared] for a in (unit, rank, opid, nb, arrival, end, dur, hm)
    )
    if not unit.size:
        return None
    size = seg_size[seg_size >= 2]
    first = np.concatenate(([0], np.cumsum(size)[:-1]))
    last = first + size - 1
    row_inst = np.repeat(np.arange(first.size), size)
    sum_arr = np.add.reduceat(arrival.astype(np.float64), first)
    host_transfer = _median_by_segment(row_inst, end.astype(np.float64), first.size)
    host_transfer -= arrival[last]
    return _Instances(
        rank=rank,
        arrival=arrival,
        row_inst=row_inst,
        first=first,
        last=last,
        unit=unit[first],
        op=opid[first],
        nbytes=np.maximum.reduceat(nb, first),
        transfer=np.where(hm[last], np.maximum(host_transfer, 0.0), dur[last].astype(np.float64)),
        mean_duration=np.add.reduceat(dur.astype(np.float64), first) / size,
        wait=arrival[last] - sum_arr / size,  # mean over members of (last arrival - arrival)
        margin=(arrival[last] - arrival[last - 1]).astype(np.float64),
        complete=size == np.asarray(calls.unit_size, dtype=np.int64)[unit[first]],
    )


def group_profiles(summaries: Iterable[GroupSummary]) -> list[GroupProfile]:
    """Combine every member's summaries into one :class:`GroupProfile` per group and call kind.

    Calls are lined up per instance by ``(group, call_index)`` (p2p: ``(link, call_index)``).
    Per instance the last arrival, the transfer time and every member's wait follow from the
    clock mode of the group (module docstring). Cost: a few sorts over all calls.
    """
    calls = _flatten(summaries)
    if calls is None:
        return []
    inst = _instances(calls)
    if inst is None:
        return []
    # streams: (unit, op, bytes) over instances
    sorder = np.lexsort((inst.nbytes, inst.op, inst.unit))
    su, so, sb = inst.unit[sorder], inst.op[sorder], inst.nbytes[sorder]
    snew = np.ones(sorder.size, dtype=bool)
    snew[1:] = (su[1:] != su[:-1]) | (so[1:] != so[:-1]) | (sb[1:] != sb[:-1])
    stream_of = np.empty(sorder.size, dtype=np.int64)
    stream_of[sorder] = np.cumsum(snew) - 1
    streams = list(zip(su[snew].tolist(), so[snew].tolist(), sb[snew].tolist(), strict=True))
    ns = len(streams)
    n_inst = np.bincount(stream_of, minlength=ns)
    med_transfer = _median_by_segment(stream_of, inst.transfer, ns)
    med_dur = _median_by_segment(stream_of, inst.mean_duration, ns)
    med_wait = _median_by_segment(stream_of, inst.wait, ns)
    all_complete = np.bincount(stream_of, weights=~inst.complete, minlength=ns) == 0

    # members of each stream, and who arrived last how often / by how much
    rank, arrival, row_inst, last = inst.rank, inst.arrival, inst.row_inst, inst.last
    pairs, pair_inv, pair_n = np.unique(
        stream_of[row_inst] * (1 << 32) + rank, return_inverse=True, return_counts=True
    )
    row_wait = (arrival[last][row_inst] - arrival).astype(np.float64)
    pair_wait = np.bincount(pair_inv.ravel(), weights=row_wait, minlength=pairs.size) / pair_n
    pair_stream, pair_rank = pairs >> 32, pairs & ((1 << 32) - 1)
    pair_first = np.searchsorted(pair_stream, np.arange(ns + 1))
    last_key = stream_of * (1 << 32) + rank[last]
    lk, lk_inv, lk_count = np.unique(last_key, return_inverse=True, return_counts=True)
    lk_margin = np.bincount(lk_inv.ravel(), weights=inst.margin, minlength=lk.size) / lk_count
    lk_first = np.searchsorted(lk >> 32, np.arange(ns + 1))
    lk_rank = lk & ((1 << 32) - 1)

    labels = {v: k for k, v in calls.op_ids.items()}
    # plain lists once: per-profile numpy slicing would dominate at thousands of groups
    p_rank, p_wait = pair_rank.tolist(), (pair_wait / 1e9).tolist()
    p_first, l_first = pair_first.tolist(), lk_first.tolist()
    l_rank, l_count, l_margin = lk_rank.tolist(), lk_count.tolist(), (lk_margin / 1e9).tolist()
    n_inst_l, complete_l = n_inst.tolist(), all_complete.tolist()
    med = (med_transfer / 1e9).tolist(), (med_dur / 1e9).tolist(), (med_wait / 1e9).tolist()
    iter_median = [_median(v) for v in calls.unit_iters]
    out = []
    for j, (u, o, b) in enumerate(streams):
        members = p_rank[p_first[j] : p_first[j + 1]]
        waits = dict(zip(members, p_wait[p_first[j] : p_first[j + 1]], strict=True))
        members.sort(key=lambda r: (calls.member_pos.get((u, r), 1 << 30), r))
        gkey, lo, hi = calls.unit_keys[u]
        lasts = l_rank[l_first[j] : l_first[j + 1]]
        size = calls.unit_size[u]
        out.append(
            GroupProfile(
                group_key=gkey,
                op=labels[o],
                nbytes=b,
                group_size=size,
                ranks=tuple(members),
                link=(lo, hi) if lo >= 0 else None,
                role=calls.unit_role[u],
                clock="host" if calls.unit_host[u] is not None else "duration",
                instances=n_inst_l[j],
                complete=complete_l[j] and len(members) == size,
                transfer_s=med[0][j],
                duration_s=med[1][j],
                wait_s=med[2][j],
                iteration_s=iter_median[u],
                last_counts=dict(zip(lasts, l_count[l_first[j] : l_first[j + 1]], strict=True)),
                lateness_s=dict(zip(lasts, l_margin[l_first[j] : l_first[j + 1]], strict=True)),
                wait_by_rank=waits,
                calls_per_s=_median(calls.rates.get((u, o, b), [])),
            )
        )
    return out


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


# -- suspects -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Suspect:
    """A group whose transfers are slow (communication) or a rank others wait for (compute)."""

    kind: str  # "communication" | "compute"
    ranks: tuple[int, ...]  # the group's members, or the one late rank
    slowdown: float  # communication: transfer / cluster median; compute: lateness / iteration
    group_key: int | None = None
    links: tuple[tuple[int, int], ...] = ()  # p2p: the pair; collectives: found by validation
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def comparable_clusters(
    profiles: Iterable[GroupProfile],
) -> dict[tuple[str, int, int], list[GroupProfile]]:
    """Profiles by comparable cluster: same op, same bytes bucket, same group size (greyhound
    4.3: e.g. all DP all-reduces of one bucket size). Clusters are never compared with each
    other."""
    clusters: dict[tuple[str, int, int], list[GroupProfile]] = {}
    for p in profiles:
        clusters.setdefault(p.cluster_key, []).append(p)
    return clusters


def degraded_groups(
    profiles: Iterable[GroupProfile],
    *,
    threshold: float = 1.1,
    min_instances: int = 3,
    min_excess_s: float = 0.0,
) -> list[Suspect]:
    """Groups whose transfer time exceeds their cluster's median by more than ``threshold``.

    The transfer time (from the last arrival to the end, falcon 4.3) is compared, not the
    duration: a group whose members spend their time waiting for a late member is healthy here
    (that member is found by :func:`late_ranks`). Only complete profiles with at least
    ``min_instances`` instances take part; a cluster needs two of them. ``min_excess_s`` ignores
    excesses too small to matter (tiny messages). Most degraded first.
    """
    out = []
    for key, members in comparable_clusters(profiles).items():
        usable = [p for p in members if p.complete and p.instances >= min_instances]
        if len(usable) < 2:
            continue
        median = float(np.median([p.transfer_s for p in usable]))
        if median <= 0:
            continue
        for p in usable:
            if p.transfer_s > threshold * median and p.transfer_s - median > min_excess_s:
                out.append(
                    Suspect(
                        kind="communication",
                        ranks=p.ranks,
                        slowdown=p.transfer_s / median,
                        group_key=p.group_key,
                        links=(p.link,) if p.link is not None else (),
                        evidence={
                            "cluster": {
                                "op": key[0],
                                "bytes_bucket": key[1],
                                "group_size": key[2],
                                "groups": len(usable),
                                "median_transfer_s": median,
                            },
                            "op": p.op,
                            "nbytes": p.nbytes,
                            "role": p.role,
                            "transfer_s": p.transfer_s,
                            "duration_s": p.duration_s,
                            "wait_fraction": p.wait_fraction,
                            "instances": p.instances,
                            "clock": p.clock,
                        },
                    )
                )
    out.sort(key=lambda s: -s.slowdown)
    return out


def late_ranks(
    profiles: Iterable[GroupProfile],
    *,
    min_last_fraction: float = 0.5,
    min_lead_share: float = 0.6,
    min_instances: int = 5,
    min_lateness: float = 0.02,
    min_lateness_s: float = 0.0,
    min_own_share: float = 0.5,
    min_busy_excess: float = 0.02,
    include_p2p: bool = False,
) -> list[Suspect]:
    """Ranks the others wait for, consistently and not because they waited themselves.

    1. A rank *holds* a group (of at least ``min_instances`` instances) when it arrived last in
       at least ``min_last_fraction`` of them and accounts for at least ``min_lead_share`` of
       the group's time spent waiting for a last member (its lead over the next-latest member,
       summed). A candidate holds at least one group, leads there by at least ``min_lateness``
       of an iteration (when iteration times are known) and ``min_lateness_s`` on average, and
       accounts for ``min_lead_share`` of that waiting over all its groups (time-weighted, so a
       group where everyone arrives together, last by a hair, does not dilute it).
    2. Lateness propagates: a pipeline stage after a slow one receives its input late and so
       arrives late too - but it *waited* for that input, while the slow rank waits for no one.
       A rank's busy fraction is 1 minus the share of wall time it spends waiting in calls (its
       wait per call times calls per second, over its profiles). The members of the groups it
       holds waited for it; a candidate is a suspect only when its busy fraction exceeds theirs
       (median) by at least ``min_own_share`` of its lateness per iteration (``min_busy_excess``
       when iteration times are unknown): most of its lateness is its own. Skipped when call
       rates are unknown.

    Point-to-point calls count for the waits of step 2 but not, unless ``include_p2p``, in step
    1: a pipeline receiver posts its recv before its input exists, so the sender is last by
    construction. A rank can also arrive late because its input came late over a slow link;
    validation (GEMM against the peers) tells which. Latest first.
    """
    iters: dict[int, list[float]] = {}
    waiting: dict[int, float] = {}  # rank -> share of wall time spent waiting in calls
    rated: set[int] = set()
    lead_own: dict[int, float] = {}
    lead_all: dict[int, float] = {}
    held: dict[int, list[tuple[GroupProfile, int, float]]] = {}
    for p in profiles:
        k = len(p.ranks)
        if k < 2 or p.instances == 0:
            continue
        for r in p.ranks:
            if p.iteration_s > 0:
                iters.setdefault(r, []).append(p.iteration_s)
            if p.calls_per_s > 0:
                waiting[r] = waiting.get(r, 0.0) + p.wait_by_rank.get(r, 0.0) * p.calls_per_s
                rated.add(r)
        if p.op == P2P and not include_p2p:
            continue
        total = sum(c * p.lateness_s.get(r, 0.0) for r, c in p.last_counts.items())
        for r in p.ranks:
            lead_all[r] = lead_all.get(r, 0.0) + total
        for r, c in p.last_counts.items():
            own = c * p.lateness_s.get(r, 0.0)
            lead_own[r] = lead_own.get(r, 0.0) + own
            if (
                p.instances >= min_instances
                and c >= min_last_fraction * p.instances
                and own >= min_lead_share * total > 0
            ):
                held.setdefault(r, []).append((p, c, p.lateness_s.get(r, 0.0)))
    out = []
    for r, groups in held.items():
        count = sum(c for _, c, _ in groups)
        lead = sum(c * m for _, c, m in groups) / count
        share = lead_own[r] / lead_all[r] if lead_all.get(r, 0.0) > 0 else 0.0
        iteration = _median(iters.get(r, []))
        if lead < min_lateness_s or share < min_lead_share:
            continue
        if iteration > 0 and lead < min_lateness * iteration:
            continue
        busy = peer_busy = None
        waiters = {m for p, _, _ in groups for m in p.ranks if m != r and m in rated}
        if r in rated and waiters:
            busy = 1.0 - waiting[r]
            peer_busy = _median([1.0 - waiting[m] for m in waiters])
            need = min_own_share * lead / iteration if iteration > 0 else min_busy_excess
            if busy - peer_busy < need:
                continue  # late because it waited itself: downstream of the real suspect
        instances = sum(p.instances for p, _, _ in groups)
        out.append(
            Suspect(
                kind="compute",
                ranks=(r,),
                slowdown=lead / iteration if iteration > 0 else 0.0,
                evidence={
                    "last": count,
                    "instances": instances,
                    "last_fraction": count / instances,
                    "lead_share": share,
                    "lateness_s": lead,
                    "iteration_s": iteration,
                    "busy_fraction": busy,
                    "peer_busy_fraction": peer_busy,
                    "groups": [
                        {
                            "group_key": p.group_key,
                            "op": p.op,
                            "ranks": list(p.ranks),
                            "last": c,
                            "instances": p.instances,
                            "lateness_s": m,
                        }
                        for p, c, m in groups[:8]
                    ],
                },
            )
        )
    out.sort(key=lambda s: -s.evidence["lateness_s"])
    return out
