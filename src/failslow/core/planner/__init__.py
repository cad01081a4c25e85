"""Decision logic (greyhound 5, odyssey III-IV) as plain functions over plain data.

:class:`Planner` is the one entry point for fail-slow (ski-rental over S2/S3/S4) and fail-stop
(odyssey reroute-or-reconfigure) plans; the pieces are public for tests, benchmarks and the
simulator.
"""

from __future__ import annotations

from failslow.core.planner.allocation import (
    allocate_microbatches,
    loss_weights,
    microbatch_plan,
    replica_times,
)
from failslow.core.planner.planner import MitigationCosts, Planner
from failslow.core.planner.plans import (
    Ignore,
    MicroBatchPlan,
    Plan,
    RerouteOrReconfigure,
    RestartPlan,
    StateMove,
    TopologyPlan,
)
from failslow.core.planner.ski_rental import Decision, MultiLevelPlanner, Strategy, hindsight_cost
from failslow.core.planner.topology_cost import (
    GREYHOUND_LINK_TRAFFIC,
    LinkTraffic,
    PlacementCost,
    placement_cost,
)
from failslow.core.planner.topology_plan import plan_topology

__all__ = [
    "GREYHOUND_LINK_TRAFFIC",
    "Decision",
    "Ignore",
    "LinkTraffic",
    "MicroBatchPlan",
    "MitigationCosts",
    "MultiLevelPlanner",
    "PlacementCost",
    "Plan",
    "Planner",
    "RerouteOrReconfigure",
    "RestartPlan",
    "StateMove",
    "Strategy",
    "TopologyPlan",
    "allocate_microbatches",
    "hindsight_cost",
    "loss_weights",
    "microbatch_plan",
    "placement_cost",
    "plan_topology",
    "replica_times",
]
