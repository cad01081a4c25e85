"""Where an iteration starts on one group's call sequence (greyhound 4.3: "pause at the next
iteration boundary").

A rank's calls on a group repeat with the training step (greyhound 4.2: collective calls are
periodic). :func:`iteration_phase` finds the period ``P`` of the recent ``(op, bytes)`` tokens and
the residue ``r`` such that calls with ``call_index % P == r`` open an iteration: the call after
the longest idle gap of the period (the optimizer step, data loading and forward happen there,
between the last collective of one step and the first of the next). Every member of the group
sees the same call_index sequence, so they agree on ``(P, r)``; a pause target with
``call_index % P == r`` stops every rank between two iterations.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

MAX_PERIOD = 64
REPEATS = 3
MAX_REPEATS = 32


def iteration_phase(
    calls: Sequence[tuple[int, int, int]], *, max_period: int = MAX_PERIOD
) -> tuple[int, int] | None:
    """``(period, residue)`` from ``(call_index, token, t_start_ns)`` in call order, or None.

    The period is the smallest ``P`` whose last ``REPEATS`` repetitions have equal tokens; the
    residue is the position (``call_index % P``) whose preceding gap is the longest (median over
    every recent repetition of the pattern, up to ``MAX_REPEATS``). None while fewer than
    ``REPEATS`` periods are known or nothing repeats.
    """
    tokens = [t for _, t, _ in calls]
    n = len(tokens)
    period = next(
        (
            p
            for p in range(1, min(max_period, n // REPEATS) + 1)
            if all(tokens[-k] == tokens[-k - p] for k in range(1, (REPEATS - 1) * p + 1))
        ),
        None,
    )
    if period is None:
        return None
    periods = REPEATS  # the gaps: over every recent repetition (up to MAX_REPEATS), robust
    while (
        periods < MAX_REPEATS
        and (periods + 1) * period <= n
        and all(
            tokens[-k] == tokens[-k - period]
            for k in range(periods * period - period + 1, periods * period + 1)
        )
    ):
        periods += 1
    window = calls[-periods * period :]
    gaps: dict[int, list[int]] = {}
    for (_, _, before), (index, _, start) in itertools.pairwise(window):
        gaps.setdefault(index % period, []).append(start - before)
    if not gaps:
        return None
    residue = max(sorted(gaps), key=lambda r: statistics.median(gaps[r]))
    return period, residue


def align(call_index: int, phase: tuple[int, int] | None) -> int:
    """The first call_index >= ``call_index`` that opens an iteration (itself without a phase)."""
    if phase is None:
        return call_index
    period, residue = phase
    return call_index + (residue - call_index) % period
