"""Rounds of DP gradient all-reduce under asymmetric parallelism (odyssey IV-B, Fig. 4).

When pipelines split the model differently, the ranks that hold one layer differ from layer to
layer, so each maximal run of layers held by the same set of devices forms its own DP
communication group. Two groups that share a device cannot all-reduce at the same time: that
is an edge of the conflict graph. A greedy colouring (O(G^2) in the number of groups, as in
the paper) assigns every group a round; groups of one round run in parallel, rounds run one
after another.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Hashable, Sequence

from failslow.core.planner.odyssey.model import ModelProfile

Device = tuple[int, int]
"""(pipeline, stage) of a node in an execution plan."""


def greedy_coloring(
    device_sets: Sequence[Collection[Hashable]], order: Sequence[int] | None = None
) -> list[int]:
    """Colour of every group: the smallest colour no conflicting group already has.

    Groups conflict when their device sets intersect. ``order`` is the visiting order
    (default: by decreasing degree, Welsh-Powell). A greedy colouring never uses more than
    ``max degree + 1`` colours.
    """
    n = len(device_sets)
    by_device: dict[Hashable, list[int]] = defaultdict(list)
    for g, devices in enumerate(device_sets):
        for d in set(devices):
            by_device[d].append(g)
    neighbours: list[set[int]] = [set() for _ in range(n)]
    for groups in by_device.values():
        for g in groups:
            neighbours[g].update(groups)
    for g in range(n):
        neighbours[g].discard(g)
    if order is None:
        order = sorted(range(n), key=lambda g: (-len(neighbours[g]), g))
    colours = [-1] * n
    for g in order:
        taken = {colours[h] for h in neighbours[g]}
        c = 0
        while c in taken:
            c += 1
        colours[g] = c
    return colours


def sync_rounds(device_sets: Sequence[Collection[Hashable]]) -> list[list[int]]:
    """Groups of each communication round, in round order (one round per colour)."""
    colours = greedy_coloring(device_sets)
    rounds: list[list[int]] = [[] for _ in range(max(colours, default=-1) + 1)]
    for g, c in enumerate(colours):
        rounds[c].append(g)
    return rounds


def dp_sync_groups(
    pipelines: Sequence[Sequence[int]],
) -> list[tuple[tuple[int, int], frozenset[Device]]]:
    """DP communication groups of an execution plan.

    ``pipelines[p][s]`` is the number of layers on stage ``s`` of pipeline ``p``. Returns, for
    each maximal run of consecutive layers ``[first, end)`` held by the same devices, the run
    and its devices (one per pipeline).
    """
    num_layers = sum(pipelines[0]) if pipelines else 0
    if any(sum(p) != num_layers for p in pipelines):
        raise ValueError("every pipeline must hold the same number of layers")
    owners: list[list[int]] = []
    for split in pipelines:
        stage_of = [s for s, n in enumerate(split) for _ in range(n)]
        owners.append(stage_of)
    groups: list[tuple[tuple[int, int], frozenset[Device]]] = []
    start = 0
    for layer in range(1, num_layers + 1):
        if layer == num_layers or any(o[layer] != o[start] for o in owners):
            devices = frozenset((p, o[start]) for p, o in enumerate(owners))
            groups.append(((start, layer), devices))
            start = layer
    return groups


def dp_sync_time(profile: ModelProfile, pipelines: Sequence[Sequence[int]]) -> float:
    """Seconds of DP gradient synchronisation of a plan, with the coloured round schedule.

    Each group all-reduces ``layers * m_g`` bytes among its devices; a round lasts as long as
    its slowest group. A symmetric plan gives one group per stage, all in one round.
    """
    groups = dp_sync_groups(pipelines)
    rounds = sync_rounds([devices for _, devices in groups])
    total = 0.0
    for members in rounds:
        total += max(
            profile.allreduce_s(
                (groups[g][0][1] - groups[g][0][0]) * profile.layer_grad_bytes,
                len(groups[g][1]),
            )
            for g in members
        )
    return total
