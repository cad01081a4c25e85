"""StepProfile: time per micro-batch and the rest of a step, from a rank's own loop."""

from __future__ import annotations

import pytest

from failslow.runtime.step_profile import StepProfile


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _steps(
    profile: StepProfile,
    clock: Clock,
    n: int,
    *,
    m: int,
    tau: float,
    rest: float,
    post: float | None = None,
    pause: float = 0.0,
    units: int | None = None,
) -> None:
    """``n`` steps of ``m`` micro-batches of ``tau`` each, ``rest`` after the last one, then
    (if given) an optimizer step and ``post`` to the boundary."""
    for _ in range(n):
        for _ in range(m):
            profile.micro_batch()
            clock.t += tau
        clock.t += rest
        if post is not None:
            profile.optimizer_step()
            clock.t += post
        end = clock.t
        clock.t += pause  # a validation pause parked the rank at this boundary
        profile.boundary(end, clock.t, units=units)


def test_spacing_and_rest_are_recovered_and_the_low_rest_is_the_one_before_a_wait() -> None:
    clock = Clock()
    profile = StepProfile(window=8, long_window=50, clock=clock)
    profile.boundary(clock.t)
    assert profile.summary() is None
    _steps(profile, clock, 40, m=4, tau=0.05, rest=0.1)
    # now this replica waits 0.4 s per step at the reduction for a slowed one
    _steps(profile, clock, 10, m=4, tau=0.06, rest=0.5, pause=3.0)
    s = profile.summary()
    assert s is not None
    assert s["calls"] == 4 and s["steps"] == 50
    assert s["spacing"] == pytest.approx(0.06)
    assert s["rest"] == pytest.approx(0.5)  # pauses between steps are in no step
    assert s["rest_low"] == pytest.approx(0.1)
    assert s["pre_sd"] == pytest.approx(0.0, abs=1e-9)  # identical steps: no scatter
    _steps(profile, clock, 1, m=4, tau=0.16, rest=0.5)  # one step 0.4 s longer
    s = profile.summary()
    assert s is not None
    # one of 8 steps 0.4 s off: sample standard deviation 0.4 / sqrt(8)
    assert s["work_sd"] == pytest.approx(s["pre_sd"]) == pytest.approx(0.4 / 8**0.5)


def test_a_step_of_one_micro_batch_keeps_the_last_spacing() -> None:
    clock = Clock()
    profile = StepProfile(clock=clock)
    profile.boundary(clock.t)
    _steps(profile, clock, 3, m=3, tau=0.2, rest=0.3)
    _steps(profile, clock, 5, m=1, tau=0.2, rest=0.3)
    s = profile.summary()
    assert s is not None and s["calls"] == 1
    assert s["spacing"] == pytest.approx(0.2) and s["rest"] == pytest.approx(0.3)


def test_steps_without_micro_batches_are_not_measured() -> None:
    clock = Clock()
    profile = StepProfile(clock=clock)
    for _ in range(5):
        clock.t += 1.0
        profile.boundary(clock.t)  # an adapter that announces no micro-batch
    assert profile.summary() is None


def test_the_optimizer_step_splits_the_rest_and_a_throttled_rank_gets_its_mean_gap() -> None:
    clock = Clock()
    profile = StepProfile(window=4, long_window=20, clock=clock)
    profile.boundary(clock.t)
    _steps(profile, clock, 10, m=3, tau=0.1, rest=0.05, post=0.02)
    _steps(profile, clock, 4, m=3, tau=0.1, rest=0.05, post=0.3)  # waits after the optimizer
    s = profile.summary()
    assert s is not None
    assert s["rest"] == pytest.approx(0.05) and s["post"] == pytest.approx(0.3)
    assert s["post_low"] == pytest.approx(0.02) and s["rest_low"] == pytest.approx(0.05)
    # bimodal gaps (stopped part of the time): the mean, not the median, is the time per call
    for gaps in ([0.02, 0.02, 0.2], [0.02, 0.2, 0.02], [0.2, 0.02, 0.02], [0.02, 0.02, 0.2]):
        for gap in gaps:
            profile.micro_batch()
            clock.t += gap
        profile.micro_batch()
        clock.t += 0.08 + 0.05  # the last micro-batch, then the rest
        profile.boundary(clock.t)
    s = profile.summary()
    assert s is not None and s["calls"] == 4
    assert s["spacing"] == pytest.approx(0.08) and s["rest"] == pytest.approx(0.05)
    assert s["post"] == 0.0  # no optimizer step announced: the whole rest is before it


