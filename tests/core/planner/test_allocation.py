"""S2 micro-batch allocation (greyhound 5.2, Eq. 1): exact min-max counts, loss weights, plans."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.allocation import (
    allocate_microbatches,
    loss_weights,
    microbatch_plan,
    replica_times,
)
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology
from failslow.errors import FailslowError


def makespan(counts: Sequence[int], times: Sequence[float]) -> float:
    return max(m * t for m, t in zip(counts, times, strict=True))


def compositions(units: int, parts: int, low: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` integers >= ``low`` summing to ``units``."""
    if parts == 1:
        if units >= low:
            yield (units,)
        return
    for first in range(low, units - low * (parts - 1) + 1):
        for rest in compositions(units - first, parts - 1, low):
            yield (first, *rest)


def brute_force(times: Sequence[float], total: int, unit: int, minimum: int) -> tuple[float, float]:
    """Optimal makespan, and the least squared distance from the even split among optima."""
    d = len(times)
    best, spread = math.inf, math.inf
    for ks in compositions(total // unit, d, minimum // unit):
        counts = [k * unit for k in ks]
        span = makespan(counts, times)
        dist = sum((m - total / d) ** 2 for m in counts)
        if span < best:
            best, spread = span, dist
        elif span == best:
            spread = min(spread, dist)
    return best, spread


def check_feasible(counts: list[int], total: int, unit: int, minimum: int) -> None:
    assert sum(counts) == total
    assert all(m % unit == 0 and m >= minimum for m in counts), counts


# -- hand examples ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "total", "kwargs", "expected"),
    [
        # even split: equal times, D divides M
        ([1.0] * 4, 16, {}, [4, 4, 4, 4]),
        ([0.3] * 8, 64, {"multiple_of": 4}, [8] * 8),
        # equal times, D does not divide M: the extra micro-batches go to the lowest indices
        ([1.0] * 4, 18, {}, [5, 5, 4, 4]),
        # one replica 2x slow: healthy ones take 5 (makespan 5), the slow one 2 (time 4)
        ([1.0, 1.0, 1.0, 2.0], 16, {}, [5, 5, 4, 2]),
        # same, slow replica in the middle: the unit left over goes to the fastest, lowest index
        ([1.0, 2.0, 1.0, 1.0], 16, {}, [5, 2, 5, 4]),
        # 1F1B with PP=2: counts move in steps of 2; the 3x slow replica keeps 2 (time 6)
        ([1.0, 1.0, 1.0, 3.0], 16, {"multiple_of": 2}, [6, 4, 4, 2]),
        # a very slow replica keeps one micro-batch (m_i in N+) ...
        ([1.0, 1.0, 1.0, 100.0], 16, {}, [5, 5, 5, 1]),
        # ... or none, if minimum=0 allows it
        ([1.0, 1.0, 1.0, 100.0], 16, {"minimum": 0}, [6, 5, 5, 0]),
        # a minimum of 4 leaves a single feasible allocation
        ([1.0, 1.0, 1.0, 100.0], 16, {"minimum": 4}, [4, 4, 4, 4]),
        # the minimum sets the makespan (200); the rest is spread as evenly as possible
        ([1.0, 1.0, 1.0, 100.0], 16, {"multiple_of": 2, "minimum": 2}, [6, 4, 4, 2]),
        ([2.5], 12, {"multiple_of": 3}, [12]),
    ],
)
def test_hand_examples(
    times: list[float], total: int, kwargs: dict[str, int], expected: list[int]
) -> None:
    assert allocate_microbatches(times, total, **kwargs) == expected


def test_accepts_numpy_times_and_integers() -> None:
    counts = allocate_microbatches(np.array([1.0, 1.5]), np.int64(10), multiple_of=np.int32(1))
    assert counts == [6, 4]
    assert all(type(m) is int for m in counts)


