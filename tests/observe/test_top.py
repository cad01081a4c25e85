"""``failslow top``: the real CLI against a real control store written by the real writers.

A TCPStore (and, where ``redis-server`` is installed, a Redis server) holds what a job writes:
the control plane's status (:class:`StatusBoard` fed with journal events), rank 0's job record
and step times (:class:`JobReport`), each rank's tracker state (:class:`NodePublisher`), the
diagnoses. ``failslow top`` runs through the CLI's entry point in this process (a subprocess
per call would pay a torch import each); live mode runs as a real subprocess on a pty and a
pipe, and ``tests/node/test_run_controller.py`` runs it as a subprocess against a real job.
"""

from __future__ import annotations

import collections
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from failslow.capabilities import Capabilities
from failslow.core.control import keys
from failslow.core.control.journal import StatusBoard, event
from failslow.core.control.store import Store, open_store
from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink, SlowRank
from failslow.core.planner.plans import MicroBatchPlan, plan_to_dict
from failslow.core.topology import Topology
from failslow.core.tracking.analyzer import LocalAnalyzer
from failslow.errors import ConfigError, FailslowError
from failslow.node.publisher import NodePublisher
from failslow.observe import top as top_module
from failslow.observe.top import TopOptions, TopReader, run_top
from failslow.observe.top_view import fitted
from failslow.runtime.job_report import JobReport

CLI_TIMEOUT_S = 60


@pytest.fixture
def hosted() -> Any:
    store = open_store("tcp://127.0.0.1:0?master=1")
    try:
        yield store
    finally:
        store.close()


def populate(store: Store, tmp_path: Path, *, dp: int, slow_rank: int) -> list[int]:
    """A job of TP 2 x PP 2 x ``dp`` in ``store``, ``slow_rank`` twice as slow and diagnosed,
    an S2 plan in effect; its micro-batch counts."""
    topology = Topology.megatron(tp=2, dp=dp, pp=2, gpus_per_host=4, micro_batches=2 * dp)
    world = topology.world_size
    capabilities = Capabilities(
        microbatch_plans="", topology_plans="", snapshots="off", hot_update="off"
    )
    job = {"topology": topology.to_dict(), "capabilities": capabilities.to_dict()}
    steps = collections.deque([(s, 0.5 if s < 125 else 0.9) for s in range(100, 130)])
    report = JobReport(store, {**job, "world_size": world}, steps, every_s=0.01).start()
    assert store.wait([keys.JOB, keys.STEPS], 10.0)
    report.stop()

    publisher = NodePublisher(LocalAnalyzer(tmp_path / "rings"), store)
    for rank in range(world):
        factor = 2.0 if rank == slow_rank else 1.0 + (rank % 10) / 1000
        publisher.iterations[rank] = 140
        publisher.recent[rank] = collections.deque([0.5 * factor] * 9, maxlen=9)
        publisher.slow[rank] = rank == slow_rank
    publisher.publish_states()

    diagnosis = Diagnosis(
        Kind.COMPUTE,
        slow_ranks=(SlowRank(slow_rank, 2.0),),
        slow_links=(SlowLink(0, 1, 1.5),),
        evidence={"onsets": []},
    )
    n = store.add(keys.DIAGNOSES, 1)  # as the controller records it
    store.set(f"{keys.DIAGNOSES}/{n}", diagnosis.to_json().encode())
    counts = [2] * dp
    counts[topology.replica_of(slow_rank)] = 1
    counts[(topology.replica_of(slow_rank) + 1) % dp] = 3
    plan = plan_to_dict(MicroBatchPlan(counts=tuple(counts), weights=tuple(c / 2 for c in counts)))
    board = StatusBoard(store, world_size=world)
    board(event("state", state="profiling", detail={}))
    board(event("state", state="validating", detail={}))
    board(event("diagnosis", diagnosis=json.loads(diagnosis.to_json())))
    board(event("state", state="diagnosed", detail={}))
    board(event("steps", steps=[[129, 0.9]]))
    board(
        event(
            "plan",
            action="apply",
            strategy="S2 micro-batches",
            plan=plan,
            reason="S2 pays off after 3 steps [red]x1.5[/] \x1b[2J",
            apply_step=131,
            committed=True,
            detail="",
            in_effect=plan,
        )
    )
    return counts


def top(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``failslow top --store URL ARGS`` through the CLI's ``main``, 160 columns wide."""
    from contextlib import redirect_stderr, redirect_stdout

    from failslow.cli import main

    argv = ["top", "--store", url, *args]
    out, err = io.StringIO(), io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "160"
    try:
        with redirect_stdout(out), redirect_stderr(err):
            status = main(argv)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the ranks table, as cells."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[\u2502|]", line.strip())[1:-1]]
        if cells and cells[0].isdigit():
            rows.append(cells)
    return rows


