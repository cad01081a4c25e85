"""Odyssey asymmetric DP gradient synchronisation as greedy graph colouring (IV-B, Fig. 4)."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.planner.odyssey import (
    ModelProfile,
    dp_sync_groups,
    dp_sync_time,
    greedy_coloring,
    sync_rounds,
)


def _check_schedule(device_sets: list[frozenset[Hashable]]) -> list[list[int]]:
    rounds = sync_rounds(device_sets)
    assert sorted(g for r in rounds for g in r) == list(range(len(device_sets)))
    for members in rounds:
        seen: set[Hashable] = set()
        for g in members:
            assert not (seen & device_sets[g]), f"round {members} shares a device"
            seen |= device_sets[g]
    degree = [
        sum(1 for h, other in enumerate(device_sets) if h != g and other & devices)
        for g, devices in enumerate(device_sets)
    ]
    assert len(rounds) <= max(degree, default=-1) + 1
    return rounds


@settings(max_examples=200, deadline=None)
@given(st.lists(st.frozensets(st.integers(0, 12), min_size=1, max_size=4), min_size=0, max_size=25))
def test_rounds_never_share_a_device_and_stay_within_degree_plus_one(
    device_sets: list[frozenset[Hashable]],
) -> None:
    _check_schedule(device_sets)


def test_paper_figure3_layout() -> None:
    # 9 layers: one pipeline [3, 3, 3], the other [2, 2, 2, 3] (odyssey Fig. 3).
    groups = dp_sync_groups([(3, 3, 3), (2, 2, 2, 3)])
    assert [span for span, _ in groups] == [(0, 2), (2, 3), (3, 4), (4, 6), (6, 9)]
    assert groups[1][1] == frozenset({(0, 0), (1, 1)})
    rounds = _check_schedule([d for _, d in groups])
    # a path 0-1-2-3 plus an isolated group: two rounds suffice
    assert len(rounds) == 2


def test_symmetric_layout_syncs_in_one_round() -> None:
    groups = dp_sync_groups([(2, 2, 2)] * 3)
    assert [span for span, _ in groups] == [(0, 2), (2, 4), (4, 6)]
    assert len(sync_rounds([d for _, d in groups])) == 1


def test_sync_time_by_hand() -> None:
    profile = ModelProfile(
        num_layers=9, forward_s=1.0, backward_s=1.0, param_bytes=1.0, dp_bandwidth_Bps=1.0
    )
    # two ranks per group: a group of k layers takes 2 * (1/2) * k = k seconds.
    groups = dp_sync_groups([(3, 3, 3), (2, 2, 2, 3)])
    colours = greedy_coloring([d for _, d in groups])
    rounds: dict[int, float] = {}
    for (span, _), c in zip(groups, colours, strict=True):
        rounds[c] = max(rounds.get(c, 0.0), float(span[1] - span[0]))
    assert dp_sync_time(profile, [(3, 3, 3), (2, 2, 2, 3)]) == pytest.approx(sum(rounds.values()))
    # Welsh-Powell visits the degree-2 groups 1 and 2 first: rounds {1, 3, 4} and {2, 0}.
    assert colours == [1, 0, 1, 0, 0]
    assert dp_sync_time(profile, [(3, 3, 3), (2, 2, 2, 3)]) == pytest.approx(3.0 + 2.0)
    # symmetric: every stage group in parallel, 3 layers each
    assert dp_sync_time(profile, [(3, 3, 3)] * 2) == pytest.approx(3.0)
    assert dp_sync_time(profile, [(3, 3, 3)]) == 0.0  # one replica: nothing to reduce


def test_pipelines_must_hold_the_whole_model() -> None:
    with pytest.raises(ValueError, match="same number of layers"):
        dp_sync_groups([(3, 3), (2, 2)])
