"""ExpectedCost, the planner's default buy rule: the duration prior, its two worst-case bounds,
waiting for the best buy, and the config that selects it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.config import load_config
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.config import PlannerConfig
from failslow.core.planner.duration_prior import DurationPrior, DurationPriors
from failslow.core.planner.planner import buy_rule
from failslow.core.planner.plans import Ignore, Plan
from failslow.core.planner.ski_rental import (
    ALL_KINDS,
    COMPUTE_ONLY,
    BreakEven,
    ExpectedCost,
    MultiLevelPlanner,
    Strategy,
)
from failslow.errors import ConfigError

COMPUTE = Diagnosis(Kind.COMPUTE, (SlowRank(3, 2.0),))
COMM = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(0, 8, 3.0),))
SMALL = ExpectedCost(DurationPriors.characterization(256))
AT_SCALE = ExpectedCost(DurationPriors.characterization(1024))


def fixed(overhead: float, step: float | None) -> Callable[[Diagnosis], Plan]:
    return lambda _d: Ignore(overhead_s=overhead, step_time_s=step)


def s2(overhead=0.01, step=1.2) -> Strategy:
    return Strategy("microbatch", COMPUTE_ONLY, fixed(overhead, step))


def s3(overhead=30.0, step=1.05) -> Strategy:
    return Strategy("topology", ALL_KINDS, fixed(overhead, step))


def s4(overhead=300.0, step=1.0) -> Strategy:
    return Strategy("restart", ALL_KINDS, fixed(overhead, step), last_resort=True, revertible=False)


def run(planner: MultiLevelPlanner, step_of: Callable[[list[str]], float], steps: int):
    """Feed ``steps`` steps whose time depends on what was bought; returns the buys."""
    bought: list[tuple[int, str]] = []
    for i in range(steps):
        for d in planner.observe(step_of([name for _, name in bought])):
            bought.append((i, d.strategy))
    return bought


def test_a_nearly_free_s2_is_bought_at_the_first_observed_step():
    planner = MultiLevelPlanner([s2(), s3(), s4()], rule=SMALL)
    assert planner.onset(COMPUTE, healthy_step_s=1.0) == []  # nothing observed yet
    assert run(planner, lambda b: 1.2 if b else 2.0, 1) == [(0, "microbatch")]


def test_a_restart_is_never_bought_when_the_expected_remaining_duration_cannot_pay():
    # after S2 the rent is 1 - 1/1.2 = 0.17 s per second; a compute fail-slow that has lasted
    # 40 minutes is expected to last ~22 more: 0.17 * 1340 s < 300 s of restart
    def step(bought: list[str]) -> float:
        return 1.2 if bought else 2.0

    expected = MultiLevelPlanner([s2(), s4()], rule=SMALL)
    expected.onset(COMPUTE, healthy_step_s=1.0)
    assert run(expected, step, 2000) == [(0, "microbatch")]
    published = MultiLevelPlanner([s2(), s4()], rule=BreakEven())
    published.onset(COMPUTE, healthy_step_s=1.0)
    assert [name for _, name in run(published, step, 2000)] == ["microbatch", "restart"]


def test_the_time_already_elapsed_makes_a_restart_worth_it():
    def buys(age_s: float) -> list[tuple[int, str]]:
        planner = MultiLevelPlanner([s4(overhead=400.0)], rule=SMALL)
        planner.onset(COMPUTE, healthy_step_s=1.0, age_s=age_s)
        return run(planner, lambda b: 1.0 if b else 2.0, 300)

    # 600 s into it, ~745 s are still to come: 0.5 * 745 s of rent saved < 400 s of restart
    assert buys(0.0) == []
    # four hours in, the heavy tail says hours more: bought once the impact is half of 400 s
    assert buys(4 * 3600.0) == [(199, "restart")]


def test_never_before_the_earliest_point_and_never_after_break_even():
    early = MultiLevelPlanner([s3(step=1.0)], rule=AT_SCALE)  # 72 min expected: buy early
    early.onset(COMM, healthy_step_s=1.0)
    assert run(early, lambda b: 1.0 if b else 3.0, 40) == [(7, "topology")]  # impact 16 >= 15
    short = DurationPrior(1.0, 0.1)  # light-tailed and short: never worth a buy
    tiny = ExpectedCost(DurationPriors(short, short))
    late = MultiLevelPlanner([s3(step=1.0)], rule=tiny)  # never worth it under the prior...
    late.onset(COMM, healthy_step_s=1.0)
    assert run(late, lambda b: 1.0 if b else 3.0, 40) == [(14, "topology")]  # ...Alg. 1's bound
    last_resort = MultiLevelPlanner([s4(overhead=30.0)], rule=tiny)  # no such bound for S4
    last_resort.onset(COMM, healthy_step_s=1.0)
    assert run(last_resort, lambda b: 1.0 if b else 3.0, 400) == []


def test_waits_for_the_best_buy_unless_a_lesser_one_pays_for_itself_meanwhile():
    # a long communication fail-slow: the restart (no residual) saves the most; a 60 s swap
    # leaving 15% would be paid again by the restart soon after, so it is skipped
    def comm_step(bought: list[str]) -> float:
        return 1.0 if "restart" in bought else 1.3 if "topology" in bought else 3.0

    planner = MultiLevelPlanner([s3(60.0, 1.3), s4(120.0)], rule=AT_SCALE)
    planner.onset(COMM, healthy_step_s=1.0)
    assert run(planner, comm_step, 100) == [(29, "restart")]  # impact 60 = half of 120 s
    published = MultiLevelPlanner([s3(60.0, 1.3), s4(120.0)], rule=BreakEven())
    published.onset(COMM, healthy_step_s=1.0)
    assert [name for _, name in run(published, comm_step, 400)] == ["topology", "restart"]

    # a nearly free S2 is bought at once while the restart is not due yet
    def compute_step(bought: list[str]) -> float:
        return 1.0 if "restart" in bought else 1.2 if bought else 2.0

    planner = MultiLevelPlanner([s2(), s4()], rule=SMALL)
    planner.onset(COMPUTE, healthy_step_s=1.0, age_s=4 * 3600.0)
    bought = run(planner, compute_step, 2000)
    assert bought[0] == (0, "microbatch") and [n for _, n in bought] == ["microbatch", "restart"]


@settings(max_examples=300, deadline=None)
@given(
    overhead=st.floats(1.0, 100.0),
    slow=st.floats(1.1, 4.0),
    steps=st.integers(1, 2000),
    mean_s=st.floats(5.0, 20_000.0),
    age_s=st.floats(0.0, 20_000.0),
)
def test_worst_case_bound_of_one_revertible_option(overhead, slow, steps, mean_s, age_s):
    """Buying at an impact x in [earliest * B, B + one step] costs at most
    max(1 + 1 / earliest, 2 + step excess / B) times the hindsight optimum, whatever the prior."""
    rule = ExpectedCost(DurationPriors(DurationPrior(mean_s), DurationPrior(mean_s)))
    planner = MultiLevelPlanner([s3(overhead, 1.0)], rule=rule, min_gain=0.0)
    planner.onset(COMM, healthy_step_s=1.0, age_s=age_s)
    online, step = 0.0, slow
    for _ in range(steps):
        online += step - 1.0
        for decision in planner.observe(step):
            online += decision.plan.overhead_s
            step = 1.0
    hindsight = min(steps * (slow - 1.0), overhead)
    bound = max(1.0 + 1.0 / rule.earliest, 2.0 + (slow - 1.0) / overhead)
    assert online <= bound * hindsight + 1e-9


def test_config_selects_the_rule_and_its_priors():
    assert isinstance(buy_rule(PlannerConfig(rule="break-even"), 8), BreakEven)
    rule = buy_rule(PlannerConfig(), 1024)
    assert isinstance(rule, ExpectedCost) and rule.earliest == 0.5
    assert rule.priors.communication.mean_s == 72 * 60.0  # by job size when not configured
    tuned = buy_rule(
        PlannerConfig(compute_mean_s=120.0, communication_mean_s=900.0, duration_sigma=0.5), 8
    )
    assert isinstance(tuned, ExpectedCost)
    assert tuned.priors.compute == DurationPrior(120.0, 0.5)
    assert tuned.priors.communication == DurationPrior(900.0, 0.5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"planner.rule": "greedy"}, "'planner.rule' must be one of expected, break-even"),
        ({"planner.earliest": "1.5"}, "'planner.earliest' must be in (0, 1]"),
        ({"planner.earliest": "0"}, "'planner.earliest' must be > 0"),
        ({"planner.compute_mean_s": "-1"}, "'planner.compute_mean_s' must be > 0"),
    ],
)
def test_bad_rule_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert message in str(info.value) and "\n" not in str(info.value)
