"""Process-group identities for the capture layer (greyhound 4.2 and 4.3).

Every record names its communication group by a key that all members compute alike, so the
GlobalAnalyzer can line up one group's calls across ranks and form comparable clusters
(greyhound 4.3). The key is :func:`failslow.core.events.group_key` over torch's group name
(identical on every member: torch derives its store prefixes from it) and the global ranks in
group order. Each group is published once as a :class:`~failslow.core.events.GroupInfo` JSON
line beside the ring (:func:`failslow.core.group_files.groups_path`).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from failslow.core.events import GroupInfo, group_key


class CallCounter:
    """The per-group call_index: ``next()`` takes one, :meth:`peek` tells the next one."""

    __slots__ = ("_count", "_next")

    def __init__(self) -> None:
        self._count = itertools.count()
        self._next = 0

    def __next__(self) -> int:
        value = next(self._count)  # atomic under the GIL
        self._next = value + 1
        return value

    def peek(self) -> int:
        return self._next


class NativeCallCounter:
    """A group's call counter kept by the native hook (``native/hook.cpp``), which takes one
    per call it records; Python reads it (the pause trap) or takes one the same way."""

    __slots__ = ("_name", "_native")

    def __init__(self, native: Any, name: str) -> None:
        self._native, self._name = native, name

    def __next__(self) -> int:
        return int(self._native.next_call(self._name))

    def peek(self) -> int:
        return int(self._native.peek_call(self._name))


@dataclass(slots=True)
class GroupEntry:
    """What the hook keeps per group: key, global ranks, and this rank's call counter."""

    key: int
    ranks: tuple[int, ...]
    name: str
    backend: str = ""
    calls: CallCounter | NativeCallCounter = field(default_factory=lambda: CallCounter())

    def global_rank(self, group_rank: int) -> int:
        if 0 <= group_rank < len(self.ranks):
            return self.ranks[group_rank]
        return -1


class GroupTable:
    """Group name -> :class:`GroupEntry`, publishing each new group to a JSON-lines file.

    Thread safe: lookups are plain dict reads; additions take a lock.
    """

    def __init__(self, path: Path | None = None) -> None:
        self._entries: dict[str, GroupEntry] = {}
        self._lock = threading.Lock()
        self._pending: list[GroupInfo] = []
        self.path = path
        self.on_add: Callable[[GroupEntry], None] | None = None
        """Called (under the table's lock) with every entry added: the native hook registers
        the group and takes over its call counter."""

    def get(self, name: str) -> GroupEntry | None:
        return self._entries.get(name)

    def add(self, name: str, ranks: Sequence[int], backend: str = "", role: str | None = None
            ) -> GroupEntry:
        """Register a group (idempotent) and publish its GroupInfo."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                return entry
            ranks_t = tuple(int(r) for r in ranks)
            entry = GroupEntry(
                key=group_key(name, ranks_t), ranks=ranks_t, name=name, backend=backend
            )
            if self.on_add is not None:
                self.on_add(entry)
            self._entries[name] = entry
            info = GroupInfo(key=entry.key, ranks=ranks_t, role=role, backend=backend, name=name)
            if self.path is None:
                self._pending.append(info)
            else:
                self._append(info)
            return entry

    def set_path(self, path: Path) -> None:
        """Start publishing to ``path``, flushing groups registered before it was known."""
        with self._lock:
            self.path = path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
            for info in self._entries_as_infos():
                self._append(info)
            self._pending.clear()

    def _entries_as_infos(self) -> list[GroupInfo]:
        return list(self._pending)

    def _append(self, info: GroupInfo) -> None:
        assert self.path is not None
        # One write() of one line on an O_APPEND file: readers never see half a line.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (info.to_json() + "\n").encode())
        finally:
            os.close(fd)

    def entries(self) -> list[GroupEntry]:
        return list(self._entries.values())


def group_ranks_of(pg: Any) -> tuple[int, ...] | None:
    """Global ranks of a live ProcessGroup in group order, from torch's world table."""
    import torch.distributed.distributed_c10d as c10d

    mapping = c10d._world.pg_group_ranks.get(pg)
    if mapping is None:
        return None
    return tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))


def backend_name_of(pg: Any) -> str:
    try:
        return str(pg.name())
    except Exception:
        return ""
