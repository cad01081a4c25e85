"""DutyCycleThrottle stops its target for part of the time, says how much it did, and always
leaves it running - also when the process that started it dies."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from failslow.faults import DutyCycleThrottle


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    """Running or stopped - not gone, not a zombie waiting for a reaper."""
    try:
        return _state(pid) != "Z"
    except FileNotFoundError:
        return False


def test_throttle_stops_and_always_continues() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        throttle = DutyCycleThrottle(proc.pid, stopped_fraction=0.5, period_s=0.05)
        seen = set()
        with throttle:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and seen != {"T", "R"}:
                seen.add(_state(proc.pid))
                time.sleep(0.003)
        assert "T" in seen  # it was stopped at times
        time.sleep(0.05)
        assert _state(proc.pid) in ("R", "S")  # and left running after the throttle ended
        assert throttle.started_ns is not None
        assert throttle.stopped_ns is not None
        assert throttle.stopped_ns > throttle.started_ns
    finally:
        proc.kill()
        proc.wait()


def test_the_throttle_reports_what_it_did() -> None:
    """The helper's own account: stopped about the set fraction (its windows are timed from the
    stopped time the target really had, so late wake-ups are made up), how it was scheduled."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        throttle = DutyCycleThrottle(proc.pid, stopped_fraction=0.75, period_s=0.02)
        with throttle:
            assert throttle.active
            time.sleep(1.0)
        assert not throttle.active
        throttle.stop()  # a second stop changes nothing
        assert throttle.scheduling in ("SCHED_FIFO", "normal")
        assert throttle.achieved is not None and abs(throttle.achieved - 0.75) < 0.1
        assert throttle.longest_run_s is not None and throttle.longest_run_s > 0
        assert _state(proc.pid) in ("R", "S")
    finally:
        proc.kill()
        proc.wait()


ORPHAN = r"""
import os, sys, time
from failslow.faults import DutyCycleThrottle
throttle = DutyCycleThrottle(int(sys.argv[1]), stopped_fraction=0.9, period_s=0.05)
throttle.start()
print(throttle._helper.pid, flush=True)
time.sleep(0.3)
os._exit(0)  # dies without stopping its throttle
"""


def test_a_throttle_whose_starter_died_leaves_the_target_running() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        starter = subprocess.run(
            [sys.executable, "-c", ORPHAN, str(proc.pid)],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        helper = int(starter.stdout.split()[0])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(helper):
            time.sleep(0.05)
        assert not _alive(helper)  # the helper saw its parent go and ended
        states = set()
        for _ in range(20):  # running, every time it is looked at
            states.add(_state(proc.pid))
            time.sleep(0.01)
        assert states <= {"R", "S"}, states
    finally:
        proc.kill()
        proc.wait()


def test_throttle_of_a_vanished_process_ends_quietly() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with DutyCycleThrottle(proc.pid, stopped_fraction=0.3, period_s=0.02):
        time.sleep(0.05)


@pytest.mark.parametrize(("fraction", "period"), [(0.0, 0.1), (1.0, 0.1), (0.5, 0.0)])
def test_bad_settings(fraction: float, period: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        DutyCycleThrottle(1, stopped_fraction=fraction, period_s=period)


SELF = r"""
import sys, time
from failslow.faults import throttle_self
def spin(seconds):
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
    return n
before = spin(0.5)
throttle = throttle_self(0.75, 0.01)
during = spin(0.5)
throttle.stop()
after = spin(0.5)
print(before, during, after)
"""


def test_throttle_self_slows_the_caller_until_stopped() -> None:
    out = subprocess.run([sys.executable, "-c", SELF], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, during, after = map(int, out.stdout.split())
    # 75% stopped: about a quarter of the work per wall second (loaded machine: only < 0.6x).
    assert during < 0.6 * before, (before, during, after)
    assert after > 1.5 * during, (before, during, after)
