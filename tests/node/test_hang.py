"""Hang detection from the ranks' rings (failslow.node.hang.HangWatch): real ring files written
by the ring writer, a clock the test moves, and - for the look itself - real processes dumped
with py-spy. A job that has not started, that progresses, or whose ranks are parked in a
validation pause is not hung; a quiet one is looked at once per ``hang_after_s``, and acted on
only when its stacks name someone."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from failslow.core.events import OpCode
from failslow.core.ring import RingWriter, ring_path
from failslow.node.hang import HangWatch

pytestmark = pytest.mark.timeout(120)

LOOP = textwrap.dedent(
    """
    import sys, time
    def wait_in_collective():
        while True: time.sleep(0.05)
    def injected_hang():
        while True: time.sleep(0.05)
    print("ready", flush=True)
    (injected_hang if sys.argv[1] == "stuck" else wait_in_collective)()
    """
)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def ranks():
    procs = []
    for role in ("ok", "stuck", "ok", "ok"):
        p = subprocess.Popen([sys.executable, "-c", LOOP, role], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().startswith("ready")
        procs.append(p)
    yield {rank: p.pid for rank, p in enumerate(procs)}
    for p in procs:
        p.kill()
        p.wait()


def _rings(ring_dir: Path, pids: dict[int, int]) -> dict[int, RingWriter]:
    return {
        r: RingWriter(ring_path(ring_dir, r, pid, "py"), capacity=64) for r, pid in pids.items()
    }


def _record(writer: RingWriter, op: int = OpCode.ALLREDUCE) -> None:
    writer.write(t_start_ns=1, t_end_ns=2, nbytes=8, group_key=1, op=op)


def test_a_quiet_job_is_looked_at_and_its_odd_stack_evicted(tmp_path: Path, ranks) -> None:
    said: list[str] = []
    clock = Clock()
    rings = _rings(tmp_path, ranks)
    watch = HangWatch(tmp_path, 5.0, tmp_path / "state", say=said.append, clock=clock)
    assert watch.check(ranks) is None  # nothing written yet: training has not started
    for writer in rings.values():
        _record(writer)  # start-up collectives (a restore's agreement, say), then quiet
    clock.now += 60
    assert watch.check(ranks) is None  # no optimizer step finished yet: not armed
    for _ in range(3):  # training: every rank commits collectives and ends its steps
        for writer in rings.values():
            _record(writer)
            _record(writer, OpCode.STEP)
        clock.now += 1
        assert watch.check(ranks) is None
    clock.now += 4.9
    assert watch.check(ranks) is None  # quiet, not yet for 5 s
    rings[2].set_header_word("parked", 7)  # a validation pause parks the ranks
    clock.now += 10
    assert watch.check(ranks) is None
    rings[2].set_header_word("parked", 0)
    clock.now += 5.1
    assert watch.check(ranks) == [1]  # quiet for 5.1 s: rank 1's stack stands alone
    assert "outliers [1]" in said[-1] and "evicting ranks [1]" in said[-1]
    [line] = (tmp_path / "state" / "hangs.jsonl").read_text().splitlines()
    look = json.loads(line)
    assert look["outliers"] == [1] and look["quiet_s"] == pytest.approx(5.1)
    assert "injected_hang" in next(g for g in look["groups"] if g["healthy"] is False)["signature"]
    for writer in rings.values():
        writer.close()


def test_a_quiet_job_whose_stacks_all_agree_is_watched_on(tmp_path: Path, ranks) -> None:
    said: list[str] = []
    clock = Clock()
    alike = {r: pid for r, pid in ranks.items() if r != 1}
    rings = _rings(tmp_path, alike)
    for writer in rings.values():
        _record(writer, OpCode.STEP)
    watch = HangWatch(tmp_path, 5.0, say=said.append, clock=clock)
    assert watch.check(alike) is None
    clock.now += 6
    assert watch.check(alike) is None and "nothing stands out - watching on" in said[-1]
    clock.now += 1
    assert watch.check(alike) is None and len(said) == 1  # the next look is 5 s later
    clock.now += 5
    assert watch.check(alike) is None and len(said) == 2
    for writer in rings.values():
        writer.close()