def test_large_instance_is_optimal_against_the_bound() -> None:
    rng = np.random.default_rng(7)
    d = 16_384
    times = np.ones(d)
    slow = rng.choice(d, 40, replace=False)
    times[slow] = rng.uniform(1.2, 3.0, slow.size)
    counts = allocate_microbatches(times, 8 * d, multiple_of=2)
    check_feasible(counts, 8 * d, 2, 2)
    # healthy replicas can take 10 (time 10); 8 would not absorb the slow ones' share
    assert makespan(counts, times) == 10.0


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "total", "kwargs", "match"),
    [
        ([], 4, {}, r"times is empty"),
        ([[1.0, 2.0]], 4, {}, r"one-dimensional"),
        (["fast"], 4, {}, r"sequence of numbers"),
        ([1.0, math.nan], 4, {}, r"times\[1\] must be a finite positive .* got nan"),
        ([1.0, math.inf], 4, {}, r"times\[1\] .* got inf"),
        ([0.0, 1.0], 4, {}, r"times\[0\] .* got 0\.0"),
        ([1.0, -2.0], 4, {}, r"times\[1\] .* got -2\.0"),
        ([1.0, 1.0], 7, {"multiple_of": 2}, r"total 7 is not a multiple of multiple_of 2"),
        ([1.0, 1.0], 6, {"multiple_of": 2, "minimum": 4}, r"total 6 is too small .* >= 8"),
        ([1.0, 1.0, 1.0], 2, {}, r"total 2 is too small for 3 replicas"),
        ([1.0, 1.0], 8, {"multiple_of": 2, "minimum": 3}, r"minimum 3 is not a multiple of"),
        ([1.0, 1.0], 8, {"multiple_of": 0}, r"multiple_of must be a positive integer, got 0"),
        ([1.0, 1.0], 8, {"multiple_of": -2}, r"multiple_of must be a positive .* got -2"),
        ([1.0, 1.0], 8, {"minimum": -1}, r"minimum must be >= 0, got -1"),
        ([1.0, 1.0], 0, {"minimum": 0}, r"total must be a positive integer, got 0"),
        ([1.0, 1.0], 8.0, {}, r"total must be an integer, got 8\.0"),
        ([1.0, 1.0], True, {}, r"total must be an integer, got True"),
    ],
)
def test_errors(times: object, total: object, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(FailslowError, match=match) as info:
        allocate_microbatches(times, total, **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


# -- properties ------------------------------------------------------------------------------


@st.composite
def small_instances(draw: st.DrawFn, exact_times: bool) -> tuple[list[float], int, int, int]:
    d = draw(st.integers(1, 4))
    if exact_times:  # small dyadic rationals: many exact ties between replicas
        times = [draw(st.integers(1, 12)) / 4 for _ in range(d)]
    else:
        times = [draw(st.floats(0.01, 100.0)) for _ in range(d)]
    unit = draw(st.integers(1, 3))
    low_units = draw(st.integers(0, 2))
    units = d * low_units + draw(st.integers(0 if low_units else 1, 10 if d < 4 else 7))
    return times, units * unit, unit, low_units * unit


@settings(max_examples=300, deadline=None)
@given(small_instances(exact_times=True))
def test_matches_brute_force_with_ties(instance: tuple[list[float], int, int, int]) -> None:
    times, total, unit, minimum = instance
    counts = allocate_microbatches(times, total, multiple_of=unit, minimum=minimum)
    check_feasible(counts, total, unit, minimum)
    best, spread = brute_force(times, total, unit, minimum)
    assert makespan(counts, times) == best
    # tie-breaking: the optimum closest to the even split (least squared distance)
    assert sum((m - total / len(times)) ** 2 for m in counts) == pytest.approx(spread)


@settings(max_examples=200, deadline=None)
@given(small_instances(exact_times=False))
def test_matches_brute_force_exactly_in_floats(
    instance: tuple[list[float], int, int, int],
) -> None:
    times, total, unit, minimum = instance
    counts = allocate_microbatches(times, total, multiple_of=unit, minimum=minimum)
    check_feasible(counts, total, unit, minimum)
    # exact float equality: the solver compares the same products m * t the makespan uses
    assert makespan(counts, times) == brute_force(times, total, unit, minimum)[0]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 12),
    st.sampled_from([1, 2, 4, 8]),
    st.floats(1e-4, 1e4),
)
def test_equal_times_give_the_even_split(d: int, per: int, unit: int, t: float) -> None:
    assert allocate_microbatches([t] * d, d * per * unit, multiple_of=unit) == [per * unit] * d


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.05, 20.0), min_size=1, max_size=200),
    st.integers(0, 40),
    st.sampled_from([1, 2, 3, 4]),
    st.integers(0, 2),
)
def test_feasible_and_certified_optimal(
    times: list[float], extra: int, unit: int, low_units: int
) -> None:
    d = len(times)
    total = (d * max(low_units, 1) + extra) * unit
    counts = allocate_microbatches(times, total, multiple_of=unit, minimum=low_units * unit)
    check_feasible(counts, total, unit, low_units * unit)
    span = makespan(counts, times)
    # no allocation beats span: strictly below it, replica i fits at most below[i] units, and
    # either some replica cannot keep its minimum or together they cannot take all the units
    below = []
    for t in times:
        k = math.floor(span / (unit * t)) + 1
        while k > 0 and k * unit * t >= span:
            k -= 1
        below.append(k)
    assert min(below) < low_units or sum(below) < total // unit


