"""The LD_PRELOAD NCCL shim against a stub libnccl built here (greyhound 4.2, 6).

gcc builds a stub ``libnccl.so.2`` (pnccl* + weak nccl* like real NCCL), a consumer library
linked to it and loaded with RTLD_LOCAL by a small C driver (the way torch loads NCCL), and the
shim from the package sources. The driver runs under ``LD_PRELOAD=<shim>``; the assertions read
the ring with :class:`failslow.core.ring.RingReader` and the membership lines with
:func:`read_members`.
"""

from __future__ import annotations

import mmap
import re
import struct
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from failslow.core import events as ev
from failslow.core import ring as rg
from failslow.core.events import DType, Flags, OpCode, Source, records_to_events
from failslow.core.group_files import merge_members, read_members
from failslow.core.ring import RingReader, find_rings

sys.path.insert(0, str(Path(__file__).parent / "stub"))
from shim_rig import Rig, build_cudart, build_rig, clean_env, have_gcc

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not have_gcc(), reason="gcc is not on PATH: cannot build the stub NCCL"),
    pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD shim is Linux-only"),
]

OFF = {name: off for name, _, off in rg.HEADER_LAYOUT}


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Rig:
    return build_rig(tmp_path_factory.mktemp("rig"))


@pytest.fixture(scope="module")
def old_rig(tmp_path_factory: pytest.TempPathFactory, rig: Rig) -> Rig:
    return build_rig(tmp_path_factory.mktemp("old_rig"), old=True, shim=rig.shim)


