"""Odyssey step-time model (IV-C): Eq. 9, Eq. 12-13 and the 1F1B simulation of Eq. 10-11."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.planner.odyssey import (
    ModelProfile,
    pipeline_time,
    simulate_1f1b,
    step_time_1f1b,
    step_time_plan,
    step_time_reroute,
)
from failslow.errors import ConfigError, FailslowError


def test_eq9_by_hand() -> None:
    # (N_pp + N_m - 1) * (Tf + Tb) = (4 + 8 - 1) * 3
    assert step_time_1f1b(4, 8, 1.0, 2.0) == 33.0


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 16])
def test_simulation_equals_eq9_for_uniform_stages(stages: int, micro_batches: int) -> None:
    tf, tb = 0.7, 1.3
    forward = [[tf] * micro_batches for _ in range(stages)]
    backward = [[tb] * micro_batches for _ in range(stages)]
    assert simulate_1f1b(forward, backward) == pytest.approx(
        step_time_1f1b(stages, micro_batches, tf, tb)
    )


def test_asymmetric_stages_by_hand() -> None:
    # Stage 0 (F=B=1) runs F0 F1 B0 B1, stage 1 (F=B=2) runs F0 B0 F1 B1 (Eq. 11 by hand):
    # s0.F0 0-1, s1.F0 1-3, s1.B0 3-5, s0.F1 1-2, s0.B0 5-6, s1.F1 5-7, s1.B1 7-9, s0.B1 9-10.
    fwd = [[1.0, 1.0], [2.0, 2.0]]
    bwd = [[1.0, 1.0], [2.0, 2.0]]
    assert simulate_1f1b(fwd, bwd) == pytest.approx(10.0)
    # With 0.5 s per transfer every cross-stage dependency arrives 0.5 s later: ends at 11.
    assert simulate_1f1b(fwd, bwd, p2p_s=0.5) == pytest.approx(11.0)


def test_slowdown_scales_one_stage() -> None:
    fwd = [[1.0] * 6 for _ in range(3)]
    bwd = [[2.0] * 6 for _ in range(3)]
    slowed = [row[:] for row in fwd], [row[:] for row in bwd]
    slowed[0][1] = [3.0] * 6
    slowed[1][1] = [6.0] * 6
    assert simulate_1f1b(fwd, bwd, slowdown=[1.0, 3.0, 1.0]) == pytest.approx(
        simulate_1f1b(*slowed)
    )
    # The straggler stage runs its 6 micro-batches back to back at 9 s each (plus the rest).
    assert simulate_1f1b(fwd, bwd, slowdown=[1.0, 3.0, 1.0]) >= 6 * 9.0


times = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]]]:
    stages = draw(st.integers(1, 5))
    m = draw(st.integers(1, 6))
    grid = st.lists(st.lists(times, min_size=m, max_size=m), min_size=stages, max_size=stages)
    return draw(grid), draw(grid)


@settings(max_examples=150, deadline=None)
@given(pipe=pipelines(), data=st.data())
def test_simulation_is_monotone_in_every_time(
    pipe: tuple[list[list[float]], list[list[float]]], data: st.DataObject
) -> None:
    fwd, bwd = pipe
    base = simulate_1f1b(fwd, bwd)
    s = data.draw(st.integers(0, len(fwd) - 1))
    j = data.draw(st.integers(0, len(fwd[0]) - 1))
    grow = data.draw(st.floats(min_value=0.0, max_value=5.0))
    which = data.draw(st.sampled_from([fwd, bwd]))
    which[s][j] += grow
    assert simulate_1f1b(fwd, bwd) >= base - 1e-9


@settings(max_examples=150, deadline=None)
@given(pipe=pipelines(), slow=st.floats(min_value=1.0, max_value=8.0), data=st.data())
def test_a_slow_stage_bounds_the_step_from_below(
    pipe: tuple[list[list[float]], list[list[float]]], slow: float, data: st.DataObject
) -> None:
    fwd, bwd = pipe
    s = data.draw(st.integers(0, len(fwd) - 1))
    factors = [1.0] * len(fwd)
    factors[s] = slow
    busy = slow * (sum(fwd[s]) + sum(bwd[s]))  # N_m * (Tf + Tb) of the slow stage
    assert simulate_1f1b(fwd, bwd, slowdown=factors) >= busy - 1e-9


def test_eq12_is_eq13_with_one_failure() -> None:
    # (N_pp + N_m - 1 + N_m / (N_dp - 1)) * (Tf + Tb) = (4 + 8 - 1 + 8/3) * 3 = 41
    assert step_time_reroute(4, 8, 4, [1, 0, 0, 0], 1.0, 2.0) == pytest.approx(41.0)
    assert step_time_reroute(4, 8, 4, [0, 0, 1, 0], 1.0, 2.0) == pytest.approx(41.0)


def test_eq13_special_cases() -> None:
    assert step_time_reroute(4, 8, 4, [0, 0, 0, 0], 1.0, 2.0) == step_time_1f1b(4, 8, 1.0, 2.0)
    # failures in two stages add up: 33 + 2 * 8/3 * 3
    assert step_time_reroute(4, 8, 4, [1, 1, 0, 0], 1.0, 2.0) == pytest.approx(49.0)
    # two failures in one stage: N_m * 2 / (4 - 2) = 8 extra micro-batches -> 33 + 24
    assert step_time_reroute(4, 8, 4, [2, 0, 0, 0], 1.0, 2.0) == pytest.approx(57.0)
    with pytest.raises(FailslowError, match="stage 1 lost 4 of its 4 replicas"):
        step_time_reroute(4, 8, 4, [0, 4, 0, 0], 1.0, 2.0)
    with pytest.raises(ConfigError, match="expected 4 stages"):
        step_time_reroute(4, 8, 4, [1, 0], 1.0, 2.0)


def test_pipeline_time_counts_first_and_last_stage_extras() -> None:
    profile = ModelProfile(
        num_layers=4, forward_s=1.0, backward_s=2.0, last_stage_forward_s=1.0,
        last_stage_backward_s=2.0,
    )  # fmt: skip
    fwd = [[2.0] * 3, [3.0] * 3]
    bwd = [[4.0] * 3, [6.0] * 3]
    assert pipeline_time(profile, [2, 2], 3) == pytest.approx(simulate_1f1b(fwd, bwd))


def test_step_time_plan_is_slowest_pipeline_plus_sync() -> None:
    profile = ModelProfile(
        num_layers=4, forward_s=1.0, backward_s=2.0, param_bytes=1e9, dp_bandwidth_Bps=1e9
    )
    # Eq. 9: (2 + 4 - 1) * 6 = 30; each stage group all-reduces 2 layers x 1 GB between two
    # ranks, 2 * (1/2) * 2e9 / 1e9 = 2 s, both groups in one round.
    assert step_time_plan(profile, [(2, 2), (2, 2)], [4, 4]) == pytest.approx(32.0)
    # Eq. 10: the pipeline with more micro-batches sets the step: (2 + 6 - 1) * 6 + 2
    assert step_time_plan(profile, [(2, 2), (2, 2)], [6, 2]) == pytest.approx(44.0)
    slow = step_time_plan(profile, [(2, 2), (2, 2)], [4, 4], slowdowns={(1, 0): 2.0})
    assert slow > 32.0 and slow >= 4 * 12.0 + 2.0


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="stage 1 has 1 forward"):
        simulate_1f1b([[1.0, 1.0], [1.0]], [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ConfigError, match="slowdown has 1 entries"):
        simulate_1f1b([[1.0], [1.0]], [[1.0], [1.0]], slowdown=[2.0])
    assert simulate_1f1b([], []) == 0.0
    assert math.isfinite(simulate_1f1b([[]], [[]]))
