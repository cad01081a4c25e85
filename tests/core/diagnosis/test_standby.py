"""Warm standby pool sizing: P99 of Binomial(machines, p) (byterobust 6.2)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.standby import standby_count, window_failure_probability
from failslow.errors import FailslowError


def quantile_by_hand(n: int, p: float, q: float) -> int:
    """Smallest k with sum_{i<=k} C(n, i) p^i (1-p)^(n-i) >= q, summed with math.comb."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * p**k * (1 - p) ** (n - k)
        if total >= q:
            return k
    return n


@pytest.mark.parametrize(
    ("machines", "rate", "quantile"),
    [(10, 0.1, 0.99), (100, 0.01, 0.99), (50, 0.3, 0.5), (200, 0.002, 0.999), (1, 0.5, 0.9)],
)
def test_matches_direct_binomial_sum(machines: int, rate: float, quantile: float) -> None:
    assert standby_count(machines, rate, quantile=quantile) == quantile_by_hand(
        machines, rate, quantile
    )


def test_known_values() -> None:
    # P[Bin(10, 0.1) <= 3] = 0.9872 < 0.99 <= P[<= 4] = 0.9984
    assert standby_count(10, 0.1) == 4
    assert standby_count(0, 0.5) == 0
    assert standby_count(1000, 0.0) == 0
    assert standby_count(7, 1.0) == 7


def test_window_turns_daily_rate_into_window_probability() -> None:
    assert window_failure_probability(0.01) == pytest.approx(0.01)
    assert window_failure_probability(0.01, 2.0) == pytest.approx(1 - 0.99**2)
    assert window_failure_probability(0.01, 0.5) == pytest.approx(1 - 0.99**0.5)
    p = window_failure_probability(0.02, 3.0)
    assert standby_count(300, 0.02, window_days=3.0) == quantile_by_hand(300, p, 0.99)
    assert standby_count(300, 0.02, window_days=3.0) >= standby_count(300, 0.02)


@settings(max_examples=100, deadline=None)
@given(
    machines=st.integers(0, 2000),
    more=st.integers(0, 500),
    rate=st.floats(0.0, 0.2),
    higher=st.floats(0.0, 0.2),
)
def test_monotonic_in_machines_and_rate(
    machines: int, more: int, rate: float, higher: float
) -> None:
    base = standby_count(machines, rate)
    assert 0 <= base <= machines
    assert standby_count(machines + more, rate) >= base
    assert standby_count(machines, min(1.0, rate + higher)) >= base
    assert standby_count(machines, rate, quantile=0.999) >= base


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"machines": -1, "daily_failure_rate": 0.1}, "machines"),
        ({"machines": 2.5, "daily_failure_rate": 0.1}, "machines"),
        ({"machines": True, "daily_failure_rate": 0.1}, "machines"),
        ({"machines": 10, "daily_failure_rate": -0.1}, "daily_failure_rate"),
        ({"machines": 10, "daily_failure_rate": 1.5}, "daily_failure_rate"),
        ({"machines": 10, "daily_failure_rate": math.nan}, "daily_failure_rate"),
        ({"machines": 10, "daily_failure_rate": 0.1, "quantile": 0.0}, "quantile"),
        ({"machines": 10, "daily_failure_rate": 0.1, "quantile": 1.0}, "quantile"),
        ({"machines": 10, "daily_failure_rate": 0.1, "window_days": 0.0}, "window_days"),
        ({"machines": 10, "daily_failure_rate": 0.1, "window_days": math.inf}, "window_days"),
    ],
)
def test_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(FailslowError, match=match):
        standby_count(**kwargs)


def test_a_fail_slow_eviction_never_takes_the_last_standby():
    from failslow.core.diagnosis.standby import spares_for_failslow

    assert [spares_for_failslow(n) for n in range(4)] == [0, 0, 1, 2]
    assert spares_for_failslow(3, reserve=0) == 3 and spares_for_failslow(3, reserve=5) == 0
