"""MultiLevelPlanner (greyhound Alg. 1): break-even buys, Table 2 filtering, relief, compounds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.plans import Ignore, Plan
from failslow.core.planner.ski_rental import (
    ALL_KINDS,
    COMPUTE_ONLY,
    MultiLevelPlanner,
    Strategy,
    hindsight_cost,
)
from failslow.errors import FailslowError

COMPUTE = Diagnosis(Kind.COMPUTE, (SlowRank(3, 2.0),))
COMM = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(0, 8, 3.0),))


def fixed(overhead: float, step: float | None) -> Callable[[Diagnosis], Plan]:
    return lambda _d: Ignore(overhead_s=overhead, step_time_s=step)


def three_levels(s2=(2.0, 1.1), s3=(30.0, 1.05), s4=(300.0, 1.0)) -> list[Strategy]:
    return [
        Strategy("restart", ALL_KINDS, fixed(*s4), last_resort=True, revertible=False),
        Strategy("topology", ALL_KINDS, fixed(*s3)),
        Strategy("microbatch", COMPUTE_ONLY, fixed(*s2)),
    ]


def run(planner: MultiLevelPlanner, times: list[float]) -> list[tuple[int, str, str]]:
    out = []
    for i, t in enumerate(times):
        out += [(i, d.action, d.strategy) for d in planner.observe(t)]
    return out


def test_buys_each_level_when_impact_reaches_its_overhead():
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    assert planner.onset(COMPUTE, healthy_step_s=1.0) == []
    assert [n for n, _ in planner.candidates()] == ["microbatch", "topology", "restart"]
    # slow step 2.0 s: 1 s impact per step, S2 bought after 2 steps (impact 2.0 >= 2.0)
    decisions = run(planner, [2.0, 2.0])
    assert decisions == [(1, "apply", "microbatch")]
    # S2 ineffective (still 2.0): S3 bought when the cumulative impact reaches 30 s
    decisions = run(planner, [2.0] * 40)
    assert decisions == [(27, "apply", "topology")]
    assert planner.impact_s == pytest.approx(42.0)  # rent keeps accruing after the buy


def test_effective_strategy_stops_the_rent():
    planner = MultiLevelPlanner(three_levels())
    planner.onset(COMPUTE, healthy_step_s=1.0)
    run(planner, [2.0, 2.0])
    assert planner.applied == ("microbatch",)
    assert run(planner, [1.0] * 1000) == []  # back to healthy: no further buy
    assert planner.impact_s == pytest.approx(2.0)


def test_root_cause_filters_strategies_table_2():
    planner = MultiLevelPlanner(three_levels())
    planner.onset(COMM, healthy_step_s=1.0)
    assert [n for n, _ in planner.candidates()] == ["topology", "restart"]


def test_skips_a_level_that_would_not_beat_the_observed_step_time():
    # S3 estimates 1.5 s, but S2 already brought the job to 1.25 s: buying S3 is pointless;
    # the restart (estimated healthy) is still bought at its break-even point.
    planner = MultiLevelPlanner(three_levels(s3=(30.0, 1.5)), min_gain=0.05)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    run(planner, [2.0, 2.0])
    decisions = run(planner, [1.25] * 1500)
    assert decisions == [(1191, "apply", "restart")]


def test_relief_reverts_newest_first_and_what_a_restart_carried_over():
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    run(planner, [2.0] * 400)
    # the restart resumes from the in-memory snapshot, which carries the uneven S2 split and
    # the swapped layout: they stay in force after it, and relief undoes them (issue 16)
    assert planner.applied == ("microbatch", "topology", "restart")
    assert [(d.action, d.strategy) for d in planner.relief()] == [
        ("revert", "topology"),
        ("revert", "microbatch"),
    ]
    planner.onset(COMPUTE, healthy_step_s=1.0)
    run(planner, [2.0] * 40)
    assert planner.applied == ("microbatch", "topology")
    reverts = planner.relief()
    assert [(d.action, d.strategy) for d in reverts] == [
        ("revert", "topology"),
        ("revert", "microbatch"),
    ]
    assert not planner.active and planner.observe(5.0) == []


def test_a_restart_pays_off_what_came_before_it():
    # S4 removed the diagnosed host: a slowdown diagnosed after it (another rank, or a noisy
    # re-validation) pays for its own restart instead of re-buying one at once (issue 16: the
    # demo restarted twice, the second time on the first restart's impact)
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert run(planner, [2.0] * 300)[-1] == (299, "apply", "restart")
    assert planner.impact_s == 0.0
    other = Diagnosis(Kind.COMPUTE, (SlowRank(5, 2.0),))
    assert planner.onset(other, healthy_step_s=1.0) == []
    assert run(planner, [2.0] * 299) == [(1, "apply", "microbatch"), (29, "apply", "topology")]
    assert run(planner, [2.0]) == [(0, "apply", "restart")]  # at its own break-even, 300 s


def test_compound_onset_replans_and_keeps_impact():
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    run(planner, [2.0] * 5)
    again = planner.onset(Diagnosis(Kind.BOTH, (SlowRank(3, 2.0),)), healthy_step_s=1.0)
    assert [(d.action, d.strategy) for d in again] == [("apply", "microbatch")]
    assert planner.impact_s == pytest.approx(5.0)


def test_a_compound_onset_without_the_compute_part_undoes_s2():
    # the slow GPU recovered while a link stays slow: the uneven split would now only cost
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert run(planner, [2.0, 2.0]) == [(1, "apply", "microbatch")]
    again = planner.onset(COMM, healthy_step_s=1.0)
    assert [(d.action, d.strategy) for d in again] == [("revert", "microbatch")]
    assert planner.applied == () and planner.active
    assert [(d.action, d.strategy) for d in planner.relief()] == []  # nothing left to undo


def test_bad_inputs_are_clear_errors():
    with pytest.raises(FailslowError, match="unique"):
        MultiLevelPlanner(three_levels() * 2)
    planner = MultiLevelPlanner(three_levels())
    with pytest.raises(FailslowError, match="healthy step time"):
        planner.onset(COMPUTE, healthy_step_s=0.0)
    bad = [Strategy("x", ALL_KINDS, fixed(float("nan"), 1.0))]
    with pytest.raises(FailslowError, match="overhead"):
        MultiLevelPlanner(bad).onset(COMPUTE, healthy_step_s=1.0)


def _online_cost(duration: int, slow: float, levels: list[tuple[float, float]]) -> float:
    strategies = [Strategy(f"s{i}", ALL_KINDS, fixed(o, s)) for i, (o, s) in enumerate(levels)]
    planner = MultiLevelPlanner(strategies, min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    cost, step = 0.0, slow
    for _ in range(duration):
        cost += step - 1.0
        for d in planner.observe(step):
            plan: Plan = d.plan
            cost += plan.overhead_s
            step = plan.step_time_s or step
    return cost


@settings(max_examples=200, deadline=None)
@given(
    duration=st.integers(1, 3000),
    slow=st.floats(1.05, 5.0),
    overhead=st.floats(0.5, 500.0),
)
def test_single_buy_is_two_competitive(duration, slow, overhead):
    """Classic ski rental: one option that eliminates the slowdown -> cost <= 2 x hindsight
    (+ one step of rent, since decisions happen at step granularity)."""
    online = _online_cost(duration, slow, [(overhead, 1.0)])
    best = hindsight_cost(duration, 1.0, slow, [(overhead, 1.0)])
    assert online <= 2 * best + (slow - 1.0) + 1e-9


def test_a_plan_is_judged_by_its_models_relative_gain_when_it_has_a_baseline():
    """Observed 2.0 s per step. The model overrates the slowdown (its even split: 4.0 s, its
    plan: 2.2 s): absolutely the plan looks no better than what is observed; relatively it
    halves the step time (2.0 * 2.2 / 4.0 = 1.1 s) and is bought. Without the baseline the same
    plan is skipped."""

    def planner(baseline: float | None) -> MultiLevelPlanner:
        plan = Ignore(overhead_s=2.0, step_time_s=2.2, baseline_step_s=baseline)
        return MultiLevelPlanner([Strategy("microbatch", COMPUTE_ONLY, lambda _d: plan)])

    relative = planner(4.0)
    relative.onset(COMPUTE, healthy_step_s=1.0)
    assert run(relative, [2.0, 2.0]) == [(1, "apply", "microbatch")]
    absolute = planner(None)
    absolute.onset(COMPUTE, healthy_step_s=1.0)
    assert run(absolute, [2.0, 2.0]) == []


# ---- what the job showed (the closed loop) -----------------------------------------------------
def test_a_disabled_strategy_leaves_the_event_and_is_never_planned_again():
    planner = MultiLevelPlanner(three_levels(), min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert run(planner, [2.0, 2.0]) == [(1, "apply", "microbatch")]
    planner.disable("microbatch", "rank 2 ran 4 micro-batches")
    assert planner.applied == ()
    assert [n for n, _ in planner.candidates()] == ["topology", "restart"]
    assert planner.disabled == {"microbatch": "rank 2 ran 4 micro-batches"}
    # the impact keeps accruing: the next level is bought when it pays (30 s)
    assert run(planner, [2.0] * 30)[0][1:] == ("apply", "topology")
    # a new fail-slow: still no microbatch plan
    planner.relief()
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert "microbatch" not in [n for n, _ in planner.candidates()]


def test_a_strategy_is_judged_by_its_measured_step_once_it_ran():
    """S2 predicted 1.1 s; in effect it measured 2.0 s (no gain): reverted, it is not bought
    again on its prediction - the next level is bought on its own terms."""
    planner = MultiLevelPlanner(three_levels(), min_gain=0.05)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert run(planner, [2.0, 2.0]) == [(1, "apply", "microbatch")]
    planner.measured("microbatch", 2.0)
    planner.dropped("microbatch")
    assert planner.applied == ()
    assert run(planner, [2.0] * 3) == []
    # a compound onset makes the candidates anew: microbatch is still judged by 2.0 s
    assert planner.onset(COMPUTE, healthy_step_s=1.0) == []
    assert [d for d in run(planner, [2.0] * 5) if d[2] == "microbatch"] == []


def test_rebuild_replaces_the_applied_plan_only_when_the_new_one_differs():
    from failslow.core.planner.plans import MicroBatchPlan

    def split(*counts: int, step: float) -> MicroBatchPlan:
        return MicroBatchPlan(counts=counts, weights=(1.0,) * 4, overhead_s=1.0, step_time_s=step)

    plans = iter([split(5, 5, 1, 5, step=1.5), split(5, 5, 1, 5, step=1.4),
                  split(5, 4, 3, 4, step=1.2)])  # fmt: skip
    s2 = Strategy("microbatch", COMPUTE_ONLY, lambda _d: next(plans))
    planner = MultiLevelPlanner([s2], min_gain=0.0)
    planner.onset(COMPUTE, healthy_step_s=1.0)
    assert run(planner, [2.0])[0][1:] == ("apply", "microbatch")
    assert planner.rebuild("microbatch", "newer profiles") is None  # the same change
    decision = planner.rebuild("microbatch", "newer profiles")
    assert decision is not None and decision.plan.step_time_s == 1.2
    assert decision.reason == "newer profiles" and planner.applied == ("microbatch",)


def test_catching_up_decides_on_the_newest_steps_not_on_each_replayed_one():
    """A diagnosis after 12 slow steps, the first few only mildly slow (a noisy onset before
    the real one): replayed one by one, S2 (1.1 s) is judged against 1.12 s and passed over for
    good; caught up, the impact is the same and S2 is judged against the newest 2.0 s."""
    history = [1.12] * 7 + [2.0] * 5
    replayed = MultiLevelPlanner(three_levels(s2=(0.5, 1.1)), min_gain=0.05)
    replayed.onset(COMPUTE, healthy_step_s=1.0)
    assert [d.strategy for t in history for d in replayed.observe(t)] == []
    caught = MultiLevelPlanner(three_levels(s2=(0.5, 1.1)), min_gain=0.05)
    caught.onset(COMPUTE, healthy_step_s=1.0)
    assert [d.strategy for d in caught.catch_up(history)] == ["microbatch"]
    assert caught.impact_s == pytest.approx(replayed.impact_s)
