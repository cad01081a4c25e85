"""Odyssey's performance model and plan search for fail-stop recovery (odyssey III-IV).

:func:`plan_failstop` is the one entry point: it compares data rerouting (Eq. 12-13) with a
reconfiguration found by Algorithm 1 (step time by Eq. 9-11, memory by Eq. 14, DP
synchronisation rounds by graph colouring, transition by weight-transfer matching) under
Eq. 8, and returns a :class:`~failslow.core.planner.plans.RerouteOrReconfigure`.
"""

from __future__ import annotations

from failslow.core.planner.odyssey.choice import (
    FailstopPlan,
    crossover_horizon_s,
    healthy_step_time,
    plan_failstop,
    reroute_step_time,
    steps_in_horizon,
)
from failslow.core.planner.odyssey.coloring import (
    dp_sync_groups,
    dp_sync_time,
    greedy_coloring,
    sync_rounds,
)
from failslow.core.planner.odyssey.memory import fits_in_memory, peak_memory, stage_peak_memory
from failslow.core.planner.odyssey.model import ClusterState, ModelProfile, balanced_split
from failslow.core.planner.odyssey.search import (
    ExecutionPlan,
    distribute_batch,
    get_parallel_strategy,
    integer_partition,
    search_execution_plan,
    split_layers,
)
from failslow.core.planner.odyssey.step_time import (
    pipeline_time,
    simulate_1f1b,
    step_time_1f1b,
    step_time_plan,
    step_time_reroute,
)
from failslow.core.planner.odyssey.transition import WeightTransfer, weight_transfer

__all__ = [
    "ClusterState",
    "ExecutionPlan",
    "FailstopPlan",
    "ModelProfile",
    "WeightTransfer",
    "balanced_split",
    "crossover_horizon_s",
    "distribute_batch",
    "dp_sync_groups",
    "dp_sync_time",
    "fits_in_memory",
    "get_parallel_strategy",
    "greedy_coloring",
    "healthy_step_time",
    "integer_partition",
    "peak_memory",
    "pipeline_time",
    "plan_failstop",
    "reroute_step_time",
    "search_execution_plan",
    "simulate_1f1b",
    "split_layers",
    "stage_peak_memory",
    "step_time_1f1b",
    "step_time_plan",
    "step_time_reroute",
    "steps_in_horizon",
    "sync_rounds",
    "weight_transfer",
]
