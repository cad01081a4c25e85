"""An unexplained slowdown localized by rounds of stack aggregation (byterobust 5.1, MFU decline):
failslow.node.decline.DeclineWatch, its trigger from the controller's events
(failslow.node.launcher.decline_trigger) and the eviction through the node's rank launcher.

Real processes dumped by real py-spy: four "ranks" of which one spends its time in a slow data
loader while the others wait for it (``wait_for_peers``) - a slowdown the validation round's
GEMM and link tests would not see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from failslow.core.control.journal import event
from failslow.node.decline import DeclineWatch
from failslow.node.launcher import decline_trigger
from failslow.node.ranks import LocalRanks, RankOptions

pytestmark = pytest.mark.timeout(180)

SLOW = 2
RANK = textwrap.dedent(
    """
    import os, pathlib, time

    def slow_data_loader():
        time.sleep(0.05)

    def wait_for_peers():
        time.sleep(0.05)

    slow = os.environ.get("RANK") == os.environ["SLOW_RANK"]
    ready = os.environ.get("READY_DIR")
    if ready:
        pathlib.Path(ready, os.environ["RANK"]).touch()
    deadline = time.monotonic() + float(os.environ.get("LIVE_S", "150"))
    while time.monotonic() < deadline:
        slow_data_loader() if slow else wait_for_peers()
    """
)
BEFORE, AFTER = 0.10, 0.30
"""The onset's levels the watch is triggered with (seconds per step)."""


def _start_ranks(tmp_path: Path, slow: int) -> dict[int, subprocess.Popen[bytes]]:
    """Four rank processes, returned once each is in its loop (a dump of one still starting
    would show the interpreter's start-up, not the loop)."""
    script, ready = tmp_path / "rank.py", tmp_path / "ready"
    script.write_text(RANK)
    ready.mkdir()
    env = {**os.environ, "SLOW_RANK": str(slow), "READY_DIR": str(ready)}
    procs = {
        r: subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)})
        for r in range(4)
    }
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


@pytest.fixture
def ranks(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[int, int]]:
    pytest.importorskip("failslow.node.stacks").py_spy()  # a test dependency
    procs = _start_ranks(tmp_path, getattr(request, "param", SLOW))
    yield {r: p.pid for r, p in procs.items()}
    for p in procs.values():
        p.kill()
        p.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watch(tmp_path: Path | None, clock: Clock, said: list[str], **kw: object) -> DeclineWatch:
    options = {"every_s": 10.0, "rounds": 5, "samples": 3, "sample_gap_s": 0.25, "settle_s": 0.0}
    watch = DeclineWatch(state_dir=tmp_path, say=said.append, clock=clock, **{**options, **kw})
    watch.reset()
    return watch


def _run(watch: DeclineWatch, ranks: dict[int, int], clock: Clock) -> tuple[list[int] | None, int]:
    """Call the watch as the launcher's loop does (time moving 0.25 s per call) until its
    rounds end; returns what it named and how many calls returned None first."""
    for calls in range(1000):
        found = watch.check(ranks)
        if found is not None or not watch.active:
            return found, calls
        clock.now += 0.25
    raise AssertionError("the rounds did not end")


