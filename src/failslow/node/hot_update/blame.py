"""Which code update a rank's exception is traceable to (byterobust 4.1, 4.2 rollback).

"If it detects user-space errors, e.g., TypeError, IndexError, traceable to specific code
modules from logs and exit codes, it triggers a code rollback." A rank under ``failslow run``
records its uncaught exception - type, message, frames (:mod:`failslow.runtime.crash_record`) -
in the job's state directory. After a failure the agent asks :func:`blame`: is a frame of it,
innermost first, in a file the latest code update changed (:func:`changed_files`)? Then the
update is rolled back, whether or not it is still on probation; an exception elsewhere (the
framework, a lost peer) is an ordinary failure and restarts the same code.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.node.hot_update.version import SKIPPED_DIRS, Version


def _files(root: Path) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            if not name.endswith(".pyc"):
                yield Path(dirpath) / name


def changed_files(previous: Version | None, current: Version) -> set[Path] | None:
    """The files of ``current.code_dir`` that differ from ``previous``'s code (added or
    changed), as resolved paths; empty when the update did not change the code; None when it
    changed it in place in a way that cannot be diffed (every file of the directory counts)."""
    new = current.code_dir
    old = previous.code_dir if previous is not None else None
    if not new or (old == new and previous is not None
                   and previous.code_version == current.code_version):  # fmt: skip
        return set()
    root = Path(new).resolve()
    if old and Path(old).resolve() != root:
        base = Path(old).resolve()
        changed = set()
        for path in _files(root):
            twin = base / path.relative_to(root)
            try:
                same = twin.is_file() and twin.read_bytes() == path.read_bytes()
            except OSError:
                same = False
            if not same:
                changed.add(path.resolve())
        return changed
    revs = [v.code_version or "" for v in (previous, current) if v is not None]
    if len(revs) == 2 and all(r.startswith("git:") and not r.endswith("-dirty") for r in revs):
        try:
            done = subprocess.run(
                ["git", "-C", str(root), "diff", "--name-only", revs[0][4:], revs[1][4:]],
                capture_output=True, text=True, timeout=10, check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10).stdout.strip()  # fmt: skip
        return {(Path(top) / line).resolve() for line in done.stdout.splitlines() if line}
    return None


@dataclass(frozen=True, slots=True)
class Blame:
    record: dict[str, Any]
    """The rank's exception record."""
    file: str
    line: int
    function: str

    def describe(self, update: str, code_dir: str | None) -> str:
        where = self.file
        if code_dir:
            try:
                where = str(Path(self.file).resolve().relative_to(Path(code_dir).resolve()))
            except ValueError:
                pass
        rank = self.record.get("rank")
        who = f"rank {rank}: " if rank is not None else ""
        return (
            f"{who}{self.record.get('type')}: {self.record.get('message', '')} at {where}:"
            f"{self.line} in {self.function}, in a file {update} changed"
        )


def _collective(record: dict[str, Any]) -> bool:
    """An exception raised inside ``torch.distributed`` (a collective that failed because a
    peer was lost): a consequence, whatever file called the collective."""
    frames = record.get("frames") or []
    return bool(frames) and f"torch{os.sep}distributed" in str(frames[-1][0])


def blame(
    records: Iterable[dict[str, Any]], changed: set[Path] | None, code_dir: str | None
) -> Blame | None:
    """Whether the first exception of the launch - the earliest record that is not a failed
    collective - has a frame, innermost first, in ``changed`` (None: anywhere in
    ``code_dir``); None when it is not traceable to the update (or there is none)."""
    root = Path(code_dir).resolve() if code_dir else None
    causes = sorted((r for r in records if not _collective(r)), key=lambda r: r.get("wall", 0))
    for record in causes[:1]:
        for file, line, function in reversed(record.get("frames") or []):
            path = Path(file).resolve()
            if changed is not None:
                hit = path in changed
            else:
                hit = root is not None and path.is_relative_to(root)
            if hit:
                return Blame(record, str(file), int(line), str(function))
    return None
