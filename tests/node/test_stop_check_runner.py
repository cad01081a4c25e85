"""The stop-time checks on the node's machines (failslow.node.stop_checks,
failslow.runtime.stop_check, LocalRanks.spawn_check; byterobust 4.2 "Diagnose").

Real processes on the launcher's slots, a real gloo world of their own, the real tests (a GEMM
against float64, a link ring, a reference training step's digest). A faulty machine is made
through the plugin API, as a user's plugin would reach these processes: ``$FAILSLOW_PLUGINS``
names a module whose ``failslow_stop_check_start`` makes ``nn.functional.linear`` 8x too large
on the slots in ``BAD_SLOTS`` (a defective device) or ends the process on ``CRASH_SLOTS``. The
DeepSpeed job whose machine is named and evicted is in tests/e2e/test_failstop.py."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from failslow.node import stop_checks
from failslow.node.ranks import LocalRanks, RankOptions

pytestmark = pytest.mark.timeout(180)

PLUGIN = textwrap.dedent(
    """
    import json, os
    import failslow

    @failslow.hookimpl
    def failslow_stop_check_start(rank, incident):
        assert incident == {"step": 12, "why": "loss is nan"}
        assert "FAILSLOW_RING_DIR" not in os.environ and "FAILSLOW_STORE" not in os.environ
        slot = int(os.environ["FAILSLOW_SLOT"])
        with open(os.path.join(os.environ["PIDS"], str(os.getpid())), "w"):
            pass
        if slot in json.loads(os.environ.get("CRASH_SLOTS", "[]")):
            os._exit(3)
        if slot in json.loads(os.environ.get("BAD_SLOTS", "[]")):
            from failslow.demo.fault_plugin import corrupt_linear
            corrupt_linear()
    """
)


def _checks(
    tmp_path: Path, bad: list[int] = (), crash: list[int] = (), warm: bool = False
) -> stop_checks.CheckOutcome:
    """``warm``: the launcher keeps warm processes for the checks (``check_spares``), and the
    checks must run in them."""
    ranks = LocalRanks(
        RankOptions(nproc=4, standbys=1, preload=("colorsys",), refill_delay_s=0.0,
                    slots_as_hosts=True, check_spares=warm),
        say=lambda _: None,
    )  # fmt: skip
    pids = tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "stop_check_fault.py").write_text(PLUGIN)
    (tmp_path / "job.py").write_text("")
    state = tmp_path / "state"
    env = {
        **os.environ, "FAILSLOW_STATE_DIR": str(state), "FAILSLOW_PLUGINS": "stop_check_fault",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "FAILSLOW_STORE": "tcp://127.0.0.1:1", "FAILSLOW_RING_DIR": str(tmp_path / "rings"),
        "BAD_SLOTS": json.dumps(list(bad)), "CRASH_SLOTS": json.dumps(list(crash)),
        "PIDS": str(pids),
    }  # fmt: skip
    spares: set[int] = set()
    try:
        assert ranks.spawn([str(tmp_path / "job.py")], env, str(tmp_path)).wait(timeout=60) == 0
        deadline = time.monotonic() + 120
        while warm and ranks.ready_spares(checks=True) < 4 and time.monotonic() < deadline:
            ranks.tick()  # the job's spares first, then the checks', one at a time
            time.sleep(0.05)
        if warm:
            assert ranks.ready_spares() == 4 and ranks.ready_spares(checks=True) == 4
            spares = {w.process.pid for w in ranks._check_pool}
        outcome = stop_checks.run(ranks, env, incident={"step": 12, "why": "loss is nan"},
                                  state_dir=state, timeout_s=120, say=lambda _: None)  # fmt: skip
        if outcome.suspects:  # what the launcher does with them
            stop = ranks.evict(outcome.suspects[0], "checks")
            assert stop.replaced_by == 4 and "failed the stop-time checks" in stop.describe()
    finally:
        ranks.close()
    if warm:  # each machine's checks ran in a warm process started before them
        assert {int(p.name) for p in pids.iterdir()} == spares
    assert not list((state / "stop-checks").glob("*.json")), "results are taken as read"
    assert not (tmp_path / "rings").exists(), "the checks wrote rings into the job's"
    return outcome


def test_every_machine_passes_on_a_healthy_node_in_warm_check_processes(tmp_path: Path) -> None:
    outcome = _checks(tmp_path, warm=True)
    assert outcome.suspects == [] and outcome.status == 0, outcome.why
    assert "every machine passed" in outcome.why
    rows = outcome.table
    assert [row["verdict"] for row in rows] == ["pass"] * 4
    assert len({row["digest"] for row in rows}) == 1  # bitwise the same step on each machine
    assert all(row["link"] == "ok" and row["device_error"] < 1e-5 for row in rows)


def test_a_bad_matmul_is_named_by_the_bitwise_alignment_step_and_a_crash_by_its_silence(
    tmp_path: Path,
) -> None:
    """Machine 1's GEMM (``torch.mm``) is right: only the reference step, through
    ``nn.Linear``, shows its fault - why byterobust runs it after the device tests pass.
    Machine 2 dies in its own tests: named, and its peers, whose link test waits for it, are
    stopped once they reported theirs (not after the link test's timeout)."""
    outcome = _checks(tmp_path, bad=[1], crash=[2])
    assert outcome.suspects == [1, 2], outcome.why
    assert "machine 1 computes the reference step differently" in outcome.why
    row = outcome.table[1]
    assert row["device_error"] < 1e-5 and row["digest"] != outcome.table[0]["digest"]
    assert outcome.table[0]["digest"] == outcome.table[3]["digest"]
    assert "reported nothing" in outcome.table[2]["verdict"]
    assert outcome.table[0]["verdict"] == outcome.table[3]["verdict"] == "pass"
    assert outcome.seconds < 100  # the link test's timeout is 60 s: its peers were stopped


def test_checks_that_cannot_start_name_nobody_and_the_ladder_goes_on(tmp_path: Path) -> None:
    ranks = LocalRanks(RankOptions(nproc=2, preload=("colorsys",)), say=lambda _: None)
    (tmp_path / "job.py").write_text("")
    said: list[str] = []
    try:
        assert ranks.spawn([str(tmp_path / "job.py")], dict(os.environ), None).wait(60) == 0
        ranks.options.python = str(tmp_path / "no-python-here")  # the node lost its interpreter
        outcome = stop_checks.run(ranks, dict(os.environ), incident={"step": 3},
                                  state_dir=tmp_path, say=said.append)  # fmt: skip
    finally:
        ranks.close()
    assert (outcome.suspects, outcome.status) == ([], -1)
    assert "could not start: cannot start a rank process" in outcome.why and said[-1] == outcome.why
