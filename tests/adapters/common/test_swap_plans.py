"""The planner's S3 plans carried out by the kit's placement (greyhound 5.2, both cases): what
the ranks run after :meth:`Topology.placement` / :meth:`Topology.moved` is what the plan meant."""

from __future__ import annotations

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner import plan_topology
from failslow.core.topology import Topology


def _plan(topology: Topology, diagnosis: Diagnosis):
    return plan_topology(
        topology, diagnosis, state_bytes_per_rank=0, transfer_bandwidth_bytes_per_s=1e9,
        pause_s=1.0,
    )  # fmt: skip


def test_stragglers_in_two_stages_end_up_in_one():
    """Fig. 12: two stragglers in two pipeline stages cost two slow stages; after the swap the
    processes holding them run roles of one stage."""
    t = Topology.megatron(tp=1, dp=4, pp=2, gpus_per_host=1, micro_batches=16)
    slow = (1, 6)  # stage 0 (replica 1) and stage 1 (replica 2)
    assert {t.stage_of(r) for r in slow} == {0, 1}
    plan = _plan(t, Diagnosis(Kind.COMPUTE, slow_ranks=tuple(SlowRank(r, 3.0) for r in slow)))
    assert plan is not None
    after = t.moved(t.placement(plan.hosts))
    assert after.hosts == t.hosts  # the processes (and the slow devices) stay where they are
    assert len({after.stage_of(r) for r in slow}) == 1, after.coords


def test_a_congested_dp_link_stops_carrying_dp_traffic():
    """Fig. 11: the ends of a congested DP link no longer share a DP group after the swap."""
    t = Topology.megatron(tp=1, dp=2, pp=2, gpus_per_host=1, micro_batches=8)
    plan = _plan(t, Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(0, 1, 5.0),)))
    assert plan is not None
    after = t.moved(t.placement(plan.hosts))
    assert t.stage_of(0) == t.stage_of(1) and after.stage_of(0) != after.stage_of(1)
