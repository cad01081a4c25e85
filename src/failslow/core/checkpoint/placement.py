"""Where each rank's in-memory checkpoint is backed up (byterobust 6.3, over-eviction: 5).

ByteRobust evicts whole parallel groups at once - typically every machine of one pipeline (PP)
group (section 5) - so a backup kept inside any of the rank's own groups can vanish together with
the rank. Its "cross parallel group backup strategy" (6.3, Fig. 9) therefore places each rank's
backup on a rank that shares none of its TP, PP or DP groups, on another machine; when the job has
a single parallel group (plain ZeRO/FSDP, DP only) it "defaults to backup in neighboring machines".

:func:`backup_holders` returns, for every rank, the rank that holds its backup. The result is
always a permutation of the ranks (for a world of two or more): every rank holds exactly one
backup, so the load bound is 1 = ceil(world / world) and every rank sends one snapshot and
receives one per step (O(1) messages per rank). Among permutations it prefers, in this order:

1. *hard*: the holder is on another host and outside the rank's own PP group (so the backup
   survives the eviction of the rank's host and of the rank's PP group);
2. the holder's host is none of the hosts of the rank's PP group (the backup survives the
   eviction of every machine of that pipeline, as in byterobust Fig. 7);
3. the holder shares no TP or DP group with the rank either (Fig. 9).

Candidates are coordinate shifts ``(t, d, p) -> (t + a, d + b, p + c)`` (permutations by
construction; Fig. 9's pairing is one of them) and "neighbouring host" shifts of the ranks sorted
by host; each is scored in O(world) with numpy, stopping at the first perfect one. Shuffled
host layouts (after topology swaps) that no shift serves are then repaired by pairwise swaps of
holders, and where a rank's hard constraint is still unmet, by three-way rotations; both keep
the permutation. Work is O(world * candidates) with a bounded number of
candidates (a few dozen in the worst case) - no O(world^2) step. Pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from failslow.core.topology import Topology

_HARD = 1000
_HOST_PP = 10
_SOFT = 1
_CANDIDATES = 48
"""Shifts scored before the swap repair takes over (bounds the work at O(48 * world))."""


def _offsets(size: int) -> list[int]:
    """Shift amounts worth trying along one dimension of ``size`` (0 first, then small)."""
    if size <= 1:
        return [0]
    picks = {1, 2, 3, 4, size // 2, (size + 1) // 2, size // 3, size // 4}
    power = 8
    while power < size:
        picks.add(power)
        power *= 2
    return [0, *sorted(o for o in picks if 0 < o < size)]


class _Scorer:
    """Vectorized per-rank costs of a holder assignment for one topology."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        coords = np.asarray(topology.coords, dtype=np.int64).reshape(-1, 3)
        self.t, self.d, self.p = coords[:, 0], coords[:, 1], coords[:, 2]
        host_index = {h: i for i, h in enumerate(topology.host_names)}
        self.host = np.fromiter((host_index[h] for h in topology.hosts), dtype=np.int64)
        self.n_hosts = len(host_index)
        # Constraints no assignment can meet are left out of the score (and of the repair).
        self.check_host = self.n_hosts > 1
        self.check_pp = topology.tp * topology.dp > 1
        # One PP group per (t, d): its id, and which hosts it touches (a sparse set of pairs).
        self.pp_id = self.t * topology.dp + self.d
        pairs = np.unique(self.pp_id * self.n_hosts + self.host)
        self.pp_host_pairs = pairs
        self.pp_hosts: dict[int, set[int]] = {}
        for key in pairs.tolist():
            self.pp_hosts.setdefault(key // self.n_hosts, set()).add(key % self.n_hosts)

    def costs(self, holders: np.ndarray) -> np.ndarray:
        t, d, p, host = self.t, self.d, self.p, self.host
        ht, hd, hp = t[holders], d[holders], p[holders]
        same_host = (host[holders] == host) & self.check_host
        same_pp = (ht == t) & (hd == d) & self.check_pp
        selfish = holders == np.arange(len(holders))
        hard = same_host | same_pp | selfish
        key = self.pp_id * self.n_hosts + host[holders]
        idx = np.searchsorted(self.pp_host_pairs, key)
        idx = np.minimum(idx, len(self.pp_host_pairs) - 1)
        host_pp = (self.pp_host_pairs[idx] == key) & self.check_host
        shares = ((hd == d) & (hp == p)) | ((ht == t) & (hp == p))
        return (
            hard.astype(np.int64) * _HARD
            + host_pp.astype(np.int64) * _HOST_PP
            + shares.astype(np.int64) * _SOFT
        )

    def cost(self, rank: int, holder: int) -> int:
        t, d, p, host = self.t, self.d, self.p, self.host
        hard = (
            holder == rank
            or (self.check_host and host[holder] == host[rank])
            or (self.check_pp and t[holder] == t[rank] and d[holder] == d[rank])
        )
        host_pp = self.check_host and int(host[holder]) in self.pp_hosts[int(self.pp_id[rank])]
        shares = p[holder] == p[rank] and (d[holder] == d[rank] or t[holder] == t[rank])
        return int(hard) * _HARD + int(host_pp) * _HOST_PP + int(shares) * _SOFT


def _shift_candidates(topology: Topology, scorer: _Scorer) -> Iterator[np.ndarray]:
    tp, dp, pp = topology.tp, topology.dp, topology.pp
    index = np.empty((tp, dp, pp), dtype=np.int64)
    index[scorer.t, scorer.d, scorer.p] = np.arange(topology.world_size)
    shifts = [
        (a, b, c)
        for c in _offsets(pp)
        for b in _offsets(dp)
        for a in _offsets(tp)
        if (a, b, c) != (0, 0, 0)
    ]
    # Fewer moved dimensions first, then small shifts: the nearest group-free peer.
    shifts.sort(key=lambda s: (sum(1 for x in s if x) != 2, sum(s), s[::-1]))
    for a, b, c in shifts:
        yield index[(scorer.t + a) % tp, (scorer.d + b) % dp, (scorer.p + c) % pp]


def _host_candidates(topology: Topology, scorer: _Scorer) -> Iterator[np.ndarray]:
    """Neighbouring-host shifts: ranks sorted by host, rotated by a multiple of the largest host.

    With contiguous host blocks of at most ``m`` ranks, rotating by ``m`` never lands on the same
    host while ``m <= world / 2``; with equal hosts it is "the same slot on the next machine".
    """
    n = topology.world_size
    order = np.argsort(scorer.host, kind="stable")
    largest = int(np.bincount(scorer.host).max())
    for k in range(1, 5):
        shift = k * largest
        if shift >= n:
            break
        holders = np.empty(n, dtype=np.int64)
        holders[order] = order[(np.arange(n) + shift) % n]
        yield holders
    if largest >= n:  # one host: the next rank
        yield (np.arange(n) + 1) % n


def _repair(holders: np.ndarray, costs: np.ndarray, scorer: _Scorer) -> None:
    """Swap holders between pairs of ranks while that lowers the total cost (in place)."""
    n = len(holders)
    tries = n if n <= 512 else 256
    stride = max(1, n // tries)
    for _ in range(4):
        improved = False
        for r in np.flatnonzero(costs >= _HOST_PP).tolist():
            if costs[r] < _HOST_PP:
                continue  # fixed by an earlier swap
            for j in range(1, tries + 1):
                s = (r + j * stride) % n
                if s == r:
                    continue
                hr, hs = int(holders[r]), int(holders[s])
                new_r, new_s = scorer.cost(r, hs), scorer.cost(s, hr)
                if new_r + new_s < costs[r] + costs[s]:
                    holders[r], holders[s] = hs, hr
                    costs[r], costs[s] = new_r, new_s
                    improved = True
                    if new_r < _HOST_PP:
                        break
        if not improved:
            return


_ROTATION_TRIES = 96
"""Partners per side of a three-way rotation (bounds it at O(96^2) per rank it repairs)."""


def _rotate(holders: np.ndarray, costs: np.ndarray, scorer: _Scorer) -> bool:
    """Three-way rotations for ranks whose hard constraint no pairwise swap meets (in place):
    ``r`` takes ``s``'s holder, ``s`` takes ``u``'s and ``u`` takes ``r``'s, when that lowers
    the three ranks' cost. A swap needs a partner whose holder suits ``r`` *and* who can take
    ``r``'s holder; in small shuffled layouts (9 ranks on hosts of 4, 4 and 1) no such partner
    may exist while a rotation frees one. Returns whether anything changed."""
    n = len(holders)
    tries = min(n - 1, _ROTATION_TRIES)
    stride = max(1, n // tries)
    changed = False
    for r in np.flatnonzero(costs >= _HARD).tolist():
        if costs[r] < _HARD:
            continue  # fixed by an earlier rotation
        partners = [s for s in ((r + j * stride) % n for j in range(1, tries + 1)) if s != r]
        hr = int(holders[r])
        for s in partners:
            new_r = scorer.cost(r, int(holders[s]))
            if new_r >= _HARD:
                continue
            found = None
            for u in partners:
                if u == s:
                    continue
                new_s, new_u = scorer.cost(s, int(holders[u])), scorer.cost(u, hr)
                if new_r + new_s + new_u < costs[r] + costs[s] + costs[u]:
                    found = u, new_s, new_u
                    break
            if found is not None:
                u, new_s, new_u = found
                holders[r], holders[s], holders[u] = holders[s], holders[u], hr
                costs[r], costs[s], costs[u] = new_r, new_s, new_u
                changed = True
                break
    return changed


def backup_holders(topology: Topology) -> tuple[int, ...]:
    """The rank that holds each rank's backup (``result[r]`` holds rank ``r``'s snapshot).

    A permutation: every rank holds exactly one backup (load bound 1). See the module docstring
    for the order of preferences; a world of one rank "holds" its own (no backup possible).
    """
    n = topology.world_size
    if n == 1:
        return (0,)
    scorer = _Scorer(topology)
    best: np.ndarray | None = None
    best_costs: np.ndarray | None = None
    best_key: tuple[int, int, int] | None = None
    multi_group = sum(1 for s in (topology.tp, topology.dp, topology.pp) if s > 1) >= 2
    sources = (
        (_shift_candidates(topology, scorer), _host_candidates(topology, scorer))
        if multi_group
        else (_host_candidates(topology, scorer), _shift_candidates(topology, scorer))
    )
    budget = _CANDIDATES
    for source in sources:
        for holders in source:
            budget -= 1
            if budget < 0:
                break
            costs = scorer.costs(holders)
            key = (
                int(np.count_nonzero(costs >= _HARD)),
                int(np.count_nonzero((costs % _HARD) >= _HOST_PP)),
                int(np.count_nonzero(costs % _HOST_PP)),
            )
            if best_key is None or key < best_key:
                best, best_costs, best_key = holders, costs, key
            if key == (0, 0, 0):
                break
        if best_key == (0, 0, 0):
            break
    assert best is not None and best_costs is not None
    if best_key is not None and best_key[:2] != (0, 0):
        best, costs = best.copy(), best_costs.copy()
        _repair(best, costs, scorer)
        if (costs >= _HARD).any() and _rotate(best, costs, scorer):
            _repair(best, costs, scorer)
    return tuple(int(h) for h in best)


def wards_of(holders: tuple[int, ...] | list[int], rank: int) -> list[int]:
    """Ranks whose backups ``rank`` holds, ascending (one for :func:`backup_holders`)."""
    return [w for w, h in enumerate(holders) if h == rank and w != rank]
