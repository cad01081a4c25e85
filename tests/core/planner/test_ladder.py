"""The stop-time ladder (byterobust 4.2): failslow.core.planner.ladder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.planner.ladder import (
    NEEDS_PERSON,
    REATTEMPT,
    REPLAY,
    ROLL_BACK_CODE,
    Ladder,
)


def test_a_repeated_incident_climbs_reattempt_then_code_rollback_then_a_person() -> None:
    ladder = Ladder(reattempts=1, repeat_within=16)
    first = ladder.next(40, "loss is nan at step 40", code_update="update #3: code v2")
    assert (first.name, first.before_step) == (REATTEMPT, 40)
    assert "transient" in first.why and "before step 40" in first.why
    again = ladder.next(41, "loss is nan at step 41", code_update="update #3: code v2")
    assert (again.name, again.before_step) == (ROLL_BACK_CODE, 40)  # the first bad step
    assert "update #3" in again.why and "again after reattempt" in again.why
    last = ladder.next(40, "loss is nan at step 40", code_update=None)
    assert (last.name, last.before_step) == (NEEDS_PERSON, 40)
    assert "reattempt, roll back code" in last.why and "snapshots before step 40" in last.why
    assert [r.name for r in ladder.taken] == [REATTEMPT, ROLL_BACK_CODE, NEEDS_PERSON]


def test_without_a_code_update_the_ladder_ends_after_the_reattempts() -> None:
    ladder = Ladder(reattempts=2)
    names = [ladder.next(10, "nan").name for _ in range(4)]
    assert names == [REATTEMPT, REATTEMPT, NEEDS_PERSON, NEEDS_PERSON]
    assert "no code update to roll back" in ladder.taken[2].why


def test_an_incident_well_past_the_last_one_starts_at_the_bottom_again() -> None:
    ladder = Ladder(reattempts=1, repeat_within=16)
    assert ladder.next(10, "nan").name == REATTEMPT
    assert ladder.next(26, "nan").name == NEEDS_PERSON  # 16 steps on: the same incident
    assert ladder.next(43, "nan").name == REATTEMPT  # 17 on: a new one
    assert ladder.taken[0].before_step == 43


def test_a_launcher_that_can_replay_tries_it_before_a_person() -> None:
    ladder = Ladder(reattempts=1)
    names = [ladder.next(30, "loss 9.1 is 7.0x", replay=True).name for _ in range(4)]
    assert names == [REATTEMPT, REPLAY, NEEDS_PERSON, NEEDS_PERSON]
    assert "silent data corruption" in ladder.taken[1].why and "step 30" in ladder.taken[1].why


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(0, 200), min_size=1, max_size=30),
    reattempts=st.integers(0, 3),
    code=st.booleans(),
    replay=st.booleans(),
)
def test_property_the_ladder_never_loops(
    steps: list[int], reattempts: int, code: bool, replay: bool
) -> None:
    """Within one incident the rungs only go up, at most reattempts + 1 + 1 of them end
    anywhere but a person, and every rung restarts no later than the first bad step."""
    ladder = Ladder(reattempts=reattempts, repeat_within=16)
    order = {REATTEMPT: 0, ROLL_BACK_CODE: 1, REPLAY: 2, NEEDS_PERSON: 3}
    for step in steps:
        rung = ladder.next(step, "nan", code_update="update #1" if code else None, replay=replay)
        taken = ladder.taken
        assert rung is taken[-1]
        assert [order[r.name] for r in taken] == sorted(order[r.name] for r in taken)
        assert sum(r.name != NEEDS_PERSON for r in taken) <= reattempts + int(code) + int(replay)
        assert rung.before_step <= step and rung.before_step == min(
            [step, *(r.before_step for r in taken)]
        )
