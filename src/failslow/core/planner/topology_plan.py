"""S3 topology plans: swap whole hosts' roles to dodge congestion and pack stragglers.

Implements greyhound 5.2, S3 "Adjust parallelism topology": congested links are handed from
heavy DP traffic to light PP traffic (Fig. 11: swapping nodes 2 and 3 turns the congested DP
link 3-4 into a PP link), and stragglers are consolidated into the fewest PP stages,
``ceil(#stragglers / #GPUs per stage)``, preferring interior stages (Fig. 12: two stragglers in
two stages cost 8.5 s per step, in one stage 8 s). Applying a plan pauses training, copies each
moved role's state peer to peer and resumes (5.2 "Implementation and overhead", Fig. 19: the
cost depends on the state per GPU, not on the job's size, because hosts copy in parallel).
Among equally good placements the plan moves the least state, the assignment step of odyssey
IV-B (Kuhn-Munkres on a cost matrix of bytes to move).

Formulation. Plans are node-granular: slot ``j`` is the set of roles host ``j`` holds now, and a
plan gives every host one slot (a permutation), so a host's GPUs move together and TP groups stay
inside a host. The cost is :class:`~failslow.core.planner.topology_cost.PlacementCost` (link
cost, then straggler stages, then edge straggler stages; traffic model in that module). It
depends only on where the *affected* hosts go (ends of congested links, hosts of straggling
GPUs), so the search chooses slots for those ``a`` hosts and every other host stays put unless
an affected host took its slot. The fewest moved hosts for a choice is then fixed (see
:meth:`SlotCost.moved_hosts`), and the displaced hosts fill the freed slots by a linear
assignment (``scipy.optimize.linear_sum_assignment``) on bytes moved, 0 for a host returning
to its own slot. With equal-sized disjoint slots every other entry costs the same, so this step
is exact but unremarkable; the search is what minimizes moves, by ranking placements on
``(cost, moved hosts)``.

Search and its limits. Choosing slots for ``a`` affected hosts among ``H`` is a quadratic
assignment problem (NP-hard in general). When ``H! / (H - a)!`` is at most
``exact_search_limit`` every choice is scored and the result is optimal in cost and then in
moves. Otherwise the plan is constructive:

1. Consolidation (when every host lies in one stage): pick ``ceil(s / g)`` stages for the ``s``
   straggler hosts (``g`` hosts per stage), interior first, then those already holding most
   stragglers; move each straggler outside them into the best slot of a chosen stage that
   holds no straggler (best = cost after the swap, then moves).
2. Local search from both the current placement and the consolidated one: for each affected
   host, screen all slots by the traffic its congested links would carry there (a slot that is
   no DP or PP neighbour of the partner's slot carries none), keep the best few, score the
   swaps exactly, and apply the single best strict improvement of ``(cost, moved hosts)``
   over all affected hosts; repeat until none (at most ``_ROUNDS`` swaps per affected host).

The plan never increases the cost: it is returned only if strictly better than the current
placement, else ``None``. The constructive search reaches the optimum in the paper's cases
(Fig. 11, 12) and in the 16,384-GPU test, but it is a heuristic: forced onto small random layouts
(hosts spanning several stages, several congested links per host) and checked against exhaustive
search, it missed the optimal cost in about 5% of the cases that had a better placement. Hosts
spanning several PP stages skip step 1, so consolidation there relies on single swaps. Measured
at 16,384 GPUs (2,048 hosts, tp=8, dp=256, pp=8, one shared CPU core): 40 ms with 2 stragglers
and 2 congested links, 180 ms with 8 stragglers and 8 congested DP links.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import numpy as np

from failslow.core.diagnosis.record import Diagnosis
from failslow.core.planner.plans import StateMove, TopologyPlan
from failslow.core.planner.topology_cost import (
    GREYHOUND_LINK_TRAFFIC,
    LinkTraffic,
    SlotCost,
    link_traffic,
    placement_cost,
)
from failslow.core.topology import Topology, inverse_placement
from failslow.errors import FailslowError

__all__ = ["plan_topology"]

_SCREEN = 32
"""Slots per affected host that the local search scores exactly after screening."""
_ROUNDS = 4
"""The local search makes at most this many swaps per affected host."""

Score = tuple[tuple[float, int, int], int]
"""(placement cost key, moved hosts): smaller is better."""


def _number(name: str, value: Any, *, positive: bool) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x) or x < 0 or (positive and x == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise FailslowError(f"topology plan: {name} must be {want}, got {value!r}")
    return x


def _integer(name: str, value: Any) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if isinstance(value, bool) or n < 0:
        raise FailslowError(f"topology plan: {name} must be an integer >= 0, got {value!r}")
    return n


def _score(cost: SlotCost, slots: tuple[int, ...]) -> Score:
    return cost.key(slots), cost.moved_hosts(slots)


def _exact(cost: SlotCost) -> tuple[int, ...]:
    """Every choice of slots for the affected hosts; the best by (cost, moves)."""
    best, best_score = cost.identity, _score(cost, cost.identity)
    for slots in itertools.permutations(range(cost.n_hosts), len(cost.affected)):
        score = _score(cost, slots)
        if score < best_score:
            best, best_score = slots, score
    return best


class _Placement:
    """A full host -> slot permutation that the constructive search edits by swaps."""

    def __init__(self, cost: SlotCost) -> None:
        self.cost = cost
        self.slot_of = np.arange(cost.n_hosts)
        self.holder = np.arange(cost.n_hosts)
        self.position = {h: i for i, h in enumerate(cost.affected)}
        self._slots = list(cost.affected)

    def slots(self) -> tuple[int, ...]:
        """Slot of each affected host, in :attr:`SlotCost.affected` order."""
        return tuple(self._slots)

    def swap(self, host: int, slot: int) -> None:
        """Give ``host`` the slot ``slot``; its holder takes ``host``'s old slot."""
        other, old = int(self.holder[slot]), int(self.slot_of[host])
        self.slot_of[host], self.slot_of[other] = slot, old
        self.holder[slot], self.holder[old] = host, other
        for h in (host, other):
            if h in self.position:
                self._slots[self.position[h]] = int(self.slot_of[h])

    def score_if(self, host: int, slot: int) -> Score:
        """Score after :meth:`swap` ``(host, slot)``, without making it."""
        slots = list(self._slots)
        other = int(self.holder[slot])
        if other in self.position:
            slots[self.position[other]] = int(self.slot_of[host])
        if host in self.position:
            slots[self.position[host]] = slot
        return _score(self.cost, tuple(slots))