@settings(max_examples=12, deadline=None)
@given(
    st.integers(5, 40).flatmap(
        lambda d: st.tuples(
            st.lists(st.integers(16, 64), min_size=d, max_size=d),  # times in sixteenths
            st.integers(d, 8 * d),
            st.sampled_from([1, 2, 4]),
        )
    )
)
def test_matches_cvxpy_reference(instance: tuple[list[int], int, int]) -> None:
    pytest.importorskip("cvxpy")
    from failslow.core.planner.allocation_reference import allocate_microbatches_milp

    sixteenths, units, unit = instance
    times = [x / 16 for x in sixteenths]
    ours = allocate_microbatches(times, units * unit, multiple_of=unit)
    ref = allocate_microbatches_milp(times, units * unit, multiple_of=unit)
    check_feasible(ref, units * unit, unit, unit)
    assert makespan(ours, times) == makespan(ref, times)


# -- loss weights ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=64).filter(lambda c: sum(c) > 0))
def test_loss_weights_sum_to_d(counts: list[int]) -> None:
    weights = loss_weights(counts)
    assert math.isclose(sum(weights), len(counts), rel_tol=1e-12)
    assert all(w == 0.0 for w, m in zip(weights, counts, strict=True) if m == 0)


def test_loss_weights_give_the_even_split_gradient() -> None:
    rng = np.random.default_rng(3)
    micro_batch, features = 3, 5
    for counts in ([4, 4, 4, 4], [5, 5, 4, 2], [6, 4, 4, 2], [1, 1, 1, 13], [7, 0, 9]):
        n = sum(counts) * micro_batch
        x = rng.normal(size=(n, features))
        y = rng.normal(size=n)
        w = rng.normal(size=features)
        per_sample = (x @ w - y)[:, None] * x  # gradient of 0.5 * (x.w - y)^2
        full = per_sample.mean(axis=0)
        bounds = np.cumsum([0, *[m * micro_batch for m in counts]])
        weights = loss_weights(counts)
        reduced = np.zeros(features)
        for r, weight in enumerate(weights):
            if counts[r]:  # a replica with no micro-batch contributes a zero gradient
                reduced += weight * per_sample[bounds[r] : bounds[r + 1]].mean(axis=0)
        reduced /= len(counts)  # the DP all-reduce averages over D replicas
        # float64; only summation order differs, so 1e-12 holds with margin
        np.testing.assert_allclose(reduced, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        ([], r"counts is empty"),
        ([2, -1], r"counts\[1\] must be >= 0, got -1"),
        ([0, 0], r"counts sum to 0"),
        ([1, 2.5], r"counts\[1\] must be an integer, got 2\.5"),
    ],
)
def test_loss_weights_errors(counts: list[int], match: str) -> None:
    with pytest.raises(FailslowError, match=match):
        loss_weights(counts)


