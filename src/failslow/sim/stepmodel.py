"""Step time of a simulated hybrid-parallel job with fail-slows (the simulator's ground truth).

A step is the slowest DP replica's 1F1B pipeline plus the DP gradient synchronisation
(greyhound 2, 5.2; odyssey III). Each pipeline is timed by the odyssey dynamic-programming
simulation (:func:`failslow.core.planner.odyssey.simulate_1f1b`, Eq. 10-11) - the same function
the planner uses, never a copy - with per-stage times scaled by the slowest rank of that
stage's TP group (TP ranks are synchronous every layer). The DP all-reduce is a ring per DP
group, so it runs at the pace of its slowest link (greyhound 5.2, S3: DP traffic is the
heavy one); a congested link between pipeline neighbours only slows that pipeline's p2p.

The cost per evaluation is O(#slow replicas * PP * micro-batches + #slow links * ranks per
host), never O(world size): healthy replicas with the same micro-batch count share one value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from failslow.core.planner.odyssey.step_time import simulate_1f1b
from failslow.core.planner.topology_cost import link_roles
from failslow.core.topology import Topology

HostPair = tuple[str, str]


def host_pair(a: str, b: str) -> HostPair:
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True, kw_only=True)
class StepModel:
    """Healthy per-micro-batch stage times and communication times, in seconds."""

    forward_s: float
    backward_s: float
    p2p_s: float
    dp_sync_s: float


@lru_cache(maxsize=4096)
def _pipeline_s(
    stage_factors: tuple[float, ...], count: int, model: StepModel, p2p_factor: float
) -> float:
    forward = [[model.forward_s * f] * count for f in stage_factors]
    backward = [[model.backward_s * f] * count for f in stage_factors]
    return simulate_1f1b(forward, backward, p2p_s=model.p2p_s * p2p_factor)


def step_time(
    topology: Topology,
    model: StepModel,
    counts: Sequence[int],
    compute: Mapping[int, float],
    links: Mapping[HostPair, float],
) -> float:
    """Seconds per step with ``counts[d]`` micro-batches on replica ``d``.

    ``compute`` maps a global rank to its slowdown; ``links`` a host pair to its slowdown.
    Roles are placed on hosts by ``topology.hosts`` (a topology plan changes that).
    """
    stage_factor: dict[int, dict[int, float]] = {}
    for rank, factor in compute.items():
        _, d, p = topology.coords[rank]
        stages = stage_factor.setdefault(d, {})
        stages[p] = max(stages.get(p, 1.0), factor)
    dp_factor, pp_factor = 1.0, dict[int, float]()
    for (a, b), factor in links.items():
        dp_link, pp_replicas = link_roles(topology, a, b)
        if dp_link:
            dp_factor = max(dp_factor, factor)
        for d in pp_replicas:
            pp_factor[d] = max(pp_factor.get(d, 1.0), factor)
    healthy = (1.0,) * topology.pp
    slowest = 0.0
    for d in set(stage_factor) | set(pp_factor):
        factors = tuple(stage_factor.get(d, {}).get(p, 1.0) for p in range(topology.pp))
        slowest = max(slowest, _pipeline_s(factors, counts[d], model, pp_factor.get(d, 1.0)))
    for count in set(
        counts[d] for d in range(topology.dp) if d not in stage_factor and d not in pp_factor
    ):
        slowest = max(slowest, _pipeline_s(healthy, count, model, 1.0))
    return slowest + model.dp_sync_s * dp_factor
