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


def test_s4_evicts_the_worst_hosts_the_standbys_can_replace():
    """Issue 16: the S4 demo's restart plan evicted a slow rank's host and a noisy link's end
    with one standby, so one of them restarted in place on its own host - slow GPU included.
    S4 now evicts the worst diagnosed hosts first, no more than the free standbys replace, and
    is no option without a standby."""
    topo = topology()
    slow, fast = topo.rank_of(0, 1, 0), topo.rank_of(0, 3, 1)
    link = SlowLink(topo.rank_of(0, 0, 0), topo.rank_of(0, 2, 1), 5.0)
    diagnosis = Diagnosis(Kind.BOTH, (SlowRank(fast, 1.5), SlowRank(slow, 4.0)), (link,))
    by_severity = (topo.hosts[slow], topo.hosts[fast], topo.hosts[link.b])
    free: list[int | None] = [None]

    def restart(n: int | None) -> tuple[str, ...] | None:
        free[0] = n
        planner = Planner(
            topo, COSTS, healthy_microbatch_s=0.1, strategies=("S4",), standbys=lambda: free[0]
        )
        planner.onset(diagnosis, healthy_step_s=1.0)
        for _ in range(200):
            for d in planner.observe(2.0):
                assert isinstance(d.plan, RestartPlan)
                return d.plan.evict
        return None

    assert restart(None) == tuple(sorted(by_severity))  # no launcher says: every host
    assert restart(3) == tuple(sorted(by_severity))
    assert restart(2) == tuple(sorted(by_severity[:2]))
    assert restart(1) == (topo.hosts[slow],)  # the slowest GPU's host
    assert restart(0) is None  # restarting on the same hosts would keep the slow GPU


def test_a_restart_is_planned_with_the_standbys_free_when_it_is_bought():
    """The standbys can be taken between the onset and the buy (a fail-stop used one): S4 is
    planned again as it is bought, with what a restart can do then - or not bought at all."""
    topo = topology()
    slow, other = topo.rank_of(0, 1, 0), topo.rank_of(0, 3, 1)
    diagnosis = Diagnosis(Kind.COMPUTE, (SlowRank(slow, 4.0), SlowRank(other, 2.0)))
    free = [2]
    planner = Planner(
        topo, COSTS, healthy_microbatch_s=0.1, strategies=("S4",), standbys=lambda: free[0]
    )
    planner.onset(diagnosis, healthy_step_s=1.0)
    assert planner.ski.candidates() == (("S4 restart", COSTS.restart_s),)
    free[0] = 1  # one of the two standbys went to a fail-stop meanwhile
    decisions = [d for _ in range(200) for d in planner.observe(2.0)]
    assert [d.plan.evict for d in decisions] == [(topo.hosts[slow],)]  # type: ignore[attr-defined]
    free[0] = 0
    planner.onset(Diagnosis(Kind.COMPUTE, (SlowRank(other, 2.0),)), healthy_step_s=1.0)
    free[0] = 1
    assert planner.ski.candidates() == ()  # none free at the onset: no restart to plan
    planner.onset(Diagnosis(Kind.COMPUTE, (SlowRank(other, 3.0),)), healthy_step_s=1.0)
    free[0] = 0  # taken before the buy
    assert [d for _ in range(200) for d in planner.observe(2.0)] == []
