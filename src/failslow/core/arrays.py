"""Lean numpy helpers for the per-poll and per-update paths (tracking, localization, records).

``np.isin`` sorts and ``np.median`` pays a generic reduction's setup on every call; on the
short arrays those paths see every poll, both cost several times the work itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def one_of(values: np.ndarray, options: Sequence[int]) -> np.ndarray:
    """``np.isin(values, options)`` for a few options: one comparison each."""
    mask = values == options[0]
    for option in options[1:]:
        mask |= values == option
    return mask


def median(a: np.ndarray) -> float:
    """Median of a non-empty 1-D array (a lean ``np.median``)."""
    n = a.size
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    part = np.partition(a, (k - 1, k))
    return 0.5 * float(part[k - 1] + part[k])
