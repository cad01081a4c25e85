"""Odyssey's choice between data rerouting and reconfiguration (III Eq. 8, IV-B, IV-C)."""

from __future__ import annotations

import itertools
import math

import pytest

from failslow.core.planner.odyssey import (
    ClusterState,
    ModelProfile,
    crossover_horizon_s,
    plan_failstop,
    reroute_step_time,
    step_time_reroute,
    weight_transfer,
)
from failslow.core.planner.plans import RerouteOrReconfigure
from failslow.core.topology import Topology
from failslow.errors import ConfigError, FailslowError

PROFILE = ModelProfile(
    num_layers=32,
    forward_s=0.01,
    backward_s=0.02,
    param_bytes=1e8,
    optimizer_bytes=2e8,
    activation_bytes=5e7,
    dp_bandwidth_Bps=1e10,
    memory_capacity_bytes=64e9,
)
CLUSTER = ClusterState(dp=4, pp=2, failed_per_stage=(1, 0))


def test_reroute_step_time_is_eq12_without_communication() -> None:
    profile = ModelProfile(num_layers=32, forward_s=0.01, backward_s=0.02)
    # stage: 16 layers, Tf + Tb = 0.48 s; N_m = 64 / 4 = 16; Eq. 12: (2 + 16 - 1 + 16/3) * 0.48
    want = step_time_reroute(2, 16, 4, [1, 0], 0.16, 0.32)
    assert want == pytest.approx((17 + 16 / 3) * 0.48)
    assert reroute_step_time(profile, CLUSTER, 64) == pytest.approx(want)


def _options(horizon: float) -> tuple[RerouteOrReconfigure, dict[str, float]]:
    plan = plan_failstop(
        PROFILE, CLUSTER, global_batch_microbatches=64, horizon_s=horizon, restart_s=10.0
    )
    return plan, plan.alternatives


def test_short_horizon_reroutes_long_horizon_reconfigures_with_the_crossover() -> None:
    short, _ = _options(50.0)
    long, _ = _options(5000.0)
    assert isinstance(short, RerouteOrReconfigure) and short.choice == "reroute"
    assert short.overhead_s == 0.0 and short.dp == 4 and short.failed_per_stage == (1, 0)
    assert long.choice == "reconfigure" and long.overhead_s >= 10.0
    assert long.step_time_s is not None and short.step_time_s is not None
    assert long.step_time_s < short.step_time_s
    assert sum(long.micro_batches_per_replica) == 64
    assert sum(len(p) for p in long.pipelines) == 7  # all survivors used (paper: [2, 2, 3])
    # Eq. 8: the choice flips where both options complete the same number of steps.
    crossover = crossover_horizon_s(short.step_time_s, long.step_time_s, long.overhead_s)
    assert 50.0 < crossover < 5000.0
    before, costs_before = _options(crossover * 0.95)
    after, costs_after = _options(crossover * 1.05)
    assert before.choice == "reroute" and after.choice == "reconfigure"
    assert costs_before["reroute"] < costs_before["reconfigure"]
    assert costs_after["reroute"] > costs_after["reconfigure"]
    _, costs_at = _options(crossover)
    assert costs_at["reroute"] == pytest.approx(costs_at["reconfigure"])


def test_horizon_shorter_than_the_transition_never_reconfigures() -> None:
    plan, costs = _options(5.0)
    assert plan.choice == "reroute"
    assert costs["reconfigure"] == pytest.approx(5.0)  # the whole horizon is lost


def test_a_stage_without_survivors_forces_reconfiguration() -> None:
    cluster = ClusterState(dp=2, pp=2, failed_per_stage=(2, 0))
    plan = plan_failstop(PROFILE, cluster, global_batch_microbatches=8, horizon_s=1.0)
    assert plan.choice == "reconfigure" and plan.alternatives["reroute"] == math.inf
    assert sum(len(p) for p in plan.pipelines) == 2


def test_impossible_inputs_are_clear_errors() -> None:
    with pytest.raises(FailslowError, match="no nodes left"):
        plan_failstop(
            PROFILE,
            ClusterState(dp=2, pp=1, failed_per_stage=(2,)),
            global_batch_microbatches=8,
            horizon_s=100.0,
        )
    with pytest.raises(ConfigError, match="not divisible by dp = 4"):
        plan_failstop(PROFILE, CLUSTER, global_batch_microbatches=30, horizon_s=100.0)
    with pytest.raises(ConfigError, match="horizon_s"):
        plan_failstop(PROFILE, CLUSTER, global_batch_microbatches=64, horizon_s=0.0)
    with pytest.raises(ConfigError, match=r"failed_per_stage\[0\]"):
        ClusterState(dp=2, pp=2, failed_per_stage=(3, 0))
    with pytest.raises(ConfigError, match="failed_per_stage has 1 entries"):
        ClusterState(dp=2, pp=2, failed_per_stage=(1,))
    tiny = ModelProfile(
        num_layers=4, forward_s=1.0, backward_s=1.0, param_bytes=10.0, memory_capacity_bytes=1.0
    )
    with pytest.raises(FailslowError, match="no way to continue"):
        plan_failstop(
            tiny,
            ClusterState(dp=1, pp=2, failed_per_stage=(1, 0)),
            global_batch_microbatches=4,
            horizon_s=100.0,
        )


def test_cluster_state_from_topology() -> None:
    topo = Topology.megatron(tp=2, dp=4, pp=2, gpus_per_host=2, micro_batches=64)
    cluster = ClusterState.from_topology(topo, ["node00001", "node00006"])
    # host 1 runs (dp=1, pp=0); host 6 runs (dp=2, pp=1)
    assert cluster.failed_per_stage == (1, 1) and cluster.devices_per_node == 2
    assert cluster.nodes_available == 6
    with pytest.raises(ConfigError, match="not in the topology"):
        ClusterState.from_topology(topo, ["elsewhere"])


def _brute_force_layers_moved(cluster: ClusterState, pipelines: list[tuple[int, ...]]) -> int:
    def spans(split: tuple[int, ...]) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(split))
        return [(e - n, e) for n, e in zip(split, ends, strict=True)]

    old = [
        s
        for s, f in zip(spans(cluster.split(6)), cluster.failures, strict=True)
        for _ in range(cluster.dp - f)
    ]
    new = [s for split in pipelines for s in spans(split)]
    best = math.inf
    for chosen in itertools.permutations(old, len(new)):
        moved = sum(
            (b - a) - max(0, min(b, d) - max(a, c))
            for (a, b), (c, d) in zip(new, chosen, strict=True)
        )
        best = min(best, moved)
    return int(best)


@pytest.mark.parametrize(
    "pipelines", [[(2, 2, 2), (3, 3)], [(3, 3), (3, 3)], [(1, 2, 3), (4, 2)], [(6,), (6,)]]
)
def test_weight_transfer_is_the_minimum_matching(pipelines: list[tuple[int, ...]]) -> None:
    profile = ModelProfile(
        num_layers=6, forward_s=1.0, backward_s=1.0, param_bytes=1.0, optimizer_bytes=1.0
    )
    cluster = ClusterState(dp=2, pp=3, failed_per_stage=(0, 1, 0))
    moved = weight_transfer(profile, cluster, pipelines, transfer_bandwidth_Bps=1.0)
    assert moved.layers_moved == _brute_force_layers_moved(cluster, pipelines)
    assert moved.bytes_moved == 2.0 * moved.layers_moved
    with pytest.raises(FailslowError, match="needs 6 nodes but only 5"):
        weight_transfer(profile, cluster, [(2, 2, 2), (2, 2, 2)], transfer_bandwidth_Bps=1.0)
