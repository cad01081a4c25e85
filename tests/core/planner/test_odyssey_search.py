"""Odyssey plan search (IV-A, Algorithm 1) and the memory estimator (IV-C, Eq. 14)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest

from failslow.core.planner.odyssey import (
    ModelProfile,
    distribute_batch,
    fits_in_memory,
    get_parallel_strategy,
    integer_partition,
    peak_memory,
    search_execution_plan,
    split_layers,
    stage_peak_memory,
    step_time_plan,
)
from failslow.core.planner.odyssey.search import evaluate_candidate
from failslow.errors import ConfigError, FailslowError


def _profile(**kw: float) -> ModelProfile:
    base: dict[str, float] = dict(
        forward_s=0.1, backward_s=0.2, param_bytes=1.0, dp_bandwidth_Bps=4.0
    )
    base.update(kw)
    layers = int(base.pop("num_layers", 6))
    return ModelProfile(num_layers=layers, **base)  # type: ignore[arg-type]


def test_eq14_by_hand() -> None:
    p = _profile(param_bytes=1.0, optimizer_bytes=2.0, activation_bytes=3.0)
    # m_g = m_p = 1: static 2 * (1 + 2 + 1) = 8; stage 0 of 4 holds 4 micro-batches: 4*2*3
    assert stage_peak_memory(p, 2, 0, 4) == 8 + 24
    assert stage_peak_memory(p, 2, 3, 4) == 8 + 6
    assert stage_peak_memory(p, 2, 0, 4, micro_batches=2) == 8 + 12
    assert peak_memory(p, [2, 2, 1, 1]) == 32
    q = _profile(param_bytes=1.0, first_stage_bytes=100.0, last_stage_bytes=50.0)
    assert stage_peak_memory(q, 1, 0, 1) == 2 + 150


def test_integer_partition_matches_brute_force() -> None:
    for total, parts, lo, hi, spread in itertools.product(
        range(1, 10), range(1, 4), (1, 2), (3, 9), (None, 0, 1, 2)
    ):
        want = {
            tuple(sorted(c, reverse=True))
            for c in itertools.product(range(lo, hi + 1), repeat=parts)
            if sum(c) == total and (spread is None or max(c) - min(c) <= spread)
        }
        got = integer_partition(total, parts, (lo, hi), max_spread=spread)
        assert len(got) == len(set(got)) and set(got) == want


def test_parallel_strategy_uses_all_nodes_within_ranges() -> None:
    cands = get_parallel_strategy(7, dp_range=(2, 3), pp_range=(2, 4))
    assert set(cands) == {(4, 3), (3, 2, 2)}
    with_idle = get_parallel_strategy(7, dp_range=(2, 3), pp_range=(2, 4), max_idle_nodes=1)
    assert {(3, 3), (4, 2), (2, 2, 2)} <= set(with_idle)


def test_distribute_batch_balances_and_feeds_everyone() -> None:
    counts = distribute_batch(10, [1.0, 1.0, 2.0])
    assert sum(counts) == 10 and min(counts) >= 1
    assert counts[2] < counts[0]
    with pytest.raises(FailslowError, match="2 micro-batches cannot feed 3 pipelines"):
        distribute_batch(2, [1.0, 1.0, 1.0])


def test_split_layers_moves_layers_off_a_heavy_last_stage() -> None:
    assert split_layers(_profile(num_layers=8), 4, 4) == (2, 2, 2, 2)
    heavy = _profile(num_layers=8, last_stage_forward_s=0.2, last_stage_backward_s=0.4)
    split = split_layers(heavy, 4, 8)
    assert split is not None and split[-1] < 2 and sum(split) == 8


def test_memory_filter_excludes_plans_over_capacity() -> None:
    free = _profile(num_layers=4, activation_bytes=1.0, dp_bandwidth_Bps=math.inf)
    # no limit and free all-reduce: two one-stage replicas beat a two-stage pipeline (no bubble)
    assert search_execution_plan(
        free, 2, global_batch_microbatches=4, dp_range=(1, 2)
    ).pipelines == ((4,), (4,))
    # a whole model needs 4 * 2 static + 4 activations = 12 bytes; a half needs at most 8
    tight = _profile(num_layers=4, activation_bytes=1.0, memory_capacity_bytes=10.0)
    assert not fits_in_memory(tight, [4])
    plan = search_execution_plan(tight, 2, global_batch_microbatches=4, dp_range=(1, 2))
    assert plan.pipelines == ((2, 2),)
    assert plan.peak_memory_bytes <= 10.0
    tiny = _profile(num_layers=4, activation_bytes=1.0, memory_capacity_bytes=3.0)
    with pytest.raises(FailslowError, match="within 3 bytes per device"):
        search_execution_plan(tiny, 2, global_batch_microbatches=4, dp_range=(1, 2))


def _compositions(layers: int, stages: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(stages))


def _brute_force(profile: ModelProfile, nodes: int, total: int) -> float:
    """Every layout, every layer split and every batch distribution."""
    best = float("inf")
    for lengths in get_parallel_strategy(
        nodes, dp_range=(1, 3), pp_range=(1, profile.num_layers), max_length_spread=None
    ):
        for splits in itertools.product(*(_compositions(profile.num_layers, n) for n in lengths)):
            for batch in itertools.product(range(1, total + 1), repeat=len(lengths)):
                if sum(batch) == total:
                    best = min(best, step_time_plan(profile, splits, batch))
    return best


@pytest.mark.parametrize("last_extra", [0.0, 0.5])
@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("total", [2, 4, 6])
def test_search_returns_the_best_candidate(last_extra: float, nodes: int, total: int) -> None:
    profile = _profile(last_stage_forward_s=last_extra)
    plan = search_execution_plan(
        profile, nodes, global_batch_microbatches=total, dp_range=(1, 3), max_length_spread=None
    )
    scored = [
        evaluate_candidate(profile, lengths, total)
        for lengths in get_parallel_strategy(
            nodes, dp_range=(1, 3), pp_range=(1, 6), max_length_spread=None
        )
    ]
    assert plan.step_time_s == min(c.step_time_s for c in scored if c is not None)
    assert plan.nodes == nodes and sum(plan.micro_batches) == total
    assert plan.step_time_s == pytest.approx(
        step_time_plan(profile, plan.pipelines, plan.micro_batches)
    )
    # Algorithm 1's heuristics (balanced splits, balanced batch) stay close to the optimum
    # over all splits and batch distributions: within 5% on these sizes.
    optimum = _brute_force(profile, nodes, total)
    assert optimum - 1e-9 <= plan.step_time_s <= 1.05 * optimum


def test_paper_example_seven_of_eight_nodes() -> None:
    # DP=4, PP=2 loses one node; the paper's plan uses all 7 in pipelines of [2, 2, 3]
    profile = _profile(num_layers=32, forward_s=0.01, backward_s=0.02)
    plan = search_execution_plan(profile, 7, global_batch_microbatches=64, dp_range=(3, 5))
    assert sorted(len(p) for p in plan.pipelines) == [2, 2, 3] and plan.nodes == 7
    three = plan.micro_batches[[len(p) for p in plan.pipelines].index(3)]
    assert three == max(plan.micro_batches)  # the longer pipeline is faster per micro-batch


def test_impossible_inputs_are_clear_errors() -> None:
    profile = _profile()
    with pytest.raises(FailslowError, match="no nodes left"):
        search_execution_plan(profile, 0, global_batch_microbatches=4, dp_range=(1, 2))
    with pytest.raises(ConfigError, match="global_batch_microbatches"):
        search_execution_plan(profile, 2, global_batch_microbatches=0, dp_range=(1, 2))
    with pytest.raises(FailslowError, match="admit no layout"):
        search_execution_plan(
            profile, 3, global_batch_microbatches=4, dp_range=(2, 2), pp_range=(2, 2)
        )
    with pytest.raises(FailslowError, match="none of 1 layouts"):  # 1 micro-batch, 2 replicas
        search_execution_plan(
            profile, 2, global_batch_microbatches=1, dp_range=(2, 2), pp_range=(1, 1)
        )
    with pytest.raises(ConfigError, match="num_layers"):
        ModelProfile(num_layers=0, forward_s=1.0, backward_s=1.0)
    with pytest.raises(ConfigError, match="forward_s"):
        ModelProfile(num_layers=2, forward_s=-1.0, backward_s=1.0)
