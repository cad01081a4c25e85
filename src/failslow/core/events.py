"""Collective-call records and the per-process shared-memory event ring.

This module is the one definition of what the capture layer records (greyhound 4.2: the
Monitor "intercepts communication operations ... and logs their types and timestamps" into
shared memory, from which the node's LocalAnalyzer reads). Both capture paths write it: the
Python hook over torch.distributed (``failslow.nccl_hook``) and the LD_PRELOAD C shim. The C
header is checked against :data:`HEADER_LAYOUT` and :data:`RECORD_LAYOUT` by a test, field by
field, so change a field here and the C side must follow.

Ring file layout (little-endian, one file per process, normally under ``/dev/shm``)::

    offset  size  header field        meaning
    0       8     magic   u64         0x474E495257534C46 (b"FLSWRING" read as LE u64)
    8       4     version u32         RING_VERSION
    12      4     record_size u32     RECORD_SIZE (64)
    16      8     capacity u64        number of record slots, a power of two
    24      8     write_index u64     next index to reserve; writers fetch-and-add 1
    32      8     dropped u64         records a writer abandoned (e.g. reentrant capture)
    40      8     pid i64             writer process id
    48      4     global_rank i32     RANK of the writer, -1 if unknown
    52      4     local_rank i32      LOCAL_RANK of the writer, -1 if unknown
    56      8     mono_anchor_ns i64  CLOCK_MONOTONIC when the ring was created
    64      8     wall_anchor_ns i64  CLOCK_REALTIME at the same instant
    72      8     control u64         control word of the pause trap (0 = run, else pause)
    80      8     parked u64          write_index + 1 when a thread parked in the trap, 0 = none
    88      8     self_releases u64   parks that ended by the trap's timeout, not by a resume
    96      8     pause_group u64     0: park at the next call; else park only at this group's
    104     8     pause_call u64      call with call_index >= pause_call (a targeted pause)
    112     144   reserved            zero
    256     capacity * 64             record slots; slot of index i is i % capacity

    offset  size  record field
    0       8     commit u64          0 while being written; index + 1 once complete
    8       8     t_start_ns i64      CLOCK_MONOTONIC when the call was issued
    16      8     t_end_ns i64        CLOCK_MONOTONIC when it completed (0 = unknown)
    24      8     nbytes u64          payload bytes of this rank's input (send side)
    32      8     group_key u64       equal on every rank of the group (see GroupInfo)
    40      8     call_index u64      per-group sequence number of this call on this rank
    48      2     op u16              OpCode
    50      2     dtype u16           DType
    52      1     source u8           Source
    53      1     flags u8            Flags
    54      2     reserved u16        zero
    56      4     peer i32            global rank of the peer (p2p) or root, -1 if none
    60      4     reserved u32        zero

Protocol: a writer reserves index ``i`` with an atomic fetch-and-add on ``write_index``,
stores 0 into the slot's ``commit``, writes the other fields, and stores ``i + 1`` into
``commit`` last (a release store in C; x86 keeps Python's stores in program order). A reader
copies ``commit``, the record, then ``commit`` again, and accepts the copy only when both
equal ``i + 1``; a larger value means the slot was overwritten (counted as dropped), a smaller
one means the writer has not finished. Writers never wait for readers: a slow reader loses the
oldest records and counts them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RING_MAGIC = 0x474E495257534C46  # b"FLSWRING" as a little-endian u64
RING_VERSION = 1
HEADER_SIZE = 256
RECORD_SIZE = 64
DEFAULT_CAPACITY = 1 << 16


class OpCode(enum.IntEnum):
    """What kind of call a record describes (shared by the C shim and the Python hook)."""

    UNKNOWN = 0
    ALLREDUCE = 1
    ALLGATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    REDUCE = 5
    ALLTOALL = 6
    GATHER = 7
    SCATTER = 8
    SEND = 9
    RECV = 10
    BARRIER = 11
    ALLREDUCE_COALESCED = 12
    ALLGATHER_COALESCED = 13
    REDUCE_SCATTER_COALESCED = 14
    GROUP_START = 15
    GROUP_END = 16

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> OpCode:
        """Map a name such as ``"allreduce"`` or ``"AllReduce"`` to an op code."""
        key = text.strip().upper().replace("-", "_")
        aliases = {"ALL_REDUCE": "ALLREDUCE", "ALL_GATHER": "ALLGATHER", "ALL_TO_ALL": "ALLTOALL"}
        key = aliases.get(key, key)
        try:
            return cls[key]
        except KeyError:
            allowed = ", ".join(op.label for op in cls)
            raise ValueError(f"unknown op {text!r}; expected one of: {allowed}") from None


class DType(enum.IntEnum):
    """Element type of a call's payload (0 when unknown or mixed)."""

    UNKNOWN = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT32 = 7
    INT64 = 8
    FP8_E4M3 = 9
    FP8_E5M2 = 10
    BOOL = 11


