"""Special steps: iterations that make other collective calls than the usual step are left out
of the detector's series (tracking v2, issue 19); the tracker counts each iteration's calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_iteration import CALLS, make_records

from failslow.core.tracking import FailSlowDetector, IterationTracker, detect, iteration_times
from failslow.core.tracking.special import SpecialSteps, Verdict


def _usual_calls(steps: range) -> np.ndarray:
    """make_records' calls per step: 6, one more on logging steps, five more on eval steps."""
    i = np.asarray(steps)
    return len(CALLS) + (i % 10 == 9) + 5 * (i % 100 == 99)


def test_the_tracker_counts_the_calls_between_step_markers() -> None:
    rec, truth = make_records(400, markers=(77,))
    result = iteration_times(rec)
    np.testing.assert_allclose(result.seconds, truth[1:], rtol=1e-6)
    assert result.calls is not None
    np.testing.assert_array_equal(result.calls, _usual_calls(range(1, 400)))


def test_the_tracker_counts_the_calls_between_anchors_online_as_offline() -> None:
    rec, _ = make_records(600, seed=2)
    offline = iteration_times(rec)
    assert offline.calls is not None and offline.calls.size == offline.seconds.size
    counts = dict(zip(*np.unique(offline.calls, return_counts=True), strict=True))
    # every call of the trace after the first anchor is in exactly one iteration
    assert max(counts, key=counts.get) == len(CALLS)
    # logging steps; eval steps (also logging ones; the last step has no closing anchor)
    assert counts[len(CALLS) + 1] == 54 and counts[len(CALLS) + 6] == 5
    tracker = IterationTracker(min_tokens=rec.size)
    parts = [tracker.feed_steps(rec[i : i + 37]) for i in range(0, rec.size, 37)]
    assert all(p[1].size == p[2].size for p in parts)
    online = np.concatenate([p[2] for p in parts])
    np.testing.assert_array_equal(online, offline.calls[-online.size :])


def test_a_periodic_step_is_held_then_left_out() -> None:
    judge = SpecialSteps()
    assert judge.judge(6) == Verdict(0, False, False)  # the first count is the usual one
    assert judge.judge(6) == Verdict(0, False, False)
    assert judge.judge(11) == Verdict(0, False, True)  # an eval step of three iterations
    assert judge.judge(11) == Verdict(0, False, True)
    assert judge.judge(11) == Verdict(0, False, True)
    assert judge.judge(6) == Verdict(3, False, False)  # back: the three stay out
    assert judge.judge(7) == Verdict(0, False, True)  # a logging step, then a checkpoint
    assert judge.judge(9) == Verdict(1, False, True)
    assert judge.judge(6) == Verdict(1, False, False)
    assert judge.judge(None) == Verdict(0, False, False)


def test_a_count_that_lasts_is_the_new_usual_step_and_its_run_is_given_back() -> None:
    """A topology change or a new micro-batch assignment changes every later step."""
    judge = SpecialSteps()
    judge.judge(6)
    assert [judge.judge(8) for _ in range(3)] == [Verdict(0, False, True)] * 3
    assert judge.judge(8) == Verdict(0, True, False)
    assert judge.usual == 8 and judge.judge(8) == Verdict(0, False, False)
    assert judge.judge(6) == Verdict(0, False, True)  # the old count is now the special one


def test_a_job_whose_count_varies_every_step_is_judged_on_its_times_alone() -> None:
    rng = np.random.default_rng(0)
    judge = SpecialSteps()
    verdicts = [judge.judge(int(6 + rng.integers(0, 3))) for _ in range(400)]
    assert sum(v.hold for v in verdicts[100:]) == 0
    with pytest.raises(ValueError, match="adopt"):
        SpecialSteps(adopt=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(1, 4)), max_size=300))
def test_every_iteration_is_fed_or_left_out_exactly_once(counts: list[int | None]) -> None:
    """Whatever the counts, the detector's held points and the judge agree: each iteration is
    fed, left out or still held, once."""
    det = FailSlowDetector(rhythm=False)
    for i, c in enumerate(counts):
        det.update(1.0 + 0.01 * (i % 3), c)
    assert det.special is not None
    assert det.history.n + det.skipped + len(det._special_held) == len(counts)
    assert det.skipped == det.special_skipped  # no rhythm: every left-out point was special
    assert len(det._special_held) == det.special.held


def _healthy(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 0.5 * np.exp(0.02 * rng.standard_normal(n))


def test_the_first_eval_step_with_a_gc_spike_beside_it_is_no_fail_slow() -> None:
    """Four slow points in a row at one level: on times alone a verified change (reported
    at once without persistence; since issue 47 a transient); its first three iterations made
    the eval's calls, so with the counts it is one GC spike."""
    times = _healthy(400, 1)
    times[200:203] *= 1.6  # the job's first eval step (three iterations)
    times[203] *= 1.6  # a GC pause right after it
    calls = np.full(400, 40)
    calls[200:203] += 12
    plain = FailSlowDetector(persistence=False)
    assert [e.type for e in detect(times, plain)] == ["onset", "relief"]
    assert detect(times) == []
    det = FailSlowDetector()
    assert detect(times, det, calls) == [] and det.transients == []
    assert det.special_skipped == 3  # what `failslow analyze` reports as special steps


def test_a_fail_slow_that_begins_on_a_logging_step_is_reported_as_soon() -> None:
    """A one-iteration special step that the slowdown outlasts was the slowdown's first point
    (onsets often begin in a logging step): it is fed after all, and nothing is late."""
    times = _healthy(500, 2)
    times[250:] *= 1.4
    calls = np.full(500, 40)
    calls[250] += 1
    [plain] = detect(times)
    [onset] = detect(times, calls=calls)
    assert (onset.iteration, onset.detected_at) == (plain.iteration, plain.detected_at)


def test_a_fail_slow_that_begins_on_an_eval_step_is_judged_on_the_iterations_after_it() -> None:
    """An eval step's three iterations are slow by the eval and the fail-slow together: they
    stay out, and the onset is verified on the iterations after them."""
    times = _healthy(500, 2)
    times[250:] *= 1.4
    times[250:253] *= 2.0
    calls = np.full(500, 40)
    calls[250:253] += 12
    [onset] = detect(times, FailSlowDetector(persistence=False), calls)
    assert onset.iteration == 253 and onset.detected_at <= 253 + 4


def test_a_fail_slow_with_a_new_call_count_from_its_start_is_still_reported() -> None:
    """The slowdown and the change of count come together (a restart onto another layout):
    the four held iterations are given back and the onset is reported with no delay."""
    times = _healthy(500, 3)
    times[250:] *= 1.4
    calls = np.full(500, 40)
    calls[250:] = 44
    [plain] = detect(times)
    [onset] = detect(times, calls=calls)
    assert (onset.iteration, onset.detected_at) == (plain.iteration, plain.detected_at)


def test_bad_call_counts_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="2 call counts for 3 iteration times"):
        detect([1.0, 1.0, 1.0], calls=[4, 4])