# -- from a diagnosis ------------------------------------------------------------------------


@pytest.fixture
def topology() -> Topology:
    return Topology.megatron(tp=2, dp=4, pp=2, gpus_per_host=4, micro_batches=16)


def test_replica_times_take_the_slowest_rank_of_each_replica(topology: Topology) -> None:
    diagnosis = Diagnosis(
        kind=Kind.COMPUTE,
        slow_ranks=(
            SlowRank(topology.rank_of(1, 2, 1), 2.0),
            SlowRank(topology.rank_of(0, 2, 0), 1.5),  # same replica, less slow
            SlowRank(topology.rank_of(0, 0, 1), 1.25),
        ),
        slow_links=(SlowLink(0, 15, 3.0),),  # ignored by S2
    )
    assert replica_times(topology, diagnosis, 0.5) == [0.625, 0.5, 1.0, 0.5]


def test_replica_times_errors(topology: Topology) -> None:
    with pytest.raises(FailslowError, match=r"rank 16, outside the topology's 16 ranks"):
        replica_times(topology, Diagnosis(kind=Kind.COMPUTE, slow_ranks=(SlowRank(16, 2.0),)), 1)
    healthy = Diagnosis(kind=Kind.COMPUTE)
    with pytest.raises(FailslowError, match=r"healthy_time must be > 0 seconds, got 0"):
        replica_times(topology, healthy, 0)
    with pytest.raises(FailslowError, match=r"healthy_time must be a finite number, got nan"):
        replica_times(topology, healthy, math.nan)


def test_microbatch_plan(topology: Topology) -> None:
    diagnosis = Diagnosis(kind=Kind.COMPUTE, slow_ranks=(SlowRank(topology.rank_of(1, 3, 0), 3.0),))
    plan = microbatch_plan(topology, diagnosis, healthy_time=0.1, overhead_s=0.02)
    assert isinstance(plan, MicroBatchPlan)
    # pp = 2: counts in steps of 2 (1F1B); the 3x slow replica keeps 2 (time 0.6 <= 0.6)
    assert plan.counts == (6, 4, 4, 2)
    assert plan.weights == (1.5, 1.0, 1.0, 0.5)
    assert plan.overhead_s == 0.02
    assert plan.step_time_s == pytest.approx(0.6)
    assert plan.baseline_step_s == pytest.approx(1.2)  # the even split: 4 x 0.3 s
    # a schedule that runs any count (the adapter says so): the slow replica keeps 1
    from dataclasses import replace

    anycount = replace(topology, microbatch_multiple=1)
    assert Topology.from_dict(anycount.to_dict()) == anycount
    plan = microbatch_plan(anycount, diagnosis, healthy_time=0.1, overhead_s=0.02)
    assert plan.counts == (5, 5, 5, 1) and plan.step_time_s == pytest.approx(0.5)
    even = microbatch_plan(
        topology, Diagnosis(kind=Kind.COMPUTE), healthy_time=0.1, overhead_s=0.0, multiple_of=1
    )
    assert even.counts == (4, 4, 4, 4) and even.weights == (1.0,) * 4


def test_microbatch_plan_errors(topology: Topology) -> None:
    odd = Topology.megatron(tp=1, dp=2, pp=4, gpus_per_host=8, micro_batches=10)
    diagnosis = Diagnosis(kind=Kind.COMPUTE)
    with pytest.raises(FailslowError, match=r"topology.micro_batches 10 is not a multiple of 4"):
        microbatch_plan(odd, diagnosis, healthy_time=1.0, overhead_s=1.0)
    with pytest.raises(FailslowError, match=r"overhead_s must be >= 0 seconds, got -1"):
        microbatch_plan(topology, diagnosis, healthy_time=1.0, overhead_s=-1)
    with pytest.raises(TypeError, match="overhead_s"):
        microbatch_plan(topology, diagnosis, healthy_time=1.0)  # type: ignore[call-arg]