def test_a_loop_that_waits_at_every_micro_batch_is_measured_by_its_own_work() -> None:
    """Lightning broadcasts from rank 0 before every batch: a healthy replica waits there for
    a slowed one at every micro-batch. With the ends of the micro-batches' own work stamped,
    its time per call is that work (0.05 s), not the gap between starts (0.2 s); the last
    micro-batch's (its backward holds the reduction) is left out. Without the ends: the gap."""
    for stamped, want in ((True, 0.05), (False, 0.2)):
        clock = Clock()
        profile = StepProfile(window=8, clock=clock)
        profile.boundary(clock.t)
        for _ in range(5):
            for i in range(4):
                profile.micro_batch()
                clock.t += 0.05 if i < 3 else 0.3  # the last: its backward waits to reduce
                if stamped:
                    profile.micro_batch_end()
                clock.t += 0.15 if i < 3 else 0.0  # the next batch's broadcast waits
            profile.boundary(clock.t)
        s = profile.summary()
        assert s is not None and s["spacing"] == pytest.approx(want), (stamped, s)


def test_blocks_keep_a_replicas_parts_from_before_it_began_to_wait() -> None:
    """The long window's medians by blocks of steps with one count: a planner reads a waiting
    replica's typical parts (not a low quantile) from before the slowdown; a block cut short
    by a count change (calls, or units under the same calls: S2's size form) is kept from
    MIN_BLOCK steps on, shorter ones are dropped."""
    from failslow.runtime.step_profile import BLOCK_STEPS, MIN_BLOCK

    clock = Clock()
    profile = StepProfile(window=8, long_window=4 * BLOCK_STEPS, clock=clock)
    profile.boundary(clock.t)
    _steps(profile, clock, 2 * BLOCK_STEPS, m=4, tau=0.05, rest=0.1, post=0.02, units=4)
    # from here the replica runs faster micro-batches and waits 0.4 s at the reduction
    wait = {"tau": 0.04, "rest": 0.5, "post": 0.02}
    _steps(profile, clock, BLOCK_STEPS, m=4, units=4, **wait)
    _steps(profile, clock, MIN_BLOCK - 1, m=5, units=5, **wait)  # dropped
    _steps(profile, clock, MIN_BLOCK, m=4, units=5, **wait)  # kept: 4 calls, 5 units
    _steps(profile, clock, 1, m=4, units=4, **wait)  # closes the one before
    s = profile.summary()
    assert s is not None and s["units"] == 4
    healthy = [BLOCK_STEPS, 4, 0.05, 0.1, 0.02, 4 * 0.05 + 0.1 + 0.02, 4]
    waiting = [4, 0.04, 0.5, 0.02, 4 * 0.04 + 0.5 + 0.02]
    got = s["blocks"]
    assert [b[0] for b in got] == [BLOCK_STEPS, BLOCK_STEPS, BLOCK_STEPS, MIN_BLOCK]
    assert got[0] == pytest.approx(healthy) and got[1] == pytest.approx(healthy)
    assert got[2] == pytest.approx([BLOCK_STEPS, *waiting, 4])
    assert got[3] == pytest.approx([MIN_BLOCK, *waiting, 5])
    # the long window holds 4 blocks at most: the oldest go
    _steps(profile, clock, 2 * BLOCK_STEPS, m=4, units=4, **wait)
    s = profile.summary()
    assert s is not None and len(s["blocks"]) == 4
    assert s["blocks"][0] == pytest.approx([BLOCK_STEPS, *waiting, 4])
