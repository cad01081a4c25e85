"""Planner: one interface for fail-slow and fail-stop plans, costs from MitigationCosts."""

from __future__ import annotations

import pytest

from failslow.core.diagnosis import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner import (
    MicroBatchPlan,
    MitigationCosts,
    Planner,
    RerouteOrReconfigure,
    RestartPlan,
    TopologyPlan,
)
from failslow.core.planner.odyssey import ModelProfile
from failslow.core.topology import Topology

COSTS = MitigationCosts(
    state_bytes_per_rank=2**30, transfer_bytes_per_s=1e9, pause_s=10.0, restart_s=100.0
)


def topology() -> Topology:
    return Topology.megatron(tp=2, dp=4, pp=2, gpus_per_host=2, micro_batches=16)


def test_compute_failslow_escalates_s2_then_s4_with_configured_costs():
    planner = Planner(topology(), COSTS, healthy_microbatch_s=0.1)
    slow_rank = topology().rank_of(0, 1, 0)
    diagnosis = Diagnosis(Kind.COMPUTE, (SlowRank(slow_rank, 3.0),))
    assert planner.onset(diagnosis, healthy_step_s=1.0) == []  # no impact yet
    decisions = planner.observe(2.0)  # 1 s of impact > the measured solve time
    assert [type(d.plan) for d in decisions] == [MicroBatchPlan]
    plan = decisions[0].plan
    assert plan.counts[1] < plan.counts[0] and sum(plan.counts) == 16
    names = []
    for _ in range(200):
        names += [d.strategy for d in planner.observe(2.0)]
    # one straggler host: S3 finds nothing to consolidate; restart at its 100 s break-even
    assert names == ["S4 restart"]
    # the restart resumed from the snapshot, uneven split included: relief undoes it
    reverts = planner.relief()
    assert [(d.action, d.strategy) for d in reverts] == [("revert", "S2 micro-batches")]
    assert reverts[0].plan is plan


def test_link_failslow_gets_a_topology_plan_whose_overhead_is_pause_plus_transfer():
    topo = topology()
    a, b = topo.rank_of(0, 1, 0), topo.rank_of(0, 2, 0)  # DP ring neighbours, other hosts
    planner = Planner(topo, COSTS, healthy_microbatch_s=0.1)
    planner.onset(
        Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(a, b, 4.0),)), healthy_step_s=1.0
    )
    decisions = []
    for _ in range(100):
        decisions += planner.observe(2.0)
    plan = decisions[0].plan
    assert isinstance(plan, TopologyPlan)
    busiest = max(sum(m.nbytes for m in plan.moves if m.dst_host == h) for h in set(plan.hosts))
    assert plan.overhead_s == pytest.approx(COSTS.pause_s + busiest / COSTS.transfer_bytes_per_s)


def test_failstop_restarts_without_a_profile_and_asks_odyssey_with_one():
    topo = topology()
    lost = topo.hosts[topo.rank_of(0, 3, 1)]
    plan = Planner(topo, COSTS, healthy_microbatch_s=0.1).failstop([lost], horizon_s=3600.0)
    assert isinstance(plan, RestartPlan) and plan.evict == (lost,)
    assert plan.overhead_s == COSTS.restart_s
    profile = ModelProfile(num_layers=8, forward_s=0.01, backward_s=0.02)
    with_profile = Planner(topo, COSTS, healthy_microbatch_s=0.1, profile=profile)
    plan = with_profile.failstop([lost], horizon_s=3600.0)
    assert isinstance(plan, RerouteOrReconfigure)
    assert plan.choice in ("reroute", "reconfigure") and set(plan.alternatives) == {
        "reroute",
        "reconfigure",
    }
    forced = with_profile.failstop([lost], horizon_s=3600.0, options=("reroute",))
    assert forced.choice == "reroute" and forced.failed_per_stage == (0, 1)
