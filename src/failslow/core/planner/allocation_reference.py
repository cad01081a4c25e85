"""Reference solver for S2's micro-batch allocation (greyhound 5.2, Eq. 1), for tests only.

The paper states Eq. 1 as minimizing the variance of the replicas' times ``m_i * t_i`` over
integer ``m_i``: a mixed-integer QP, which none of cvxpy's bundled solvers accept. This module
solves the min-max form instead - the objective S2 actually wants (the slowest replica sets
the step time) - as a MILP with HiGHS:

    minimize z  subject to  z >= c_i * k_i,  sum_i k_i = K,  k_i >= L,  k_i integer,

in units of ``u = multiple_of`` (``c_i = u * t_i``, ``K = total / u``, ``L = minimum / u``).
Used by the tests and ``benchmarks/s2_solve_time.py`` to check
:func:`failslow.core.planner.allocation.allocate_microbatches`; cvxpy and highspy come with the
``test`` extra and are imported inside the function.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from failslow.errors import FailslowError


def allocate_microbatches_milp(
    times: Sequence[float] | np.ndarray,
    total: int,
    *,
    multiple_of: int = 1,
    minimum: int | None = None,
) -> list[int]:
    """Counts minimizing ``max_i m_i * times[i]`` (sum ``total``, multiples of ``multiple_of``,
    each ``>= minimum``, default ``multiple_of``), from cvxpy + HiGHS with zero MIP gap."""
    import cvxpy as cp

    t = np.asarray(times, dtype=np.float64)
    low = multiple_of if minimum is None else minimum
    if t.ndim != 1 or t.size == 0 or total % multiple_of or low % multiple_of:
        raise FailslowError(
            f"allocate_microbatches_milp: bad instance (D={t.size}, total={total}, "
            f"multiple_of={multiple_of}, minimum={low})"
        )
    units, lo_units = total // multiple_of, low // multiple_of
    k = cp.Variable(t.size, integer=True)
    z = cp.Variable()
    problem = cp.Problem(
        cp.Minimize(z),
        [z >= cp.multiply(multiple_of * t, k), cp.sum(k) == units, k >= lo_units],
    )
    problem.solve(solver=cp.HIGHS, highs_options={"mip_rel_gap": 0.0, "mip_abs_gap": 0.0})
    if k.value is None:
        raise FailslowError(f"allocate_microbatches_milp: HiGHS returned {problem.status}")
    return [round(x) * multiple_of for x in k.value]
