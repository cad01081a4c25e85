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
from collections.abc import Iterator
from pathlib import Path

import pytest

from failslow.core.control.journal import event
from failslow.node.decline import DeclineWatch
from failslow.node.launcher import decline_trigger
from failslow.node.ranks import LocalRanks, RankOptions

pytestmark = pytest.mark.timeout(120)

SLOW = 2
RANK = textwrap.dedent(
    """
    import os, time

    def slow_data_loader():
        time.sleep(0.05)

    def wait_for_peers():
        time.sleep(0.05)

    slow = os.environ.get("RANK") == os.environ["SLOW_RANK"]
    deadline = time.monotonic() + float(os.environ.get("LIVE_S", "90"))
    while time.monotonic() < deadline:
        slow_data_loader() if slow else wait_for_peers()
    """
)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[dict[int, int]]:
    pytest.importorskip("failslow.node.stacks").py_spy()  # a test dependency
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    procs = {
        r: subprocess.Popen([sys.executable, str(script)],
                            env={**os.environ, "RANK": str(r), "SLOW_RANK": str(SLOW)})
        for r in range(4)
    }  # fmt: skip
    yield {r: p.pid for r, p in procs.items()}
    for p in procs.values():
        p.kill()
        p.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_five_rounds_flag_the_slow_rank_and_name_it_for_eviction(
    ranks: dict[int, int], tmp_path: Path
) -> None:
    clock, said = Clock(), []
    watch = DeclineWatch(every_s=10.0, rounds=5, state_dir=tmp_path, say=said.append, clock=clock)
    assert watch.check(ranks) is None and not watch.active  # not triggered: nothing done
    assert not (tmp_path / "declines.jsonl").exists()
    watch.trigger("the step time is up and every rank is healthy")
    found = []
    for _ in range(5):
        found.append(watch.check(ranks))
        assert watch.check(ranks) is None  # the next round is 10 s later
        clock.now += 10.0
    assert found[:4] == [None] * 4 and found[4] == [SLOW], said
    lines = [json.loads(x) for x in (tmp_path / "declines.jsonl").read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3, 4, 5]
    assert all(line["flagged"] == ["ranks", [SLOW]] for line in lines), lines
    assert "slow_data_loader" in json.dumps(lines[0]["groups"])
    assert "evicting ranks [2]" in said[-1] and not watch.active


def test_a_relief_or_a_localized_diagnosis_cancels_the_rounds(ranks: dict[int, int]) -> None:
    """Through the controller's observer: a healthy round for a new onset triggers, a recheck
    does not; a relief cancels; a diagnosis (the fail-slow path localized it) cancels."""

    class Ranks:
        decline_watch = DeclineWatch(every_s=10.0, rounds=5, say=lambda _: None, clock=Clock())

    observe, watch = decline_trigger(Ranks), Ranks.decline_watch
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": True}))
    assert not watch.active  # a recheck while a plan is in effect is the mitigator's
    observe(event("state", state="diagnosed", detail={"healthy": False, "recheck": False}))
    assert not watch.active
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": False}))
    assert watch.active and watch.check(ranks) is None  # round 1
    observe(event("onset", type="relief", rank=0))
    assert watch.check(ranks) is None and not watch.active
    observe(event("state", state="diagnosed", detail={"healthy": True, "recheck": False}))
    assert watch.check(ranks) is None and watch.active
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
                    decline_every_s=0.2, warm=False),
        say=lambda _: None,
    )  # fmt: skip
    env = {**os.environ, "SLOW_RANK": str(SLOW), "FAILSLOW_STATE_DIR": str(tmp_path / "state")}
    try:
        group = launcher.spawn([str(script)], env, str(tmp_path))
        decline_trigger(launcher)(
            event("state", state="diagnosed", detail={"healthy": True, "recheck": False})
        )
        status = group.wait(timeout=100)
    finally:
        launcher.close()
    [stop] = launcher.failstops
    assert (stop.rank, stop.slot, stop.cause, stop.replaced_by) == (SLOW, SLOW, "declined", 4)
    assert status == stop.status and "slows the job" in stop.describe()
    rounds = (tmp_path / "state" / "declines.jsonl").read_text().splitlines()
    assert len(rounds) == 5