def _consolidate(cost: SlotCost) -> _Placement | None:
    """Step 1: straggler hosts into the fewest stages, interior ones first (Fig. 12)."""
    stage_of_slot = cost.slot_stages[:, 0]
    positions = sorted({i for i, _ in cost.devices})
    if not positions or not (cost.slot_stages == stage_of_slot[:, None]).all():
        return None
    per_stage = np.bincount(stage_of_slot, minlength=cost.pp)
    if per_stage.min() != per_stage.max():
        return None
    placement = _Placement(cost)
    stragglers = [cost.affected[i] for i in positions]
    present = np.bincount(stage_of_slot[stragglers], minlength=cost.pp)
    needed = math.ceil(len(stragglers) / int(per_stage[0]))
    edge = {0, cost.pp - 1}
    chosen = sorted(range(cost.pp), key=lambda p: (p in edge, -present[p], p))[:needed]
    in_chosen = np.isin(stage_of_slot, chosen)
    for host in stragglers:
        if in_chosen[placement.slot_of[host]]:
            continue
        is_straggler = np.isin(placement.holder, stragglers)
        targets = np.flatnonzero(in_chosen & ~is_straggler)
        best = min(targets.tolist(), key=lambda s: (placement.score_if(host, s), s))
        placement.swap(host, best)
    return placement


def _adjacency(cost: SlotCost) -> list[list[tuple[int, float]]]:
    """Per slot: (neighbouring slot, bytes per step between them)."""
    n = cost.n_hosts
    adjacency: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for key, nbytes in cost.pair_bytes.items():
        lo, hi = divmod(key, n)
        adjacency[lo].append((hi, nbytes))
        adjacency[hi].append((lo, nbytes))
    return adjacency


