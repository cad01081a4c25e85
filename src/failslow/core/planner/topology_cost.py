"""What a placement of roles on hosts costs under a diagnosis (greyhound 5.2, S3; Fig. 11, 12).

S3 (topology adjustment) moves roles between hosts so that (a) congested links carry light
pipeline (PP) traffic, or none, instead of heavy data-parallel (DP) traffic (Fig. 11), and (b)
straggling GPUs sit in as few PP stages as possible, preferably interior ones (Fig. 12). This
module scores a placement; :mod:`failslow.core.planner.topology_plan` searches for a better one.

Traffic model (per step, per pair of *neighbouring* roles whose hosts differ):

* DP: a ring all-reduce runs over each DP group in ``dp`` order, so ranks ``d`` and ``d+1``
  (and ``D-1`` and ``0``, closing the ring when ``D > 2``) exchange ``traffic.dp_bytes``. Ring
  order is the group order; NCCL may build its rings differently, and this is the proxy.
* PP: stages ``p`` and ``p+1`` of one pipeline exchange ``traffic.pp_bytes`` (activations and
  their gradients for all micro-batches). The paper puts DP at tens of GB per GPU and step, PP
  at tens to hundreds of MB: :data:`GREYHOUND_LINK_TRAFFIC`.
* TP traffic stays inside a host (the planner refuses layouts where it does not) - except in a
  sharded job (:attr:`Topology.sharded`: the ``tp`` dimension is an FSDP/HSDP shard group,
  which may span hosts). There shard-ring neighbours ``t`` and ``t+1`` exchange
  ``traffic.tp_bytes``: an all-gather in the forward and in the backward and a reduce-scatter
  per micro-batch, against one all-reduce per step between replicas, so
  :func:`link_traffic` puts ``tp_bytes = 1.5 * G * dp_bytes`` (``G`` micro-batches per replica;
  an all-reduce moves twice what an all-gather does). A placement that moves a congested link
  from a shard group to between replicas is then the S3 of an HSDP job.

A congested host pair ``(h1, h2)`` with slowdown ``s`` costs ``(s - 1) * bytes`` where
``bytes`` is the traffic its neighbouring role pairs put on it; pairs that are neither DP nor PP
neighbours carry nothing and cost nothing. Several slow rank pairs between the same two hosts
are one physical link: the largest slowdown counts. Slow links inside one host (NVLink/PCIe)
move with the host and are left out.

Stragglers are physical GPUs: the diagnosis names rank ``r`` on host ``h`` at local position
``i`` (the ``i``-th smallest rank on ``h``); after a re-placement that GPU runs the ``i``-th
smallest rank the host then holds. The cost counts the PP stages that contain a straggler (a
stage runs at its slowest member's pace, so the count matters and not how many stragglers share
a stage) and, of those, the first and last stages (they carry embedding and loss work).

Placements compare by :attr:`PlacementCost.key`: link cost first, then straggler stages, then
edge straggler stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from failslow.core.diagnosis.record import Diagnosis
from failslow.core.topology import Topology
from failslow.errors import FailslowError

__all__ = [
    "GREYHOUND_LINK_TRAFFIC",
    "LinkTraffic",
    "PlacementCost",
    "link_roles",
    "link_traffic",
    "placement_cost",
]


@dataclass(frozen=True, slots=True)
class LinkTraffic:
    """Bytes one step sends between one pair of DP ring neighbours, of PP neighbours and (in a
    sharded job) of shard-group ring neighbours."""

    dp_bytes: float
    pp_bytes: float
    tp_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dp_bytes", "pp_bytes", "tp_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
                raise FailslowError(
                    f"link traffic: {name} must be a finite number of bytes >= 0, got {value!r}"
                )


GREYHOUND_LINK_TRAFFIC = LinkTraffic(dp_bytes=10e9, pp_bytes=100e6)
"""Orders of magnitude from greyhound 5.2: DP tens of GB, PP tens to hundreds of MB per step."""


def link_traffic(topology: Topology, base: LinkTraffic = GREYHOUND_LINK_TRAFFIC) -> LinkTraffic:
    """``base`` for ``topology``: a sharded job's shard-group traffic added (module docstring)
    unless ``base`` has its own; none otherwise (TP inside hosts)."""
    if not topology.sharded or topology.tp < 2 or base.tp_bytes:
        return base
    per_replica = topology.micro_batches / topology.dp
    return LinkTraffic(
        dp_bytes=base.dp_bytes, pp_bytes=base.pp_bytes, tp_bytes=1.5 * per_replica * base.dp_bytes
    )


def canonical(x: float) -> float:
    """``x`` to 12 significant digits, so sums taken in a different order compare equal."""
    return float(f"{x:.12g}")


@dataclass(frozen=True, slots=True)
class PlacementCost:
    """How much a placement suffers from a diagnosis (see the module docstring)."""

    link_cost: float
    """Sum over congested host pairs of ``(slowdown - 1) * bytes`` of DP and PP traffic."""
    slow_dp_links: int
    """Congested host pairs that carry DP traffic."""
    slow_pp_links: int
    """Congested host pairs that carry PP traffic."""
    straggler_stages: int
    """PP stages that contain at least one straggling GPU."""
    edge_straggler_stages: int
    """Of those, how many are the first or the last stage."""
    slow_tp_links: int = 0
    """Congested host pairs that carry shard-group traffic (sharded jobs)."""

    @property
    def key(self) -> tuple[float, int, int]:
        """Lexicographic order: smaller is better."""
        return (canonical(self.link_cost), self.straggler_stages, self.edge_straggler_stages)


def role_grid(topology: Topology) -> np.ndarray:
    """Ranks indexed by coordinates: ``grid[t, d, p]`` is the rank with coords ``(t, d, p)``."""
    coords = np.asarray(topology.coords, dtype=np.int64).reshape(-1, 3)
    grid = np.empty((topology.tp, topology.dp, topology.pp), dtype=np.int64)
    grid[coords[:, 0], coords[:, 1], coords[:, 2]] = np.arange(len(coords))
    return grid


def ring_pairs(grid: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) rank arrays of ring neighbours along ``axis`` of the grid (each pair once)."""
    size = grid.shape[axis]
    if size == 1:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    if size == 2:
        return np.take(grid, 0, axis=axis).ravel(), np.take(grid, 1, axis=axis).ravel()
    return grid.ravel(), np.roll(grid, -1, axis=axis).ravel()


