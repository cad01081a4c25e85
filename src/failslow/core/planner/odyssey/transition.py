"""State-transition time of a reconfiguration (odyssey IV-B weight transfer, IV-C).

``t_{S_i -> S_{i+1}}`` of dynamic parallelism = plan search (overlapped with training, so 0)
+ weight transfer + restart. A surviving node keeps the layers it already holds and must
receive the others; which survivor takes which new slot is the paper's bipartite matching
(Kuhn-Munkres on an N x N cost matrix of layers to transfer). Survivors of one old stage are
interchangeable and so are new slots holding the same layers, so the same optimum is found as a
transportation problem over those classes (integral, solved by HiGHS simplex): its size does
not grow with the number of nodes.

Cost of a layer moved: its parameters and optimizer state (``m_p + m_o``; gradients are
recomputed). Nodes receive in parallel, each at ``transfer_bandwidth_Bps``, so the transfer
takes as long as the busiest receiver.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from failslow.core.planner.odyssey.model import ClusterState, ModelProfile
from failslow.errors import FailslowError

Span = tuple[int, int]
"""Layers ``[first, end)`` held by one node."""


@dataclass(frozen=True, slots=True)
class WeightTransfer:
    layers_moved: int
    """Total layers received over all nodes (the matching's objective)."""
    bytes_moved: float
    seconds: float
    """Time of the busiest receiver."""


def _spans(split: Sequence[int]) -> list[Span]:
    out, start = [], 0
    for n in split:
        out.append((start, start + n))
        start += n
    return out


def _missing(new: Span, old: Span | None) -> int:
    if old is None:
        return new[1] - new[0]
    overlap = max(0, min(new[1], old[1]) - max(new[0], old[0]))
    return new[1] - new[0] - overlap


def weight_transfer(
    profile: ModelProfile,
    cluster: ClusterState,
    pipelines: Sequence[Sequence[int]],
    *,
    transfer_bandwidth_Bps: float,
) -> WeightTransfer:
    """Minimum-layer weight transfer from ``cluster``'s survivors (and spares) to ``pipelines``."""
    from scipy.optimize import linprog

    old_split = cluster.split(profile.num_layers)
    supply: Counter[Span | None] = Counter()
    for span, failed in zip(_spans(old_split), cluster.failures, strict=True):
        if cluster.dp - failed:
            supply[span] += cluster.dp - failed
    if cluster.spare_nodes:
        supply[None] += cluster.spare_nodes
    demand: Counter[Span] = Counter(span for split in pipelines for span in _spans(split))
    if sum(demand.values()) > sum(supply.values()):
        raise FailslowError(
            f"odyssey: the plan needs {sum(demand.values())} nodes but only "
            f"{sum(supply.values())} are healthy"
        )
    olds, news = list(supply), list(demand)
    cost = np.array([[_missing(n, o) for n in news] for o in olds], dtype=float)
    n_old, n_new = len(olds), len(news)
    a_ub = np.zeros((n_old, n_old * n_new))
    a_eq = np.zeros((n_new, n_old * n_new))
    for i in range(n_old):
        a_ub[i, i * n_new : (i + 1) * n_new] = 1
    for j in range(n_new):
        a_eq[j, j::n_new] = 1
    result = linprog(
        cost.ravel(),
        A_ub=a_ub,
        b_ub=[supply[o] for o in olds],
        A_eq=a_eq,
        b_eq=[demand[n] for n in news],
        method="highs-ds",
    )
    if not result.success:  # pragma: no cover - feasible by the node count check
        raise RuntimeError(f"weight-transfer matching failed: {result.message}")
    flow = np.rint(result.x).reshape(n_old, n_new)
    layer_bytes = profile.param_bytes + profile.optimizer_bytes
    used = flow > 0
    layers = round(float((flow * cost).sum()))
    busiest = float(cost[used].max()) if used.any() else 0.0
    return WeightTransfer(
        layers_moved=layers,
        bytes_moved=layers * layer_bytes,
        seconds=busiest * layer_bytes / transfer_bandwidth_Bps,
    )
