"""The job's rhythm: recurring slow steps learned from iteration indices, and forgotten."""

from __future__ import annotations

import numpy as np
import pytest

from failslow.core.tracking.rhythm import Rhythm


def feed(rhythm: Rhythm, high: np.ndarray) -> np.ndarray:
    """Observe every iteration; return which ones the rhythm explained."""
    return np.array([rhythm.observe(t, bool(h)) for t, h in enumerate(high)], dtype=bool)


def steps(n: int, period: int, phase: int, duration: int) -> np.ndarray:
    high = np.zeros(n, dtype=bool)
    for start in range(phase, n, period):
        high[start : start + duration] = True
    return high


def test_a_periodic_step_is_explained_from_its_fifth_occurrence() -> None:
    high = steps(1000, 100, 37, 3)
    explained = feed(Rhythm(), high)
    assert not explained[:437].any()  # learning needs four occurrences
    assert np.array_equal(explained[437:], high[437:])


def test_two_rhythms_with_one_period_and_different_phases() -> None:
    """An eval and a checkpoint every 200 iterations, 24 iterations apart."""
    high = steps(2000, 200, 24, 1) | steps(2000, 200, 48, 3)
    rhythm = Rhythm()
    explained = feed(rhythm, high)
    assert sorted((p.period, p.phase % 200, p.duration) for p in rhythm.periods) == [
        (200, 24, 1),
        (200, 48, 3),
    ]
    assert np.array_equal(explained[900:], high[900:])


def test_a_slowdown_that_starts_before_a_slot_is_never_explained() -> None:
    high = steps(1200, 100, 50, 2)
    high[748:] = True  # a fail-slow two iterations before the eighth eval step
    explained = feed(Rhythm(), high)
    assert explained[450:452].all()  # the rhythm is known by then
    assert not explained[748:].any()


def test_a_slowdown_that_starts_in_a_slot_is_explained_only_for_the_slot() -> None:
    high = steps(1200, 100, 50, 2)
    high[750:] = True
    explained = feed(Rhythm(), high)
    assert explained[750:760].tolist() == [True, True, True] + [False] * 7


def test_a_rhythm_that_stops_is_forgotten() -> None:
    high = steps(2000, 100, 10, 2)
    high[1000:] = False
    rhythm = Rhythm()
    feed(rhythm, high[:1000])
    assert [p.period for p in rhythm.periods] == [100]
    feed_from = [rhythm.observe(t, bool(high[t])) for t in range(1000, 2000)]
    assert not any(feed_from)
    assert rhythm.periods == []


def test_random_spikes_are_rarely_a_rhythm() -> None:
    """1% GC spikes at random: chance alignments are learned now and then, but die at their
    first empty slots, so almost no spike is explained away."""
    rng = np.random.default_rng(3)
    high = rng.random(50_000) < 0.01
    rhythm = Rhythm()
    explained = feed(rhythm, high)
    assert explained.sum() <= 0.01 * high.sum()
    assert all(p.hits <= 5 for p in rhythm.periods)  # none ever confirmed much


def test_a_missed_iteration_keeps_the_rhythm() -> None:
    """A capture layer that loses an iteration shifts later steps by one: still the rhythm."""
    high = np.concatenate((steps(600, 100, 20, 2), steps(600, 100, 19, 2)))
    explained = feed(Rhythm(), high)
    assert np.array_equal(explained[420:], high[420:])


@pytest.mark.parametrize(
    "kwargs",
    [{"max_burst": 0}, {"repeats": 1}, {"tolerance": -1}, {"keep": 2}, {"min_period": 3}],
)
def test_bad_parameters(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        Rhythm(**kwargs)