def snapshot(store: Store) -> dict[str, bytes | None]:
    return {key: store.get(key) for key in store.keys("failslow/")}


def check_job_frame(frame: dict[str, Any], *, slow_rank: int, world: int, k: int) -> None:
    assert frame["waiting"] is False
    assert frame["job"]["world_size"] == world
    assert (frame["job"]["tp"], frame["job"]["pp"]) == (2, 2)
    assert frame["status"]["state"] == "diagnosed"
    assert frame["status"]["in_effect"]["type"] == "MicroBatchPlan"
    assert frame["status"]["last_action"]["apply_step"] == 131
    assert frame["diagnoses"]["count"] == 1
    assert frame["diagnoses"]["last"]["slow_ranks"] == [[slow_rank, 2.0]]
    ranks = frame["ranks"]
    assert len(ranks) == k
    assert ranks[0]["rank"] == slow_rank and ranks[0]["slow"] is True
    assert ranks[0]["x_median"] == pytest.approx(2.0, rel=0.05)
    assert [r["median_s"] for r in ranks] == sorted((r["median_s"] for r in ranks), reverse=True)
    assert frame["steps"][-1] == [129, 0.9]
    assert frame["aggregate"]["world_size"] == world
    assert frame["aggregate"]["slow"] >= 1
    assert frame["aggregate"]["max_s"] == pytest.approx(1.0)


def test_once_shows_the_slow_rank_the_diagnosis_and_the_plan(hosted, tmp_path) -> None:
    counts = populate(hosted, tmp_path, dp=4, slow_rank=6)
    before = snapshot(hosted)

    out = top(hosted.url, "--once", "--json")
    assert out.returncode == 0, out.stderr
    frame = json.loads(out.stdout)
    check_job_frame(frame, slow_rank=6, world=16, k=16)
    assert frame["aggregate"] | {"median_s": None} == {
        "world_size": 16, "sampled": False, "read": 16, "reporting": 16, "median_s": None,
        "p99_s": 1.0, "max_s": 1.0, "slow": 1, "transients": 0,
    }  # fmt: skip

    out = top(hosted.url, "--once", "--ranks", "4")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "16 ranks, TP 2 PP 2 DP 4, 4 hosts, mitigations S2 S3" in text
    assert "diagnosed for" in text and "1 diagnosis" in text and "step 129" in text
    assert "the 4 slowest ranks" in text
    rows = table_rows(text)
    assert len(rows) == 4
    assert rows[0][:2] == ["6", "140"] and rows[0][4:6] == ["x1.99", "SLOW"]
    assert not any("SLOW" in row for row in rows[1:])
    assert "16 of 16 ranks reporting" in text and "slow 1" in text
    assert "compute" in text and "ranks 6(x2.00)" in text and "links 0-1(x1.50)" in text
    assert f"S2 micro-batches per DP replica: {' '.join(map(str, counts))} (loss" in text
    assert "apply S2 micro-batches at step 131, committed: S2 pays off" in text
    assert "[red]x1.5[/] ?[2J" in text and "\x1b" not in text  # text, not markup or escapes
    assert "120-129 (s): 0.500 0.500 0.500 0.500 0.500 0.900 0.900" in text
    assert snapshot(hosted) == before  # the viewer wrote nothing


def test_a_store_without_a_job_is_waited_for(hosted) -> None:
    out = top(hosted.url, "--once")
    assert out.returncode == 0, out.stderr
    assert "waiting for the job" in out.stdout
    out = top(hosted.url, "--once", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["waiting"] is True


def test_an_unreachable_store_is_one_line_and_exit_2(unused_port) -> None:
    started = time.monotonic()
    out = top(f"tcp://127.0.0.1:{unused_port}", "--once")
    assert out.returncode == 2
    assert time.monotonic() - started < top_module.CONNECT_S + 20
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{unused_port}" in lines[0], out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (TopOptions("tcp://127.0.0.1", once=True), "no port"),
        (TopOptions("http://127.0.0.1:80", once=True), "unknown scheme"),
        (TopOptions("tcp://127.0.0.1:0?master=1", once=True), "would host a new, empty store"),
        (TopOptions("tcp://127.0.0.1:1234", as_json=True), "--json needs --once"),
        (TopOptions("tcp://127.0.0.1:1234", ranks=0), "--ranks must be >= 1"),
        (TopOptions("tcp://127.0.0.1:1234", interval_s=0.0), "--interval must be > 0"),
    ],
)
def test_bad_input_is_one_line_error(options, says) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        run_top(options)
    assert "\n" not in str(info.value)


def test_bad_url_through_the_cli(unused_port) -> None:
    out = top("tcp://127.0.0.1", "--once")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1 and "no port" in out.stderr


