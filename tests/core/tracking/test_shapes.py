"""Fail-slows that do not look like a step (issue 47): flapping congestion and slow ramps are
reported - the one-level verification alone (``sustain=0``) turns them down or reports them
late - while a healthy drift with a sub-threshold shift on top is not."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.tracking import FailSlowDetector, detect


def noisy(n: int, *, seed: int, sd: float = 0.02) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).normal(0.0, sd, n))


@pytest.mark.parametrize("seed", range(3))
def test_flapping_congestion_is_a_fail_slow(seed: int) -> None:
    """Three iterations at 1.6x, two at full speed, for 300 iterations: slow on average, never
    one level."""
    x = noisy(1200, seed=seed)
    x[500:800] *= np.tile([1.6, 1.6, 1.6, 1.0, 1.0], 60)
    assert detect(x, FailSlowDetector(sustain=0)) == []  # the one-level rules alone
    onset, relief = detect(x)
    assert (onset.type, relief.type) == ("onset", "relief")
    assert abs(onset.iteration - 500) <= 2 and onset.detected_at <= 520
    assert 800 <= relief.detected_at <= 820


@pytest.mark.parametrize("seed", range(4))
def test_a_slow_ramp_is_reported_near_where_it_crosses_the_line(seed: int) -> None:
    """Thermal throttling: 1.3x reached over 150 iterations (0.17% per iteration), crossing
    1.1x at iteration 555. A moving reference climbs with it; the climb rule does not."""
    x = noisy(1200, seed=10 + seed)
    ramp = np.full(700, 1.3)
    ramp[:150] = np.exp(np.linspace(0.0, np.log(1.3), 150))
    x[500:] *= ramp
    cross = 500 + int(np.argmax(ramp >= 1.1))
    late = [e for e in detect(x, FailSlowDetector(sustain=0)) if e.type == "onset"]
    assert late[0].detected_at - cross > 40
    first = next(e for e in detect(x) if e.type == "onset")
    assert abs(first.iteration - cross) <= 20 and first.detected_at - cross <= 35


@pytest.mark.parametrize("seed", range(4))
def test_healthy_drift_and_a_sub_threshold_shift_are_not_a_ramp(seed: int) -> None:
    """3% per 100 iterations of drift for 300 iterations, then an 8% shift: 17% above the
    start in all, never 10% within the windows a climb is judged on."""
    level = np.zeros(2000)
    level[600:900] = np.linspace(0.0, 0.09, 300)
    level[900:] = 0.09
    level[1300:] += np.log(1.08)
    assert detect(noisy(2000, seed=20 + seed) * np.exp(level)) == []