class Source(enum.IntEnum):
    """Which capture layer wrote a record."""

    UNKNOWN = 0
    SHIM = 1
    PYTHON = 2


class Flags(enum.IntFlag):
    """Bit flags of a record."""

    NONE = 0
    ASYNC_OP = 1  # the caller did not wait on the call
    COALESCED = 2  # one record stands for a coalesced batch of tensors
    FAILED = 4  # the call raised or its work completed with an error
    END_IS_ENQUEUE = 8  # t_end_ns is when the call returned, not device completion


HEADER_LAYOUT: tuple[tuple[str, str, int], ...] = (
    ("magic", "<u8", 0),
    ("version", "<u4", 8),
    ("record_size", "<u4", 12),
    ("capacity", "<u8", 16),
    ("write_index", "<u8", 24),
    ("dropped", "<u8", 32),
    ("pid", "<i8", 40),
    ("global_rank", "<i4", 48),
    ("local_rank", "<i4", 52),
    ("mono_anchor_ns", "<i8", 56),
    ("wall_anchor_ns", "<i8", 64),
    ("control", "<u8", 72),
    ("parked", "<u8", 80),
    ("self_releases", "<u8", 88),
    ("pause_group", "<u8", 96),
    ("pause_call", "<u8", 104),
)
"""(field, numpy type, byte offset) of every header field; the rest up to 256 is reserved."""

RECORD_LAYOUT: tuple[tuple[str, str, int], ...] = (
    ("commit", "<u8", 0),
    ("t_start_ns", "<i8", 8),
    ("t_end_ns", "<i8", 16),
    ("nbytes", "<u8", 24),
    ("group_key", "<u8", 32),
    ("call_index", "<u8", 40),
    ("op", "<u2", 48),
    ("dtype", "<u2", 50),
    ("source", "u1", 52),
    ("flags", "u1", 53),
    ("peer", "<i4", 56),
)
"""(field, numpy type, byte offset) of every record field; unnamed bytes are reserved."""


def _structured(layout: Sequence[tuple[str, str, int]], itemsize: int) -> np.dtype:
    return np.dtype(
        {
            "names": [name for name, _, _ in layout],
            "formats": [fmt for _, fmt, _ in layout],
            "offsets": [off for _, _, off in layout],
            "itemsize": itemsize,
        }
    )


HEADER_DTYPE = _structured(HEADER_LAYOUT, HEADER_SIZE)
RECORD_DTYPE = _structured(RECORD_LAYOUT, RECORD_SIZE)

