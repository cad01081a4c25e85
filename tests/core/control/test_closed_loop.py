"""The closed loop's own rules: a plan's prediction on the observed scale, its verdict, and the
window its outcome is measured over (the mitigator's tests run them against real stores)."""

from __future__ import annotations

import pytest

from failslow.core.control.closed_loop import (
    KEEP_STEPS,
    OUTCOME_FIRST,
    OUTCOME_STEPS,
    STOPPED_PAYING,
    ClosedLoop,
    judge,
    median_before,
    predicted_step_s,
)
from failslow.core.planner.plans import MicroBatchPlan


def _plan(step: float | None, baseline: float | None = None) -> MicroBatchPlan:
    return MicroBatchPlan(
        counts=(5, 5, 1, 5), weights=(1.25, 1.25, 0.25, 1.25), step_time_s=step,
        baseline_step_s=baseline,
    )  # fmt: skip


def test_a_prediction_is_read_on_the_observed_scale() -> None:
    assert predicted_step_s(_plan(0.25), before_s=0.5) == 0.25  # the rank profiles' own
    assert predicted_step_s(_plan(0.3, baseline=0.6), before_s=0.5) == 0.25  # a relative gain
    assert predicted_step_s(_plan(None), before_s=0.5) is None


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [(0.30, "pays"), (0.35, "pays"), (0.3501, "short"), (0.5, "short"), (0.6, "short")],
)
def test_a_plan_pays_when_it_saved_half_of_what_it_promised(measured: float, verdict: str) -> None:
    got, reason = judge(before_s=0.5, predicted_s=0.2, measured_s=measured)  # 0.3 s promised
    assert got == verdict, reason
    assert reason.startswith(f"measured {measured:.3f} s per step against 0.500 s before")


def test_without_a_prediction_or_a_before_there_is_no_verdict() -> None:
    assert judge(None, 0.2, 0.3)[0] == "unknown"
    assert judge(0.5, None, 0.3) == (
        "unknown",
        "measured 0.300 s per step against 0.500 s before (no prediction)",
    )
    assert judge(0.5, 0.6, 0.3) == (
        "unknown",
        "measured 0.300 s per step against 0.500 s before and 0.600 s predicted (it predicted "
        "no saving)",
    )


def test_the_outcome_is_the_median_of_its_window_once_every_step_of_it_is_known() -> None:
    steps = {s: (0.5, 0.0) for s in range(90, 100)}
    loop = ClosedLoop(store=None, world_size=lambda: 4)  # type: ignore[arg-type]

    class Action:
        plan = _plan(0.2)

    loop.watch(Action(), 100, steps)
    assert median_before(steps, 100) == 0.5
    first = 100 + OUTCOME_FIRST
    for s in range(100, first + OUTCOME_STEPS - 1):
        steps[s] = (9.0 if s < first else 0.25, 0.0)  # the switch's steps are not counted
    assert loop.outcomes(steps) == []  # one step of the window still missing
    steps[first + OUTCOME_STEPS - 1] = (0.25, 0.0)
    ((_, outcome),) = loop.outcomes(steps)
    assert (outcome.before_s, outcome.predicted_s, outcome.measured_s) == (0.5, 0.2, 0.25)
    assert outcome.verdict == "pays" and loop.watching == []


def test_a_plan_replaced_before_its_window_ends_is_not_measured_on_the_newer_plans_steps() -> None:
    """A newer plan that takes effect inside a watched plan's window ends that watch: the steps
    from then on are the newer plan's. A plan whose window ends before it keeps its watch; the
    end of the fail-slow (no step) ends every watch."""
    steps = {s: (0.5, 0.0) for s in range(90, 100)}
    loop = ClosedLoop(store=None, world_size=lambda: 4)  # type: ignore[arg-type]

    class Action:
        plan = _plan(0.2)

    early, late = loop.watch(Action(), 80, steps), loop.watch(Action(), 100, steps)
    end = 100 + OUTCOME_FIRST + OUTCOME_STEPS  # the late plan's window is [102, 107)
    assert loop.unmeasured(end) == [] and loop.watching == [early, late]
    assert loop.unmeasured(end - 1) == [late] and loop.watching == [early]
    for s in range(100, end + 5):
        steps[s] = (0.25, 0.0)
    assert loop.outcomes(steps) == []  # the late one is no longer watched; the early one's
    # window (82-86) has no steps known: it waits, until the fail-slow ends
    assert loop.unmeasured() == [early] and loop.watching == []


def test_a_plan_that_paid_is_judged_again_and_stops_paying_after_two_short_windows_in_a_row() -> (
    None
):
    """After its verdict a plan that paid stays watched in windows of KEEP_STEPS: one short
    window (a pause, a checkpoint) is forgiven when the next pays; two in a row are a plan
    that stopped paying, reported once with the steps and medians it was judged on."""
    steps = {s: (0.5, 0.0) for s in range(90, 100)}
    loop = ClosedLoop(store=None, world_size=lambda: 4)  # type: ignore[arg-type]

    class Action:
        plan = _plan(0.2)

    watched = loop.watch(Action(), 100, steps)
    first = 100 + OUTCOME_FIRST + OUTCOME_STEPS  # the first kept window
    for s in range(100, first):
        steps[s] = (0.25, 0.0)
    ((_, outcome),) = loop.outcomes(steps)
    kept = loop.keep(watched, outcome)
    assert kept.next_step == first and loop.drifts(steps) == []
    # short (0.4 > 0.35), then paying, then short twice
    medians = [0.4, 0.26, 0.45, 0.42]
    for i, seconds in enumerate(medians):
        for s in range(first + i * KEEP_STEPS, first + (i + 1) * KEEP_STEPS):
            steps[s] = (seconds, 0.0)
        if i < len(medians) - 1:
            assert loop.drifts(steps) == [], i
    ((again, drift),) = loop.drifts(steps)
    assert again is kept and loop.kept == [] and loop.drifts(steps) == []
    assert (drift.verdict, drift.measured_s, drift.before_s, drift.predicted_s) == (
        STOPPED_PAYING, 0.42, 0.5, 0.2,
    )  # fmt: skip
    last = first + len(medians) * KEEP_STEPS - 1
    assert drift.reason == (
        "measured 0.420 s per step against 0.500 s before and 0.200 s predicted: saved 0.080 s "
        f"of the 0.300 s it promised over steps {first + 2 * KEEP_STEPS}-{last} (medians "
        "0.450, 0.420 s), after 0.250 s at its verdict"
    )


def test_a_kept_plan_is_no_longer_kept_once_a_newer_plan_or_the_end_of_the_fail_slow_came() -> None:
    steps = {s: (0.5, 0.0) for s in range(90, 100)}
    loop = ClosedLoop(store=None, world_size=lambda: 4)  # type: ignore[arg-type]

    class Action:
        plan = _plan(0.2)

    for s in range(100, 110):
        steps[s] = (0.25, 0.0)
    watched = loop.watch(Action(), 100, steps)
    ((_, outcome),) = loop.outcomes(steps)
    loop.keep(watched, outcome)
    assert loop.unmeasured(100) == [] and len(loop.kept) == 1  # a plan from its own step on
    assert loop.unmeasured(150) == [] and loop.kept == []  # a newer plan replaced it
    loop.keep(watched, outcome)
    assert loop.unmeasured() == [] and loop.kept == []  # the fail-slow ended
    unwatched = ClosedLoop(store=None, world_size=lambda: 4, keep_steps=0)  # type: ignore[arg-type]
    assert unwatched.keep(watched, outcome) is None and unwatched.kept == []  # planner.keep_steps
