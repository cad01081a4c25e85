"""The stop-time ladder (byterobust 4.2): failslow.core.planner.ladder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from failslow.core.planner.ladder import (
    DIAGNOSE,
    EVICT,
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


def test_a_new_incident_is_diagnosed_first_and_clean_checks_go_on_to_reattempt() -> None:
    """byterobust 4.2: the stop-time checks come before the reattempt, once per incident."""
    ladder = Ladder(reattempts=1)
    first = ladder.next(20, "rank 1: loss is nan", code_update="update #2: v2", diagnose=True)
    assert (first.name, first.before_step) == (DIAGNOSE, 20)
    assert "bitwise alignment" in first.why
    clean = ladder.diagnosed([], "every machine passed")
    assert clean.name == REATTEMPT and "every machine passed the stop-time checks" in clean.why
    again = ladder.next(21, "rank 1: loss is nan", code_update="update #2: v2", diagnose=True)
    assert again.name == ROLL_BACK_CODE  # the same incident: no second diagnosis
    assert "again after diagnose, reattempt" in again.why
    assert ladder.next(60, "nan", diagnose=True).name == DIAGNOSE  # a new incident


def test_machines_the_checks_name_are_evicted_and_that_counts_as_the_restart() -> None:
    """"training crashes again after machine eviction" goes on to the rollback (4.2)."""
    ladder = Ladder(reattempts=1)
    assert ladder.next(30, "loss 9.1 is 7.0x", diagnose=True, replay=True).name == DIAGNOSE
    evict = ladder.diagnosed([2], "machine 2 computes the reference step differently")
    assert (evict.name, evict.before_step) == (EVICT, 30)
    assert "machine(s) [2]" in evict.why and "computes the reference" in evict.why
    assert ladder.next(31, "loss 9.1 is 7.0x", diagnose=True, replay=True).name == REPLAY


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(0, 200), min_size=1, max_size=30),
    reattempts=st.integers(0, 3),
    code=st.booleans(),
    replay=st.booleans(),
    diagnose=st.booleans(),
    named=st.lists(st.booleans(), max_size=30),
)
def test_property_the_ladder_never_loops(
    steps: list[int], reattempts: int, code: bool, replay: bool, diagnose: bool,
    named: list[bool],
) -> None:  # fmt: skip
    """Within one incident the rungs only go up (diagnose first, at most once; an eviction
    counts as a restart), at most 1 + reattempts + 1 + 1 of them end anywhere but a person,
    and every rung restarts no later than the first bad step."""
    ladder = Ladder(reattempts=reattempts, repeat_within=16)
    order = {DIAGNOSE: -2, EVICT: -1, REATTEMPT: 0, ROLL_BACK_CODE: 1, REPLAY: 2, NEEDS_PERSON: 3}
    for i, step in enumerate(steps):
        update = "update #1" if code else None
        rung = ladder.next(step, "nan", code_update=update, replay=replay, diagnose=diagnose)
        if rung.name == DIAGNOSE:
            rung = ladder.diagnosed([1] if i < len(named) and named[i] else [], "checks")
        taken = ladder.taken
        assert rung is taken[-1]
        assert [order[r.name] for r in taken] == sorted(order[r.name] for r in taken)
        assert [r.name for r in taken].count(DIAGNOSE) <= 1
        restarts = sum(r.name in (REATTEMPT, EVICT) for r in taken)
        assert restarts <= max(reattempts, 1 if EVICT in [r.name for r in taken] else 0)
        acted = sum(r.name not in (NEEDS_PERSON, DIAGNOSE) for r in taken)
        assert acted <= max(reattempts, 1) + int(code) + int(replay)
        assert rung.before_step <= step and rung.before_step == min(
            [step, *(r.before_step for r in taken)]
        )