@pytest.mark.parametrize(
    "status",
    [
        {"world_size": 4, "state": "tracking", "since": "yesterday", "diagnoses": 0},  # drawing
        {"world_size": 4, "state": "tracking", "since": 0.0, "diagnoses": "many"},  # reading
        [1, 2, 3],
    ],
)
def test_a_record_of_another_shape_is_one_line(hosted, monkeypatch, capsys, status) -> None:
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")  # run_top sets it when unset
    hosted.set_json(keys.STATUS, status)
    if isinstance(status, list):  # not an object: as if there were no status yet
        assert run_top(TopOptions(hosted.url, once=True)) == 0
        assert "waiting for the job" in capsys.readouterr().out
        return
    with pytest.raises(FailslowError, match="a record is not as failslow writes it") as info:
        run_top(TopOptions(hosted.url, once=True))
    assert "\n" not in str(info.value)


def test_transients_are_shown_per_rank_and_summed(hosted, tmp_path) -> None:
    """Issue 47: a rank's transients (slowdowns its detector verified that were over before
    they persisted - no fail-slow, no pause) are a column and a sum, beside the slow flag."""
    populate(hosted, tmp_path, dp=1, slow_rank=2)
    for rank, count in ((1, 3), (2, 1)):
        record = hosted.get_json(f"{keys.NODE}/ranks/{rank}")
        hosted.set_json(f"{keys.NODE}/ranks/{rank}", {**record, "transients": count})
    frame = TopReader(hosted, ranks=4, url=hosted.url).frame()
    assert {r["rank"]: r["transients"] for r in frame["ranks"]} == {0: 0, 1: 3, 2: 1, 3: 0}
    assert frame["aggregate"]["transients"] == 4

    out = top(hosted.url, "--once")
    assert out.returncode == 0, out.stderr
    assert "transients" in out.stdout and "slow 1, transients 4" in out.stdout
    rows = {row[0]: row for row in table_rows(out.stdout)}
    assert rows["2"][5:7] == ["SLOW", "1"] and rows["1"][5:7] == ["", "3"]


def test_rank_records_of_another_shape_are_skipped(hosted) -> None:
    StatusBoard(hosted, world_size=4)(event("state", state="profiling", detail={}))
    hosted.set(f"{keys.NODE}/ranks/0", b"not json")
    hosted.set_json(f"{keys.NODE}/ranks/1", {"median_s": "slow", "last_s": 1.0})
    hosted.set_json(f"{keys.NODE}/ranks/2", {"median_s": 0.5, "last_s": 0.5, "wall": 1.0})
    frame = TopReader(hosted, ranks=16, url=hosted.url).frame()
    assert [r["rank"] for r in frame["ranks"]] == [2]
    assert frame["aggregate"]["reporting"] == 1 and frame["job"] is None


def test_a_large_job_shows_k_rows_and_the_aggregate(hosted, tmp_path) -> None:
    # 300 ranks: sampled; the first frame's sweep reads the odd ranks, the diagnosis pins 278
    populate(hosted, tmp_path, dp=75, slow_rank=278)
    out = top(hosted.url, "--once", "--json", "--ranks", "5")
    assert out.returncode == 0, out.stderr
    frame = json.loads(out.stdout)
    check_job_frame(frame, slow_rank=278, world=300, k=5)
    agg = frame["aggregate"]
    assert agg["sampled"] is True and agg["read"] <= top_module.SAMPLE_READS
    assert agg["reporting"] == agg["read"] < 300

    out = top(hosted.url, "--once", "--ranks", "5")
    assert out.returncode == 0, out.stderr
    assert "the 5 slowest ranks" in out.stdout
    rows = table_rows(out.stdout)
    assert len(rows) == 5 and rows[0][0] == "278" and rows[0][5] == "SLOW"
    assert "ranks known of 300 (sampled" in out.stdout and "p99" in out.stdout
    replica = 278 // 2 % 75  # Megatron's order: rank = tp + TP * (dp + DP * pp)
    assert (
        f"2 each of 75, except replica {replica}: 1 (weight 0.50), replica {replica + 1}: 3"
        in out.stdout
    )


def test_successive_frames_sweep_every_rank(hosted, tmp_path) -> None:
    populate(hosted, tmp_path, dp=75, slow_rank=4)
    reader = TopReader(hosted, ranks=16, url=hosted.url)
    frames = [reader.frame() for _ in range(3)]
    assert all(f["aggregate"]["read"] <= top_module.SAMPLE_READS for f in frames)
    assert frames[0]["aggregate"]["reporting"] < 300 == frames[-1]["aggregate"]["reporting"]
    assert all(f["ranks"][0]["rank"] == 4 for f in frames)
    assert frames[-1]["aggregate"]["median_s"] == pytest.approx(0.5, rel=0.01)


