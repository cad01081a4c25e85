"""When a mitigation demo run with ``until_mitigated`` (the e2e tests', the benchmarks') ends:
once the slowdown is over and the even split has been back ``until_mitigated`` steps - after
the walk back, or after a revert during the slowdown when the closed loop measured the plan
short of its promise. Under a CPU hog the latter left the run waiting for a walk back that
could not come, until ``max_steps`` (1,496 steps, 770 s in an e2e test)."""

from __future__ import annotations

from typing import Any

from failslow.demo.mitigation import MitigationDemoOptions, Run, _end_due, _release_due


def _action(
    action: str, step: int, committed: bool = True, reason: str = "fail-slow relieved"
) -> dict[str, Any]:
    return {"action": action, "apply_step": step, "committed": committed, "reason": reason}


def _run(step: int, actions: list[dict[str, Any]]) -> Run:
    opts = MitigationDemoOptions(steps=140, slow_start=50, slow_end=100, until_mitigated=20)
    return Run(opts, step=step, injected=(50, 100), actions=actions)


def test_the_walk_back_after_the_release_ends_the_run_that_many_steps_later() -> None:
    actions = [_action("apply", 60), _action("revert", 125)]
    assert not _end_due(_run(144, actions), None)
    assert _end_due(_run(145, actions), None)


def test_a_plan_reverted_during_the_slowdown_ends_the_run_after_the_release() -> None:
    actions = [_action("apply", 59), _action("revert", 71)]  # did not pay
    assert not _end_due(_run(119, actions), None)
    assert _end_due(_run(140, actions), None)  # steps: the earliest end


def test_a_split_in_effect_or_none_bought_keeps_the_run_going() -> None:
    in_effect = [_action("apply", 59), _action("revert", 71), _action("apply", 90)]
    assert not _end_due(_run(400, in_effect), None)
    refused = [_action("apply", 60, committed=False)]
    assert not _end_due(_run(400, refused), None)
    assert _end_due(_run(1495, in_effect), None)  # max_steps bounds it


def test_the_release_waits_for_a_plan_in_effect_not_for_a_revert_that_claims_relief() -> None:
    """The throttle ends at ``slow_end`` once the first plan has been in effect
    ``until_mitigated`` steps - unless the split was reverted as "relieved" while the rank was
    still throttled (a re-validation under a CPU hog): then not before the controller planned
    again. A revert that did not pay is the closed loop's verdict and releases."""
    plan = [_action("apply", 60, reason="expected saving 40 s")]
    assert not _release_due(_run(99, plan)) and _release_due(_run(100, plan))
    assert not _release_due(_run(100, [_action("apply", 85, reason="expected saving 40 s")]))
    relieved = [*plan, _action("revert", 99)]
    assert not _release_due(_run(120, relieved))
    assert _release_due(_run(130, [*relieved, _action("apply", 110, reason="again")]))
    short = [*plan, _action("revert", 99, reason="did not pay: measured 0.3 s")]
    assert _release_due(_run(100, short))
    assert _release_due(_run(750, relieved))  # max_steps / 2 bounds the wait