def _local_search(placement: _Placement, adjacency: list[list[tuple[int, float]]]) -> None:
    """Step 2: apply the best swap of any affected host with a screened slot, until none helps."""
    cost = placement.cost
    n, affected = cost.n_hosts, cost.affected
    partners: list[list[tuple[int, float]]] = [[] for _ in affected]
    for i, j, excess in cost.links:
        partners[i].append((j, excess))
        partners[j].append((i, excess))
    stragglers = {i for i, _ in cost.devices}
    is_affected = np.zeros(n, dtype=bool)
    is_affected[list(affected)] = True
    everyone = np.arange(n)
    current = _score(cost, placement.slots())
    for _ in range(_ROUNDS * len(affected)):
        best, best_swap = current, (-1, -1)
        for i, host in enumerate(affected):
            carried = np.zeros(n)
            for j, excess in partners[i]:
                for slot, nbytes in adjacency[placement.slot_of[affected[j]]]:
                    carried[slot] += excess * nbytes
            if i in stragglers:
                here = cost.slot_stages[placement.slot_of[host]]
                moves_stage = (cost.slot_stages != here).any(axis=1)
            else:
                moves_stage = np.zeros(n, dtype=bool)
            displaces = (placement.holder == everyone) & (everyone != host)
            order = np.lexsort(
                (everyone, displaces, is_affected[placement.holder], moves_stage, carried)
            )
            candidates = set(order[:_SCREEN].tolist()) | {host}
            candidates |= {int(placement.slot_of[h]) for h in affected}
            candidates.discard(int(placement.slot_of[host]))
            for slot in sorted(candidates):
                score = placement.score_if(host, slot)
                if score < best:
                    best, best_swap = score, (host, slot)
        if best_swap[0] < 0:
            return
        placement.swap(*best_swap)
        current = best


def _constructive(cost: SlotCost) -> tuple[int, ...]:
    adjacency = _adjacency(cost)
    starts = [_Placement(cost)]
    consolidated = _consolidate(cost)
    if consolidated is not None:
        starts.append(consolidated)
    results = []
    for placement in starts:
        _local_search(placement, adjacency)
        slots = placement.slots()
        results.append((_score(cost, slots), slots))
    return min(results)[1]


def _complete(cost: SlotCost, slots: tuple[int, ...], slot_bytes: np.ndarray) -> np.ndarray:
    """Holder of every slot: affected hosts where the search put them, the rest by assignment.

    Hosts whose slot is still free stay (0 bytes); hosts displaced by an affected host fill the
    freed slots by a minimum-bytes linear assignment (odyssey IV-B).
    """
    n = cost.n_hosts
    holder = np.full(n, -1)
    affected = np.asarray(cost.affected, dtype=np.int64)
    holder[list(slots)] = affected
    others = np.setdiff1d(np.arange(n), affected)
    stay = holder[others] == -1
    holder[others[stay]] = others[stay]
    displaced, free = others[~stay], np.flatnonzero(holder == -1)
    if len(displaced):
        matrix = np.where(free[None, :] == displaced[:, None], 0.0, slot_bytes[free][None, :])
        from scipy.optimize import linear_sum_assignment  # 0.2 s to import: used here only

        rows, cols = linear_sum_assignment(matrix)
        holder[free[cols]] = displaced[rows]
    return holder


