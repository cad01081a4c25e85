"""S3 topology plans (greyhound 5.2, Fig. 11 and 12; odyssey IV-B minimal state moves)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.plans import TopologyPlan
from failslow.core.planner.topology_cost import (
    GREYHOUND_LINK_TRAFFIC,
    LinkTraffic,
    PlacementCost,
    placement_cost,
)
from failslow.core.planner.topology_plan import plan_topology
from failslow.core.topology import Topology
from failslow.errors import FailslowError

STATE = 3_000
ARGS = {"state_bytes_per_rank": STATE, "transfer_bandwidth_bytes_per_s": 1_000.0, "pause_s": 2.0}


def links(*pairs: tuple[int, int, float]) -> Diagnosis:
    return Diagnosis(kind=Kind.COMMUNICATION, slow_links=tuple(SlowLink(*p) for p in pairs))


def stragglers(*ranks: int, slowdown: float = 2.0) -> Diagnosis:
    return Diagnosis(kind=Kind.COMPUTE, slow_ranks=tuple(SlowRank(r, slowdown) for r in ranks))


def cost_after(topology: Topology, diagnosis: Diagnosis, plan: TopologyPlan) -> PlacementCost:
    return placement_cost(topology.with_hosts(plan.hosts), diagnosis, diagnosed_on=topology)


def swapped(topology: Topology, a: str, b: str) -> Topology:
    return topology.with_hosts([{a: b, b: a}.get(h, h) for h in topology.hosts])


def check_plan(topology: Topology, plan: TopologyPlan) -> None:
    """A node-granular permutation, with exactly the changed roles listed as moves."""
    old = {h: frozenset(topology.ranks_on(h)) for h in topology.host_names}
    new = {h: frozenset(r for r, x in enumerate(plan.hosts) if x == h) for h in old}
    assert set(plan.hosts) == set(old)
    assert sorted(map(sorted, new.values())) == sorted(map(sorted, old.values()))
    for d in range(topology.dp):
        for p in range(topology.pp):
            on = {plan.hosts[r] for r in topology.tp_group(d, p)}
            was = {topology.hosts[r] for r in topology.tp_group(d, p)}
            assert len(was) > 1 or len(on) == 1
    changed = [r for r in range(topology.world_size) if plan.hosts[r] != topology.hosts[r]]
    assert sorted(m.role for m in plan.moves) == changed
    for m in plan.moves:
        assert (m.src_host, m.dst_host, m.nbytes) == (
            topology.hosts[m.role],
            plan.hosts[m.role],
            STATE,
        )
    assert plan.bytes_moved == STATE * len(changed)
    per_host = {h: 0 for h in old}
    for m in plan.moves:
        per_host[m.dst_host] += m.nbytes
    assert plan.overhead_s == pytest.approx(ARGS["pause_s"] + max(per_host.values()) / 1_000.0)


def brute_force(topology: Topology, diagnosis: Diagnosis) -> dict[tuple, int]:
    """Every host permutation: cost key -> fewest roles moved to reach it."""
    names = topology.host_names
    best: dict[tuple, int] = {}
    for perm in itertools.permutations(names):
        to = dict(zip(names, perm, strict=True))
        hosts = [to[h] for h in topology.hosts]
        key = placement_cost(topology.with_hosts(hosts), diagnosis, diagnosed_on=topology).key
        moved = sum(a != b for a, b in zip(hosts, topology.hosts, strict=True))
        best[key] = min(best.get(key, moved), moved)
    return best


# -- Fig. 11: a congested DP link becomes a PP link ------------------------------------------


def fig11() -> Topology:
    # Paper nodes 1..4 are node00000..node00003: DP pairs {1,2}, {3,4}; pipelines 1-3, 2-4.
    return Topology.megatron(tp=2, dp=2, pp=2, gpus_per_host=2, micro_batches=4)


def test_fig11_congested_dp_link_stops_carrying_dp() -> None:
    topology = fig11()
    diagnosis = links((4, 6, 3.0))  # node 3 <-> node 4
    before = placement_cost(topology, diagnosis)
    assert (before.slow_dp_links, before.slow_pp_links) == (1, 0)

    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    check_plan(topology, plan)
    after = cost_after(topology, diagnosis, plan)
    assert after.slow_dp_links == 0 and after.link_cost < before.link_cost
    # The paper's swap of nodes 2 and 3 puts the link on PP; the plan does at least as well
    # (here: the two hosts end up with no traffic between them at all) with as few moves.
    paper = placement_cost(
        swapped(topology, "node00001", "node00002"), diagnosis, diagnosed_on=topology
    )
    assert (paper.slow_dp_links, paper.slow_pp_links) == (0, 1)
    assert after.key <= paper.key
    assert len(plan.moves) == 2 * 2


def test_fig11_swap_when_the_link_must_carry_something() -> None:
    # Node 4's links to nodes 3 and 1 are both congested: node 4 must have *some* traffic with
    # one of them, and the best is PP. The plan is the paper's swap of nodes 2 and 3.
    topology = fig11()
    diagnosis = links((4, 6, 3.0), (0, 6, 3.0))
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    check_plan(topology, plan)
    assert plan.hosts == swapped(topology, "node00001", "node00002").hosts
    before, after = placement_cost(topology, diagnosis), cost_after(topology, diagnosis, plan)
    assert (before.slow_dp_links, before.slow_pp_links) == (1, 0)
    assert (after.slow_dp_links, after.slow_pp_links) == (0, 1)
    assert "DP traffic 1 -> 0" in plan.reason


# -- Fig. 12: stragglers consolidated into the fewest, interior stages -----------------------


def test_fig12_two_stragglers_into_one_interior_stage() -> None:
    topology = Topology.megatron(tp=1, dp=2, pp=4, gpus_per_host=1, micro_batches=8)
    diagnosis = stragglers(topology.rank_of(0, 0, 1), topology.rank_of(0, 1, 2))
    before = placement_cost(topology, diagnosis)
    assert (before.straggler_stages, before.edge_straggler_stages) == (2, 0)
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    check_plan(topology, plan)
    after = cost_after(topology, diagnosis, plan)
    assert (after.straggler_stages, after.edge_straggler_stages) == (1, 0)
    assert len(plan.moves) == 2  # one straggler and the host it displaces


def test_edge_stragglers_move_inside() -> None:
    topology = Topology.megatron(tp=2, dp=2, pp=4, gpus_per_host=2, micro_batches=8)
    diagnosis = stragglers(topology.rank_of(1, 0, 0), topology.rank_of(0, 1, 3))
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    after = cost_after(topology, diagnosis, plan)
    assert (after.straggler_stages, after.edge_straggler_stages) == (1, 0)


@pytest.mark.parametrize(("dp", "pp", "stage_list"), [(2, 4, [0, 1, 2]), (4, 8, [0, 1, 3, 5, 7])])
def test_stragglers_fill_ceil_s_over_g_stages(dp: int, pp: int, stage_list: list[int]) -> None:
    topology = Topology.megatron(tp=1, dp=dp, pp=pp, gpus_per_host=1, micro_batches=pp * dp)
    diagnosis = stragglers(*(topology.rank_of(0, i % dp, p) for i, p in enumerate(stage_list)))
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    check_plan(topology, plan)
    after = cost_after(topology, diagnosis, plan)
    assert after.straggler_stages == math.ceil(len(stage_list) / dp)
    assert after.edge_straggler_stages == 0


# -- nothing to gain ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "diagnosis",
    [
        Diagnosis(kind=Kind.BOTH),
        links((0, 6, 3.0)),  # node 1 <-> node 4: no DP or PP traffic between them
        links((0, 1, 3.0)),  # inside one host: moves with the host
        links(*((a, b, 2.0) for a, b in itertools.combinations((0, 2, 4, 6), 2))),  # all links
        stragglers(0, 1),  # both on one host
    ],
    ids=["healthy", "idle-link", "intra-host", "all-links", "one-host"],
)
def test_no_plan_when_nothing_to_gain(diagnosis: Diagnosis) -> None:
    assert plan_topology(fig11(), diagnosis, **ARGS) is None


def test_no_plan_when_already_consolidated_inside() -> None:
    topology = Topology.megatron(tp=1, dp=4, pp=4, gpus_per_host=1, micro_batches=16)
    diagnosis = stragglers(*(topology.rank_of(0, d, 2) for d in (0, 3)))
    assert plan_topology(topology, diagnosis, **ARGS) is None
    assert plan_topology(topology, diagnosis, exact_search_limit=0, **ARGS) is None


# -- minimal moves, against brute force over all host permutations ----------------------------


def test_moves_are_minimal_for_the_optimal_cost() -> None:
    topology = Topology.megatron(tp=1, dp=3, pp=2, gpus_per_host=1, micro_batches=6)
    diagnosis = Diagnosis(
        kind=Kind.BOTH,
        slow_ranks=(SlowRank(0, 2.0), SlowRank(5, 1.5)),
        slow_links=(SlowLink(1, 2, 2.5), SlowLink(3, 4, 1.5)),
    )
    best = brute_force(topology, diagnosis)
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    key = cost_after(topology, diagnosis, plan).key
    assert key == min(best)
    assert len(plan.moves) == best[key]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Topology, Diagnosis]:
    tp = draw(st.sampled_from([1, 2]))
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(1, 4))
    groups = dp * pp
    fits = [g for g in (1, 2) if groups % g == 0 and groups // g <= 6]
    assume(fits)
    per_host = draw(st.sampled_from(fits))
    base = Topology.megatron(tp=tp, dp=dp, pp=pp, gpus_per_host=tp, micro_batches=groups)
    # Whole TP groups, shuffled, then dealt to hosts `per_host` at a time: arbitrary layouts.
    order = draw(st.permutations(range(groups)))
    hosts = [""] * base.world_size
    for i, g in enumerate(order):
        for r in base.tp_group(g % dp, g // dp):
            hosts[r] = f"h{i // per_host}"
    topology = base.with_hosts(hosts)
    n = topology.world_size
    rank = st.integers(0, n - 1)
    slow = st.sampled_from([1.5, 2.0, 3.0])
    slow_links = draw(st.lists(st.builds(SlowLink, rank, rank, slow), max_size=3))
    slow_ranks = draw(st.lists(st.builds(SlowRank, rank, slow), max_size=3))
    return topology, Diagnosis(
        kind=Kind.BOTH, slow_ranks=tuple(slow_ranks), slow_links=tuple(slow_links)
    )


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_exact_plans_are_optimal_and_minimal(scenario: tuple[Topology, Diagnosis]) -> None:
    topology, diagnosis = scenario
    plan = plan_topology(topology, diagnosis, **ARGS)
    best = brute_force(topology, diagnosis)
    before = placement_cost(topology, diagnosis).key
    if plan is None:
        assert min(best) == before
        return
    check_plan(topology, plan)
    key = cost_after(topology, diagnosis, plan).key
    assert key == min(best) < before
    assert len(plan.moves) == best[key]


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_constructive_plans_are_valid_and_never_worse(scenario: tuple[Topology, Diagnosis]) -> None:
    topology, diagnosis = scenario
    plan = plan_topology(topology, diagnosis, exact_search_limit=0, **ARGS)
    if plan is None:
        return
    check_plan(topology, plan)
    assert cost_after(topology, diagnosis, plan).key < placement_cost(topology, diagnosis).key


# -- scale -----------------------------------------------------------------------------------


def test_16384_gpus() -> None:
    topology = Topology.megatron(tp=8, dp=256, pp=8, gpus_per_host=8, micro_batches=1024)
    rank = topology.rank_of
    diagnosis = Diagnosis(
        kind=Kind.BOTH,
        slow_ranks=(SlowRank(rank(3, 3, 0), 2.0), SlowRank(rank(0, 7, 5), 1.5)),
        slow_links=(
            SlowLink(rank(0, 10, 0), rank(0, 11, 0), 4.0),  # DP neighbours
            SlowLink(rank(0, 4, 3), rank(0, 4, 4), 2.0),  # PP neighbours
        ),
    )
    plan = plan_topology(topology, diagnosis, **ARGS)
    assert plan is not None
    after = cost_after(topology, diagnosis, plan)
    assert after == PlacementCost(
        link_cost=0.0, slow_dp_links=0, slow_pp_links=0, straggler_stages=1, edge_straggler_stages=0
    )
    assert len(plan.moves) == 4 * 8  # two hosts for the stragglers, two for both links
    assert len({m.src_host for m in plan.moves}) == 4


# -- errors and the traffic model -------------------------------------------------------------


def test_layouts_without_node_granular_swaps_are_refused() -> None:
    topology = Topology.megatron(tp=2, dp=2, pp=1, gpus_per_host=2, micro_batches=2)
    uneven = topology.with_hosts(["a", "a", "a", "b"])
    with pytest.raises(FailslowError, match="same number of roles"):
        plan_topology(uneven, links((0, 3, 2.0)), **ARGS)
    split_tp = topology.with_hosts(["a", "b", "a", "b"])
    with pytest.raises(FailslowError, match="TP group"):
        plan_topology(split_tp, links((0, 3, 2.0)), **ARGS)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("state_bytes_per_rank", -1),
        ("state_bytes_per_rank", 1.5),
        ("transfer_bandwidth_bytes_per_s", 0.0),
        ("transfer_bandwidth_bytes_per_s", math.inf),
        ("pause_s", -1.0),
        ("exact_search_limit", -5),
    ],
)
def test_bad_arguments(name: str, value: float) -> None:
    with pytest.raises(FailslowError, match=name):
        plan_topology(fig11(), links((4, 6, 3.0)), **{**ARGS, name: value})


def test_unknown_rank_in_diagnosis() -> None:
    with pytest.raises(FailslowError, match="rank 99"):
        plan_topology(fig11(), links((4, 99, 3.0)), **ARGS)
    with pytest.raises(FailslowError, match="dp_bytes"):
        LinkTraffic(dp_bytes=-1.0, pp_bytes=0.0)


def test_traffic_weights_decide_between_dp_and_pp() -> None:
    # If PP carried more than DP, the plan would move the link the other way.
    topology = fig11()
    diagnosis = links((0, 4, 3.0), (2, 4, 3.0))  # node 3 to node 1 (PP) and node 2 (diagonal)
    assert plan_topology(topology, diagnosis, **ARGS) is None  # PP is already the light choice
    heavy_pp = LinkTraffic(dp_bytes=1.0, pp_bytes=GREYHOUND_LINK_TRAFFIC.dp_bytes)
    plan = plan_topology(topology, diagnosis, traffic=heavy_pp, **ARGS)
    assert plan is not None
    after = cost_after(topology, diagnosis, plan)
    assert placement_cost(topology, diagnosis).slow_pp_links == 1
    assert (
        placement_cost(
            topology.with_hosts(plan.hosts), diagnosis, diagnosed_on=topology, traffic=heavy_pp
        ).slow_dp_links
        == 1
    )
    assert after.slow_pp_links == 0


def hsdp_2x2(**kw: object) -> Topology:
    """HSDP 2 x 2, one rank per host: tp = shard (0, 1 on replica 0; 2, 3 on replica 1)."""
    return Topology(
        tp=2, dp=2, pp=1,
        coords=((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)),
        hosts=("h0", "h1", "h2", "h3"),
        micro_batches=8,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_sharded_job_moves_a_congested_shard_link_between_replicas() -> None:
    """HSDP: the link inside a shard group carries per-layer all-gathers and reduce-scatters
    (4 micro-batches per replica: 6x a replica all-reduce); after the plan its hosts are in
    different shard groups (2 x 2: diagonal roles, so the link carries nothing)."""
    topology = hsdp_2x2(sharded=True)
    diagnosis = links((0, 1, 4.0))
    plan = plan_topology(topology, diagnosis, **ARGS)  # type: ignore[arg-type]
    assert plan is not None
    assert plan.moves
    moved = topology.with_hosts(plan.hosts)
    a, b = (moved.ranks_on(h)[0] for h in ("h0", "h1"))
    assert moved.coords[a][1] != moved.coords[b][1]  # no longer one replica's shard group
    before = placement_cost(topology, diagnosis, traffic=_sharded(topology))
    after = placement_cost(moved, diagnosis, diagnosed_on=topology, traffic=_sharded(topology))
    assert (before.slow_tp_links, after.slow_tp_links) == (1, 0)
    assert after.link_cost < before.link_cost
    assert "shard-group traffic 1 -> 0" in plan.reason


def _sharded(topology: Topology) -> LinkTraffic:
    from failslow.core.planner.topology_cost import link_traffic

    traffic = link_traffic(topology)
    assert traffic.tp_bytes == 1.5 * 4 * GREYHOUND_LINK_TRAFFIC.dp_bytes
    return traffic


def test_tensor_parallel_across_hosts_is_still_refused_when_not_sharded() -> None:
    with pytest.raises(FailslowError, match="TP group"):
        plan_topology(hsdp_2x2(), links((0, 1, 4.0)), **ARGS)  # type: ignore[arg-type]


def test_the_sharded_flag_survives_the_job_record() -> None:
    topology = hsdp_2x2(sharded=True)
    assert Topology.from_dict(topology.to_dict()).sharded
    assert topology.with_hosts(("h1", "h0", "h2", "h3")).sharded
    assert not Topology.from_dict({**topology.to_dict(), "sharded": False}).sharded
