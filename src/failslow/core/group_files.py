"""Group files beside each ring: which global ranks a group key stands for (greyhound 4.2).

A record names its group by a 63-bit key (:func:`failslow.core.events.group_key`); the capture
layer publishes each group's membership as JSON lines in ``<ring>.groups.jsonl``: a
:class:`~failslow.core.events.GroupInfo` per group the Python hook saw created, and a
:class:`GroupMember` per communicator the C shim joined (a rank inside NCCL knows only its own
position; :func:`merge_members` assembles the group once every position was reported).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from failslow.core.events import GroupInfo


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
