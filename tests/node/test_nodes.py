"""Several nodes' launchers, one job (failslow.node.nodes): every launch agreed through the job's
store, a rank that fails on one node restarts every node's ranks, and only that rank is a
fail-stop.

Two :class:`LocalRanks` in this process stand for two nodes' launchers, each with its own
:class:`NodeGroup` connection to a real TCPStore (the job's store). Their ranks are real warm
processes (preloading ``colorsys``, not torch) running a small script; a peer that "loses its
gloo connection" is a rank that exits with status 1 as soon as the failed rank's process is
gone - what a gloo rank does when its peer dies, and what makes the race the protocol settles.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from failslow.core.control.stop import EXIT_ROLLBACK, request_rollback
from failslow.core.control.store import open_store
from failslow.core.planner.ladder import REATTEMPT, ROLL_BACK_CODE, Rung
from failslow.errors import FailslowError
from failslow.node.control import host_store
from failslow.node.hot_update.history import History
from failslow.node.hot_update.version import Version
from failslow.node.incidents import Incidents
from failslow.node.launcher import _node_version
from failslow.node.nodes import NodeGroup, NodeOptions
from failslow.node.rank_group import HUNG
from failslow.node.ranks import LocalRanks, RankGroup, RankOptions

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from failslow.runtime import teardown

    teardown.install()  # what failslow run's hook does: an uncaught exception is recorded

    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FAILSLOW_SLOT")
    record = {k: os.environ.get(k) for k in names}
    record["pid"] = os.getpid()
    tmp = out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}.json")
    mode, failing = os.environ.get("MODE", "ok"), int(os.environ.get("FAIL_RANK", "3"))
    if mode == "ok":
        sys.exit(0)
    if mode in ("hang", "busy", "slow"):  # training steps in the rank's ring, then it hangs
        from failslow.core.events import OpCode
        from failslow.core.ring import RingWriter, ring_path

        ring = RingWriter(ring_path(os.environ["FAILSLOW_RING_DIR"], rank, os.getpid(), "py"),
                          capacity=256)
        def step():
            ring.write(t_start_ns=1, t_end_ns=2, nbytes=8, group_key=1, op=OpCode.ALLREDUCE)
            ring.write(t_start_ns=2, t_end_ns=3, nbytes=0, group_key=1, op=OpCode.STEP)
        for _ in range(3):
            step()
        def wait_in_collective():
            while True:
                if mode == "slow" or (mode == "busy" and rank >= world // 2):
                    step()  # training goes on (on the other node, or everywhere)
                time.sleep(0.05)
        def injected_hang():
            while True:
                time.sleep(0.05)
        def injected_slow_data():
            while True:
                step()
                time.sleep(0.05)
        if rank != failing:
            wait_in_collective()
        (injected_slow_data if mode == "slow" else injected_hang)()
    deadline = time.monotonic() + 30
    while len(list(out.glob("rank*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.01)
    if rank == failing:
        if mode == "raise":
            raise RuntimeError("a bad batch")
        if mode == "incident":  # what failslow.report_metrics does on a NaN loss
            from failslow.core.control.stop import EXIT_ROLLBACK, request_rollback

            request_rollback(os.environ["FAILSLOW_STATE_DIR"], rank,
                             {"step": 13, "why": "loss is nan at step 13"})
            os._exit(EXIT_ROLLBACK)
        time.sleep(60)  # "kill": the test SIGKILLs it
    # every other rank: its "gloo peer" is gone as soon as the failed rank exited (its
    # sockets close then, reaped or not)
    pid = json.loads((out / f"rank{failing}.json").read_text())["pid"]
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except (FileNotFoundError, ProcessLookupError):
            state = "gone"
        if state in ("Z", "X", "gone"):
            raise RuntimeError("Connection closed by peer")  # what gloo raises
        time.sleep(0.005)
    """
)


def _nodes(store_url: str, nnodes: int = 2, **options: float) -> list[NodeGroup]:
    return [
        NodeGroup(NodeOptions(nnodes=nnodes, node_rank=k, **options), open_store(store_url))
        for k in range(nnodes)
    ]


