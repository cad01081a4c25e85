"""Exact micro-batch allocation across DP replicas (greyhound 5.2, S2, Eq. 1 and footnote 4).

S2 gives a DP replica with a computation fail-slow fewer of the M micro-batches of a global
batch. With ``t_i`` the time replica ``i`` takes per micro-batch, Eq. 1 asks for integer counts
``m_i >= 1`` with ``sum m_i = M`` that minimize the step's slowest replica, ``max_i m_i * t_i``;
footnote 4 adds ``m_i = 0 (mod PP)`` for a 1F1B pipeline. The paper solves the equivalent
variance form with cvxpy in seconds (Table 5: 36 s at 512 replicas). This module solves the
min-max form exactly in O(D log K) numpy time (well under a millisecond at 512 replicas);
:mod:`failslow.core.planner.allocation_reference` is the MILP it is tested against.

Weighted aggregation (greyhound 5.2, citing [6]) keeps the gradient the even split would give:
:func:`loss_weights`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from failslow.core.diagnosis.record import Diagnosis
from failslow.core.planner.plans import MicroBatchPlan
from failslow.core.topology import Topology
from failslow.errors import FailslowError

__all__ = ["allocate_microbatches", "loss_weights", "microbatch_plan", "replica_times"]


def _as_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise FailslowError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise FailslowError(f"{where}: {name} must be an integer, got {value!r}") from None


def _finite(where: str, name: str, value: Any) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not math.isfinite(x):
        raise FailslowError(f"{where}: {name} must be a finite number, got {value!r}")
    return x


def _check_times(where: str, times: Sequence[float] | np.ndarray) -> np.ndarray:
    try:
        t = np.asarray(times, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise FailslowError(f"{where}: times must be a sequence of numbers ({exc})") from None
    if t.ndim != 1:
        raise FailslowError(f"{where}: times must be one-dimensional, got shape {t.shape}")
    if t.size == 0:
        raise FailslowError(f"{where}: times is empty; need one time per DP replica")
    bad = ~(np.isfinite(t) & (t > 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FailslowError(
            f"{where}: times[{i}] must be a finite positive per-micro-batch time, got {t[i]}"
        )
    return t


def allocate_microbatches(
    times: Sequence[float] | np.ndarray,
    total: int,
    *,
    multiple_of: int = 1,
    minimum: int | None = None,
) -> list[int]:
    """Micro-batches per DP replica minimizing the slowest replica's time, exactly.

    ``times[i]`` is replica ``i``'s time per micro-batch. Returns integer counts ``m_i`` with
    ``sum m_i == total``, each a multiple of ``multiple_of`` (1F1B: the PP size, greyhound
    footnote 4) and ``>= minimum``, minimizing ``max_i m_i * times[i]``. ``minimum`` defaults
    to ``multiple_of``: every replica keeps at least one unit, as Eq. 1 requires ``m_i`` in
    N+. ``minimum=0`` lets a replica drop out of the step (it still joins the all-reduce,
    with weight 0).

    Method (all in units of ``u = multiple_of``: ``K = total / u`` units, ``L = minimum / u``
    per replica at least, a unit costs replica ``i`` ``c_i = u * t_i``). Let ``V`` be the
    multiset of values ``k * c_i`` over replicas ``i`` and ``k >= 1``, and ``g(T)`` the number
    of elements of ``V`` that are ``<= T``; replica ``i`` can take ``floor(T / c_i)`` units
    within time ``T``, so ``g(T) = sum_i floor(T / c_i)``. An allocation of makespan ``<= T``
    exists iff ``floor(T / c_i) >= L`` for every ``i`` and ``g(T) >= K`` (take any ``K`` units
    below the caps that are at least ``L``). Both conditions are monotone in ``T``, so the
    optimum is ``T* = max(T_K, max_i L * c_i)`` with ``T_K`` the K-th smallest element of
    ``V``, and every allocation with ``L <= k_i <= floor(T* / c_i)`` and ``sum k_i = K`` is
    optimal. ``T_K`` is found without a search: with ``S = sum 1 / c_i``,
    ``T S - D < g(T) <= T S``, so ``T_K`` lies in ``[K / S, (K + D) / S]``; the multiples of
    each ``c_i`` below ``K / S`` (minus one, for rounding) are counted, the ``O(D)`` multiples
    inside the interval are generated and ``np.partition`` picks the remaining rank. The
    result is certified before use (``g(T*) >= K`` and fewer than ``K`` values below ``T_K``).
    The values compared are the float products ``(k * u) * t_i`` themselves, which are
    monotone in ``k``, so the optimum is exact in floating point too: the returned makespan is
    the smallest ``max_i m_i * times[i]`` any feasible allocation attains.

    Tie-breaking: among the optimal allocations, the one closest to the even split, i.e. the
    minimizer of ``sum_i (m_i - total / D) ** 2``: ``k_i = clip(lam, L, cap_i)`` for the
    largest integer ``lam`` that does not overshoot ``K``, and the ``r`` leftover units go one
    each to the eligible replicas (``cap_i > lam``) with the smallest time, then lowest
    index. Equal times with ``D`` dividing ``total / u`` give the even split.
    """
    where = "allocate_microbatches"
    t = _check_times(where, times)
    total = _as_int(where, "total", total)
    unit = _as_int(where, "multiple_of", multiple_of)
    if unit < 1:
        raise FailslowError(f"{where}: multiple_of must be a positive integer, got {unit}")
    low = unit if minimum is None else _as_int(where, "minimum", minimum)
    if low < 0:
        raise FailslowError(f"{where}: minimum must be >= 0, got {low}")
    if low % unit:
        raise FailslowError(
            f"{where}: minimum {low} is not a multiple of multiple_of {unit}; "
            "every count is a multiple of it, so the effective minimum would differ"
        )
    if total < 1:
        raise FailslowError(f"{where}: total must be a positive integer, got {total}")
    if total % unit:
        raise FailslowError(f"{where}: total {total} is not a multiple of multiple_of {unit}")
    d = t.size
    if total < d * low:
        raise FailslowError(
            f"{where}: total {total} is too small for {d} replicas with at least {low} each "
            f"(needs >= {d * low})"
        )
    units = total // unit
    lo_units = low // unit
    if units == d * lo_units:  # only one allocation is feasible
        return [low] * d

    per_unit = unit * t  # c_i (approximate; exact comparisons use (k * unit) * t)
    inv_sum = float(np.sum(1.0 / per_unit))
    lo = units / inv_sum
    hi = (units + d) / inv_sum * (1.0 + 1e-9)
    # Multiples of c_i certainly below lo (one less than the estimate, so rounding cannot
    # count a value >= T_K); they are among the K smallest and are skipped.
    below = np.maximum(np.floor(lo / per_unit) - 1.0, 0.0).astype(np.int64)
    rank = units - int(below.sum())  # 1-based rank of T_K among the rest
    span = np.floor(hi / per_unit).astype(np.int64) - below + 1
    span = np.maximum(span, 1)
    owner = np.repeat(np.arange(d), span)
    start = np.cumsum(span) - span
    k = below[owner] + 1 + (np.arange(owner.size) - start[owner])
    values = (k * unit) * t[owner]
    t_k = float(np.partition(values, rank - 1)[rank - 1])
    t_star = max(t_k, float(np.max((lo_units * unit) * t)))

    cap = _units_within(t, unit, t_star, strict=False)
    if int(cap.sum()) < units or int(_units_within(t, unit, t_k, strict=True).sum()) >= units:
        raise RuntimeError(f"{where}: internal error, makespan {t_star} failed certification")
    counts = _closest_to_even(cap, lo_units, units, t)
    return [int(c) * unit for c in counts]


def _units_within(t: np.ndarray, unit: int, limit: float, *, strict: bool) -> np.ndarray:
    """Per replica, the most units ``k >= 0`` with ``(k * unit) * t_i <= limit`` (``<``: strict)."""
    k = np.floor(limit / (unit * t)).astype(np.int64)

    def fits(kk: np.ndarray) -> np.ndarray:
        v = (kk * unit) * t
        return v < limit if strict else v <= limit

    k = np.where(fits(k + 1), k + 1, k)  # correct the float division by at most one
    k = np.where((k > 0) & ~fits(k), k - 1, k)
    return k


def _closest_to_even(cap: np.ndarray, low: int, units: int, t: np.ndarray) -> np.ndarray:
    """Integer ``k`` in ``[low, cap]`` summing to ``units``, minimizing ``sum (k - units/D)^2``."""
    a, b = low, int(cap.max())  # f(a) = D * low <= units <= sum(cap) = f(b)
    while a < b:  # largest lam with f(lam) = sum(clip(lam, low, cap)) <= units
        mid = (a + b + 1) // 2
        if int(np.minimum(cap, mid).sum()) <= units:  # mid >= low, so clip is a minimum
            a = mid
        else:
            b = mid - 1
    k = np.minimum(cap, a)
    left = units - int(k.sum())
    if left:
        eligible = np.flatnonzero(cap > a)
        order = eligible[np.lexsort((eligible, t[eligible]))]  # fastest first, then index
        k[order[:left]] += 1
    return k


def loss_weights(counts: Sequence[int]) -> list[float]:
    """Loss weight of each DP replica: ``w_r = m_r * D / M`` (``M = sum m_r``).

    Replica ``r`` averages its loss over its ``m_r`` micro-batches and the all-reduce averages
    over D replicas, so sum_r (w_r / D) * (1 / m_r) * sum_{s in r} g_s = (1 / M) * sum_s g_s:
    the full batch's mean gradient, exactly as with the even split. The weights sum to D.
    """
    where = "loss_weights"
    if len(counts) == 0:
        raise FailslowError(f"{where}: counts is empty; need one count per DP replica")
    m = [_as_int(where, f"counts[{i}]", c) for i, c in enumerate(counts)]
    for i, c in enumerate(m):
        if c < 0:
            raise FailslowError(f"{where}: counts[{i}] must be >= 0, got {c}")
    total = sum(m)
    if total == 0:
        raise FailslowError(f"{where}: counts sum to 0; at least one micro-batch is needed")
    d = len(m)
    return [c * d / total for c in m]


def replica_times(topology: Topology, diagnosis: Diagnosis, healthy_time: float) -> list[float]:
    """Per-micro-batch time of each DP replica, from the diagnosed slow ranks.

    A replica's TP and PP ranks work in lock-step, so its slowest rank sets its pace:
    ``healthy_time * max(slowdown of its ranks)``, 1.0 for ranks the diagnosis does not list.
    Slow links are ignored here (S2 mitigates computation fail-slows; greyhound Table 2).
    O(#slow ranks + D).
    """
    where = "replica_times"
    healthy = _finite(where, "healthy_time", healthy_time)
    if healthy <= 0:
        raise FailslowError(f"{where}: healthy_time must be > 0 seconds, got {healthy_time}")
    slowdown = [1.0] * topology.dp
    world = topology.world_size
    for s in diagnosis.slow_ranks:
        if not 0 <= s.rank < world:
            raise FailslowError(
                f"{where}: diagnosis names rank {s.rank}, outside the topology's {world} ranks"
            )
        dp = topology.replica_of(s.rank)
        slowdown[dp] = max(slowdown[dp], s.slowdown)
    return [healthy * x for x in slowdown]


def microbatch_plan(
    topology: Topology,
    diagnosis: Diagnosis,
    *,
    healthy_time: float,
    overhead_s: float,
    multiple_of: int | None = None,
) -> MicroBatchPlan:
    """The S2 plan for a diagnosis: counts, loss weights, cost and estimated step time.

    ``multiple_of`` defaults to the adapter's ``topology.microbatch_multiple``, else to
    ``topology.pp`` when ``pp > 1`` (1F1B, greyhound footnote 4), else 1. ``overhead_s`` is
    the caller's measured or estimated one-off cost of switching (solve plus broadcast of the
    counts). ``step_time_s`` is ``max_i m_i * t_i``, a simple estimate that leaves out the
    pipeline bubble and the gradient all-reduce; ``baseline_step_s`` the same estimate for the
    even split under this diagnosis.
    """
    where = "microbatch_plan"
    overhead = _finite(where, "overhead_s", overhead_s)
    if overhead < 0:
        raise FailslowError(f"{where}: overhead_s must be >= 0 seconds, got {overhead_s}")
    if multiple_of is None:
        multiple_of = topology.microbatch_multiple or (topology.pp if topology.pp > 1 else 1)
    unit = multiple_of
    total = topology.micro_batches
    if isinstance(unit, int) and unit >= 1 and total % unit:
        raise FailslowError(
            f"{where}: topology.micro_batches {total} is not a multiple of {unit} "
            f"(multiple_of; 1F1B needs each replica's count to be a multiple of pp)"
        )
    times = replica_times(topology, diagnosis, healthy_time)
    counts = allocate_microbatches(times, total, multiple_of=unit)
    even = total // topology.dp
    return MicroBatchPlan(
        counts=tuple(counts),
        weights=tuple(loss_weights(counts)),
        overhead_s=overhead,
        step_time_s=max(m * x for m, x in zip(counts, times, strict=True)),
        baseline_step_s=max(even * x for x in times),
    )


def even_counts(micro_batches: int, replicas: int) -> tuple[int, ...]:
    """``micro_batches`` over ``replicas`` as evenly as they go, the first ``M mod D`` one more
    (odyssey Eq. 12: survivors of a lost replica take its micro-batches)."""
    base, extra = divmod(micro_batches, replicas)
    return tuple(base + (r < extra) for r in range(replicas))


def even_plan(topology: Topology) -> MicroBatchPlan:
    """The framework's own split: ``M / D`` micro-batches per DP replica, every weight 1 (what
    a job runs without a plan, and what a reverted micro-batch plan returns to). A job that
    went on with fewer replicas than its global batch divides (odyssey) runs
    :func:`even_counts`, each replica weighted ``m_r * D / M``."""
    dp, m = topology.dp, topology.micro_batches
    counts = even_counts(m, dp)
    return MicroBatchPlan(counts=counts, weights=tuple(c * dp / m for c in counts))