# Body of a record after the commit word, packed in one store.
_BODY = struct.Struct("<qqQQQHHBBxxixxxx")
assert _BODY.size == RECORD_SIZE - 8
_U64 = struct.Struct("<Q")
_OFF_WRITE_INDEX = dict((n, o) for n, _, o in HEADER_LAYOUT)["write_index"]
_OFF_DROPPED = dict((n, o) for n, _, o in HEADER_LAYOUT)["dropped"]
_OFF_CONTROL = dict((n, o) for n, _, o in HEADER_LAYOUT)["control"]
HEADER_WORDS: dict[str, int] = {n: o // 8 for n, t, o in HEADER_LAYOUT if t[-2:] in ("u8", "i8")}
"""Index of every 8-byte header field in the header read as little-endian u64 words."""


class RingFormatError(ValueError):
    """A ring file that is not a failslow ring, or of another version."""


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One captured collective or point-to-point call (a decoded ring record)."""

    t_start_ns: int
    t_end_ns: int
    nbytes: int
    group_key: int
    op: OpCode
    dtype: DType = DType.UNKNOWN
    source: Source = Source.UNKNOWN
    flags: Flags = Flags.NONE
    peer: int = -1
    call_index: int = 0

    @property
    def duration_ns(self) -> int:
        return self.t_end_ns - self.t_start_ns if self.t_end_ns else 0


def group_key(name: str, ranks: Sequence[int]) -> int:
    """A 63-bit key that every member of a group computes alike from its name and ranks."""
    text = name + "|" + ",".join(str(int(r)) for r in ranks)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Membership of one communication group, as seen by one rank."""

    key: int
    ranks: tuple[int, ...]  # global ranks in group order (group rank i is ranks[i])
    role: str | None = None  # tp / dp / pp / ep / cp / world / other, when known
    backend: str = ""
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_json(self) -> str:
        return json.dumps(
            {
                "key": self.key,
                "ranks": list(self.ranks),
                "role": self.role,
                "backend": self.backend,
                "name": self.name,
                **({"extra": self.extra} if self.extra else {}),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> GroupInfo:
        obj = json.loads(text)
        return cls(
            key=int(obj["key"]),
            ranks=tuple(int(r) for r in obj["ranks"]),
            role=obj.get("role"),
            backend=obj.get("backend", ""),
            name=obj.get("name", ""),
            extra=obj.get("extra", {}),
        )


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One rank's view of a communicator it belongs to, as the C shim sees it.

    A rank inside NCCL knows its own position and the communicator's size but not the other
    members' global ranks; :func:`merge_members` assembles a :class:`GroupInfo` once every
    position of a key has been reported (by the rings of one node, or by the controller).
    ``key`` is equal on every member: a hash of the ncclUniqueId (with the per-process
    communicator sequence number when ``NCCL_COMM_ID`` makes ids repeat), or for a split the
    parent's key with the color and the parent's split sequence number.
    """

    key: int
    comm_rank: int
    size: int
    global_rank: int
    host: str = ""
    pid: int = 0
    parent_key: int = 0
    color: int = -1

    def to_json(self) -> str:
        return json.dumps(
            {
                "member": True,
                "key": self.key,
                "comm_rank": self.comm_rank,
                "size": self.size,
                "global_rank": self.global_rank,
                "host": self.host,
                "pid": self.pid,
                "parent_key": self.parent_key,
                "color": self.color,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> GroupMember:
        obj = json.loads(text)
        return cls(
            key=int(obj["key"]),
            comm_rank=int(obj["comm_rank"]),
            size=int(obj["size"]),
            global_rank=int(obj["global_rank"]),
            host=str(obj.get("host", "")),
            pid=int(obj.get("pid", 0)),
            parent_key=int(obj.get("parent_key", 0)),
            color=int(obj.get("color", -1)),
        )


def merge_members(members: Iterable[GroupMember]) -> dict[int, GroupInfo]:
    """GroupInfo of every key whose positions 0..size-1 have all been reported."""
    by_key: dict[int, dict[int, GroupMember]] = {}
    for m in members:
        by_key.setdefault(m.key, {})[m.comm_rank] = m
    out = {}
    for key, seen in by_key.items():
        size = next(iter(seen.values())).size
        if len(seen) == size and all(i in seen for i in range(size)):
            out[key] = GroupInfo(
                key=key, ranks=tuple(seen[i].global_rank for i in range(size)), backend="nccl"
            )
    return out


def read_members(ring: str | os.PathLike[str]) -> list[GroupMember]:
    """The shim's membership lines published beside a ring."""
    path = groups_path(ring)
    if not path.exists():
        return []
    return [
        GroupMember.from_json(line)
        for line in path.read_text().splitlines()
        if line.strip() and '"member": true' in line
    ]


def ring_path(
    directory: str | os.PathLike[str], global_rank: int, pid: int, source: str = ""
) -> Path:
    """Where the ring of one process lives inside a run's ring directory.

    The C shim writes ``rank{R:05d}-pid{P}.ring``; the Python hook writes the same name, or
    ``rank{R:05d}-pid{P}-py.ring`` (``source="py"``) when the shim is active in its process,
    so the two writers never replace each other's file.
    """
    suffix = f"-{source}" if source else ""
    return Path(directory) / f"rank{global_rank:05d}-pid{pid}{suffix}.ring"


def groups_path(ring: str | os.PathLike[str]) -> Path:
    """The JSON-lines file of GroupInfo records published beside a ring."""
    return Path(ring).with_suffix(".groups.jsonl")


def read_groups(ring: str | os.PathLike[str]) -> dict[int, GroupInfo]:
    """All groups published beside a ring, by key (later lines win)."""
    path = groups_path(ring)
    groups: dict[int, GroupInfo] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and '"member": true' not in line:
                info = GroupInfo.from_json(line)
                groups[info.key] = info
    return groups


class RingWriter:
    """Writes CommEvent records into a ring file (the pure-Python writer).

    Thread safe within one process: slot reservation takes a lock (the C writer uses an
    atomic fetch-and-add instead, so both may share a ring only through the C writer).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int = DEFAULT_CAPACITY,
        global_rank: int = -1,
        local_rank: int = -1,
    ) -> None:
        if capacity <= 0 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a positive power of two, got {capacity}")
        self.path = Path(path)
        self.capacity = capacity
        self._mask = capacity - 1
        size = HEADER_SIZE + capacity * RECORD_SIZE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Build the file under a private name and rename it into place: a reader that still
        # maps an older ring at this path keeps its (intact) inode instead of seeing it shrink.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = np.zeros((), dtype=HEADER_DTYPE)
        header["version"] = RING_VERSION
        header["record_size"] = RECORD_SIZE
        header["capacity"] = capacity
        header["pid"] = os.getpid()
        header["global_rank"] = global_rank
        header["local_rank"] = local_rank
        header["mono_anchor_ns"] = time.monotonic_ns()
        header["wall_anchor_ns"] = time.time_ns()
        self._mm[8:HEADER_SIZE] = header.tobytes()[8:]
        self._mm[0:8] = _U64.pack(RING_MAGIC)
        os.replace(tmp, self.path)
        self._lock = threading.Lock()
        self._next = 0

    def write(
        self,
        *,
        t_start_ns: int,
        t_end_ns: int,
        nbytes: int,
        group_key: int,
        op: int,
        dtype: int = 0,
        source: int = Source.PYTHON,
        flags: int = 0,
        peer: int = -1,
        call_index: int = 0,
    ) -> int:
        """Append one record; returns its ring index."""
        body = _BODY.pack(
            t_start_ns, t_end_ns, nbytes, group_key, call_index, op, dtype, source, flags, peer
        )
        with self._lock:
            index = self._next
            self._next = index + 1
            _U64.pack_into(self._mm, _OFF_WRITE_INDEX, index + 1)
            off = HEADER_SIZE + (index & self._mask) * RECORD_SIZE
            _U64.pack_into(self._mm, off, 0)
            self._mm[off + 8 : off + RECORD_SIZE] = body
            _U64.pack_into(self._mm, off, index + 1)
        return index

    def write_event(self, event: CommEvent) -> int:
        return self.write(
            t_start_ns=event.t_start_ns,
            t_end_ns=event.t_end_ns,
            nbytes=event.nbytes,
            group_key=event.group_key,
            op=event.op,
            dtype=event.dtype,
            source=event.source,
            flags=event.flags,
            peer=event.peer,
            call_index=event.call_index,
        )

    def count_dropped(self, n: int = 1) -> None:
        """Record that ``n`` events were abandoned by the writer."""
        with self._lock:
            dropped = _U64.unpack_from(self._mm, _OFF_DROPPED)[0]
            _U64.pack_into(self._mm, _OFF_DROPPED, dropped + n)

    @property
    def control(self) -> int:
        return _U64.unpack_from(self._mm, _OFF_CONTROL)[0]

    def header_word(self, name: str) -> int:
        """One 8-byte header field (``control``, ``parked``, ...), read with a single load."""
        return int(header_words(self)[HEADER_WORDS[name]])

    def set_header_word(self, name: str, value: int) -> None:
        """Store one 8-byte header field with a single store (the C side reads it atomically)."""
        header_words(self)[HEADER_WORDS[name]] = value

    def close(self) -> None:
        words = getattr(self, "_words", None)
        if words is not None:
            self._words = None
            words.release()
        if not self._mm.closed:
            self._mm.close()


def header_words(owner: Any) -> Any:
    """The 256-byte header of ``owner._mm`` as a memoryview of native u64 words, made once.

    Item access on it is one aligned 8-byte load or store, so a concurrent C reader or writer
    never sees a torn value (the ring is little-endian; so is every platform torch runs on).
    ``owner`` must release ``owner._words`` before closing its mmap.
    """
    words = getattr(owner, "_words", None)
    if words is None:
        if sys.byteorder != "little":
            raise RingFormatError("event rings are little-endian; this host is not")
        words = memoryview(owner._mm)[:HEADER_SIZE].cast("Q")
        owner._words = words
    return words


class RingReader:
    """Reads committed records from a ring file without ever returning a torn one.

    ``poll()`` returns the records committed since the previous poll, in index order, as a
    numpy structured array of :data:`RECORD_DTYPE`. ``dropped`` counts records this reader
    lost because the writer lapped it or never finished them.
    """

    def __init__(self, path: str | os.PathLike[str], *, from_start: bool = True) -> None:
        self.path = Path(path)
        size = os.path.getsize(self.path)
        if size < HEADER_SIZE:
            raise RingFormatError(f"{self.path}: {size} bytes is too small for a ring header")
        with open(self.path, "rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, mmap.MAP_SHARED, mmap.PROT_READ)
        self.header = np.frombuffer(self._mm, dtype=HEADER_DTYPE, count=1)[0]
        if int(self.header["magic"]) != RING_MAGIC:
            raise RingFormatError(f"{self.path}: not a failslow ring (bad magic)")
        if int(self.header["version"]) != RING_VERSION:
            raise RingFormatError(
                f"{self.path}: ring version {int(self.header['version'])}, "
                f"this reader understands {RING_VERSION}"
            )
        if int(self.header["record_size"]) != RECORD_SIZE:
            raise RingFormatError(f"{self.path}: record size {int(self.header['record_size'])}")
        self.capacity = int(self.header["capacity"])
        if size < HEADER_SIZE + self.capacity * RECORD_SIZE:
            raise RingFormatError(f"{self.path}: file shorter than its capacity says")
        self._records = np.frombuffer(
            self._mm, dtype=RECORD_DTYPE, count=self.capacity, offset=HEADER_SIZE
        )
        self._commits = self._records["commit"]
        self.dropped = 0
        self._next = 0 if from_start else self.write_index
        self._stuck_at: int | None = None

    @property
    def write_index(self) -> int:
        return int(_U64.unpack_from(self._mm, _OFF_WRITE_INDEX)[0])

    @property
    def writer_dropped(self) -> int:
        return int(_U64.unpack_from(self._mm, _OFF_DROPPED)[0])

    @property
    def global_rank(self) -> int:
        return int(self.header["global_rank"])

    @property
    def pid(self) -> int:
        return int(self.header["pid"])

    def poll(self, max_records: int | None = None) -> np.ndarray:
        """Committed records since the last poll, oldest first."""
        end = self.write_index
        start = self._next
        if end - start > self.capacity:  # the writer lapped us
            self.dropped += end - self.capacity - start
            start = end - self.capacity
        if max_records is not None:
            end = min(end, start + max_records)
        n = end - start
        if n <= 0:
            return np.empty(0, dtype=RECORD_DTYPE)
        expected = np.arange(start + 1, end + 1, dtype=np.uint64)
        slots = (expected - 1) % np.uint64(self.capacity)
        before = self._commits[slots]  # fancy indexing copies
        data = self._records[slots]
        after = self._commits[slots]
        valid = (before == expected) & (after == expected)
        overwritten = (before > expected) | (after > expected)
        pending = ~valid & ~overwritten
        if pending.any():
            first = int(np.argmax(pending))
            # A slot pending at the same index on two polls in a row, with later records
            # complete, belongs to a writer that died mid-record: count it lost and move on.
            if self._stuck_at == start + first and valid[first + 1 :].any():
                pending[first] = False
                overwritten[first] = True
        cut = int(np.argmax(pending)) if pending.any() else n
        self._stuck_at = start + cut if cut < n else None
        self.dropped += int(overwritten[:cut].sum())
        self._next = start + cut
        return data[:cut][valid[:cut]]

    def close(self) -> None:
        self.header = None  # type: ignore[assignment]
        self._records = self._commits = None  # type: ignore[assignment]
        if not self._mm.closed:
            try:
                self._mm.close()
            except BufferError:  # a caller still holds a view; the OS frees it with the map
                pass


def _enum_or_unknown(cls: type[enum.IntEnum], value: int) -> Any:
    return cls(value) if value in cls._value2member_map_ else cls(0)


def records_to_events(records: np.ndarray) -> list[CommEvent]:
    """Decode ring records into CommEvent objects (for tests and small exports)."""
    return [
        CommEvent(
            t_start_ns=int(r["t_start_ns"]),
            t_end_ns=int(r["t_end_ns"]),
            nbytes=int(r["nbytes"]),
            group_key=int(r["group_key"]),
            op=_enum_or_unknown(OpCode, int(r["op"])),
            dtype=_enum_or_unknown(DType, int(r["dtype"])),
            source=_enum_or_unknown(Source, int(r["source"])),
            flags=Flags(int(r["flags"]) & 0xF),
            peer=int(r["peer"]),
            call_index=int(r["call_index"]),
        )
        for r in records
    ]


def find_rings(directory: str | os.PathLike[str]) -> list[Path]:
    """All ring files in a run's ring directory, ordered by rank then pid."""
    return sorted(Path(directory).glob("rank*-pid*.ring"))


def events_to_records(events: Iterable[CommEvent]) -> np.ndarray:
    """Pack events into a record array (the inverse of :func:`records_to_events`)."""
    items = list(events)
    out = np.zeros(len(items), dtype=RECORD_DTYPE)
    for i, e in enumerate(items):
        out[i] = (
            i + 1, e.t_start_ns, e.t_end_ns, e.nbytes, e.group_key, e.call_index,
            int(e.op), int(e.dtype), int(e.source), int(e.flags), e.peer,
        )
    return out