def neighbour_pairs(grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(a, b) rank arrays of DP ring neighbours, then of PP neighbours (each pair once)."""
    dp_a, dp_b = ring_pairs(grid, 1)
    pp_a, pp_b = grid[:, :, :-1].ravel(), grid[:, :, 1:].ravel()
    return dp_a, dp_b, pp_a, pp_b


def host_indices(topology: Topology) -> tuple[tuple[str, ...], np.ndarray]:
    """Distinct hosts (first-appearance order) and each rank's index into them."""
    names = topology.host_names
    index = {name: i for i, name in enumerate(names)}
    return names, np.fromiter((index[h] for h in topology.hosts), np.int64, len(topology.hosts))


@dataclass(frozen=True, slots=True)
class ResolvedDiagnosis:
    """A diagnosis in physical terms: congested host pairs and straggling GPUs."""

    links: dict[tuple[str, str], float]
    """``(host, host)`` (sorted) -> largest slowdown measured between them."""
    devices: tuple[tuple[str, int], ...]
    """Straggling GPUs as ``(host, local position)``, sorted, each once."""


def resolve(diagnosis: Diagnosis, diagnosed_on: Topology) -> ResolvedDiagnosis:
    """Map the diagnosis's ranks to hosts and GPUs of the layout it was measured on."""
    n = diagnosed_on.world_size
    hosts = diagnosed_on.hosts
    for rank in [s.rank for s in diagnosis.slow_ranks] + [
        r for link in diagnosis.slow_links for r in (link.a, link.b)
    ]:
        if not 0 <= rank < n:
            raise FailslowError(
                f"topology plan: diagnosis names rank {rank}, but the topology has ranks 0..{n - 1}"
            )
    links: dict[tuple[str, str], float] = {}
    for link in diagnosis.slow_links:
        ha, hb = hosts[link.a], hosts[link.b]
        if ha == hb:
            continue
        pair = (ha, hb) if ha < hb else (hb, ha)
        links[pair] = max(links.get(pair, 1.0), link.slowdown)
    devices = set()
    for s in diagnosis.slow_ranks:
        host = hosts[s.rank]
        devices.add((host, sum(1 for r in range(s.rank) if hosts[r] == host)))
    return ResolvedDiagnosis(links=links, devices=tuple(sorted(devices)))


def placement_cost(
    topology: Topology,
    diagnosis: Diagnosis,
    *,
    diagnosed_on: Topology | None = None,
    traffic: LinkTraffic = GREYHOUND_LINK_TRAFFIC,
) -> PlacementCost:
    """Cost of ``topology``'s placement under ``diagnosis``.

    ``diagnosed_on`` is the placement the diagnosis was measured on (default: ``topology``
    itself); its ranks locate the congested host pairs and straggling GPUs, which stay where
    they are when roles move. To score a plan: ``placement_cost(topology.with_hosts(plan.hosts),
    diagnosis, diagnosed_on=topology)``.
    """
    found = resolve(diagnosis, diagnosed_on if diagnosed_on is not None else topology)
    names, host_of = host_indices(topology)
    index = {name: i for i, name in enumerate(names)}
    n_hosts = len(names)
    dp_a, dp_b, pp_a, pp_b = neighbour_pairs(role_grid(topology))

    def pair_counts(a: np.ndarray, b: np.ndarray) -> dict[int, int]:
        ha, hb = host_of[a], host_of[b]
        cross = ha != hb
        lo, hi = np.minimum(ha, hb)[cross], np.maximum(ha, hb)[cross]
        keys, counts = np.unique(lo * n_hosts + hi, return_counts=True)
        return dict(zip(keys.tolist(), counts.tolist(), strict=True))

    dp_pairs, pp_pairs = pair_counts(dp_a, dp_b), pair_counts(pp_a, pp_b)
    tp_pairs = pair_counts(*ring_pairs(role_grid(topology), 0)) if traffic.tp_bytes else {}
    link_cost, slow_dp, slow_pp, slow_tp = 0.0, 0, 0, 0
    for (h1, h2), slowdown in found.links.items():
        if h1 not in index or h2 not in index:
            continue  # a host that runs no role here carries none of this job's traffic
        i, j = sorted((index[h1], index[h2]))
        key = i * n_hosts + j
        n_dp, n_pp, n_tp = dp_pairs.get(key, 0), pp_pairs.get(key, 0), tp_pairs.get(key, 0)
        link_cost += (slowdown - 1.0) * (
            n_dp * traffic.dp_bytes + n_pp * traffic.pp_bytes + n_tp * traffic.tp_bytes
        )
        slow_dp += n_dp > 0
        slow_pp += n_pp > 0
        slow_tp += n_tp > 0

    stages: set[int] = set()
    for host, position in found.devices:
        held = np.flatnonzero(host_of == index[host]) if host in index else np.empty(0)
        if position >= len(held):
            raise FailslowError(
                f"placement cost: host {host} had a straggling GPU at position {position}, "
                f"but holds {len(held)} roles in this placement"
            )
        stages.add(topology.coords[int(held[position])][2])
    edge = sum(1 for p in stages if p in (0, topology.pp - 1))
    return PlacementCost(
        link_cost=link_cost,
        slow_dp_links=slow_dp,
        slow_pp_links=slow_pp,
        slow_tp_links=slow_tp,
        straggler_stages=len(stages),
        edge_straggler_stages=edge,
    )


class SlotCost:
    """The planner's fast scorer: hosts exchange *slots*, a slot being the roles a host holds.

    Slot ``j`` is the set of roles host ``j`` (of ``topology.host_names``) holds now, in rank
    order. A node-granular placement gives every host one slot; only the *affected* hosts (ends
    of congested links, hosts of straggling GPUs) change the cost, so a placement is scored from
    ``slots``: the slot of each affected host, in :attr:`affected` order. Raises
    :class:`FailslowError` if the layout does not allow node-granular swaps.
    """

    def __init__(self, topology: Topology, diagnosis: Diagnosis, traffic: LinkTraffic) -> None:
        names, host_of = host_indices(topology)
        n_hosts = len(names)
        per_host = np.bincount(host_of, minlength=n_hosts)
        if per_host.min() != per_host.max():
            counts = {names[i]: int(per_host[i]) for i in (per_host.argmin(), per_host.argmax())}
            raise FailslowError(
                "topology plan: node-granular swaps need every host to hold the same number of "
                f"roles, got {counts}"
            )
        grid = role_grid(topology)
        split = (host_of[grid] != host_of[grid[:1]]).any(axis=0)
        if split.any() and not traffic.tp_bytes:
            d, p = (int(x) for x in np.argwhere(split)[0])
            raise FailslowError(
                f"topology plan: TP group (dp={d}, pp={p}) spans several hosts; node-granular "
                "swaps need each TP group inside one host (tp <= GPUs per host)"
            )
        self.host_names = names
        self.n_hosts = n_hosts
        self.pp = topology.pp
        self.slot_roles = np.argsort(host_of, kind="stable").reshape(n_hosts, -1)
        stage = np.asarray(topology.coords, dtype=np.int64).reshape(-1, 3)[:, 2]
        self.slot_stages = stage[self.slot_roles]
        self._stage_rows: list[list[int]] = self.slot_stages.tolist()

        dp_a, dp_b, pp_a, pp_b = neighbour_pairs(grid)
        tp_a, tp_b = ring_pairs(grid, 0) if traffic.tp_bytes else (dp_a[:0], dp_b[:0])
        a = np.concatenate([host_of[dp_a], host_of[pp_a], host_of[tp_a]])
        b = np.concatenate([host_of[dp_b], host_of[pp_b], host_of[tp_b]])
        weight = np.concatenate(
            [
                np.full(len(dp_a), traffic.dp_bytes),
                np.full(len(pp_a), traffic.pp_bytes),
                np.full(len(tp_a), traffic.tp_bytes),
            ]
        )
        cross = a != b
        lo, hi = np.minimum(a, b)[cross], np.maximum(a, b)[cross]
        keys, inverse = np.unique(lo * n_hosts + hi, return_inverse=True)
        summed = np.bincount(inverse.ravel(), weights=weight[cross], minlength=len(keys))
        self.pair_bytes: dict[int, float] = dict(zip(keys.tolist(), summed.tolist(), strict=True))
        """``lo * n_hosts + hi`` -> bytes per step between slots ``lo`` and ``hi``."""

        found = resolve(diagnosis, topology)
        index = {name: i for i, name in enumerate(names)}
        congested = [pair for pair, slowdown in found.links.items() if slowdown > 1.0]
        affected = sorted(
            {index[h] for pair in congested for h in pair} | {index[h] for h, _ in found.devices}
        )
        self.affected: tuple[int, ...] = tuple(affected)
        position = {h: i for i, h in enumerate(affected)}
        self.links: tuple[tuple[int, int, float], ...] = tuple(
            (position[index[h1]], position[index[h2]], slowdown - 1.0)
            for (h1, h2), slowdown in found.links.items()
            if slowdown > 1.0
        )
        """Congested links as (affected position, affected position, slowdown - 1)."""
        self.devices: tuple[tuple[int, int], ...] = tuple(
            (position[index[h]], i) for h, i in found.devices
        )
        """Straggling GPUs as (affected position, local position)."""

    @property
    def identity(self) -> tuple[int, ...]:
        """Every affected host in its own slot: the current placement."""
        return self.affected

    def key(self, slots: tuple[int, ...] | list[int]) -> tuple[float, int, int]:
        """:attr:`PlacementCost.key` of the placement giving affected host ``i`` ``slots[i]``."""
        n, pair_bytes = self.n_hosts, self.pair_bytes
        link = 0.0
        for i, j, excess in self.links:
            a, b = slots[i], slots[j]
            link += excess * pair_bytes.get(a * n + b if a < b else b * n + a, 0.0)
        rows = self._stage_rows
        stages = {rows[slots[i]][local] for i, local in self.devices}
        edge = sum(1 for p in stages if p == 0 or p == self.pp - 1)
        return (canonical(link), len(stages), edge)

    def moved_hosts(self, slots: tuple[int, ...] | list[int]) -> int:
        """Fewest hosts that change slot in any full placement extending ``slots``.

        Affected hosts off their own slot move, and so does every other host whose slot an
        affected host takes; all the rest can stay.
        """
        own = self.affected
        return sum(1 for s, h in zip(slots, own, strict=True) if s != h) + len(
            set(slots) - set(own)
        )


def link_roles(topology: Topology, a: str, b: str) -> tuple[bool, list[int]]:
    """The traffic model above for one host pair: whether ``a`` and ``b`` hold DP ring
    neighbours, and the DP replicas whose pipelines have adjacent stages on them.

    O(ranks on ``a``) - the simulator asks this per congested link on every state change.
    """
    hosts = topology.hosts
    dp_link, replicas = False, set[int]()
    for rank in topology.ranks_on(a):
        t, d, p = topology.coords[rank]
        for dd in ((d - 1) % topology.dp, (d + 1) % topology.dp):
            if dd != d and hosts[topology.rank_of(t, dd, p)] == b:
                dp_link = True
        for pp in (p - 1, p + 1):
            if 0 <= pp < topology.pp and hosts[topology.rank_of(t, d, pp)] == b:
                replicas.add(d)
    return dp_link, sorted(replicas)
