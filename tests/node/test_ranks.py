"""The node's own rank launcher (``failslow run --nproc-per-node``): warm processes, fail-stop
detection, the survivors' release, standby slots (failslow.node.ranks, failslow.node.warm).

Real processes, small scripts: each rank is a warm process (preloading ``colorsys`` here, so the
tests do not pay torch's import) given its rank over its socket. A failing rank must be seen
while its peers still run, the peers stopped (SIGTERM, SIGKILL after the grace period for one
that ignores it), its slot evicted onto a standby while one is left; a stop for an update is
not a failure; a restart takes the warm spares started with the last launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from failslow import envvars
from failslow.core.control.stop import (
    EXIT_FOR_RESTART,
    EXIT_FOR_UPDATE,
    EXIT_ROLLBACK,
    EXIT_UNRESTORABLE,
)
from failslow.node.ranks import LocalRanks, RankGroup, RankOptions

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "FAILSLOW_SLOT",
             "FAILSLOW_RESTART", "FAILSLOW_HOST", "FAILSLOW_SNAPSHOT_DIR",
             "FAILSLOW_RESHARD_FROM", "FAILSLOW_LAYOUT", "FAILSLOW_ROLLBACK_BEFORE")
    record = {k: os.environ.get(k) for k in names}
    record.update(pid=os.getpid(), ppid=os.getppid(), argv=sys.argv, name=__name__,
                  cwd=os.getcwd(), preloaded="colorsys" in sys.modules)
    # written whole or not at all: a peer's exit can stop this rank mid-write
    tmp = out / f".rank{rank}-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}-{os.getpid()}.json")
    mode = os.environ.get("MODE", "ok")
    failing = int(os.environ.get("FAIL_RANK", "1"))
    if mode in ("fail", "unrestorable", "rollback"):  # end once every peer said who it is
        deadline = time.monotonic() + 30
        while (len(list(out.glob("rank*.json"))) < int(os.environ["WORLD_SIZE"])
               and time.monotonic() < deadline):
            time.sleep(0.01)
    if mode == "fail" and rank == failing:
        sys.exit(3)
    if mode == "orphan" and rank == 1:  # a data loader worker, say, left in the rank's group
        import subprocess
        child = subprocess.Popen(["sleep", "600"])
        (out / "child.pid").write_text(str(child.pid))
        os._exit(3)
    if mode == "orphan":
        time.sleep(600)
    if mode == "machine":  # the test kills two ranks together, as a lost machine would
        time.sleep(600)
    if mode == "update":
        sys.exit(75)
    if mode == "s4":  # an S4 restart plan evicts rank 1's host; the others stop for it
        sys.exit(77 if rank == 1 else 76)
    if mode == "unrestorable":  # rank 0 first, then the others
        time.sleep(0.0 if rank == 0 else 0.3)
        sys.exit(78)
    if mode == "rollback" and rank == failing:  # its loss went NaN (failslow.report_metrics)
        os._exit(79)
    if mode == "rollback":  # a peer: its collective with the rank that left fails at once
        peer = json.loads(next(out.glob(f"rank{failing}-*.json")).read_text())["pid"]
        def gone():
            try:
                return open(f"/proc/{peer}/stat").read().rsplit(") ", 1)[1][0] == "Z"
            except OSError:
                return True
        while not gone():
            time.sleep(0.001)
        sys.exit(1)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode in ("fail", "stubborn") and rank != failing:
        time.sleep(600)  # a survivor waiting for a peer that will never come
    if mode == "stubborn":
        time.sleep(1.0)  # the peer ignores SIGTERM by now
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _ranks(
    nproc: int = 2,
    standbys: int = 0,
    grace: float = 10.0,
    slots_as_hosts: bool = False,
    min_ranks: int | None = None,
) -> LocalRanks:
    said: list[str] = []
    options = RankOptions(
        nproc=nproc, standbys=standbys, preload=("colorsys",), kill_grace_s=grace,
        refill_delay_s=0.0, slots_as_hosts=slots_as_hosts, min_ranks=min_ranks,
    )  # fmt: skip
    ranks = LocalRanks(options, say=said.append)
    ranks.said = said  # type: ignore[attr-defined]
    return ranks


def _last_said(ranks: LocalRanks) -> str:
    """The launcher's last word on the ranks (the warm pool's, whenever its spares are ready,
    aside: forked, they can be ready before a launch ends)."""
    said = [s for s in ranks.said if "warm spares ready" not in s]  # type: ignore[attr-defined]
    return said[-1]


def _run(
    tmp_path: Path, ranks: LocalRanks, mode: str, restart: int = 0, **env_extra: str
) -> tuple[int, dict, RankGroup]:
    import json

    out = tmp_path / f"out-{mode}-{restart}"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MODE": mode, "FAILSLOW_RESTART": str(restart), **env_extra}
    group = ranks.spawn([str(script), str(out)], env, str(tmp_path))
    status = group.wait(timeout=100)
    records = {}
    for f in out.glob("rank*.json"):
        r = json.loads(f.read_text())
        records[int(r["RANK"])] = r
    return status, records, group


def test_ranks_get_torchrun_s_environment_and_run_as_main(tmp_path: Path) -> None:
    ranks = _ranks(nproc=3)
    try:
        status, records, _ = _run(tmp_path, ranks, "ok")
    finally:
        ranks.close()
    assert status == 0
    assert sorted(records) == [0, 1, 2]
    for rank, r in records.items():
        assert r["WORLD_SIZE"] == "3" and r["LOCAL_RANK"] == str(rank)
        assert r["FAILSLOW_SLOT"] == str(rank) and r["name"] == "__main__"
        assert r["argv"][0].endswith("job.py") and r["cwd"] == str(tmp_path)
        assert r["preloaded"]  # preloaded before the rank was given
    assert len({r["MASTER_PORT"] for r in records.values()}) == 1
    assert not ranks.failstops


def test_a_failed_rank_releases_its_peers_and_moves_to_a_standby(tmp_path: Path) -> None:
    ranks = _ranks(nproc=3, standbys=1)
    try:
        status, records, _ = _run(tmp_path, ranks, "fail")
        assert status == 3  # the failed rank's status, not the survivors' SIGTERM
        [stop] = ranks.failstops
        assert (stop.rank, stop.slot, stop.status, stop.replaced_by) == (1, 1, 3, 3)
        assert ranks.slots == [0, 3, 2] and ranks.evicted == [1]
        assert "slot 1 evicted, standby slot 3 takes rank 1" in _last_said(ranks)
        # the restart: rank 1 on the standby slot; a second failure has no standby left
        status, records, _ = _run(tmp_path, ranks, "fail", restart=1)
        assert records[1]["FAILSLOW_SLOT"] == "3"
        assert ranks.failstops[-1].replaced_by is None and ranks.slots == [0, 3, 2]
        assert "no standby left: rank 1 restarts on slot 3" in _last_said(ranks)
    finally:
        ranks.close()


def test_a_survivor_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    ranks = _ranks(nproc=2, grace=0.5)
    try:
        status, _, group = _run(tmp_path, ranks, "stubborn")
    finally:
        ranks.close()
    assert status == 128 + signal.SIGKILL  # rank 1's own death
    assert [s.rank for s in ranks.failstops] == [1]
    assert group.ranks[0][1].returncode == -signal.SIGKILL  # SIGTERM ignored: killed


def test_a_stop_for_an_update_is_not_a_fail_stop(tmp_path: Path) -> None:
    ranks = _ranks(nproc=2, standbys=1)
    try:
        status, _, _ = _run(tmp_path, ranks, "update")
    finally:
        ranks.close()
    assert status == EXIT_FOR_UPDATE
    assert not ranks.failstops and ranks.slots == [0, 1]


def test_a_restart_plan_moves_the_evicted_rank_to_a_standby_without_a_fail_stop(
    tmp_path: Path,
) -> None:
    ranks = _ranks(nproc=3, standbys=1)
    try:
        status, _, group = _run(tmp_path, ranks, "s4")
        assert status == EXIT_FOR_RESTART  # the agent relaunches, not a failure
        assert not group.failstops and [e.rank for e in group.evictions] == [1]
        assert [(s.rank, s.cause, s.replaced_by) for s in ranks.failstops] == [(1, "evicted", 3)]
        assert ranks.slots == [0, 3, 2] and ranks.evicted == [1]
        assert "S4: rank 1 (slot 1) evicted by the restart plan" in _last_said(ranks)
        _, records, _ = _run(tmp_path, ranks, "ok", restart=1)
        assert records[1]["FAILSLOW_SLOT"] == "3"
    finally:
        ranks.close()


def test_ranks_that_cannot_restore_end_the_launch_without_a_fail_stop(tmp_path: Path) -> None:
    ranks = _ranks(nproc=3, standbys=1)
    try:
        status, _, _ = _run(tmp_path, ranks, "unrestorable")
    finally:
        ranks.close()
    assert status == EXIT_UNRESTORABLE  # the agent ends the job on it (tests/e2e/test_failstop)
    assert not ranks.failstops and ranks.standby_slots == [3]


def test_a_rank_asking_for_a_rollback_ends_the_launch_and_no_failing_peer_is_evicted(
    tmp_path: Path,
) -> None:
    """Rank 1's metrics went bad (exit 79); rank 0, whose collective with it broke, exits 1
    right after - in the same poll, often. Neither is a fail-stop: no slot is evicted, and
    the next launch (with ``$FAILSLOW_ROLLBACK_BEFORE``, a per-launch variable) takes the warm
    spares on the same slots."""
    ranks = _ranks(nproc=3, standbys=1)
    try:
        for attempt in range(3):  # the peer's exit races the launcher's poll differently
            status, _, group = _run(tmp_path, ranks, "rollback", restart=attempt)
            assert status == EXIT_ROLLBACK, ranks.said  # type: ignore[attr-defined]
            assert not group.failstops
        status, records, _ = _run(tmp_path, ranks, "ok", restart=3, FAILSLOW_ROLLBACK_BEFORE="7")
    finally:
        ranks.close()
    assert status == 0 and not ranks.failstops and ranks.standby_slots == [3]
    assert [records[r]["FAILSLOW_SLOT"] for r in range(3)] == ["0", "1", "2"]
    assert all(records[r]["FAILSLOW_ROLLBACK_BEFORE"] == "7" for r in range(3))
    assert all(records[r]["preloaded"] for r in range(3))


def test_the_agent_s_signal_stops_the_ranks_without_a_fail_stop(tmp_path: Path) -> None:
    ranks = _ranks(nproc=2, standbys=1)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    try:
        group = ranks.spawn([str(script)], dict(os.environ), None)
        time.sleep(0.5)
        group.signal_group(signal.SIGTERM)
        status = group.wait(timeout=60)
    finally:
        ranks.close()
    assert status == 128 + signal.SIGTERM
    assert not ranks.failstops and ranks.standby_slots == [2]


def test_a_restart_takes_the_warm_spares_and_a_new_environment_gets_new_ones(
    tmp_path: Path,
) -> None:
    ranks = _ranks(nproc=2)
    try:
        _run(tmp_path, ranks, "ok")
        deadline = time.monotonic() + 60
        while ranks.ready_spares() < 2 and time.monotonic() < deadline:
            ranks.tick()  # the group's poll does this while the ranks run
            # one spare at a time imports: never two beside the ranks
            assert sum(not w.ready for w in ranks._pool) <= 1
            time.sleep(0.02)
        assert ranks.ready_spares() == 2
        spares = {w.process.pid for w in ranks._pool}
        # FAILSLOW_RESTART changes at every launch and is not part of the warm key
        _, records, _ = _run(tmp_path, ranks, "ok", restart=1)
        assert {r["pid"] for r in records.values()} == spares
        assert {r["FAILSLOW_RESTART"] for r in records.values()} == {"1"}
        old = {w.process for w in ranks._pool}
        _, records, _ = _run(tmp_path, ranks, "ok2", restart=2)  # MODE changed: new processes
        assert not {r["pid"] for r in records.values()} & {p.pid for p in old}
        assert all(p.poll() is not None for p in old)  # the stale spares were ended
    finally:
        pool = [w.process for w in ranks._pool]
        ranks.close()
    assert all(p.poll() is not None for p in pool)


CODE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import jobcode  # only on PYTHONPATH: the code directory of this version

    rank = os.environ["RANK"]
    record = {"pid": os.getpid(), "version": jobcode.VERSION, "RANK": rank}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    """
)


