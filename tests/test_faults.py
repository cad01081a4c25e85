"""DutyCycleThrottle stops its target for part of the time and always leaves it running."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from failslow.faults import DutyCycleThrottle


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


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
