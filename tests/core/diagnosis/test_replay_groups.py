"""Dual-phase replay's group arithmetic (byterobust Algorithm 1): failslow.core.diagnosis.replay."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.replay import ReplayPlan, locate, plan


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