def test_a_code_update_takes_the_warm_spares_and_runs_the_new_code(tmp_path: Path) -> None:
    """Issue 16, faster restarts: a hot update of the code (a new code directory, on PYTHONPATH)
    restarts on the warm spares - processes that imported the framework before the update -
    and the job's own modules come from the new directory, not the one the spares started
    with (measured: benchmarks/hot_update.py)."""
    import json

    from failslow import envvars
    from failslow.node.ranks import preloads_code

    (tmp_path / "job.py").write_text(CODE_SCRIPT)
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "jobcode.py").write_text(f"VERSION = {version!r}\n")
    ranks = _ranks(nproc=2)

    def launch(version: str, restart: int) -> dict[int, dict]:
        out = tmp_path / f"out-{version}"
        out.mkdir()
        code = str(tmp_path / version)
        env = {**os.environ, envvars.CODE_DIR: code, envvars.CODE_VERSION: version,
               "PYTHONPATH": code, envvars.RESTART: str(restart)}  # fmt: skip
        group = ranks.spawn([str(tmp_path / "job.py"), str(out)], env, str(tmp_path))
        assert group.wait(timeout=100) == 0
        records = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
        return {int(r["RANK"]): r for r in records}

    try:
        assert {r["version"] for r in launch("v1", 0).values()} == {"v1"}
        deadline = time.monotonic() + 60
        while ranks.ready_spares() < 2 and time.monotonic() < deadline:
            ranks.tick()
            time.sleep(0.02)
        spares = {w.process.pid for w in ranks._pool}
        records = launch("v2", 1)
        assert {r["pid"] for r in records.values()} == spares  # the warm spares
        assert {r["version"] for r in records.values()} == {"v2"}  # with the new code
    finally:
        ranks.close()
    # a process that preloaded the job's own code is of no use to another version
    assert preloads_code(("?jobcode.sub", "colorsys"), str(tmp_path / "v1"))
    assert not preloads_code(("colorsys",), str(tmp_path / "v1"))


