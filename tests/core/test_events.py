"""The event ring: layout, commit protocol, drops, torn records, concurrent writers."""

from __future__ import annotations

import multiprocessing as mp
import os
import struct
import threading
import time

import numpy as np
import pytest

from failslow.core.events import (
    RECORD_DTYPE,
    RECORD_SIZE,
    CommEvent,
    GroupInfo,
    OpCode,
    Source,
    events_to_records,
    group_key,
    records_to_events,
)
from failslow.core.ring import (
    HEADER_DTYPE,
    HEADER_SIZE,
    RingFormatError,
    RingReader,
    RingWriter,
    ring_path,
)


def _write(writer: RingWriter, i: int) -> None:
    writer.write(
        t_start_ns=1000 + i, t_end_ns=2000 + i, nbytes=4 * i, group_key=7, op=OpCode.ALLREDUCE,
        call_index=i,
    )


def test_layout_sizes_are_the_documented_ones() -> None:
    assert HEADER_DTYPE.itemsize == HEADER_SIZE == 256
    assert RECORD_DTYPE.itemsize == RECORD_SIZE == 64
    offsets = {name: RECORD_DTYPE.fields[name][1] for name in RECORD_DTYPE.names}
    assert offsets == {
        "commit": 0, "t_start_ns": 8, "t_end_ns": 16, "nbytes": 24, "group_key": 32,
        "call_index": 40, "op": 48, "dtype": 50, "source": 52, "flags": 53, "peer": 56,
    }


def test_roundtrip_and_incremental_poll(tmp_path) -> None:
    writer = RingWriter(ring_path(tmp_path, 3, 99), capacity=16, global_rank=3)
    reader = RingReader(writer.path)
    assert reader.global_rank == 3 and reader.capacity == 16
    for i in range(5):
        _write(writer, i)
    first = reader.poll()
    assert list(first["call_index"]) == [0, 1, 2, 3, 4]
    assert len(reader.poll()) == 0
    _write(writer, 5)
    events = records_to_events(reader.poll())
    assert events == [
        CommEvent(t_start_ns=1005, t_end_ns=2005, nbytes=20, group_key=7, op=OpCode.ALLREDUCE,
                  source=Source.PYTHON, call_index=5)
    ]
    assert reader.dropped == 0


def test_lapped_reader_counts_drops_and_keeps_newest(tmp_path) -> None:
    writer = RingWriter(tmp_path / "r.ring", capacity=8)
    reader = RingReader(writer.path)
    for i in range(30):
        _write(writer, i)
    got = reader.poll()
    assert list(got["call_index"]) == list(range(22, 30))
    assert reader.dropped == 22


def test_uncommitted_slot_is_never_returned(tmp_path) -> None:
    writer = RingWriter(tmp_path / "r.ring", capacity=8)
    reader = RingReader(writer.path)
    for i in range(3):
        _write(writer, i)
    # Simulate a writer that reserved index 3 and has not stored its commit word yet.
    with open(writer.path, "r+b") as fh:
        fh.seek(24)
        fh.write(struct.pack("<Q", 5))
        fh.seek(HEADER_SIZE + 4 * RECORD_SIZE)
        fh.write(struct.pack("<Q", 5))  # index 4 complete, index 3 still pending
    got = reader.poll()
    assert list(got["call_index"]) == [0, 1, 2]
    # Still pending on the next poll with a later record complete: a dead writer, skip it.
    got = reader.poll()
    assert len(got) == 1 and reader.dropped == 1


def test_torn_record_detected_by_commit_mismatch(tmp_path) -> None:
    writer = RingWriter(tmp_path / "r.ring", capacity=4)
    reader = RingReader(writer.path)
    for i in range(4):
        _write(writer, i)
    # Overwrite slot 0's commit with a later index: the slot now belongs to index 4.
    with open(writer.path, "r+b") as fh:
        fh.seek(HEADER_SIZE)
        fh.write(struct.pack("<Q", 5))
    got = reader.poll()
    assert list(got["call_index"]) == [1, 2, 3]
    assert reader.dropped == 1


def test_bad_files_give_clear_errors(tmp_path) -> None:
    small = tmp_path / "small.ring"
    small.write_bytes(b"x" * 10)
    with pytest.raises(RingFormatError, match="too small"):
        RingReader(small)
    junk = tmp_path / "junk.ring"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(RingFormatError, match="bad magic"):
        RingReader(junk)
    with pytest.raises(ValueError, match="power of two"):
        RingWriter(tmp_path / "x.ring", capacity=12)


def test_concurrent_threads_never_lose_or_tear(tmp_path) -> None:
    writer = RingWriter(tmp_path / "r.ring", capacity=1 << 12)
    reader = RingReader(writer.path)
    n_threads, per_thread = 4, 500

    def work(tid: int) -> None:
        for i in range(per_thread):
            writer.write(t_start_ns=i, t_end_ns=i, nbytes=tid, group_key=tid * 100000 + i, op=1)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        seen.append(reader.poll())
    for t in threads:
        t.join()
    seen.append(reader.poll())
    allrec = np.concatenate(seen)
    assert len(allrec) == n_threads * per_thread and reader.dropped == 0
    # Every record is internally consistent (no field from another write).
    assert np.all(allrec["group_key"] // 100000 == allrec["nbytes"])
    assert np.all(allrec["group_key"] % 100000 == allrec["t_start_ns"])


def _producer(path: str, n: int) -> None:
    writer = RingWriter(path, capacity=256)
    for i in range(n):
        writer.write(t_start_ns=i, t_end_ns=i * 3, nbytes=i * 7, group_key=i * 11, op=2,
                     call_index=i)


def test_reader_in_another_process_sees_no_torn_records(tmp_path) -> None:
    """A writer process laps a small ring while this process reads it."""
    path = tmp_path / "x.ring"
    _producer(str(path), 1)  # create the file so the reader can open it
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_producer, args=(str(path), 200_000))
    proc.start()
    try:
        import time

        deadline = time.monotonic() + 30
        reader = None
        while reader is None and time.monotonic() < deadline:
            try:
                candidate = RingReader(path)
                if candidate.pid == proc.pid:
                    reader = candidate
            except (RingFormatError, ValueError, FileNotFoundError):
                pass
        assert reader is not None
        total = 0
        while proc.is_alive() or total == 0:
            rec = reader.poll()
            total += len(rec)
            i = rec["call_index"].astype(np.int64)
            assert np.all(rec["t_end_ns"] == i * 3)
            assert np.all(rec["nbytes"] == i * 7)
            assert np.all(rec["group_key"] == i * 11)
            assert np.all(np.diff(i) > 0)
        total += len(reader.poll())
        assert total + reader.dropped == 200_000
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == 0


