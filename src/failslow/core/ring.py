"""The per-process shared-memory event ring the capture layer writes (greyhound 4.2).

One file per process, normally under ``/dev/shm``, holding :mod:`failslow.core.events` records;
the node's analyzer reads it while the process runs. The pause trap's words live in its header
(:mod:`failslow.nccl_hook.trap`). The C shim writes the same format (``native/ring.h``, checked
against :data:`HEADER_LAYOUT` by a test).

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
    112     8     settled_ns i64      every call that started before this CLOCK_MONOTONIC time
                                      is committed; 0 = the writer does not keep it (the C shim)
    120     136   reserved            zero
    256     capacity * 64             record slots; slot of index i is i % capacity

Protocol: a writer reserves index ``i`` with an atomic fetch-and-add on ``write_index``,
stores 0 into the slot's ``commit``, writes the other fields, and stores ``i + 1`` into
``commit`` last (a release store in C; x86 keeps Python's stores in program order). A reader
copies ``commit``, the record, then ``commit`` again, and accepts the copy only when both
equal ``i + 1``; a larger value means the slot was overwritten (counted as dropped), a smaller
one means the writer has not finished. Writers never wait for readers: a slow reader loses the
oldest records and counts them.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.events import (
    RECORD_DTYPE,
    RECORD_SIZE,
    CommEvent,
    Source,
    structured_dtype,
)

RING_MAGIC = 0x474E495257534C46  # b"FLSWRING" as a little-endian u64
RING_VERSION = 1
HEADER_SIZE = 256
DEFAULT_CAPACITY = 1 << 16


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
    ("settled_ns", "<i8", 112),
)
"""(field, numpy type, byte offset) of every header field; the rest up to 256 is reserved."""

HEADER_DTYPE = structured_dtype(HEADER_LAYOUT, HEADER_SIZE)

# Body of a record after the commit word, packed in one store.
_BODY = struct.Struct("<qqQQQHHBBxxixxxx")
assert _BODY.size == RECORD_SIZE - 8
_U64 = struct.Struct("<Q")
_OFF_WRITE_INDEX = dict((n, o) for n, _, o in HEADER_LAYOUT)["write_index"]
_OFF_DROPPED = dict((n, o) for n, _, o in HEADER_LAYOUT)["dropped"]
_OFF_CONTROL = dict((n, o) for n, _, o in HEADER_LAYOUT)["control"]
_OFF_SETTLED = dict((n, o) for n, _, o in HEADER_LAYOUT)["settled_ns"]
_I64 = struct.Struct("<q")
HEADER_WORDS: dict[str, int] = {n: o // 8 for n, t, o in HEADER_LAYOUT if t[-2:] in ("u8", "i8")}
"""Index of every 8-byte header field in the header read as little-endian u64 words."""


class RingFormatError(ValueError):
    """A ring file that is not a failslow ring, or of another version."""


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


def ring_process(path: str | os.PathLike[str]) -> str:
    """``rank{R}-pid{P}``: the process a ring belongs to (its C shim and Python hook rings
    share it, :func:`ring_path`)."""
    return Path(path).name.removesuffix(".ring").removesuffix("-py")


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
        self._inflight: dict[int, int] = {}  # token -> t_start_ns of a call not yet written
        self._token = 0
        self._native: Any = None

    def use_native(self, native: Any) -> None:
        """Write through ``native`` from now on: the hook's C++ writer (``nccl_hook/native/
        hook.cpp``), which maps this ring itself and takes slots with the C writer's
        fetch-and-add from the header's write index. Its calls and this object's records (step
        markers) then share one slot counter, one lock and one ``settled_ns``."""
        native.open_ring(str(self.path))
        self._native = native

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
        token: int | None = None,
    ) -> int:
        """Append one record; returns its ring index. ``token``: the call's :meth:`begin`
        (settled past once the record is in); without one, a record written at once (a
        marker) still moves ``settled_ns`` to now when no call is in flight - once a writer
        began any call (writers that never do leave it 0: unknown)."""
        if self._native is not None:
            return int(
                self._native.write(
                    t_start_ns, t_end_ns, nbytes, group_key, call_index, op, dtype, source,
                    flags, peer, token or 0,
                )
            )
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
            if token is not None:
                self._inflight.pop(token, None)
            if self._token:  # this writer keeps settled_ns
                self._settle()
        return index

    def begin(self) -> tuple[int, int]:
        """``(token, t_start_ns)`` of a call issued now whose record comes later (at its
        completion): until :meth:`end` the header's ``settled_ns`` stays at or before its
        start, so a reader knows which records can still arrive out of order. The start is
        stamped under the writer's lock, so no call of another thread can settle past it
        before it is registered."""
        if self._native is not None:
            token, t = self._native.begin()
            return int(token), int(t)
        with self._lock:
            t = time.monotonic_ns()
            token = self._token = self._token + 1
            self._inflight[token] = t
            if len(self._inflight) == 1:
                _I64.pack_into(self._mm, _OFF_SETTLED, t)
            return token, t

    def end(self, token: int) -> None:
        """The call of ``token`` was written (or given up): settle past it."""
        if self._native is not None:
            self._native.end(token)
            return
        with self._lock:
            self._inflight.pop(token, None)
            self._settle()

    def _settle(self) -> None:
        """``settled_ns`` := the oldest start still in flight, or now (lock held)."""
        oldest = next(iter(self._inflight.values()), None)  # tokens are issued in time order
        _I64.pack_into(self._mm, _OFF_SETTLED, time.monotonic_ns() if oldest is None else oldest)

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
        if self._native is not None:
            self._native.count_dropped(n)
            return
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
        if self._native is not None:
            self._native.close_ring()  # unmapped there once its calls in flight are written
            self._native = None
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
    def settled_ns(self) -> int:
        """Every call that started before this time is committed (0: the writer does not
        say). Read it *before* :meth:`poll`: the records that poll returns then include every
        one it covers."""
        return int(_I64.unpack_from(self._mm, _OFF_SETTLED)[0])

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
        lo = start % self.capacity
        if lo + n <= self.capacity:  # no wrap: one slice, and every record committed (the
            commits = self._commits[lo : lo + n]  # common case) costs a few array operations
            if (commits == expected).all():
                data = self._records[lo : lo + n].copy()
                if (commits == expected).all():  # still the same records after the copy
                    self._next, self._stuck_at = end, None
                    return data
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


def find_rings(directory: str | os.PathLike[str]) -> list[Path]:
    """All ring files in a run's ring directory, ordered by rank then pid."""
    return sorted(Path(directory).glob("rank*-pid*.ring"))