def plan_topology(
    topology: Topology,
    diagnosis: Diagnosis,
    *,
    state_bytes_per_rank: int,
    transfer_bandwidth_bytes_per_s: float,
    pause_s: float,
    traffic: LinkTraffic = GREYHOUND_LINK_TRAFFIC,
    exact_search_limit: int = 20_000,
) -> TopologyPlan | None:
    """A node-granular re-placement that lowers the placement cost, or None if none is found.

    ``state_bytes_per_rank`` is what one role's state (parameters, gradients, optimizer state)
    takes to copy. ``overhead_s = pause_s + max per-host bytes sent or received /
    transfer_bandwidth_bytes_per_s``: all hosts copy in parallel, each sending and receiving at
    once (greyhound Fig. 19), so the busiest host bounds the copy. ``traffic`` weighs DP against
    PP traffic on congested links (a sharded job's shard-group traffic is added:
    :func:`~failslow.core.planner.topology_cost.link_traffic`). Placements of up to
    ``exact_search_limit`` candidates are searched exhaustively, larger ones constructively
    (module docstring). Raises :class:`FailslowError` for bad arguments or a layout that does
    not allow node-granular swaps (hosts holding different numbers of roles, TP groups spanning
    hosts unless sharded).
    """
    nbytes = _integer("state_bytes_per_rank", state_bytes_per_rank)
    bandwidth = _number(
        "transfer_bandwidth_bytes_per_s", transfer_bandwidth_bytes_per_s, positive=True
    )
    pause = _number("pause_s", pause_s, positive=False)
    limit = _integer("exact_search_limit", exact_search_limit)
    traffic = link_traffic(topology, traffic)
    cost = SlotCost(topology, diagnosis, traffic)
    if not cost.affected:
        return None
    if math.perm(cost.n_hosts, len(cost.affected)) <= limit:
        slots = _exact(cost)
    else:
        slots = _constructive(cost)
    if not cost.key(slots) < cost.key(cost.identity):
        return None

    per_slot = cost.slot_roles.shape[1]
    holder = _complete(cost, slots, np.full(cost.n_hosts, float(per_slot * nbytes)))
    names = cost.host_names
    new_host = np.empty(topology.world_size, dtype=np.int64)
    new_host[cost.slot_roles] = holder[:, None]
    moves = tuple(
        StateMove(
            role=int(role), src_host=names[src], dst_host=names[int(holder[src])], nbytes=nbytes
        )
        for src in np.flatnonzero(holder != np.arange(cost.n_hosts)).tolist()
        for role in cost.slot_roles[src]
    )
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    for move in moves:
        sent[move.src_host] = sent.get(move.src_host, 0) + move.nbytes
        received[move.dst_host] = received.get(move.dst_host, 0) + move.nbytes
    busiest = max([*sent.values(), *received.values()], default=0)
    hosts = tuple(names[h] for h in new_host.tolist())

    before = placement_cost(topology, diagnosis, traffic=traffic)
    after = placement_cost(
        topology.with_hosts(hosts), diagnosis, diagnosed_on=topology, traffic=traffic
    )
    moved_hosts = len(sent)
    reason = (
        f"S3 topology swap: {moved_hosts} hosts exchange roles ({len(moves)} roles); congested "
        f"links carrying DP traffic {before.slow_dp_links} -> {after.slow_dp_links}, carrying "
        f"PP traffic {before.slow_pp_links} -> {after.slow_pp_links}"
        + (
            f", carrying shard-group traffic {before.slow_tp_links} -> {after.slow_tp_links}"
            if traffic.tp_bytes
            else ""
        )
        + "; PP stages with stragglers "
        f"{before.straggler_stages} -> {after.straggler_stages} (first/last "
        f"{before.edge_straggler_stages} -> {after.edge_straggler_stages})"
    )
    return TopologyPlan(
        hosts=hosts, moves=moves, reason=reason, overhead_s=pause + busiest / bandwidth
    )


def reverse_topology_plan(before: Topology, plan: TopologyPlan, *, reason: str) -> TopologyPlan:
    """The plan that moves every role back where it ran before ``plan`` (a swap rolled back
    because it did not take effect on some rank, or reverted at relief): the role ``plan``
    put on process ``p`` goes back to the host of the process it came from. Indexed, as every
    plan is, by the placement in force once ``plan`` applied; the same state bytes move back."""
    dest = before.placement(plan.hosts)
    source = inverse_placement(dest)
    hosts = tuple(before.hosts[source[p]] for p in range(before.world_size))
    moves = tuple(
        StateMove(role=m.role, src_host=m.dst_host, dst_host=m.src_host, nbytes=m.nbytes)
        for m in plan.moves
    )
    return TopologyPlan(hosts=hosts, moves=moves, overhead_s=plan.overhead_s, reason=reason)