def test_an_unrelieved_onset_pins_its_rank(hosted, tmp_path) -> None:
    populate(hosted, tmp_path, dp=75, slow_rank=4)
    hosted.set_json(keys.STATUS, {**hosted.get_json(keys.STATUS), "last_diagnosis": None})
    assert TopReader(hosted, ranks=16, url=hosted.url).frame()["ranks"][0]["rank"] != 4
    onsets = f"{keys.NODE}/onsets"
    for rank, kind in [(4, "onset"), (8, "onset"), (8, "relief")]:  # NodePublisher's records
        record = {"rank": rank, "type": kind, "iteration": 130, "reported_at": 131,
                  "before_s": 0.5, "after_s": 1.0, "wall": time.time()}  # fmt: skip
        hosted.set_json(f"{onsets}/{hosted.add(onsets, 1)}", record)
    reader = TopReader(hosted, ranks=16, url=hosted.url)
    assert reader.frame()["ranks"][0]["rank"] == 4
    assert reader._unrelieved() == [4]


def read_until(fd: int, done: Any, timeout_s: float = CLI_TIMEOUT_S) -> bytes:
    """Read ``fd`` until ``done(everything read)`` or EOF or the timeout."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while not done(seen) and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty whose other end closed
                break
            if not chunk:
                break
            seen += chunk
    return seen


def interrupt(proc: subprocess.Popen[bytes]) -> str:
    """Ctrl-C; the exit status must be 0 and stderr empty. Returns stderr."""
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    assert "Traceback" not in stderr and stderr.strip() == "", stderr
    return stderr


def start_top(url: str, stdout: int) -> subprocess.Popen[bytes]:
    """``failslow top`` as from a terminal, where Ctrl-C reaches it: SIGINT at its default
    (a suite started in the background of a non-interactive shell - ``./dev test &`` - ignores
    SIGINT, and every process it starts inherits that; top then never sees the Ctrl-C)."""
    return subprocess.Popen(
        [sys.executable, "-m", "failslow.cli", "top", "--store", url, "--interval", "0.2"],
        stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
        env={**os.environ, "TERM": "xterm"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


def test_live_mode_redraws_until_ctrl_c(hosted, tmp_path) -> None:
    populate(hosted, tmp_path, dp=2, slow_rank=1)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 140, 0, 0))
    proc = start_top(hosted.url, slave)
    os.close(slave)
    try:
        seen = read_until(master, lambda seen: seen.count(b"failslow top") >= 3)
        assert seen.count(b"failslow top") >= 3, seen[-2000:]
        assert b"SLOW" in seen and b"\x1b[" in seen  # drawn in place, in colour
        interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_live_frames_fit_the_terminal(hosted, tmp_path) -> None:
    """Live mode drops rank rows, never the diagnosis and the plan below the table."""
    populate(hosted, tmp_path, dp=4, slow_rank=6)
    frame = TopReader(hosted, ranks=16, url=hosted.url).frame()
    console = Console(
        file=io.StringIO(), width=100, height=24, force_terminal=True, color_system=None
    )
    console.print(fitted(frame, console))
    text = console.file.getvalue()
    shown = len(table_rows(text))
    assert len(text.splitlines()) < 24 and 1 <= shown < 16
    assert f"the {shown} slowest ranks" in text and table_rows(text)[0][0] == "6"
    assert "action     apply S2" in text and "steps      120-129" in text


def test_on_a_pipe_frames_follow_each_other_and_a_lost_store_is_retried(tmp_path) -> None:
    store = open_store("tcp://127.0.0.1:0?master=1")
    populate(store, tmp_path, dp=2, slow_rank=1)
    proc = start_top(store.url, subprocess.PIPE)
    assert proc.stdout is not None
    out = proc.stdout.fileno()
    try:
        seen = read_until(out, lambda seen: seen.count(b"failslow top") >= 2)
        assert seen.count(b"failslow top") >= 2 and b"SLOW" in seen, seen[-2000:]
        store.close()  # the job's store goes away
        seen = read_until(out, lambda seen: b"(retrying)" in seen)
        assert b"(retrying)" in seen and b"control store" in seen, seen[-2000:]
        interrupt(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_on_redis(redis_server, tmp_path) -> None:
    import redis

    with open_store(redis_server.url) as store:
        populate(store, tmp_path, dp=4, slow_rank=9)
    raw = redis.Redis.from_url(redis_server.url)
    before = {k: raw.dump(k) for k in raw.keys("*")}

    out = top(redis_server.url, "--once", "--json")
    assert out.returncode == 0, out.stderr
    check_job_frame(json.loads(out.stdout), slow_rank=9, world=16, k=16)
    assert {k: raw.dump(k) for k in raw.keys("*")} == before  # read-only
    raw.close()
