"""Collective-call records: what the capture layer records, defined once.

greyhound 4.2: the Monitor "intercepts communication operations ... and logs their types and
timestamps" into shared memory, from which the node's LocalAnalyzer reads. Both capture paths
write these records - the Python hook over torch.distributed (``failslow.nccl_hook``) and the
LD_PRELOAD C shim - into the event ring (:mod:`failslow.core.ring`); groups are described beside
it (:mod:`failslow.core.group_files`). The C header is checked against :data:`RECORD_LAYOUT`
(and the ring's header layout) by a test, field by field, so change a field here and the C side
must follow.

Record layout (little-endian, 64 bytes; see :mod:`failslow.core.ring` for the protocol)::

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
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from failslow.core.arrays import one_of

RECORD_SIZE = 64


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
    STEP = 17
    """Not a call: the Python hook's step marker, written when an optimizer step ends
    (``group_key`` names the optimizer, ``call_index`` counts its steps; see
    :data:`MARKER_OPS`)."""

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


MARKER_OPS: tuple[int, ...] = (int(OpCode.STEP),)
"""Op codes of records that mark a point of the job's step rather than a call: consumers of
calls (summaries, the conformance suite, the ACF period) leave them out; the iteration tracker
measures iterations between them (:mod:`failslow.core.tracking.iteration`)."""


def is_marker(records: np.ndarray) -> np.ndarray:
    """Which of ``records`` (:data:`RECORD_DTYPE`) are step markers, not calls (a mask)."""
    return one_of(records["op"], MARKER_OPS)  # np.isin sorts: 10x the cost per poll


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


def structured_dtype(layout: Sequence[tuple[str, str, int]], itemsize: int) -> np.dtype:
    return np.dtype(
        {
            "names": [name for name, _, _ in layout],
            "formats": [fmt for _, fmt, _ in layout],
            "offsets": [off for _, _, off in layout],
            "itemsize": itemsize,
        }
    )


RECORD_DTYPE = structured_dtype(RECORD_LAYOUT, RECORD_SIZE)


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


def events_to_records(events: Iterable[CommEvent]) -> np.ndarray:
    """Pack events into a record array (the inverse of :func:`records_to_events`)."""
    items = list(events)
    out = np.zeros(len(items), dtype=RECORD_DTYPE)
    for i, e in enumerate(items):
        out[i] = (
            i + 1,
            e.t_start_ns,
            e.t_end_ns,
            e.nbytes,
            e.group_key,
            e.call_index,
            int(e.op),
            int(e.dtype),
            int(e.source),
            int(e.flags),
            e.peer,
        )
    return out
