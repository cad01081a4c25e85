"""How many warm standby machines to keep (byterobust section 6.2, "Warm Standby Machines").

ByteRobust keeps a pool of pre-validated, sleeping machines so that an eviction does not wait for
scheduling. Failures in large-scale training are mostly independent single-machine events, so
the number of machines failing within a window is Binomial(machines, p); the pool is sized to
its 99th percentile (P99), which covers the demand in all but 1% of windows.

``p`` is the probability that one machine fails within the window. From a daily failure rate
``r`` (the fraction of machines that fail on a given day, estimated from history) and a window
of ``w`` days, with failures independent from day to day and at a constant rate,
``p = 1 - (1 - r) ** w``: for ``w = 1`` this is ``r`` itself, for a shorter window it is less
and for a longer one more (a replenishment window of two days with ``r = 1%`` gives
``p = 1.99%``).
"""

from __future__ import annotations

import math
import operator
from typing import Any

from failslow.errors import FailslowError

__all__ = ["standby_count", "window_failure_probability"]


def _fraction(name: str, value: Any, *, open_interval: bool) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    inside = 0.0 < x < 1.0 if open_interval else 0.0 <= x <= 1.0
    if isinstance(value, bool) or not inside:
        where = "strictly between 0 and 1" if open_interval else "in [0, 1]"
        raise FailslowError(f"standby: {name} must be a number {where}, got {value!r}")
    return x


def window_failure_probability(daily_failure_rate: float, window_days: float = 1.0) -> float:
    """Probability that one machine fails within ``window_days``: ``1 - (1 - r) ** w``."""
    rate = _fraction("daily_failure_rate", daily_failure_rate, open_interval=False)
    try:
        days = float(window_days)
    except (TypeError, ValueError):
        days = math.nan
    if isinstance(window_days, bool) or not (math.isfinite(days) and days > 0):
        raise FailslowError(
            f"standby: window_days must be a finite number of days > 0, got {window_days!r}"
        )
    return -math.expm1(days * math.log1p(-rate)) if rate < 1.0 else 1.0


def standby_count(
    machines: int,
    daily_failure_rate: float,
    *,
    quantile: float = 0.99,
    window_days: float = 1.0,
) -> int:
    """Warm standbys to keep for ``machines`` training machines: a quantile of Binomial(n, p).

    The smallest ``k`` with ``P[Binomial(machines, p) <= k] >= quantile``, where ``p`` is
    :func:`window_failure_probability` of ``daily_failure_rate`` over ``window_days`` (the time
    the pool takes to be replenished). ``quantile=0.99`` is ByteRobust's P99.
    """
    from scipy.stats import binom  # 0.4 s to import: only where it is used

    try:
        n = operator.index(machines)
    except TypeError:
        n = -1
    if isinstance(machines, bool) or n < 0:
        raise FailslowError(f"standby: machines must be an integer >= 0, got {machines!r}")
    q = _fraction("quantile", quantile, open_interval=True)
    p = window_failure_probability(daily_failure_rate, window_days)
    if n == 0 or p == 0.0:
        return 0
    if p == 1.0:
        return n
    k = int(binom.ppf(q, n, p))
    # ppf inverts a floating-point CDF; settle the boundary on the CDF itself.
    while k > 0 and binom.cdf(k - 1, n, p) >= q:
        k -= 1
    while k < n and binom.cdf(k, n, p) < q:
        k += 1
    return k


FAILSTOP_RESERVE = 1
"""Standbys an S4 restart for a fail-slow leaves in the pool (see :func:`spares_for_failslow`)."""


def spares_for_failslow(spares: int, *, reserve: int = FAILSTOP_RESERVE) -> int:
    """How many of ``spares`` warm standbys an S4 restart for a fail-slow may take.

    The pool is sized for fail-stops (byterobust 6.2, :func:`standby_count`): a dead machine
    has no slower fallback, while a fail-slow still trains (S2/S3) without one. So an eviction
    for a fail-slow never takes the last ``reserve`` standbys. Measured in ``mixed-1k``
    (benchmarks/README.md, Simulator): without the reserve, three fail-slow restarts emptied
    the pool and the next fail-stop waited for a cold restart (1,500 s).
    """
    return max(0, spares - max(0, reserve))
