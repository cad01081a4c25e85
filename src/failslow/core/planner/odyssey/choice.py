"""Choose between data rerouting and reconfiguration after a fail-stop (odyssey III, Eq. 4-8).

Between two faults the time ``H = t_{S_i -> S_{i+1}} + t_{S_{i+1}}`` is fixed, so Eq. 8 picks
the next state maximising ``B / t_step * (H - t_transition) / H``: the steps it completes in
the horizon. Rerouting keeps the layout (Eq. 12-13; transition negligible, the paper's value,
kept as ``reroute_s``); reconfiguring runs Algorithm 1 and pays the transition of
:mod:`.transition` (weight transfer + ``restart_s``).

Each option's cost is reported as seconds of training lost over the horizon against the
pre-failure layout: ``H - steps_done * t_ref``. Lower cost = more steps = Eq. 8's choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from failslow.core.planner.odyssey.coloring import dp_sync_time
from failslow.core.planner.odyssey.model import ClusterState, ModelProfile
from failslow.core.planner.odyssey.search import ExecutionPlan, search_execution_plan
from failslow.core.planner.odyssey.step_time import pipeline_time
from failslow.core.planner.odyssey.transition import weight_transfer
from failslow.core.planner.plans import RerouteOrReconfigure
from failslow.errors import ConfigError, FailslowError


@dataclass(frozen=True, kw_only=True)
class FailstopPlan(RerouteOrReconfigure):
    """:class:`RerouteOrReconfigure` with every pipeline's layout, which an asymmetric plan
    needs: ``pipelines[p]`` is pipeline ``p``'s layers per stage (``pp`` and
    ``layers_per_stage`` describe the longest pipeline)."""

    pipelines: tuple[tuple[int, ...], ...] = ()


def microbatches_per_replica(cluster: ClusterState, global_batch_microbatches: int) -> int:
    """``N_m`` of the current layout: the global batch split evenly over ``cluster.dp``."""
    if not isinstance(global_batch_microbatches, int) or global_batch_microbatches < 1:
        raise ConfigError(
            "odyssey: global_batch_microbatches must be a positive integer, "
            f"got {global_batch_microbatches!r}"
        )
    if global_batch_microbatches % cluster.dp:
        raise ConfigError(
            f"odyssey: global batch of {global_batch_microbatches} micro-batches is not "
            f"divisible by dp = {cluster.dp}"
        )
    return global_batch_microbatches // cluster.dp


def healthy_step_time(
    profile: ModelProfile, cluster: ClusterState, global_batch_microbatches: int
) -> float:
    """Step time of the current layout with no node lost (the reference ``t_ref``)."""
    split = cluster.split(profile.num_layers)
    m = microbatches_per_replica(cluster, global_batch_microbatches)
    return pipeline_time(profile, split, m) + dp_sync_time(profile, [split] * cluster.dp)


def reroute_step_time(
    profile: ModelProfile, cluster: ClusterState, global_batch_microbatches: int
) -> float:
    """Eq. 13 on the current layout, plus p2p and the DP all-reduce of the survivors.

    The pipeline part is :func:`pipeline_time` (Eq. 9 when stages are equal and p2p is free)
    plus ``sum_i [F_i > 0] * N_m * F_i / (N_dp - F_i) * (Tf + Tb)`` with the slowest stage's
    ``Tf + Tb``. Raises :class:`FailslowError` when a stage has no survivor.
    """
    split = cluster.split(profile.num_layers)
    m = microbatches_per_replica(cluster, global_batch_microbatches)
    n = cluster.pp
    per_mb = max(
        profile.stage_forward_s(layers, s, n) + profile.stage_backward_s(layers, s, n)
        for s, layers in enumerate(split)
    )
    extra = 0.0
    for i, f in enumerate(cluster.failures):
        if f >= cluster.dp:
            raise FailslowError(
                f"odyssey: stage {i} lost all {cluster.dp} replicas; rerouting cannot recover it"
            )
        if f:
            extra += m * f / (cluster.dp - f)
    sync = max(
        profile.allreduce_s(layers * profile.layer_grad_bytes, cluster.dp - f)
        for layers, f in zip(split, cluster.failures, strict=True)
    )
    return pipeline_time(profile, split, m) + extra * per_mb + sync


def steps_in_horizon(step_time_s: float, transition_s: float, horizon_s: float) -> float:
    """Steps completed before the next fault (Eq. 8 up to the constant ``B / H``)."""
    if not math.isfinite(step_time_s) or step_time_s <= 0:
        return 0.0 if not math.isfinite(step_time_s) else math.inf
    return max(0.0, horizon_s - transition_s) / step_time_s


def crossover_horizon_s(
    reroute_step_s: float,
    reconfigure_step_s: float,
    reconfigure_transition_s: float,
    reroute_transition_s: float = 0.0,
) -> float:
    """Horizon beyond which reconfiguring completes more steps than rerouting (inf: never)."""
    gain = 1.0 / reconfigure_step_s - 1.0 / reroute_step_s
    if gain <= 0:
        return math.inf
    return (
        reconfigure_transition_s / reconfigure_step_s - reroute_transition_s / reroute_step_s
    ) / gain


def plan_failstop(
    profile: ModelProfile,
    cluster: ClusterState,
    *,
    global_batch_microbatches: int,
    horizon_s: float,
    restart_s: float = 0.0,
    reroute_s: float = 0.0,
    transfer_bandwidth_Bps: float | None = None,
    dp_window: int = 1,
    pp_range: tuple[int, int] | None = None,
    max_length_spread: int | None = 2,
    max_idle_nodes: int = 0,
    options: tuple[str, ...] = ("reroute", "reconfigure"),
) -> FailstopPlan:
    """Odyssey's decision after losing ``cluster.failed_per_stage`` nodes (Eq. 8).

    ``horizon_s``: expected time until the next fault (transition included). ``restart_s``:
    the reconfiguration's restart overhead, which the paper says depends only on the training
    scale and does not quantify (default 0; Fig. 10 reports 8.2-11.2 s of total recovery on
    8 NPUs). ``reroute_s``: rerouting's transition, negligible in the paper. The weight
    transfer runs at ``transfer_bandwidth_Bps`` (default: ``profile.dp_bandwidth_Bps``).
    The new DP degree is searched within ``dp_window`` of the old one (the paper: it rarely
    differs by 2 or more). ``options`` restricts the choice (``("reroute",)`` is ReCycle's
    policy, ``("reconfigure",)`` Oobleck's; the simulator compares them with the adaptive one).

    Returns the chosen option; ``alternatives`` holds both options' cost (seconds of training
    lost over the horizon, ``inf`` when infeasible), ``overhead_s`` the chosen transition time
    and ``step_time_s`` its estimated step time.
    """
    if not (isinstance(horizon_s, int | float) and horizon_s > 0):
        raise ConfigError(f"odyssey: horizon_s must be a positive number, got {horizon_s!r}")
    for name, value in (("restart_s", restart_s), ("reroute_s", reroute_s)):
        if not value >= 0:
            raise ConfigError(f"odyssey: {name} must be >= 0, got {value!r}")
    unknown = set(options) - {"reroute", "reconfigure"}
    if not options or unknown:
        raise ConfigError(f"odyssey: options must be reroute and/or reconfigure, got {options}")
    if cluster.nodes_available < 1:
        raise FailslowError(
            f"odyssey: all {cluster.dp * cluster.pp} nodes have failed; no nodes left to train on"
        )
    t_ref = healthy_step_time(profile, cluster, global_batch_microbatches)
    bandwidth = transfer_bandwidth_Bps or profile.dp_bandwidth_Bps

    def lost(step_s: float, transition_s: float) -> float:
        return horizon_s - steps_in_horizon(step_s, transition_s, horizon_s) * t_ref

    reasons: list[str] = []
    old_split = cluster.split(profile.num_layers)
    m = global_batch_microbatches // cluster.dp
    reroute: FailstopPlan | None = None
    try:
        if "reroute" not in options:
            raise FailslowError("not among the options")
        step = reroute_step_time(profile, cluster, global_batch_microbatches)
    except FailslowError as exc:
        reasons.append(f"reroute: {exc}")
    else:
        reroute = FailstopPlan(
            choice="reroute",
            dp=cluster.dp,
            pp=cluster.pp,
            layers_per_stage=old_split,
            micro_batches_per_replica=(m,) * cluster.dp,
            failed_per_stage=cluster.failures,
            pipelines=(old_split,) * cluster.dp,
            overhead_s=reroute_s,
            step_time_s=step,
        )

    reconfigure: FailstopPlan | None = None
    try:
        if "reconfigure" not in options:
            raise FailslowError("not among the options")
        best: ExecutionPlan = search_execution_plan(
            profile,
            cluster.nodes_available,
            global_batch_microbatches=global_batch_microbatches,
            dp_range=(max(1, cluster.dp - dp_window), cluster.dp + dp_window),
            pp_range=pp_range,
            max_length_spread=max_length_spread,
            max_idle_nodes=max_idle_nodes,
        )
    except FailslowError as exc:
        reasons.append(f"reconfigure: {exc}")
    else:
        moved = weight_transfer(profile, cluster, best.pipelines, transfer_bandwidth_Bps=bandwidth)
        reconfigure = FailstopPlan(
            choice="reconfigure",
            dp=best.dp,
            pp=len(best.pipelines[0]),
            layers_per_stage=best.pipelines[0],
            micro_batches_per_replica=best.micro_batches,
            pipelines=best.pipelines,
            overhead_s=moved.seconds + restart_s,
            step_time_s=best.step_time_s,
        )

    feasible = [p for p in (reroute, reconfigure) if p is not None]
    if not feasible:
        raise FailslowError("odyssey: no way to continue: " + "; ".join(reasons))
    costs = {"reroute": math.inf, "reconfigure": math.inf}
    for p in feasible:
        assert p.step_time_s is not None
        costs[p.choice] = lost(p.step_time_s, p.overhead_s)
    chosen = min(feasible, key=lambda p: costs[p.choice])  # ties: reroute (listed first)
    return FailstopPlan(
        choice=chosen.choice,
        dp=chosen.dp,
        pp=chosen.pp,
        layers_per_stage=chosen.layers_per_stage,
        micro_batches_per_replica=chosen.micro_batches_per_replica,
        failed_per_stage=chosen.failed_per_stage,
        pipelines=chosen.pipelines,
        overhead_s=chosen.overhead_s,
        step_time_s=chosen.step_time_s,
        alternatives=costs,
    )
