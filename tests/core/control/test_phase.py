"""iteration_phase / align: the pause target at an iteration's first collective."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.control.phase import align, iteration_phase


def _calls(pattern, gaps_ms, steps, start_index=0):
    """A step: len(pattern) calls; gaps_ms[i] is the idle time before call i of a step."""
    out, t = [], 0
    for s in range(steps):
        for i, token in enumerate(pattern):
            t += gaps_ms[i] * 1_000_000
            out.append((start_index + s * len(pattern) + i, token, t))
    return out


def test_ddp_like_step_opens_at_the_call_after_the_long_gap():
    # 3 bucket all-reduces back to back, then a long gap (optimizer, data, forward)
    calls = _calls([10, 11, 12], [40, 1, 1], steps=6, start_index=5)  # 5 init calls before
    assert iteration_phase(calls) == (3, 5 % 3)  # the first bucket: index 5, 8, 11, ...
    assert align(13, (3, 2)) == 14 and align(14, (3, 2)) == 14


def test_nothing_periodic_gives_none_and_align_keeps_the_index():
    calls = [(i, i, i * 1000) for i in range(30)]
    assert iteration_phase(calls) is None
    assert align(17, None) == 17


@settings(max_examples=200, deadline=None)
@given(
    period=st.integers(1, 8),
    first=st.integers(0, 7),
    offset=st.integers(0, 50),
    target=st.integers(0, 500),
)
def test_found_phase_marks_the_step_start(period, first, offset, target):
    first %= period
    gaps = [1] * period
    gaps[first] = 30  # the step starts at position `first`
    pattern = list(range(period))
    calls = _calls(pattern, gaps, steps=5, start_index=offset)
    phase = iteration_phase(calls)
    assert phase is not None and phase[0] == period
    assert phase[1] == (offset + first) % period
    aligned = align(target, phase)
    assert target <= aligned < target + period and aligned % period == phase[1]