def test_failslow_run_checks_its_rank_options(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "failslow.cli", "run", "--ring-dir", str(tmp_path / "r"),
             *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    done = run("--nproc-per-node", "2", "--preload", "no_such_module_x", "--", "job.py")
    assert done.returncode != 0 and "--preload no_such_module_x: no such module" in done.stderr
    done = run("--nproc-per-node", "2", "--", str(tmp_path / "missing.py"))
    assert done.returncode != 0 and "missing.py" in done.stderr and "no such script" in done.stderr
    done = run("--standbys", "1", "--", "true")
    assert done.returncode != 0 and "need --nproc-per-node" in done.stderr
    done = run("--nproc-per-node", "0", "--", "job.py")
    assert done.returncode != 0 and "--nproc-per-node must be >= 1" in done.stderr


def test_a_dead_rank_s_children_do_not_outlive_it(tmp_path: Path) -> None:
    ranks = _ranks(nproc=2)
    try:
        status, _, _ = _run(tmp_path, ranks, "orphan")
    finally:
        ranks.close()
    assert status == 3
    child = int((tmp_path / "out-orphan-0" / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_closing_the_launcher_ends_the_ranks_it_started(tmp_path: Path) -> None:
    ranks = _ranks(nproc=2)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    group = ranks.spawn([str(script)], dict(os.environ), None)
    ranks.close()
    assert all(p.poll() is not None for _, p in group.ranks.values())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_ranks_lost_together_are_each_a_fail_stop_with_its_own_standby(tmp_path: Path) -> None:
    # one machine standing for four: slots are hosts with their own memory, as a test job uses
    memory = tmp_path / "snapshots"
    for slot in range(4):
        (memory / f"slot{slot}").mkdir(parents=True)
        (memory / f"slot{slot}" / "rank-state").write_text("x")
    ranks = _ranks(nproc=4, standbys=2, slots_as_hosts=True)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MODE": "machine", "FAILSLOW_SNAPSHOT_DIR": str(memory)}
    try:
        group = ranks.spawn([str(script), str(out)], env, str(tmp_path))
        deadline = time.monotonic() + 60
        while len(list(out.glob("rank*.json"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        records = {int(r["RANK"]): r for r in map(json.loads, _texts(out))}
        os.kill(records[0]["pid"], signal.SIGKILL)
        os.kill(records[2]["pid"], signal.SIGKILL)
        status = group.wait(timeout=60)
    finally:
        ranks.close()
    assert status == 128 + signal.SIGKILL
    assert sorted((s.rank, s.replaced_by) for s in ranks.failstops) in (
        [(0, 4), (2, 5)],
        [(0, 5), (2, 4)],
    )
    assert ranks.evicted and sorted(ranks.evicted) == [0, 2]
    # the evicted machines' memory is gone with them; the others' is kept
    assert sorted(p.name for p in memory.iterdir()) == ["slot1", "slot3"]
    for rank, r in records.items():
        assert r["FAILSLOW_HOST"].endswith(f"-slot{rank}")
        assert r["FAILSLOW_SNAPSHOT_DIR"] == str(memory / f"slot{rank}")


def _texts(out: Path) -> list[str]:
    return [f.read_text() for f in out.glob("rank*.json")]


def test_with_no_standby_left_a_dead_rank_s_slot_is_dropped_down_to_min_ranks(
    tmp_path: Path,
) -> None:
    """``--min-ranks 2`` on three slots that are hosts: rank 1 dies with no standby, so its
    slot is dropped and the next launch has two ranks (slots 0 and 2) in a new world's snapshot
    directories, told where the three-rank world's memory is and which old rank each was
    (``$FAILSLOW_RESHARD_FROM``); the dropped host's memory is gone. Rank 1 (slot 2) dies again:
    two is the minimum, so it restarts in place, still pointed at the larger world while its
    own has no complete snapshot."""
    memory = tmp_path / "snapshots"
    for slot in range(3):
        (memory / f"slot{slot}").mkdir(parents=True)
    ranks = _ranks(nproc=3, slots_as_hosts=True, min_ranks=2)
    env = {"FAILSLOW_SNAPSHOT_DIR": str(memory)}
    try:
        status, first, _ = _run(tmp_path, ranks, "fail", **env)
        assert status == 3
        [stop] = ranks.failstops
        assert (stop.rank, stop.replaced_by, stop.ranks_left) == (1, None, 2)
        assert "slot 1 dropped, the job goes on with 2 ranks from memory" in _last_said(ranks)
        assert sorted(p.name for p in memory.iterdir()) == ["slot0", "slot2"]
        assert first[1]["FAILSLOW_RESHARD_FROM"] is None
        status, second, _ = _run(tmp_path, ranks, "fail", restart=1, **env)
        assert status == 3 and ranks.slots == [0, 2]
        assert "the job goes on with 2 ranks on slots [0, 2]" in ranks.said
        assert ranks.failstops[-1].ranks_left is None
        assert "no standby left: rank 1 restarts on slot 2" in _last_said(ranks)
        status, third, _ = _run(tmp_path, ranks, "ok", restart=2, **env)
        assert status == 0
    finally:
        ranks.close()
    for records in (second, third):
        assert sorted(records) == [0, 1]
        for rank, slot in ((0, 0), (1, 2)):
            r = records[rank]
            assert r["WORLD_SIZE"] == "2" and r["FAILSLOW_SLOT"] == str(slot)
            assert r["FAILSLOW_SNAPSHOT_DIR"] == str(memory / "world1" / f"slot{slot}")
            assert json.loads(r["FAILSLOW_RESHARD_FROM"]) == [
                {"directory": str(memory / f"slot{slot}"), "rank": slot}
            ]


def test_worlds_without_a_complete_snapshot_chain_back_to_the_last_larger_one(
    tmp_path: Path,
) -> None:
    """Two drops in a row before the three-rank world wrote any snapshot (``--min-ranks 1``):
    the one-rank world is pointed at the three-rank world first and the four-rank world after
    it, newest first - its rank restores from the first one every old rank survives in."""
    memory = tmp_path / "snapshots"
    ranks = _ranks(nproc=3, slots_as_hosts=True, min_ranks=1)
    env = {"FAILSLOW_SNAPSHOT_DIR": str(memory)}
    try:
        assert _run(tmp_path, ranks, "fail", **env)[0] == 3  # rank 1 (slot 1) dropped
        assert _run(tmp_path, ranks, "fail", restart=1, **env)[0] == 3  # rank 1 (slot 2) too
        status, records, _ = _run(tmp_path, ranks, "ok", restart=2, **env)
    finally:
        ranks.close()
    assert status == 0 and ranks.slots == [0]
    assert [s.ranks_left for s in ranks.failstops] == [2, 1]
    (r,) = records.values()
    assert r["WORLD_SIZE"] == "1"
    assert r["FAILSLOW_SNAPSHOT_DIR"] == str(memory / "world2" / "slot0")
    assert json.loads(r["FAILSLOW_RESHARD_FROM"]) == [
        {"directory": str(memory / "world1" / "slot0"), "rank": 0},
        {"directory": str(memory / "slot0"), "rank": 0},
    ]


def _grid_notes(memory: Path) -> None:
    """The layout notes a Megatron job's snapshot service leaves: PP2 x DP2, 4 layers, a global
    batch of 8 micro-batches, 0.1 s per micro-batch on each stage."""
    from failslow.core.checkpoint.layout_notes import write_note
    from failslow.core.topology import Topology

    coords = ((0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1))
    topology = Topology(
        tp=1, dp=2, pp=2, coords=coords, hosts=("h",) * 4, micro_batches=8,
        layers_per_stage=(2, 2),
    )  # fmt: skip
    for rank in range(4):
        (memory / f"slot{rank}").mkdir(parents=True)
        write_note(memory / f"slot{rank}", rank, topology, {"spacing": 0.1, "post_low": 0.01})


def test_a_grid_that_loses_a_rank_goes_on_in_the_layout_odyssey_chose(tmp_path: Path) -> None:
    """A PP2 x DP2 job whose ranks noted their layers loses rank 2 (stage 1 of replica 0) with
    no standby: with room for every layer on one rank, odyssey reconfigures to PP1 x DP3 (3
    micro-batches of 4 layers, against 9 pipeline slots of 2 layers for the reroute); the
    three ranks are told the grid (``$FAILSLOW_LAYOUT``) and their old ranks."""
    memory = tmp_path / "snapshots"
    _grid_notes(memory)
    ranks = _ranks(nproc=4, slots_as_hosts=True, min_ranks=2)
    env = {"FAILSLOW_SNAPSHOT_DIR": str(memory), "FAIL_RANK": "2"}
    try:
        assert _run(tmp_path, ranks, "fail", **env)[0] == 3
        status, records, _ = _run(tmp_path, ranks, "ok", restart=1, **env)
    finally:
        ranks.close()
    assert status == 0 and ranks.slots == [0, 1, 3] and ranks.standby_slots == []
    assert any("odyssey reconfigure: PP2xDP2 -> PP1xDP3 on 3 ranks" in s for s in ranks.said)
    for rank, old in enumerate((0, 1, 3)):
        layout = json.loads(records[rank]["FAILSLOW_LAYOUT"])
        assert (layout["tp"], layout["pp"], layout["dp"], layout["choice"]) == (
            1, 1, 3, "reconfigure",
        )  # fmt: skip
        assert layout["estimated_s"] < layout["before_s"] * 1.5
        assert json.loads(records[rank]["FAILSLOW_RESHARD_FROM"])[0]["rank"] == old


def test_a_lost_pipeline_s_other_ranks_stand_by_and_take_the_next_loss(tmp_path: Path) -> None:
    """The same loss when a rank holds at most 2 layers (``max_stage_layers``): odyssey
    reroutes - replica 0 cannot run without its stage 1, so replica 1 (old ranks 1 and 3) goes
    on as PP2 x DP1 and rank 0's slot stands by. When the new rank 1 (slot 3) dies, that slot
    takes its place, still in the chosen grid."""
    memory = tmp_path / "snapshots"
    _grid_notes(memory)
    ranks = _ranks(nproc=4, slots_as_hosts=True, min_ranks=2)
    ranks.options.max_stage_layers = 2
    env = {"FAILSLOW_SNAPSHOT_DIR": str(memory), "FAIL_RANK": "2"}
    try:
        assert _run(tmp_path, ranks, "fail", **env)[0] == 3
        status, second, _ = _run(tmp_path, ranks, "fail", restart=1, **{**env, "FAIL_RANK": "1"})
        assert status == 3 and ranks.failstops[-1].replaced_by == 0
        status, third, _ = _run(tmp_path, ranks, "ok", restart=2, **env)
    finally:
        ranks.close()
    assert status == 0 and ranks.slots == [1, 0] and ranks.standby_slots == []
    assert any("odyssey reroute: PP2xDP2 -> PP2xDP1 on 2 ranks" in s for s in ranks.said)
    assert "slots [0] stand by (odyssey reroute)" in ranks.said
    for records, slots in ((second, ("1", "3")), (third, ("1", "0"))):
        assert [records[r]["FAILSLOW_SLOT"] for r in (0, 1)] == list(slots)
        for r in (0, 1):
            layout = json.loads(records[r]["FAILSLOW_LAYOUT"])
            assert (layout["pp"], layout["dp"], layout["choice"]) == (2, 1, "reroute")
    assert [json.loads(second[r]["FAILSLOW_RESHARD_FROM"])[0]["rank"] for r in (0, 1)] == [1, 3]
    # the standby was old rank 0 in the four-rank world: its memory there is its own
    assert json.loads(third[1]["FAILSLOW_RESHARD_FROM"])[0] == {
        "directory": str(memory / "slot0"), "rank": 0,
    }  # fmt: skip


def test_ranks_a_hang_names_are_evicted_and_the_launch_ends_for_a_restart(tmp_path: Path) -> None:
    """What the hang watch does once stack aggregation named rank 1 (tests/node/test_hang.py):
    its slot goes to the standby, every rank is stopped, and the launch ends with HUNG for the
    agent to restart it from memory."""
    from failslow.node.ranks import HUNG

    ranks = _ranks(nproc=3, standbys=1, grace=2.0)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    try:
        group = ranks.spawn([str(script), str(out)], {**os.environ, "MODE": "machine"}, None)
        deadline = time.monotonic() + 60
        while len(list(out.glob("rank*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert group.running()
        group.hang([1])
        assert group.wait(timeout=60) == HUNG and not group.running()
    finally:
        ranks.close()
    [stop] = ranks.failstops
    assert (stop.rank, stop.cause, stop.replaced_by, stop.status) == (1, "hung", 3, HUNG)
    assert "rank 1 (slot 1" in _last_said(ranks) and "hung (stack aggregation named it)" in (
        _last_said(ranks)
    )
    assert ranks.slots == [0, 3, 2]


def test_the_next_launch_is_the_same_job_after_a_fail_stop_not_after_an_update_or_s4(
    tmp_path: Path,
) -> None:
    """What the launcher tells the node's analyzer before a relaunch (``carry_over``): the
    ranks' detectors go on only when the job restarts as it ran - after a fail-stop, with the
    same command, environment and code - not after an update, an S4 plan or a dropped slot."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    ranks = _ranks(standbys=1, min_ranks=1)
    try:
        assert not ranks.same_job_next([str(script)], {}, None)  # nothing ran yet
        for mode, same in (("fail", True), ("update", False), ("s4", False)):
            out = tmp_path / f"out-{mode}"
            out.mkdir()
            command, env = [str(script), str(out)], {**os.environ, "MODE": mode}
            ranks.spawn(command, env, str(tmp_path)).wait(timeout=100)
            assert ranks.same_job_next(command, env, str(tmp_path)) is same, mode
            assert not ranks.same_job_next(command, {**env, "X": "1"}, str(tmp_path))
            assert not ranks.same_job_next([*command, "--new"], env, str(tmp_path))
            env[envvars.RESTART] = "7"  # per launch: not the job's
            assert ranks.same_job_next(command, env, str(tmp_path)) is same, mode
        out = tmp_path / "out-fail-again"
        out.mkdir()
        command, env = [str(script), str(out)], {**os.environ, "MODE": "fail"}
        ranks.spawn(command, env, str(tmp_path)).wait(timeout=100)  # the standby is taken: the
        assert not ranks.same_job_next(command, env, str(tmp_path))  # slot is dropped
    finally:
        ranks.close()