def _ranks(node: NodeGroup, said: list[str], **more: float) -> LocalRanks:
    options = RankOptions(
        nproc=2, standbys=1, preload=("colorsys",), kill_grace_s=10.0, refill_delay_s=0.0,
        nodes=node, **more,  # type: ignore[arg-type]
    )  # fmt: skip
    return LocalRanks(options, say=lambda line: said.append(f"node {node.node_rank}: {line}"))


@contextlib.contextmanager
def _launchers(store_url: str, said: list[str], **more: float) -> Iterator[list[LocalRanks]]:
    """Two nodes' launchers on the job's store (each with its own connection), closed at exit."""
    nodes = _nodes(store_url)
    launchers = [_ranks(node, said, **more) for node in nodes]
    try:
        yield launchers
    finally:
        for launcher in launchers:
            launcher.close()
        for node in nodes:
            node.store.close()


def _spawn_all(tmp_path: Path, launchers: list[LocalRanks], mode: str, launch: int,
               **env: str) -> tuple[list[RankGroup], Path]:  # fmt: skip
    out = tmp_path / f"out-{mode}-{launch}"
    out.mkdir()
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    full = {**os.environ, "MODE": mode, "FAILSLOW_STATE_DIR": str(tmp_path / "state"), **env}
    rings = [tmp_path / f"rings-node{k}" for k in range(len(launchers))]  # each node's own
    # at once, as separate launchers do: node 0 hosts the rendezvous the others wait for, and
    # starts its ranks once they joined it
    with concurrent.futures.ThreadPoolExecutor(len(launchers)) as pool:
        started = [
            pool.submit(r.spawn, [str(script), str(out)],
                        {**full, "FAILSLOW_RING_DIR": str(ring)}, str(tmp_path))
            for r, ring in zip(launchers, rings, strict=True)
        ]  # fmt: skip
        return [s.result() for s in started], out


def _wait_all(groups: list[RankGroup], timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while None in (statuses := [g.poll() for g in groups]):  # every node's launcher polls
        assert time.monotonic() < deadline, "the launches did not end"
        time.sleep(0.01)
    return statuses  # type: ignore[return-value]


def _wait_apart(groups: list[RankGroup], timeout: float = 60.0) -> list[int]:
    """Each node's launcher polls in a thread of its own, as separate processes do (node 0's
    look at a hang waits for the other nodes' answers)."""
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda group: group.wait(timeout), groups))


def _records(out: Path) -> dict[int, dict]:
    return {int(json.loads(f.read_text())["RANK"]): json.loads(f.read_text())
            for f in out.glob("rank*.json")}  # fmt: skip


