"""The labeled trace corpora, and BOCD+V meeting its detection targets on small ones.

``generate_corpus`` is the first corpus (clean level shifts among single spikes);
``life_corpus`` adds the normal life of a training job (periodic eval / checkpoint / log
steps, GC bursts, compile warm-up, drift, heavy tails, ladders), on which the baselines fail.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest

from failslow.core.tracking import (
    BOCDDetector,
    FailSlowDetector,
    SlidingWindowDetector,
    detect,
)
from failslow.core.tracking.persistence import Persistence
from failslow.sim.traces import CATEGORIES, generate_corpus, generate_trace, score_job
from failslow.sim.training_life import RHYTHMS, life_corpus, life_trace


def test_corpus_is_deterministic_and_labeled() -> None:
    a, b, c = generate_corpus(30, 7), generate_corpus(30, 7), generate_corpus(30, 8)
    assert [t.job_id for t in a] == [t.job_id for t in b]
    assert all(np.array_equal(x.times, y.times) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x.times, y.times) for x, y in zip(a, c, strict=True))
    assert {t.category for t in a} == set(CATEGORIES)
    assert 0 < sum(t.positive for t in a) < len(a)
    for t in a:
        assert np.all(np.isfinite(t.times))
        assert np.all(t.times > 0)
        for onset, relief, slowdown in t.labels:
            assert 200 <= onset < relief <= t.times.size
            assert slowdown >= 0.1


def test_categories_differ_as_in_the_study() -> None:
    rng = np.random.default_rng(0)
    durations = {c: [] for c in CATEGORIES}
    for c in CATEGORIES:
        for _ in range(40):
            trace = generate_trace(c, rng, positive=True)
            durations[c] += [
                (f.relief - f.onset) * trace.base_s for f in trace.failslows if not f.compound
            ]
    means = {c: statistics.mean(d) / 60 for c, d in durations.items()}
    assert means["1-node"] < means["4-node"] < means["at-scale"]


def test_unknown_category() -> None:
    with pytest.raises(ValueError, match="'8-node'"):
        generate_trace("8-node", np.random.default_rng(0), positive=False)


@pytest.fixture(scope="module")
def small_corpus():  # type: ignore[no-untyped-def]
    return generate_corpus(36, 2024)


def test_bocd_v_meets_targets_on_a_small_corpus(small_corpus) -> None:  # type: ignore[no-untyped-def]
    scores = [score_job(t, detect(t.times, FailSlowDetector())) for t in small_corpus]
    neg = [s for s in scores if not s.positive]
    lat = [x for s in scores for x in s.latencies]
    found = [x for x in lat if x is not None]
    quiet = sum(s.quiet_iterations for s in scores)
    assert sum(s.correct for s in scores) / len(scores) >= 0.97
    assert all(s.correct for s in neg)  # no false positive job
    assert sum(x <= 15 for x in found) / len(lat) >= 0.95
    # issue 47: the reported change point within 3 iterations of the labeled one (median); the
    # report once the slowdown persisted (Persistence.min_points points)
    assert statistics.median(x for s in scores for x in s.errors) <= 3
    assert statistics.median(found) <= Persistence().min_points
    assert sum(s.order_faults for s in scores) == 0  # no relief without its onset
    assert 1e4 * sum(s.false_alarms for s in scores) / quiet <= 0.1


def test_raw_bocd_is_worse_on_the_same_corpus(small_corpus) -> None:  # type: ignore[no-untyped-def]
    subset = small_corpus[::4]
    scores = [score_job(t, detect(t.times, BOCDDetector())) for t in subset]
    assert sum(s.false_alarms for s in scores) > len(subset)


def test_life_corpus_is_deterministic_labeled_and_lives() -> None:
    a, b = life_corpus(24, 5), life_corpus(24, 5)
    assert all(np.array_equal(x.times, y.times) for x, y in zip(a, b, strict=True))
    assert 10 <= sum(t.positive for t in a) <= 14
    rhythms = [name for t in a for name in RHYTHMS if t.distractors.get(name)]
    assert set(rhythms) == set(RHYTHMS)
    for t in a:
        assert np.all(np.isfinite(t.times)) and np.all(t.times > 0)
        for onset, relief, slowdown in t.labels:
            assert 300 <= onset < relief <= t.times.size
            assert slowdown >= 0.1
        steps = sorted(i for name in RHYTHMS for i in t.distractors.get(name, []))
        run = longest = 1
        for prev, cur in itertools.pairwise(steps):
            run = run + 1 if cur - prev == 1 else 1  # touching steps would merge
            longest = max(longest, run)
        assert longest <= 3


def test_life_trace_unknown_category() -> None:
    with pytest.raises(ValueError, match="'8-node'"):
        life_trace("8-node", np.random.default_rng(0), positive=False)


@pytest.fixture(scope="module")
def life() -> list:  # type: ignore[type-arg]
    return life_corpus(40, 2024)


def test_bocd_v_meets_targets_on_a_small_life_corpus(life) -> None:  # type: ignore[no-untyped-def]
    scores = [score_job(t, detect(t.times, FailSlowDetector())) for t in life]
    lat = [x for s in scores for x in s.latencies]
    found = [x for x in lat if x is not None]
    quiet = sum(s.quiet_iterations for s in scores)
    assert all(s.correct for s in scores if not s.positive)  # no false positive job
    assert sum(s.correct for s in scores) / len(scores) >= 0.97
    assert sum(x <= 15 for x in found) / len(lat) >= 0.95
    # issue 47: the reported change point within 3 iterations of the labeled one (median); the
    # report once the slowdown persisted (Persistence.min_points points)
    assert statistics.median(x for s in scores for x in s.errors) <= 3
    assert statistics.median(found) <= Persistence().min_points
    assert sum(s.order_faults for s in scores) == 0  # no relief without its onset
    assert 1e4 * sum(s.false_alarms for s in scores) / quiet <= 0.1


def test_the_sliding_window_fails_on_the_life_corpus(life) -> None:  # type: ignore[no-untyped-def]
    """The corpus is not too easy: the paper's sliding window flags most healthy jobs."""
    negatives = [t for t in life if not t.positive]
    scores = [score_job(t, detect(t.times, SlidingWindowDetector())) for t in negatives]
    assert sum(not s.correct for s in scores) >= len(negatives) // 2