def test_group_info_roundtrip_and_key_is_order_sensitive() -> None:
    info = GroupInfo(key=group_key("g1", [2, 0, 1]), ranks=(2, 0, 1), role="dp", backend="gloo",
                     name="g1")
    assert GroupInfo.from_json(info.to_json()) == info
    assert group_key("g1", [2, 0, 1]) != group_key("g1", [0, 1, 2])
    assert 0 <= info.key < 2**63


def test_events_to_records_inverse() -> None:
    events = [CommEvent(t_start_ns=i, t_end_ns=i + 5, nbytes=8, group_key=1, op=OpCode.SEND,
                        peer=3, call_index=i) for i in range(4)]
    assert records_to_events(events_to_records(events)) == events
    assert os.path.basename(str(ring_path("/tmp", 7, 12))) == "rank00007-pid12.ring"


def test_group_members_merge_into_group_info_only_when_complete(tmp_path):
    from failslow.core.group_files import GroupMember, merge_members, read_groups, read_members

    members = [GroupMember(key=7, comm_rank=i, size=3, global_rank=10 + 2 * i) for i in (2, 0)]
    assert merge_members(members) == {}
    members.append(GroupMember(key=7, comm_rank=1, size=3, global_rank=12, host="h", pid=5))
    merged = merge_members(members)
    assert merged[7].ranks == (10, 12, 14) and merged[7].backend == "nccl"
    ring = tmp_path / "rank00000-pid1.ring"
    ring.with_suffix(".groups.jsonl").write_text(
        "\n".join(m.to_json() for m in members)
        + "\n"
        + GroupInfo(key=9, ranks=(0, 1)).to_json()
        + "\n"
    )
    assert sorted(read_members(ring), key=lambda m: m.comm_rank) == sorted(
        members, key=lambda m: m.comm_rank
    )
    assert list(read_groups(ring)) == [9]  # member lines are not GroupInfo lines


def test_settled_word_follows_the_oldest_call_in_flight(tmp_path) -> None:
    writer = RingWriter(tmp_path / "r.ring", capacity=64)
    reader = RingReader(writer.path)
    writer.write(t_start_ns=5, t_end_ns=6, nbytes=0, group_key=1, op=1)
    assert reader.settled_ns == 0, "a writer that never began a call does not say"
    first, t1 = writer.begin()
    second, t2 = writer.begin()
    assert t1 <= t2 and reader.settled_ns == t1
    writer.write(t_start_ns=t2, t_end_ns=t2 + 1, nbytes=0, group_key=1, op=1, token=second)
    assert reader.settled_ns == t1, "the older call is still in flight"
    writer.write(t_start_ns=t1, t_end_ns=t2 + 2, nbytes=0, group_key=1, op=1, token=first)
    assert reader.settled_ns >= t2
    third, t3 = writer.begin()
    writer.end(third)  # given up (the call raised before any record): settled past it
    assert reader.settled_ns >= t3
    marker = reader.settled_ns
    writer.write(t_start_ns=t3 + 5, t_end_ns=t3 + 5, nbytes=0, group_key=2, op=17)
    assert reader.settled_ns >= marker, "a record written at once settles to now"


def test_settled_word_never_passes_a_call_of_another_thread(tmp_path) -> None:
    """Four threads begin and write calls while a reader reads the word, then the records: every
    call that started before the word is among the records read by then."""
    writer = RingWriter(tmp_path / "r.ring", capacity=1 << 15)
    reader = RingReader(writer.path)
    go = threading.Barrier(5)

    def work(tid: int) -> None:
        go.wait()
        for i in range(300):
            token, t = writer.begin()
            if i % 3:
                time.sleep(0.0001)  # in flight for a while: other threads write meanwhile
            writer.write(t_start_ns=t, t_end_ns=t + 1, nbytes=tid, group_key=i, op=1, token=token)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    go.wait()
    seen: list[int] = []
    checks: list[tuple[int, int]] = []  # (settled word, records read by then)
    while any(t.is_alive() for t in threads):
        settled = reader.settled_ns
        seen.extend(reader.poll()["t_start_ns"].tolist())
        checks.append((settled, len(seen)))
    for t in threads:
        t.join()
    seen.extend(reader.poll()["t_start_ns"].tolist())
    assert len(seen) == 1200 and len(checks) > 10
    # the oldest start among the records read after each check
    later = np.minimum.accumulate(np.array([*seen, np.iinfo(np.int64).max])[::-1])[::-1]
    late = [(settled, int(later[count])) for settled, count in checks if later[count] < settled]
    assert not late, late[:3]
