"""Dual-phase replay's group arithmetic (byterobust Algorithm 1): failslow.core.diagnosis.replay."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.replay import Grid, ReplayPlan, locate, plan
from failslow.core.topology import megatron_rank


def _faulty(groups: list[list[int]], x: int) -> int:
    [g] = [i for i, members in enumerate(groups) if x in members]
    return g


def test_the_paper_s_figure_6_isolates_machine_13() -> None:
    """Fig. 6: m = 4, n = 6 (24 machines); machine 13 is in H3 and V1."""
    replay = ReplayPlan(24, 4)
    h, v = replay.horizontal(), replay.vertical()
    assert (len(h), len(v)) == (6, 6) and all(len(g) == 4 for g in h + v)
    assert h[3] == [12, 13, 14, 15] and v[1] == [1, 7, 13, 19]
    assert replay.locate(_faulty(h, 13), _faulty(v, 13)) == [13]


def test_plan_takes_whole_pipelines_and_the_largest_unique_group() -> None:
    assert (plan(4, 1).group_size, plan(4, 1).groups) == (2, 2)
    assert plan(16, 2).group_size == 4  # k = 2 pipelines of 2: 4 groups of 4
    assert plan(64, 4).group_size == 8
    assert plan(8, 4).group_size == 4 and not plan(8, 4).unique  # 2 groups of 1 pipeline
    assert plan(12, 2, k=2).group_size == 4
    for bad in ((1, 1), (4, 4), (6, 4)):
        with pytest.raises(ValueError, match=r"replay groups|fewer than two|no replay"):
            plan(*bad)
    with pytest.raises(ValueError, match="k=3"):
        plan(8, 1, k=3)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_property_every_machine_is_found_from_its_two_faulty_groups(data: st.DataObject) -> None:
    """At 2..20,000 machines: each phase partitions the machines into n groups of m, and the
    two groups holding the faulty machine name exactly it when m <= n, else ceil(m/n) machines
    (or one fewer) that include it."""
    n = data.draw(st.integers(2, 200))
    m = data.draw(st.integers(1, 100))
    z = m * n
    replay = ReplayPlan(z, m)
    x = data.draw(st.integers(0, z - 1))
    a, b = x // m, x % n
    found = replay.locate(a, b)
    assert x in found and all(y // m == a and y % n == b for y in found)
    if m <= n:
        assert found == [x]
    else:
        assert math.ceil(m / n) - 1 <= len(found) <= math.ceil(m / n)


@pytest.mark.parametrize("z", [10_000, 10_240, 16_384])
def test_the_phases_partition_a_10k_machine_job_and_name_any_machine(z: int) -> None:
    replay = plan(z, 8)  # 8-stage pipelines
    assert replay.unique and replay.group_size % 8 == 0
    for phase in (replay.horizontal(), replay.vertical()):
        assert sorted(x for g in phase for x in g) == list(range(z))
        assert {len(g) for g in phase} == {replay.group_size}
    h, v = replay.horizontal(), replay.vertical()
    where_h = {x: a for a, g in enumerate(h) for x in g}
    where_v = {x: b for b, g in enumerate(v) for x in g}
    for x in range(0, z, 97):
        assert replay.locate(where_h[x], where_v[x]) == [x]


def test_locate_rejects_groups_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"each must be in 0\.\.1"):
        locate(4, 2, 2, 0)


def _grid(tp: int, dp: int, pp: int, order: list[int] | None = None) -> Grid:
    """Megatron's default numbering, or the roles dealt to ranks in ``order`` (after a swap a
    process may run any role)."""
    roles = sorted(
        ((t, d, s) for t in range(tp) for d in range(dp) for s in range(pp)),
        key=lambda c: megatron_rank(c, tp=tp, dp=dp),
    )
    ranks = order or list(range(len(roles)))
    return Grid.from_coords(dict(zip(ranks, roles, strict=True)), tp, pp)


def test_a_pp2_dp2_grid_replays_its_own_pipelines_then_re_formed_ones() -> None:
    """Megatron PP2 x DP2: ranks 0, 1 are stage 0 of replicas 0, 1 and ranks 2, 3 stage 1, so
    the machines (replica, stage) are 0 -> rank 0, 1 -> rank 2, 2 -> rank 1, 3 -> rank 3. The
    horizontal groups are the job's two pipelines; vertically {0, 2} are both stage 0, so rank
    1 takes stage 1 (rank 3's place), and in {1, 3} rank 2 takes stage 0 (rank 0's)."""
    grid = _grid(1, 2, 2)
    replay = plan(grid.machines, grid.pp)
    h, v = replay.horizontal(), replay.vertical()
    assert (h, v) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert [(w.ranks, w.roles) for w in map(grid.world, h)] == [([0, 2], [0, 2]), ([1, 3], [1, 3])]
    assert [(w.ranks, w.roles) for w in map(grid.world, v)] == [([0, 1], [0, 3]), ([2, 3], [0, 3])]
    for faulty_rank in range(4):  # the SDC follows the machine, whatever stage it replays
        [x] = [x for x in range(4) if grid.machine_ranks(x) == [faulty_rank]]
        found = replay.locate(_faulty(h, x), _faulty(v, x))
        assert [r for m in found for r in grid.machine_ranks(m)] == [faulty_rank]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_property_every_replay_world_is_a_whole_grid_of_the_old_ranks(data: st.DataObject) -> None:
    """Any TP x DP x PP grid, any dealing of roles to ranks: each group of either phase is a
    replay world in which every rank of its machines runs exactly once, rank ``t + TP * (d +
    k * s)`` is TP rank ``t`` of a machine given stage ``s``, and takes the place of the old
    rank with that TP rank and stage in its own old replica (its own place in the horizontal
    phase). The machines of a phase's groups cover the world once."""
    tp = data.draw(st.integers(1, 3))
    pp = data.draw(st.integers(1, 4))
    dp = data.draw(st.integers(2, 8))
    if tp * pp == 1:
        pp = 2
    order = data.draw(st.permutations(list(range(tp * dp * pp))))
    grid = _grid(tp, dp, pp, list(order))
    coord = {r: c for c, r in grid.rank_of.items()}
    replay = plan(grid.machines, pp)
    for phase in (replay.horizontal(), replay.vertical()):
        seen: list[int] = []
        for machines in phase:
            world = grid.world(machines)
            k = len(machines) // pp
            assert sorted(world.ranks) == sorted(r for x in machines for r in grid.machine_ranks(x))
            for j, (rank, role) in enumerate(zip(world.ranks, world.roles, strict=True)):
                t, rest = j % tp, j // tp
                s_new = rest // k
                t_old, d_old, _ = coord[rank]
                assert t_old == t
                assert coord[role] == (t, d_old, s_new)
                if phase is replay.horizontal():
                    assert role == rank
            seen += world.ranks
        assert sorted(seen) == list(range(tp * dp * pp))


def test_a_grid_must_be_whole() -> None:
    with pytest.raises(ValueError, match="do not fill"):
        Grid.from_coords({0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0)}, 1, 2)
    with pytest.raises(ValueError, match="do not fill"):
        Grid.from_coords({0: (0, 0, 0), 1: (0, 0, 0)}, 1, 2)
    with pytest.raises(ValueError, match="not whole pipelines"):
        _grid(1, 2, 2).world([0, 1, 2])