def test_rounds_of_samples_flag_the_slow_rank_and_name_it_for_eviction(
    ranks: dict[int, int], tmp_path: Path
) -> None:
    clock, said = Clock(), []
    watch = _watch(tmp_path, clock, said, step_time=lambda: AFTER)
    assert watch.check(ranks) is None and not watch.active  # not triggered: nothing done
    assert not (tmp_path / "declines.jsonl").exists()
    watch.trigger("the step time is up and every rank is healthy", BEFORE, AFTER)
    found, calls = _run(watch, ranks, clock)
    assert found == [SLOW], said
    assert calls >= 4 * 40  # five rounds, 10 s apart at 0.25 s per call
    lines = [json.loads(x) for x in (tmp_path / "declines.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3, 4, 5]
    assert all(len(line["samples"]) == 3 for line in lines)
    assert sum(line["flagged"] == ["ranks", [SLOW]] for line in lines) >= 3, lines
    assert "slow_data_loader" in json.dumps(lines[0]["samples"])
    assert "evicting ranks [2]" in said[-1] and not watch.active


def test_a_slowdown_gone_by_the_end_of_the_rounds_evicts_nobody(
    ranks: dict[int, int], tmp_path: Path
) -> None:
    """The slow rank stands out in every round, but the node's step time is back near its old
    level (a restart's warm-up, a transient): nobody is evicted."""
    clock, said = Clock(), []
    watch = _watch(tmp_path, clock, said, rounds=2, samples=2, step_time=lambda: 0.12)
    watch.trigger("up", BEFORE, AFTER)
    assert _run(watch, ranks, clock)[0] is None and not watch.active
    assert "the step time came back (0.120 s, 0.100 s before the onset)" in said[-1], said
    assert "nothing evicted" in said[-1] and "ranks [2]: 2" in said[-1]


@pytest.mark.parametrize("ranks", [-1], indirect=True)
def test_no_group_standing_out_is_tried_again_then_left_to_a_person(
    ranks: dict[int, int],
) -> None:
    """Every rank shows the same stack while the step time stays up: another tally, then a
    person - never an eviction on nothing."""
    clock, said = Clock(), []
    watch = _watch(None, clock, said, rounds=2, samples=2, attempts=2, step_time=lambda: AFTER)
    watch.trigger("up", BEFORE, AFTER)
    assert _run(watch, ranks, clock)[0] is None and not watch.active
    assert any("another 2 rounds (attempt 2 of 2)" in s for s in said), said
    assert said[-1].startswith("decline: needs a person") and "2 x 2 rounds" in said[-1]


def test_a_trigger_in_a_launch_s_first_seconds_waits_for_it_to_settle() -> None:
    clock, said = Clock(), []
    watch = _watch(None, clock, said, settle_s=15.0)
    watch.trigger("up", BEFORE, AFTER)
    clock.now += 5.0
    assert watch.check({}) is None and watch.active and not said  # waits, kept
    clock.now += 10.0
    watch.cancel()  # the step time came back before it settled: forgotten
    assert watch.check({}) is None and not watch.active and not said


def test_the_controller_s_events_trigger_and_cancel_the_rounds(ranks: dict[int, int]) -> None:
    """Through the controller's observer: a healthy round for a new onset triggers with that
    onset's levels, a recheck does not; a relief cancels; a diagnosis (the fail-slow path
    localized it) cancels."""
    clock, said = Clock(), []

    class Ranks:
        decline_watch = _watch(None, clock, said, rounds=1, samples=1, step_time=lambda: 0.2)

    observe, watch = decline_trigger(Ranks), Ranks.decline_watch
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": True}))
    assert not watch.active  # a recheck while a plan is in effect is the mitigator's
    observe(event("state", state="diagnosed", detail={"healthy": False, "recheck": False}))
    assert not watch.active
    observe(event("onset", type="onset", rank=0, before_s=0.1, after_s=0.4))
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": False}))
    assert watch.active and watch.check(ranks) is None  # one round of one sample, then decided
    assert "the step time came back (0.200 s, 0.100 s before the onset)" in said[-1], said
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": False}))
    observe(event("onset", type="relief", rank=0))
    assert watch.check(ranks) is None and not watch.active
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": False}))
    observe(event("diagnosis", diagnosis={"kind": "compute"}))
    assert watch.check(ranks) is None and not watch.active


def test_the_launcher_evicts_the_flagged_rank_onto_a_standby(tmp_path: Path) -> None:
    """The node's rank launcher (``--decline-every``): the controller's healthy round starts
    the watch, the launcher's loop runs the rounds, the flagged rank is a fail-stop with cause
    ``declined`` whose slot moves to the standby, and the launch ends for the restart."""
    pytest.importorskip("failslow.node.stacks").py_spy()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    launcher = LocalRanks(
        RankOptions(nproc=4, standbys=1, preload=("colorsys",), refill_delay_s=0.0,
                    decline_every_s=0.2, decline_settle_s=1.0, warm=False),
        say=lambda _: None,
    )  # fmt: skip
    env = {**os.environ, "SLOW_RANK": str(SLOW), "FAILSLOW_STATE_DIR": str(tmp_path / "state")}
    try:
        group = launcher.spawn([str(script)], env, str(tmp_path))
        launcher.decline_watch.samples = 2  # the launcher's loop ticks every ~0.5 s
        decline_trigger(launcher)(
            event("state", state="diagnosed", detail={"healthy": True, "recheck": False})
        )
        status = group.wait(timeout=150)
    finally:
        launcher.close()
    [stop] = launcher.failstops
    assert (stop.rank, stop.slot, stop.cause, stop.replaced_by) == (SLOW, SLOW, "declined", 4)
    assert status == stop.status and "slows the job" in stop.describe()
    rounds = (tmp_path / "state" / "declines.jsonl").read_text().splitlines()
    assert len(rounds) == 5