def run(rig: Rig, *args: str, preload: bool = True, **env: object) -> subprocess.CompletedProcess:
    full = clean_env(**{k: str(v) for k, v in env.items()})
    if preload:
        full["LD_PRELOAD"] = str(rig.shim)
    out = subprocess.run(
        [str(rig.driver), str(rig.consumer), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"driver failed ({out.returncode}): {out.stdout}{out.stderr}"
    return out


def start(rig: Rig, *args: str, **env: object) -> subprocess.Popen:
    full = clean_env(LD_PRELOAD=rig.shim, **{k: str(v) for k, v in env.items()})
    return subprocess.Popen(
        [str(rig.driver), str(rig.consumer), *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def only_ring(directory: Path) -> Path:
    rings = find_rings(directory)
    assert len(rings) == 1, rings
    return rings[0]


def read_all(ring: Path) -> tuple[list[ev.CommEvent], RingReader]:
    reader = RingReader(ring)
    return records_to_events(reader.poll()), reader


def header_word(mm: mmap.mmap, name: str) -> int:
    return struct.unpack_from("<Q", mm, OFF[name])[0]


def wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# ---- layout ----


def test_c_layout_matches_events_py(tmp_path: Path) -> None:
    from shim_rig import HERE, NATIVE, _gcc

    exe = tmp_path / "layout"
    _gcc("-Wall", f"-I{NATIVE}", "-o", exe, HERE / "layout.c")
    lines = [line.split() for line in subprocess.check_output([str(exe)], text=True).splitlines()]
    got: dict[str, dict[str, tuple[int, ...]]] = {}
    for kind, name, *nums in lines:
        got.setdefault(kind, {})[name] = tuple(int(n) for n in nums)
    for kind, layout in (("header", rg.HEADER_LAYOUT), ("record", ev.RECORD_LAYOUT)):
        expected = {name: (off, np.dtype(fmt).itemsize) for name, fmt, off in layout}
        assert got[kind] == expected, kind
    for kind, enum in (("op", OpCode), ("dtype", DType), ("source", Source), ("flag", Flags)):
        members = enum.__members__.items()
        assert got[kind] == {name: (int(m.value),) for name, m in members}, kind
    assert got["const"] == {
        "HEADER_SIZE": (rg.HEADER_SIZE,),
        "RECORD_SIZE": (ev.RECORD_SIZE,),
        "RING_MAGIC": (rg.RING_MAGIC,),
        "RING_VERSION": (rg.RING_VERSION,),
        "DEFAULT_CAPACITY": (rg.DEFAULT_CAPACITY,),
    }


# ---- what gets recorded ----


def test_every_op_with_bytes_timings_and_reentrancy(rig: Rig, tmp_path: Path) -> None:
    run(
        rig,
        "basic",
        "1",
        FAILSLOW_RING_DIR=tmp_path,
        RANK=0,
        STUB_WORLD=2,
        LOCAL_RANK=0,
        STUB_NCCL_DELAY_US=2000,
    )
    ring = only_ring(tmp_path)
    assert ring.name.startswith("rank00000-pid")
    events, reader = read_all(ring)
    assert reader.global_rank == 0 and reader.dropped == 0
    assert int(reader.header["local_rank"]) == 0
    seq = [(e.op, e.nbytes, e.dtype, e.peer) for e in events]
    w = 2
    assert seq[:13] == [
        (OpCode.ALLREDUCE, 4000, DType.FLOAT32, -1),
        (OpCode.ALLGATHER, 512, DType.FLOAT16, -1),  # the send count
        (OpCode.REDUCE_SCATTER, 800 * w, DType.FLOAT64, -1),  # this rank's input
        (OpCode.BROADCAST, 40, DType.INT32, 1),
        (OpCode.BROADCAST, 7, DType.INT8, 0),  # ncclBcast -> ncclBroadcast, recorded once
        (OpCode.REDUCE, 24, DType.INT64, 0),
        (OpCode.ALLTOALL, 20 * w, DType.FLOAT32, -1),
        (OpCode.GATHER, 6, DType.UINT8, 0),
        (OpCode.SCATTER, 8 * w, DType.BFLOAT16, 0),  # input on the root only
        (OpCode.GROUP_START, 0, DType.UNKNOWN, -1),
        (OpCode.SEND, 22, DType.BFLOAT16, 1),
        (OpCode.RECV, 22, DType.BFLOAT16, 1),
        (OpCode.GROUP_END, 0, DType.UNKNOWN, -1),
    ]
    assert [e.op for e in events[13:]] == [OpCode.ALLREDUCE] * 4
    assert all(e.source == Source.SHIM for e in events)
    assert all(e.flags == Flags.END_IS_ENQUEUE for e in events)
    for e in events:
        assert 0 < e.t_start_ns <= e.t_end_ns
        collective = e.op not in (OpCode.GROUP_START, OpCode.GROUP_END)
        assert (e.duration_ns >= 2_000_000) == collective, e  # the stub's delay
    starts = [e.t_start_ns for e in events]
    assert starts == sorted(starts)
    # call_index counts per communicator: 11 calls on comm a, group start/end on their own
    a_key = events[0].group_key
    assert [e.call_index for e in events if e.group_key == a_key] == list(range(11))
    assert [e.call_index for e in events if e.group_key == 0] == [0, 1]


def test_pass_through_without_ring_dir(rig: Rig, tmp_path: Path) -> None:
    out = run(rig, "basic", "1", RANK=0, STUB_WORLD=2)
    assert "ok basic" in out.stdout and out.stderr == ""
    assert find_rings(tmp_path) == []


def test_unwritable_ring_dir_is_one_line_then_pass_through(rig: Rig, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = run(rig, "basic", "1", FAILSLOW_RING_DIR=blocker / "sub", RANK=0, STUB_WORLD=2)
    assert "ok basic" in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot create ring" in lines[0], out.stderr


WARM_SCRIPT = """
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)  # as torch loads libnccl
args = (ctypes.c_char_p * 2)(b"basic", b"1")
sys.exit(lib.fls_scenario(2, args))
"""


@pytest.mark.parametrize("told", ["replay", "none"])
def test_a_warm_process_s_shim_records_where_its_activation_says(
    rig: Rig, tmp_path: Path, told: str
) -> None:
    """A warm rank process (failslow.node.warm) starts with the job's environment, shim
    preloaded, and is given its rank - and a replay group's ring directory, or none for a
    stop-time check - only at activation. The shim opens its ring at the first NCCL call, so
    it must record where the activation says: a replay's ranks in ``replay-<name>`` (the node
    analyzer would take rank 0 there for a restart of the job's rank 0), a check nowhere."""
    import json
    import socket

    job_rings, replay_rings = tmp_path / "rings", tmp_path / "rings" / "replay-h0"
    job_rings.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(WARM_SCRIPT)
    ours, theirs = socket.socketpair()
    env = clean_env(
        LD_PRELOAD=rig.shim, FAILSLOW_RING_DIR=job_rings, FAILSLOW_WARM_FD=theirs.fileno(),
        FAILSLOW_WARM_PRELOAD="ctypes",
    )  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "failslow.node.warm"], env=env, pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    theirs.close()
    with ours:
        assert ours.makefile().readline() == "ready\n"
        rank_env = clean_env(LD_PRELOAD=rig.shim, RANK=0, STUB_WORLD=1)
        if told == "replay":
            rank_env["FAILSLOW_RING_DIR"] = str(replay_rings)
        message = {"env": rank_env, "cwd": str(tmp_path), "argv": [str(script), str(rig.consumer)]}
        ours.sendall(json.dumps(message).encode() + b"\n")
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and "ok basic" in out, out
    assert find_rings(job_rings) == [], "the job's own ring directory got the ring"
    if told == "replay":
        (ring,) = find_rings(replay_rings)
        plain = tmp_path / "plain"  # the same scenario in a process started as rank 0
        run(rig, "basic", "1", FAILSLOW_RING_DIR=plain, RANK=0, STUB_WORLD=1)
        got, want = RingReader(ring), RingReader(only_ring(plain))
        try:
            assert got.global_rank == 0
            assert [tuple(r) for r in got.poll()[["op", "nbytes", "group_key"]]] == [
                tuple(r) for r in want.poll()[["op", "nbytes", "group_key"]]
            ]
        finally:
            got.close()
            want.close()
    else:
        assert not replay_rings.exists()


def test_device_timing_without_cuda_disables_cleanly(rig: Rig, tmp_path: Path) -> None:
    out = run(
        rig,
        "basic",
        "1",
        FAILSLOW_RING_DIR=tmp_path,
        FAILSLOW_DEVICE_TIMING=1,
        RANK=0,
        STUB_WORLD=2,
    )
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA runtime" in lines[0], out.stderr
    events, _ = read_all(only_ring(tmp_path))
    assert len(events) == 17 and all(e.flags == Flags.END_IS_ENQUEUE for e in events)


def test_device_timing_times_every_call_and_grouped_ones_from_the_groups_launch(
    rig: Rig, tmp_path: Path
) -> None:
    """PyTorch issues its collectives inside ncclGroupStart/End; NCCL launches them at the
    group's end. A grouped call's end event is recorded there, after the launch (the stub's
    group end takes 30 ms, so a grouped call's device time spans it), not at the call."""
    cudart = build_cudart(rig.directory)
    run(rig, "basic", "1", preload=False, LD_PRELOAD=f"{rig.shim}:{cudart}",
        FAILSLOW_RING_DIR=tmp_path, FAILSLOW_DEVICE_TIMING=1, RANK=0, STUB_WORLD=2,
        STUB_GROUP_END_DELAY_US=30000, STUB_EXIT_DELAY_MS=200)  # fmt: skip
    events, _ = read_all(only_ring(tmp_path))
    assert len(events) == 17
    groups = {ev.OpCode.GROUP_START, ev.OpCode.GROUP_END}
    for e in events:
        if e.op in groups:  # no stream: the group calls keep their host times
            assert e.flags == Flags.END_IS_ENQUEUE
            continue
        assert e.flags == Flags.NONE, e
        grouped = e.op in (ev.OpCode.SEND, ev.OpCode.RECV)
        assert (e.duration_ns >= 30_000_000) == grouped, e


def test_device_timing_reuses_its_events(rig: Rig, tmp_path: Path) -> None:
    """Completed calls give their two events back for the next calls (an H200 spent ~10 us a
    call creating them, benchmarks/gpu row 3): 2,000 timed calls create far fewer than the
    4,000 events one pair per call would, and every call is still device-timed."""
    cudart = build_cudart(rig.directory)
    out = run(rig, "loop", "2000", "200", preload=False, LD_PRELOAD=f"{rig.shim}:{cudart}",
              FAILSLOW_RING_DIR=tmp_path, FAILSLOW_DEVICE_TIMING=1, RANK=0, STUB_WORLD=1,
              STUB_EXIT_DELAY_MS=200, STUB_CUDART_COUNT=1)  # fmt: skip
    (created,) = re.findall(r"cudart stub: (\d+) events created", out.stderr)
    events, _ = read_all(only_ring(tmp_path))
    timed = [e for e in events if e.op == ev.OpCode.ALLREDUCE]
    assert len(timed) == 2000 and all(e.flags == Flags.NONE for e in timed)
    # calls in flight between two harvests (every 0.5 ms; longer on a loaded machine) need
    # events of their own: a few dozen, not thousands
    assert int(created) <= 1000, out.stderr


# ---- membership ----


def test_membership_equal_keys_across_ranks_and_splits(rig: Rig, tmp_path: Path) -> None:
    world = 4
    procs = [
        start(rig, "basic", "42", FAILSLOW_RING_DIR=tmp_path, RANK=r, STUB_WORLD=world)
        for r in range(world)
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out + err
    rings = find_rings(tmp_path)
    assert len(rings) == world
    members = [m for ring in rings for m in read_members(ring)]
    groups = merge_members(members)
    # comm a and b: all 4 ranks; split 1: {0,2} and {1,3}; split 2: {0,1,2}; split 3: all
    by_ranks = Counter(g.ranks for g in groups.values())
    assert by_ranks == Counter({(0, 1, 2, 3): 3, (0, 2): 1, (1, 3): 1, (0, 1, 2): 1})
    assert len(groups) == 6 and all(g.backend == "nccl" for g in groups.values())
    (a_key,) = {m.parent_key for m in members if m.parent_key}
    assert all(m.color == -1 for m in members if m.parent_key == 0)
    assert {m.color for m in members if m.parent_key} == {0, 1}
    # the records of every rank carry the group keys of the merged groups
    for ring in rings:
        events, _ = read_all(ring)
        keys = {e.group_key for e in events} - {0}
        assert a_key in keys and keys <= set(groups)


def test_nccl_comm_id_repeated_unique_ids_get_distinct_keys(rig: Rig, tmp_path: Path) -> None:
    procs = [
        start(
            rig,
            "commid",
            FAILSLOW_RING_DIR=tmp_path,
            RANK=r,
            STUB_WORLD=2,
            NCCL_COMM_ID="10.0.0.1:29500",
        )
        for r in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, out + err
    members = [m for ring in find_rings(tmp_path) for m in read_members(ring)]
    groups = merge_members(members)
    assert len(members) == 4 and len(groups) == 2
    assert all(g.ranks == (0, 1) for g in groups.values())


def test_init_all_one_process_many_members(rig: Rig, tmp_path: Path) -> None:
    run(rig, "initall", FAILSLOW_RING_DIR=tmp_path, RANK=3)
    ring = only_ring(tmp_path)
    groups = merge_members(read_members(ring))
    assert next(iter(groups.values())).ranks == (3, 3)
    events, _ = read_all(ring)
    assert [e.group_key for e in events] == [next(iter(groups))] * 2


# ---- pause trap ----


def test_pause_parks_and_resume_releases(rig: Rig, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    p = start(
        rig,
        "loop",
        "0",
        "200",
        str(stop),
        FAILSLOW_RING_DIR=tmp_path,
        RANK=0,
        FAILSLOW_PAUSE_TIMEOUT_S=30,
    )
    try:
        wait_for(lambda: find_rings(tmp_path), what="the ring")
        ring = only_ring(tmp_path)
        with open(ring, "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), 0)
        wait_for(lambda: header_word(mm, "write_index") > 5, what="records")
        struct.pack_into("<Q", mm, OFF["control"], 1)
        wait_for(lambda: header_word(mm, "parked") != 0, what="the driver to park")
        parked_at = header_word(mm, "write_index")
        assert header_word(mm, "parked") == parked_at + 1
        time.sleep(0.3)
        assert header_word(mm, "write_index") == parked_at  # no new records while parked
        struct.pack_into("<Q", mm, OFF["control"], 0)
        wait_for(lambda: header_word(mm, "write_index") > parked_at + 3, what="resume")
        assert header_word(mm, "parked") == 0 and header_word(mm, "self_releases") == 0
    finally:
        stop.touch()
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and err == "", out + err
    events, reader = read_all(ring)
    assert reader.dropped == 0
    gaps = np.diff([e.t_start_ns for e in events])
    assert gaps.max() >= 300_000_000  # the pause shows up as one long gap


def test_targeted_pause_parks_at_that_groups_call_index(rig: Rig, tmp_path: Path) -> None:
    """pause_group/pause_call: the shim parks right before the call that would get
    call_index == pause_call on that communicator (every member parks at the same one)."""
    stop = tmp_path / "stop"
    p = start(
        rig,
        "loop",
        "0",
        "200",
        str(stop),
        FAILSLOW_RING_DIR=tmp_path,
        RANK=0,
        FAILSLOW_PAUSE_TIMEOUT_S=30,
    )
    try:
        wait_for(lambda: find_rings(tmp_path), what="the ring")
        ring = only_ring(tmp_path)
        with open(ring, "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), 0)
        wait_for(lambda: header_word(mm, "write_index") > 5, what="records")
        (key,) = {e.group_key for e in read_all(ring)[0] if e.group_key}
        target = header_word(mm, "write_index") + 25
        struct.pack_into("<Q", mm, OFF["pause_group"], key)
        struct.pack_into("<Q", mm, OFF["pause_call"], target)
        struct.pack_into("<Q", mm, OFF["control"], 7)
        wait_for(lambda: header_word(mm, "parked") != 0, what="the driver to park")
        time.sleep(0.2)
        events, _ = read_all(ring)
        assert max(e.call_index for e in events if e.group_key == key) == target - 1
        struct.pack_into("<Q", mm, OFF["control"], 0)
        wait_for(lambda: header_word(mm, "write_index") > target + 3, what="resume")
    finally:
        stop.touch()
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and err == "", out + err


def test_pause_releases_itself_when_the_controller_is_gone(rig: Rig, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    p = start(
        rig,
        "loop",
        "0",
        "200",
        str(stop),
        FAILSLOW_RING_DIR=tmp_path,
        RANK=0,
        FAILSLOW_PAUSE_TIMEOUT_S=0.3,
    )
    try:
        wait_for(lambda: find_rings(tmp_path), what="the ring")
        with open(only_ring(tmp_path), "r+b") as fh:
            mm = mmap.mmap(fh.fileno(), 0)
        wait_for(lambda: header_word(mm, "write_index") > 5, what="records")
        struct.pack_into("<Q", mm, OFF["control"], 7)  # and the controller "dies"
        wait_for(lambda: header_word(mm, "parked") != 0, what="the driver to park")
        t_parked = time.monotonic()
        wait_for(lambda: header_word(mm, "self_releases") == 1, what="self release")
        assert time.monotonic() - t_parked >= 0.2
        wait_for(lambda: header_word(mm, "parked") == 0, what="parked cleared")
        at = header_word(mm, "write_index")
        # the same stale control value does not park it again
        wait_for(lambda: header_word(mm, "write_index") > at + 20, what="progress")
        assert header_word(mm, "self_releases") == 1
        # a new pause request (0, then another value) is honoured again
        struct.pack_into("<Q", mm, OFF["control"], 0)
        time.sleep(0.05)
        struct.pack_into("<Q", mm, OFF["control"], 8)
        wait_for(lambda: header_word(mm, "parked") != 0, what="the second park")
        struct.pack_into("<Q", mm, OFF["control"], 0)
        wait_for(lambda: header_word(mm, "parked") == 0, what="the second resume")
        assert header_word(mm, "self_releases") == 1
    finally:
        stop.touch()
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, out + err
    assert err.count("resuming on my own") == 1, err


# ---- ring overflow and threads ----


def test_overflow_is_counted_as_drops_without_torn_records(rig: Rig, tmp_path: Path) -> None:
    run(
        rig,
        "loop",
        "100",
        FAILSLOW_RING_DIR=tmp_path,
        RANK=1,
        STUB_WORLD=2,
        FAILSLOW_RING_CAPACITY=16,
    )
    events, reader = read_all(only_ring(tmp_path))
    assert reader.capacity == 16 and reader.write_index == 100
    assert reader.dropped == 84 and len(events) == 16
    assert [e.call_index for e in events] == list(range(84, 100))
    assert all(e.op == OpCode.ALLREDUCE and e.nbytes == 256 for e in events)


def test_threads_record_every_call_once(rig: Rig, tmp_path: Path) -> None:
    threads, calls = 4, 3000
    run(rig, "threads", str(threads), str(calls), FAILSLOW_RING_DIR=tmp_path, RANK=0)
    reader = RingReader(only_ring(tmp_path))
    records = reader.poll()
    assert reader.dropped == 0 and len(records) == 2 * threads * calls
    assert reader.write_index == len(records)
    events = records_to_events(records)
    by_key: dict[int, list[int]] = {}
    for e in events:
        by_key.setdefault(e.group_key, []).append(e.call_index)
    assert len(by_key) == threads + 1
    for key, indices in by_key.items():
        assert sorted(indices) == list(range(len(indices))), key  # unique, no gaps
    sizes = Counter(e.nbytes for e in events)
    assert sizes == Counter({100: threads * calls, **{i + 1: calls for i in range(threads)}})


# ---- resolution ----


def resolve(shim: Path, lib: Path | str) -> tuple[int, dict[str, str]]:
    code = (
        "import ctypes, sys\n"
        "shim = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)\n"
        "buf = ctypes.create_string_buffer(8192)\n"
        "n = shim.failslow_shim_resolve(sys.argv[2].encode(), buf, len(buf))\n"
        "print(n); print(buf.value.decode(), end='')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(shim), str(lib)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=True,
    ).stdout
    first, *rest = out.splitlines()
    return int(first), dict(line.split("\t", 1) for line in rest)


def test_resolve_reports_every_hooked_symbol(rig: Rig, old_rig: Rig) -> None:
    from failslow.nccl_hook.native import HOOKED_SYMBOLS, OPTIONAL_SYMBOLS

    n, table = resolve(rig.shim, rig.stub)
    assert tuple(table) == HOOKED_SYMBOLS and n == len(HOOKED_SYMBOLS)
    assert set(table.values()) == {"pnccl"}
    n, table = resolve(rig.shim, old_rig.stub)
    missing = {k for k, v in table.items() if v == "missing"}
    assert missing == set(OPTIONAL_SYMBOLS) and n == len(HOOKED_SYMBOLS) - len(missing)
    n, table = resolve(rig.shim, "/nonexistent/libnccl.so.2")
    assert n == -1 and "error" in table


def test_older_nccl_without_some_symbols_is_tolerated(old_rig: Rig, tmp_path: Path) -> None:
    out = run(old_rig, "basic", "1", FAILSLOW_RING_DIR=tmp_path, RANK=0, STUB_WORLD=2)
    assert out.stderr == ""
    events, _ = read_all(only_ring(tmp_path))
    assert len(events) == 10  # the 6 old collectives + the send/recv group
    out = run(old_rig, "split_via_default", FAILSLOW_RING_DIR=tmp_path, RANK=0)
    assert "split found result 2" in out.stdout  # ncclSystemError, no crash
    assert out.stderr.count("no real function") == 1 and "ncclCommSplit" in out.stderr


def test_installed_shim_exports_the_same_entry_points(rig: Rig) -> None:
    from failslow.nccl_hook import native

    if not native.native_available():
        pytest.skip("the package was installed without the shim (FAILSLOW_SKIP_NATIVE?)")
    n, table = resolve(native.shim_path(), rig.stub)
    assert n == len(native.HOOKED_SYMBOLS) and set(table.values()) == {"pnccl"}


def test_shim_path_names_the_fix_when_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from failslow.errors import FailslowError
    from failslow.nccl_hook import native

    monkeypatch.setattr(native, "LIBRARY_NAME", "libfailslow_nccl_missing.so")
    with pytest.raises(FailslowError, match=r"not built.*FAILSLOW_SKIP_NATIVE"):
        native.shim_path()
    assert native.native_available() is False