@pytest.fixture
def job_store():
    store = host_store()
    yield store
    store.close()


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_that_fails_on_one_node_restarts_every_node_and_only_it_is_a_fail_stop(
    tmp_path: Path, job_store, how: str
) -> None:
    """Node 1's rank 3 dies - SIGKILLed, or of an exception, as a gloo peer's failure makes
    the others die too - and node 0's ranks fail a moment later (their peer is gone), seen by
    node 0's launcher before node 1's launcher even looks (a loaded machine). Only rank 3 is a
    fail-stop: node 0 holds its ranks' failures, node 1 claims the launch's stop - a kill, or
    an exception raised before theirs - and they are consequences. Rank 3's slot goes to node
    1's standby, both launches end with rank 3's status, and the next launch starts on both
    nodes with node 0's new rendezvous."""
    said: list[str] = []
    with _launchers(job_store.url, said) as launchers:
        groups, out = _spawn_all(tmp_path, launchers, how, 0)
        if how == "kill":
            deadline = time.monotonic() + 30
            while len(_records(out)) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            os.kill(_records(out)[3]["pid"], signal.SIGKILL)
        # node 1's launcher is slow to look (a loaded machine): node 0 sees its own ranks
        # fail first, and for a while sees nothing else
        deadline = time.monotonic() + 30
        while any(process.poll() is None for _, process in groups[0].ranks.values()):
            assert time.monotonic() < deadline
            assert groups[0].poll() is None
            time.sleep(0.01)
        lag = time.monotonic() + 0.3
        while time.monotonic() < lag:
            assert groups[0].poll() is None  # held: they may be consequences
            time.sleep(0.01)
        statuses = _wait_all(groups)
        status = 128 + signal.SIGKILL if how == "kill" else 1
        assert statuses == [status, status], said
        records = _records(out)
        assert sorted(records) == [0, 1, 2, 3]
        assert [(r["LOCAL_RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for _, r in
                sorted(records.items())] == [("0", "0", "4"), ("1", "0", "4"), ("0", "1", "4"),
                                             ("1", "1", "4")]  # fmt: skip
        (rendezvous,) = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records.values()}
        assert groups[0].failstops == [], said  # consequences of node 1's failure
        assert groups[0].remote is not None and groups[0].remote["rank"] == 3
        (stop,) = groups[1].failstops
        assert (stop.rank, stop.slot, stop.replaced_by, stop.status) == (3, 1, 2, status)
        assert launchers[1].slots == [0, 2] and launchers[0].slots == [0, 1]
        assert any("node 1's rank 3 failed" in line for line in said), said

        groups, out = _spawn_all(tmp_path, launchers, "ok", 1)
        assert _wait_all(groups) == [0, 0]
        records = _records(out)
        assert [records[r]["FAILSLOW_SLOT"] for r in range(4)] == ["0", "1", "0", "2"]
        (again,) = {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in records.values()}
        assert again != rendezvous  # node 0 hosts a fresh rendezvous per launch


def test_a_rank_s_incident_on_one_node_stops_every_node_with_no_fail_stop(
    tmp_path: Path, job_store
) -> None:
    """Node 1's rank 3 reports an incident (a rollback request, exit 79: its metrics went bad)
    and node 0's ranks fail a moment later, their peer gone - seen by node 0's launcher first.
    Node 1 claims the launch's stop for the incident, so node 0's failures are consequences:
    no fail-stop anywhere, no slot evicted, and both launches end on the incident for the
    ladder (without the claim, node 0 would evict a healthy rank's slot)."""
    said: list[str] = []
    with _launchers(job_store.url, said) as launchers:
        groups, _ = _spawn_all(tmp_path, launchers, "incident", 0)
        assert _wait_all(groups) == [EXIT_ROLLBACK, EXIT_ROLLBACK], said
        assert groups[0].failstops == groups[1].failstops == [], said
        assert groups[0].remote is not None, said
        assert (groups[0].remote["rank"], groups[0].remote["cause"]) == (3, "incident")
        assert launchers[0].slots == [0, 1] and launchers[1].slots == [0, 1]
        assert any("node 1's rank 3 reported an incident" in line for line in said), said


def _incidents(tmp_path: Path, nodes: list[NodeGroup], launch: list[int]) -> list[Incidents]:
    """Each node's ladder (its own state directory and update history), across the nodes."""
    ladders = []
    for node in nodes:
        state = tmp_path / f"state{node.node_rank}"
        state.mkdir()
        ladder = Incidents(state, History(state / "updates.sqlite"), say=lambda line: None)
        ladder.across(node, lambda: launch[0])
        ladders.append(ladder)
    return ladders


def test_node_0_takes_each_rung_of_the_ladder_for_every_node(tmp_path: Path, job_store) -> None:
    """One ladder across the nodes (failslow.node.incidents): only node 1's rank reported the
    incident, node 0's history holds the latest code update. Each launch's rung is node 0's,
    from every node's requests: a reattempt before node 1's step, then - the incident back -
    rolling back node 0's update, which node 1 takes too instead of stopping for a person (its
    own history holds no update). A launch that did not end on an incident is no rung anywhere,
    and a node 0 that never decides leaves node 1 an ordinary failure after its wait."""
    nodes = _nodes(job_store.url)
    launch = [0]
    ladders = _incidents(tmp_path, nodes, launch)
    history = ladders[0].history
    update = history.submit(urgency="urgent", env={"LR": "2"}, note="new lr")
    base = Version(command=("python", "train.py"))
    history.record_applied(update, previous=base, version=base.changed(env={"LR": "2"}),
                           trigger="test", applied_step=5)  # fmt: skip

    def both(status: int = EXIT_ROLLBACK) -> list[Rung | None]:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # node 1 waits for node 0's
            follower = pool.submit(ladders[1].after, status=status)
            return [ladders[0].after(status=status), follower.result(timeout=60)]

    try:
        for n, name in enumerate([REATTEMPT, ROLL_BACK_CODE]):
            launch[0] = n
            request_rollback(tmp_path / "state1", 3, {"step": 13 + n, "why": "loss is nan"})
            got = both()
            assert [(r.name, r.before_step) for r in got if r] == [(name, 13)] * 2, got
            assert got[1].why == f"node 0: {got[0].why}"
            assert ladders[1].incident["rank"] == 3 and ladders[0].incident["rank"] == 3
        assert "update #1: LR=2" in got[0].why  # node 0's history
        launch[0] = 2
        request_rollback(tmp_path / "state1", 3, {"step": 40, "why": "loss is nan"})
        assert both(status=1) == [None, None]  # a fail-stop's launch: an ordinary failure
        launch[0] = 3
        ladders[1].RUNG_WITHIN_S = 0.2
        assert ladders[1].after(status=EXIT_ROLLBACK) is None
        rungs = [json.loads(x)["rung"] for x in (tmp_path / "state1" / "incidents.jsonl").open()]
        assert rungs == [REATTEMPT, ROLL_BACK_CODE]
    finally:
        history.close()
        ladders[1].history.close()
        for node in nodes:
            node.store.close()


def test_the_run_of_each_launcher_is_counted_from_its_join(job_store) -> None:
    """Each launcher's join counts: a second run of the job in the same store keeps its own
    keys (its launch 0 is not the first run's)."""
    first, second = _nodes(job_store.url), _nodes(job_store.url)
    try:
        assert [n.join() for n in first] == [0, 0]
        assert [n.join() for n in second] == [1, 1]
        first[1].claim(0, {"rank": 3, "status": 137})
        assert second[0].stopped(0) is None
        assert first[0].stopped(0) == {"rank": 3, "status": 137, "node": 1}
        # the first claim holds
        assert first[0].claim(0, {"rank": 0, "status": 1})["node"] == 1
    finally:
        for node in first + second:
            node.store.close()


def test_a_node_without_node_0_s_rendezvous_gives_up_with_one_line(
    tmp_path: Path, job_store
) -> None:
    said: list[str] = []
    (node,) = _nodes(job_store.url, nnodes=2, rdzv_timeout_s=0.5)[1:]
    launcher = _ranks(node, said)
    try:
        with pytest.raises(FailslowError, match="node 1: node 0 did not start launch 0 within"):
            _spawn_all(tmp_path, [launcher], "ok", 0)
    finally:
        launcher.close()
        node.store.close()


def test_node_0_without_the_other_node_gives_up_with_one_line(tmp_path: Path, job_store) -> None:
    """Node 0 hosts the launch's rendezvous, but starts no rank until every node joined it:
    alone, its ranks would wait in their rendezvous for the collective timeout."""
    said: list[str] = []
    (node,) = _nodes(job_store.url, nnodes=2, rdzv_timeout_s=0.5)[:1]
    launcher = _ranks(node, said)
    try:
        with pytest.raises(FailslowError, match="node 0: 1 of the other nodes did not join launch"):
            _spawn_all(tmp_path, [launcher], "ok", 0)
        assert launcher.group is None  # no rank started
    finally:
        launcher.close()
        node.store.close()


def test_node_options_are_checked() -> None:
    with pytest.raises(Exception, match="--node-rank must be between 0 and"):
        NodeOptions(nnodes=2, node_rank=2)
    with pytest.raises(Exception, match="--nnodes must be >= 1"):
        NodeOptions(nnodes=0, node_rank=0)


def test_failslow_run_checks_what_several_nodes_need(tmp_path: Path) -> None:
    import subprocess
    import sys

    from failslow.errors import ConfigError
    from failslow.node.launcher import RunOptions, _check_options

    def check(**options: object) -> None:
        base = {"command": ["job.py"], "nproc_per_node": 2, "nnodes": 2, "node_rank": 1,
                "store_url": "tcp://127.0.0.1:1", "job_token": "t"}  # fmt: skip
        _check_options(RunOptions(**{**base, **options}))  # type: ignore[arg-type]

    check()  # fine
    check(decline_every_s=2.0)  # node 1 answers node 0's looks: no controller of its own
    for options, message in [
        ({"store_url": None}, "--nnodes needs --store"),
        ({"nproc_per_node": None, "command": ["torchrun"]}, "--nnodes needs --nproc-per-node"),
        ({"node_rank": 2}, "--node-rank must be between 0 and --nnodes - 1 (1), got 2"),
        ({"min_ranks": 1}, "--min-ranks works on one node only"),
        ({"node_rank": 0, "decline_every_s": 2.0}, "--decline-every needs --nproc-per-node and"),
        ({"rdzv_timeout_s": 0.0}, "--rdzv-timeout must be > 0 seconds"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check(**options)
    done = subprocess.run(  # the flags as users type them
        [sys.executable, "-m", "failslow.cli", "run", "--ring-dir", str(tmp_path / "r"),
         "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--", "job.py"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "--nnodes needs --store" in done.stderr, done.stderr


def test_a_hang_is_looked_at_across_the_nodes_and_the_stuck_rank_s_node_evicts_it(
    tmp_path: Path, job_store
) -> None:
    """Every rank stops committing collectives; rank 3 (node 1's second) is stuck in its own
    code while the others wait in a collective. Neither node can tell from its own ranks: node
    0's look opens on both nodes, node 1 answers with its stacks, and the union names rank 3
    alone. Node 1 evicts it onto its standby and claims the launch's stop (status HUNG), node 0
    releases its ranks as consequences, and the next launch starts on both nodes."""
    said: list[str] = []
    with _launchers(job_store.url, said, hang_after_s=2.0) as launchers:
        groups, out = _spawn_all(tmp_path, launchers, "hang", 0)
        assert _wait_apart(groups) == [HUNG, HUNG], said
        (stop,) = groups[1].failstops
        assert (stop.rank, stop.slot, stop.replaced_by, stop.cause) == (3, 1, 2, "hung"), said
        assert groups[0].failstops == [], said
        assert groups[0].remote is not None and groups[0].remote["rank"] == 3
        look = [line for line in said if line.startswith("node 0: hang:")]
        assert len(look) == 1 and "on 2 of 2 nodes" in look[0], said
        assert "outliers [3]" in look[0] and "evicting ranks [3]" in look[0], said
        assert any("node 1: node 0's look 1 named ranks [3]" in x for x in said), said
        assert any("node 0: node 1's rank 3 hung" in x for x in said), said
        (line,) = (tmp_path / "state" / "hangs.jsonl").read_text().splitlines()
        record = json.loads(line)
        assert record["suspects"]["ranks"] == [3] and record["look"] == 1
        assert record["missing"] == [] and record["busy"] == []
        stuck = [g for g in record["groups"] if g["healthy"] is False]
        assert stuck and "injected_hang" in stuck[0]["signature"], record

        groups, out = _spawn_all(tmp_path, launchers, "ok", 1)
        assert _wait_all(groups) == [0, 0]
        assert [_records(out)[r]["FAILSLOW_SLOT"] for r in range(4)] == ["0", "1", "0", "2"]


def test_a_look_is_not_a_hang_while_another_node_s_ranks_progress(
    tmp_path: Path, job_store
) -> None:
    """Node 0's ranks are quiet, node 1's still commit collectives (their rings advance): node
    1 answers that its ranks progress, and node 0 evicts no one and watches on."""
    said: list[str] = []
    with _launchers(job_store.url, said, hang_after_s=1.0) as launchers:
        groups, _ = _spawn_all(tmp_path, launchers, "busy", 0)
        deadline = time.monotonic() + 30
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            follower = pool.submit(lambda: groups[1].wait(40))
            while not any("still progress" in line for line in said):
                assert time.monotonic() < deadline, said
                assert groups[0].poll() is None, said
                time.sleep(0.01)
            assert groups[0].failstops == [] and groups[1].failstops == [], said
            for group in groups:
                group.signal_group(signal.SIGTERM)
            assert groups[0].wait(30) == 128 + signal.SIGTERM
            assert follower.result() == 128 + signal.SIGTERM
        assert "nodes [1] still progress - watching on" in next(x for x in said if "progress" in x)


def test_every_node_launches_at_node_0_s_version(job_store) -> None:
    """Node 0 publishes the version it launches with (its hot updates, its rollbacks); the
    other nodes take it, or give up in one line when node 0 never starts that launch."""
    nodes = _nodes(job_store.url, rdzv_timeout_s=0.3)
    try:
        for node in nodes:
            node.join()
        mine = {"command": ["-m", "train"], "env": {}, "code_dir": None, "code_version": None}
        updated = {**mine, "env": {"LR": "0.1"}}
        assert nodes[0].version(0, updated) == updated
        assert nodes[1].version(0, mine) == updated
        with pytest.raises(FailslowError, match="node 1: node 0 did not start launch 1 within"):
            nodes[1].version(1, mine)
        # the launcher's side: node 0's environment, and this launch's count and the rung's
        # rollback step, which the agent set beside its own version's
        base = {"PATH": "/bin", "LR": "1"}
        own = Version(command=("-m", "train"))
        env = {**own.environment(base), "FAILSLOW_ROLLBACK_BEFORE": "20",
               "FAILSLOW_RESTART": "3", "FAILSLOW_UPDATE_ID": "0"}  # fmt: skip
        nodes[0].version(2, own.changed(env={"LR": "0.1"}).to_dict())
        version, got = _node_version(nodes[1], 2, own, env, base)
        assert version.env == {"LR": "0.1"}
        assert got == {"PATH": "/bin", "LR": "0.1", "FAILSLOW_ROLLBACK_BEFORE": "20",
                       "FAILSLOW_RESTART": "3"}  # fmt: skip
    finally:
        for node in nodes:
            node.store.close()


def test_an_unexplained_slowdown_s_rounds_take_every_node_s_stacks(
    tmp_path: Path, job_store
) -> None:
    """Node 0's controller found a slowdown unexplained (the trigger) while every rank trains
    on: each sample of node 0's rounds asks node 1 for its ranks' stacks, and rank 3 - node
    1's, in ``injected_slow_data`` - is the outlier of every union. After the rounds node 1
    evicts it (cause ``declined``) and every node restarts."""
    said: list[str] = []
    slow = {"decline_every_s": 0.5, "decline_rounds": 2, "decline_settle_s": 0.0}
    with _launchers(job_store.url, said, **slow) as launchers:
        groups, _ = _spawn_all(tmp_path, launchers, "slow", 0)
        launchers[0].decline_watch.trigger("the step time is up and nothing was localized")
        assert _wait_apart(groups) == [HUNG, HUNG], said
        (stop,) = groups[1].failstops
        assert (stop.rank, stop.replaced_by, stop.cause) == (3, 2, "declined"), said
        assert groups[0].failstops == [] and groups[0].remote["cause"] == "declined", said
        assert any("node 0: decline: ranks [3] flagged in 2 of 2 rounds" in x for x in said), said
        assert any("node 0: node 1's rank 3 slows the job" in x for x in said), said
        rounds = [json.loads(x) for x in (tmp_path / "state" / "declines.jsonl").open()]
        assert [r["flagged"] for r in rounds] == [["ranks", [3]], ["ranks", [3]]], rounds
