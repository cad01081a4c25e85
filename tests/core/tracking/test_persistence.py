"""Actionable onsets (issue 47): a verified slowdown is reported once it outlasted the job's
transients; shorter episodes are recorded as transients, events come in live order, and a
restart's re-warm-up is the job's healthy life."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from failslow.core.tracking import FailSlowDetector, detect
from failslow.core.tracking.persistence import Persistence


def noisy(n: int, *, seed: int, sd: float = 0.02) -> np.ndarray:
    return np.exp(np.random.default_rng(seed).normal(0.0, sd, n))


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_neighbour_burst_is_a_transient_not_an_onset(seed: int) -> None:
    """Eight iterations at 1.8x pass verification (reported at once without persistence,
    with their relief after the fact); with it they are one transient and no event."""
    x = noisy(600, seed=seed)
    x[300:308] *= 1.8
    plain = detect(x, FailSlowDetector(persistence=False))
    assert [e.type for e in plain] == ["onset", "relief"]
    det = FailSlowDetector()
    assert detect(x, det) == [] and not det.slow
    [transient] = det.transients
    assert 299 <= transient.start <= 300 and 307 <= transient.end <= 308
    assert transient.detected_at >= transient.end and transient.after_s > 1.6


@pytest.mark.parametrize("seed", range(3))
def test_a_fail_slow_keeps_its_change_point_and_says_when_it_was_reported(seed: int) -> None:
    x = noisy(1200, seed=10 + seed)
    x[500:700] *= 1.25
    onset, relief = detect(x)
    assert (onset.type, relief.type) == ("onset", "relief")
    assert abs(onset.iteration - 500) <= 1  # the change point, not the report
    # reported once it persisted: Persistence.min_points points from the change on
    assert 500 + Persistence().min_points - 1 <= onset.detected_at <= 515
    assert 700 <= relief.detected_at <= 720


def test_the_job_s_own_excursions_teach_it_to_wait_longer() -> None:
    """Twelve-iteration bursts outlast the default wait once; that short episode (over within
    twice the cap) sets the job's scale, and the next ones are transients."""
    x = noisy(1200, seed=4)
    for start in range(200, 1000, 200):
        x[start : start + 12] *= 1.6
    det = FailSlowDetector()
    events = detect(x, det)
    assert [(e.type, e.iteration) for e in events] == [("onset", 200), ("relief", 212)]
    assert [t.start for t in det.transients] == [400, 600, 800]
    assert det.persistence is not None and det.persistence.need(1.0) == 14


def test_a_fail_slow_after_the_job_learned_its_bursts_is_still_reported_within_15() -> None:
    x = noisy(1200, seed=6)
    for start in (200, 400):
        x[start : start + 12] *= 1.6
    x[800:] *= 1.3
    onsets = [e for e in detect(x) if e.type == "onset"]
    assert [e.iteration for e in onsets][-1] == 800
    assert onsets[-1].detected_at - 800 <= 15


def test_the_wait_is_tied_to_the_cost_of_acting() -> None:
    """A 1 s validation pause is 10 iterations of a 0.1 s job (capped at max_points), 2 of a
    0.5 s job (the floor decides)."""
    rule = Persistence(min_points=2, max_points=8, act_cost_s=1.0)
    assert rule.need(0.1) == 8 and rule.need(0.5) == 2 and rule.need(None) == 2
    assert Persistence(min_points=2, max_points=20).need(0.1) == 10
    with pytest.raises(ValueError, match="min_points"):
        Persistence(min_points=5, max_points=4)


def test_live_order_no_relief_without_its_onset() -> None:
    """Episodes of every length around the wait: whatever is reported comes as onset then
    relief, never a relief alone, and an episode is either reported or a transient."""
    x = noisy(3400, seed=8)
    gaps = np.random.default_rng(9).integers(120, 180, 18)  # irregular: no rhythm to learn
    starts = (200 + np.concatenate([[0], np.cumsum(gaps[:-1])])).tolist()
    for k, start in enumerate(starts):
        x[start : start + 4 + k] *= 1.5  # 4 .. 21 iterations
    det = FailSlowDetector()
    events = detect(x, det)
    types = [e.type for e in events]
    assert types == ["onset", "relief"] * (len(types) // 2)
    assert all(a.detected_at <= b.detected_at for a, b in itertools.pairwise(events))
    reported = {e.iteration for e in events if e.type == "onset"}
    seen = reported | {t.start for t in det.transients}
    assert all(min(abs(s - v) for v in seen) <= 1 for s in starts)
    assert all(e.detected_at - e.iteration >= Persistence().min_points - 1 for e in events
               if e.type == "onset")  # fmt: skip


def test_a_restart_s_re_warm_up_is_not_a_fail_slow() -> None:
    """After a hot update: a 10x compile step, then 1.8x decaying over ~60 iterations. Told of
    the restart, the detector learns the level afresh and reports nothing; not told, the
    re-warm-up is a fail-slow."""
    x = noisy(1000, seed=5)
    x[500] *= 10.0
    x[501:600] *= 1 + 0.8 * np.exp(-np.arange(99) / 20)
    assert [e.type for e in detect(x)] == ["onset", "relief"]
    det = FailSlowDetector()
    events = []
    for i, v in enumerate(x):
        if i == 500:
            det.restarted()
        events += det.update(float(v))
    assert events == [] and not det.slow
    x[800:] *= 1.3  # and a fail-slow after it is still seen
    det = FailSlowDetector()
    for i, v in enumerate(x):
        if i == 500:
            det.restarted()
        events += det.update(float(v))
    assert [(e.type, e.iteration) for e in events] == [("onset", 800)]


def test_a_burst_on_top_of_a_fail_slow_is_no_compound_onset() -> None:
    """A fail-slow is reported; an 8-iteration burst at 1.8x on top of it is a transient, not
    a compound step - the fail-slow is still reported, and its relief still comes."""
    x = noisy(1500, seed=12)
    x[500:1000] *= 1.3
    x[700:708] *= 1.8
    det = FailSlowDetector()
    events = detect(x, det)
    onset, relief = events
    assert (onset.type, onset.iteration, relief.type) == ("onset", 500, "relief")
    assert abs(relief.iteration - 1000) <= 1
    [transient] = det.transients
    assert 699 <= transient.start <= 700 and 707 <= transient.end <= 708
    plain = [e.type for e in detect(x, FailSlowDetector(persistence=False))]
    assert plain.count("onset") == 2  # reported at once, it was a compound onset
