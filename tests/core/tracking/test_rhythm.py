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


def test_a_slowdown_that_starts_before_a_slot_is_not_explained_by_a_new_rhythm() -> None:
    high = steps(1200, 100, 50, 2)
    high[748:] = True  # a fail-slow two iterations before the eighth eval step
    rhythm = Rhythm()
    explained = feed(rhythm, high[:748])
    assert explained[450:452].all()  # the rhythm is known by then ...
    assert rhythm.periods[0].hits < 8  # ... but seen fewer than eight times
    assert not any(rhythm.observe(t, True) for t in range(748, 1200))


def test_a_well_confirmed_step_inside_a_run_is_the_rhythm_s_own() -> None:
    """Seen eight times, a multi-iteration step is explained even inside a run of high
    iterations that began before its slot (a GC spike, a noise point just before an eval
    step), but only its own iterations - not the slot's tolerance around them."""
    high = steps(2000, 100, 50, 2)
    high[1048:] = True  # two iterations before the eleventh eval step
    rhythm = Rhythm()
    feed(rhythm, high[:1048])
    assert rhythm.periods[0].hits >= 8
    later = [rhythm.observe(t, True) for t in range(1048, 1200)]
    assert later[:8] == [False, False, True, True] + [False] * 4
    assert later[102:104] == [True, True] and not later[101] and not later[104]


def test_unlike_excursions_do_not_make_a_rhythm() -> None:
    """Four starts in line, but a 1-iteration spike among 3-iteration steps: no rhythm."""
    rhythm = Rhythm()
    high = np.zeros(600, dtype=bool)
    for start, length in ((100, 3), (200, 3), (300, 1), (400, 3)):
        high[start : start + length] = True
    feed(rhythm, high)
    assert rhythm.periods == []
    high[500:503] = True  # a fifth alike step: still no four alike ones in line
    rhythm = Rhythm()
    feed(rhythm, high)
    assert rhythm.periods == []


def test_a_step_seen_twice_must_be_outlasted_by_three() -> None:
    """A slow step of L iterations can have a GC spike on each side: L + 2 slow points.
    Seen once, a slowdown of its size must last L + 2; seen twice (a pattern, not a
    one-off), L + 3. A run the detector reported as an onset is not one of these steps."""
    rhythm = Rhythm()
    t = 0

    def run(length: int, excess: float, *, reported: bool = False) -> None:
        nonlocal t
        for _ in range(length):
            rhythm.observe(t, True, excess)
            t += 1
        if reported:
            rhythm.reported(slow=False)
        rhythm.observe(t, False)
        t += 37  # never in line: no rhythm is learned

    assert rhythm.outlast(0.9) == 0
    run(3, 0.9)
    assert rhythm.outlast(0.9) == 5
    assert rhythm.outlast(0.3) == 0  # not of a similar size
    run(2, 1.0)
    assert rhythm.outlast(0.9) == 6
    run(6, 0.4, reported=True)  # a fail-slow's onset: its points are not a slow step
    assert rhythm.outlast(0.4) == 0


def test_during_a_fail_slow_excursions_are_not_slow_steps() -> None:
    rhythm = Rhythm()
    rhythm.reported(slow=True)  # an onset: the excursions over its level are congestion
    for t in range(3):
        rhythm.observe(t, True, 0.6)
    rhythm.observe(3, False)
    assert rhythm.outlast(0.6) == 0
    rhythm.reported(slow=False)  # relief
    for t in range(50, 53):
        rhythm.observe(t, True, 0.6)
    rhythm.observe(53, False)
    assert rhythm.outlast(0.6) == 5


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


def test_during_a_fail_slow_only_large_excursions_start_a_rhythm() -> None:
    """Congestion over a fail-slow's level makes many small excursions; they line up by
    chance, so while slow only slow steps of at least 1.28x can start a rhythm."""

    def learn(size: float, *, slow: bool) -> list[tuple[int, int]]:
        rhythm = Rhythm()
        rhythm.reported(slow=slow)
        for t in range(1000):
            rhythm.observe(t, t % 50 == 7, size)
        return [(p.period, p.duration) for p in rhythm.periods]

    assert learn(0.15, slow=False) == [(50, 1)]
    assert learn(0.15, slow=True) == []
    assert learn(0.6, slow=True) == [(50, 1)]


def test_noise_as_dense_as_a_rhythm_is_not_one() -> None:
    """Heavy noise: 15% of the iterations are one-point excursions of one size, at random.
    Four aligned ones are then certain at some period; the rule asks for more the denser the
    alike excursions are (none at all when one lies in every slot), so almost none is
    explained away - before it, 754 of 3024 were."""
    rng = np.random.default_rng(5)
    high = rng.random(20_000) < 0.15
    explained = feed(Rhythm(), high)
    assert explained.sum() <= 0.01 * high.sum()


def test_a_rhythm_among_dense_noise_is_learned_from_more_occurrences() -> None:
    """A logging step every 10 iterations among 5% random spikes of the same size: the
    chance that a slot holds a spike asks for more than four occurrences, not for none."""
    rng = np.random.default_rng(6)
    noise = rng.random(3000) < 0.05
    high = steps(3000, 10, 3, 1) | noise
    rhythm = Rhythm()
    explained = feed(rhythm, high)
    assert not explained[:50].any()  # four aligned occurrences are not enough here
    logging = steps(3000, 10, 3, 1)
    assert explained[1000:][logging[1000:]].mean() >= 0.95
    assert 10 in [p.period for p in rhythm.periods]


def test_a_harmonic_gives_way_to_its_base_rhythm() -> None:
    """A logging step every 20 iterations, mostly hidden for a while (as by a fail-slow's
    congestion): only every fifth occurrence shows, so a rhythm of 100 is learned from them.
    Once the 20 is learned, the 100 of the same one-point step is dropped (the 20 predicts
    its every slot) and no multiple of 20 is learned beside it; an eval step of 3 iterations
    every 250 keeps its own place."""
    log = steps(4000, 20, 5, 1)
    hidden = log.copy()
    hidden[:1000] &= np.arange(1000) % 100 == 5  # only every fifth logging step shows
    high = hidden | steps(4000, 250, 60, 3)
    rhythm = Rhythm()
    feed(rhythm, high[:1000])
    assert [p.period for p in rhythm.periods if p.duration == 1] == [100]
    explained = [rhythm.observe(t, bool(high[t])) for t in range(1000, 4000)]
    assert sorted((p.period, p.duration) for p in rhythm.periods) == [(20, 1), (250, 3)]
    assert np.array_equal(np.array(explained[1000:]), high[2000:])
