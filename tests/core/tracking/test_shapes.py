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
    # the climb's level now, not its newest window's median (the level 10 iterations ago):
    # reported 6-9 iterations after the crossing, the change point within 3 of it; before,
    # 6-33 and -11 to +16 (seeds 0-2 failed)
    assert abs(first.iteration - cross) <= 5 and first.detected_at - cross <= 15


@pytest.mark.parametrize("seed", range(4))
def test_healthy_drift_and_a_sub_threshold_shift_are_not_a_ramp(seed: int) -> None:
    """3% per 100 iterations of drift for 300 iterations, then an 8% shift: 17% above the
    start in all, never 10% within the windows a climb is judged on."""
    level = np.zeros(2000)
    level[600:900] = np.linspace(0.0, 0.09, 300)
    level[900:] = 0.09
    level[1300:] += np.log(1.08)
    assert detect(noisy(2000, seed=20 + seed) * np.exp(level)) == []


@pytest.mark.parametrize("seed", range(4))
def test_a_ramp_verified_as_a_step_keeps_its_crossing(seed: int) -> None:
    """1.5x reached over 60 iterations (crossing 1.1x at iteration 514): the one-level rules
    verify it once enough of it clears the line, up to 9 iterations after it did; the change
    point is moved back to where it crossed and the persistence counts from there, so the
    onset is reported within 15 iterations of the crossing (16 and 18 for seeds 0 and 1
    before)."""
    x = noisy(1000, seed=30 + seed)
    ramp = np.full(500, 1.5)
    ramp[:60] = np.exp(np.linspace(0.0, np.log(1.5), 60))
    x[500:] *= ramp
    cross = 500 + int(np.argmax(ramp >= 1.1))
    onset = next(e for e in detect(x) if e.type == "onset")
    assert abs(onset.iteration - cross) <= 5
    assert onset.detected_at - cross <= 15


@pytest.mark.parametrize("seed", [2, 4, 7, 11, 14])
def test_a_burst_on_a_slightly_slow_machine_keeps_its_change_point(seed: int) -> None:
    """8 iterations at 1.12x (a busy machine), then an 8-iteration 2.5x burst, then healthy:
    16 slow iterations, under the job's transients' scale plus the 1.12x that was never a
    step of its own on these seeds. The burst's change point is not moved back over the
    1.12x points (they are flat, not a climb to it), so its persistence counts from the
    burst and it ends as a transient. Moved back, as the first ramp rule did (issue 47,
    reverted 2026-12-02: the online healthy-life test reported such a burst), every one of
    these seeds reports an onset 6-9 iterations later."""
    x = noisy(1000, seed=40 + seed, sd=0.03)
    x[500:508] *= 1.12
    x[508:516] *= 2.5
    det = FailSlowDetector()
    assert [e for e in detect(x, det) if e.type == "onset"] == []
    assert [(t.start, t.end) for t in det.transients] == [(508, 516)]
