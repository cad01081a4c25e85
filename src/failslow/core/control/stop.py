"""Stopping every rank at one step boundary for a hot update (byterobust 6.1).

Not a mitigation: the launcher's update agent (:mod:`failslow.node.hot_update.agent`) sends
:class:`StopForUpdate` through the plan channel (:mod:`failslow.core.control.plan_channel`), so
every rank reaches the same step boundary, commits its in-memory snapshot there and exits with
:data:`EXIT_FOR_UPDATE`; the launcher then restarts the command in place with the update and the
ranks resume from that snapshot (:mod:`failslow.runtime.session`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.core.planner.plans import Plan


@dataclass(frozen=True, kw_only=True)
class StopForUpdate(Plan):
    """Every rank commits an in-memory snapshot at one step boundary and exits with
    :data:`EXIT_FOR_UPDATE`, so the node agent restarts it in place with new code or config
    (byterobust 6.1); the restarted ranks resume from that snapshot."""

    update_id: int
    reason: str = ""


EXIT_FOR_UPDATE = 75
"""Exit status of a rank that stopped for a hot update (EX_TEMPFAIL)."""

EXIT_UNRESTORABLE = 78
"""Exit status of a rank that cannot restore its state from memory under failslow's rank
launcher (a rank and its backup holder lost together): restarting again cannot help, so the
launcher ends the job for a person instead (EX_CONFIG)."""

EXIT_FOR_RESTART = 76
"""Exit status of a rank that stopped at an S4 restart plan's step with its snapshot committed
(a :class:`~failslow.core.planner.plans.RestartPlan`; greyhound 5.2, byterobust 6.2): the node
launcher restarts it in place."""

EXIT_EVICTED = 77
"""Like :data:`EXIT_FOR_RESTART`, from a rank whose host the plan evicts: the node launcher
restarts its rank on a standby slot."""

EXIT_ROLLBACK = 79
"""Exit status of a rank whose training metrics went bad (a NaN loss, a 5x jump; byterobust
4.1) under ``failslow run``: it wrote a rollback request (:func:`request_rollback`) and the node
launcher restarts every rank from the newest snapshot before the bad step - or climbs the
stop-time ladder (:mod:`failslow.core.planner.ladder`)."""

ROLLBACK_REQUESTS = "rollback-requests"
"""The directory, in the job's state directory, of the ranks' rollback requests."""


def put_json(path: Path, record: dict[str, Any]) -> Path:
    """``record`` at ``path``, written whole (a tmp file, then a rename): a reader never sees
    half of it, even when the writer is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def take_json(directory: Path, pattern: str) -> list[tuple[str, dict[str, Any] | None]]:
    """Every ``pattern`` file of ``directory`` as ``(name, record)`` in name order (None: not
    readable JSON), each removed as it is read."""
    found: list[tuple[str, dict[str, Any] | None]] = []
    for path in sorted(directory.glob(pattern)):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = None
        found.append((path.name, record if isinstance(record, dict) else None))
        path.unlink(missing_ok=True)
    return found


def request_rollback(
    state_dir: str | os.PathLike[str], rank: int, incident: dict[str, Any]
) -> Path:
    """Leave ``rank``'s rollback request (``incident``: at least ``step`` and ``why``) for the
    node launcher."""
    path = Path(state_dir) / ROLLBACK_REQUESTS / f"rank{rank}.json"
    return put_json(path, {**incident, "rank": rank})


def rollback_requested_at(state_dir: str | os.PathLike[str], rank: int) -> float | None:
    """When ``rank`` left its rollback request (wall clock; None: it has none)."""
    try:
        return (Path(state_dir) / ROLLBACK_REQUESTS / f"rank{rank}.json").stat().st_mtime
    except OSError:
        return None


def take_rollback_requests(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ranks' rollback requests, earliest step first, removed as they are read (a request
    that cannot be read counts as one at step 0 - the launcher cannot trust any step)."""
    found: list[dict[str, Any]] = []
    for name, request in take_json(Path(state_dir) / ROLLBACK_REQUESTS, "rank*.json"):
        try:
            step = int((request or {})["step"])
        except (ValueError, KeyError, TypeError):
            step, request = 0, {"why": f"unreadable rollback request {name}"}
        found.append({**(request or {}), "step": step})
    return sorted(found, key=lambda r: r["step"])


REPLAYS = "replays"
"""The directory, in the job's state directory, of the replay groups' results."""
STOP_CHECKS = "stop-checks"
"""The directory, in the job's state directory, of the machines' stop-time check results."""


def rank_result_path(state_dir: str | os.PathLike[str], box: str, name: str, rank: int) -> Path:
    """Where rank ``rank`` of world ``name`` leaves its result in drop box ``box``."""
    return Path(state_dir) / box / f"{name}-rank{rank}.json"


def write_rank_result(
    state_dir: str | os.PathLike[str], box: str, name: str, rank: int, result: dict[str, Any]
) -> Path:
    """Rank ``rank``'s result for the world ``name`` in drop box ``box`` (:data:`REPLAYS`: a
    replay group's, ``reproduced`` when the incident came back; :data:`STOP_CHECKS`: a
    machine's stop-time checks, written again as its tests end)."""
    path = rank_result_path(state_dir, box, name, rank)
    return put_json(path, {**result, "name": name, "rank": rank})


def take_rank_results(
    state_dir: str | os.PathLike[str], box: str, name: str
) -> dict[int, dict[str, Any]]:
    """The results of world ``name`` in drop box ``box`` by rank, removed as read (unreadable
    ones are skipped)."""
    taken = take_json(Path(state_dir) / box, f"{name}-rank*.json")
    return {int(r["rank"]): r for _, r in taken if r is not None and isinstance(r.get("rank"), int)}
