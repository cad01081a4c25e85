"""What a ``failslow run`` directory holds besides the journal: rings, snapshots, hot updates.

For ``failslow report`` (:mod:`.report`). The event rings (greyhound 4.2's capture) give every
rank's iteration boundaries: :func:`failslow.core.tracking.iteration_times` finds the period of
a rank's collective calls, and the anchor call's start is where the rank reached the boundary
(on the wall clock through the ring header's anchors), so a straggler shows as the rank that
arrives last. The in-memory snapshots are listed from their headers
(:func:`failslow.core.checkpoint.restore.inventory`), the hot updates from the launcher's update
history (byterobust 6.1).

The update history belongs to :mod:`failslow.node.hot_update.history`, which this layer may not
import (``observe`` sits below ``node``). It is one SQLite file, ``<state dir>/updates.sqlite``,
with a documented table ``updates``; this module reads the columns it shows, by name, over a
read-only connection (so a report never takes the launcher's write lock), and says so in one
line when the file is not such a history.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from failslow.core.checkpoint.restore import inventory
from failslow.core.control.journal import JOURNAL
from failslow.core.ring import RingFormatError, RingReader, find_rings
from failslow.core.tracking import iteration_times
from failslow.errors import FailslowError

HISTORY = "updates.sqlite"
"""The update history's file in a state directory (``failslow run``: its ring directory)."""


def log_dir_of(run_dir: Path) -> Path | None:
    """Where the control plane wrote its journal and diagnoses: ``diagnoses/`` of a ring
    directory, or the directory itself."""
    for d in (run_dir / "diagnoses", run_dir):
        if (d / JOURNAL).is_file() or any(d.glob("diagnosis-*.json")):
            return d
    return None


def looks_like_run(run_dir: Path) -> bool:
    return bool(find_rings(run_dir)) or log_dir_of(run_dir) is not None


# ---- rings ------------------------------------------------------------------------------------
def rank_boundaries(ring_dir: Path) -> tuple[list[int], np.ndarray] | None:
    """(ranks, when each rank reached each iteration boundary: ranks x iterations, wall
    seconds), aligned at every rank's latest iteration; None without rings or iterations."""
    by_rank: dict[int, list[np.ndarray]] = defaultdict(list)
    for path in find_rings(ring_dir):  # a process's shim and hook rings are read as one
        try:
            reader = RingReader(path)
        except (RingFormatError, OSError) as exc:
            raise FailslowError(f"{path}: cannot read the ring ({exc})") from None
        try:
            records = reader.poll().copy()
            offset = int(reader.header["wall_anchor_ns"]) - int(reader.header["mono_anchor_ns"])
            rank = reader.global_rank
        finally:
            reader.close()
        if len(records) and rank >= 0:
            records["t_start_ns"] += offset
            records["t_end_ns"] += offset
            by_rank[rank].append(records)
    ends = {}
    for rank, parts in by_rank.items():
        records = np.concatenate(parts)
        records = records[np.argsort(records["t_start_ns"], kind="stable")]
        found = iteration_times(records)
        if len(found.end_ns) >= 2:
            ends[rank] = np.asarray(found.end_ns, dtype=np.float64) / 1e9
    if not ends:
        return None
    n = min(len(e) for e in ends.values())
    ranks = sorted(ends)
    return ranks, np.stack([ends[r][len(ends[r]) - n :] for r in ranks])


# ---- snapshots and hot updates -----------------------------------------------------------------
def read_history(state_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
    """(every update, oldest first; the job records) of ``state_dir``'s update history, None
    when it has none."""
    path = state_dir / HISTORY
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        raise FailslowError(f"{path}: cannot open the update history ({exc})") from None
    try:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute("SELECT * FROM updates ORDER BY id")]
        job = {r["key"]: json.loads(r["value"]) for r in db.execute("SELECT key, value FROM job")}
    except (sqlite3.Error, ValueError) as exc:
        raise FailslowError(f"{path}: not an update history ({exc})") from None
    finally:
        db.close()
    return [_update(r, path) for r in rows], job


def _update(row: dict[str, Any], path: Path) -> dict[str, Any]:
    """A row as the report shows it, with what it changes in a few words (``describe``)."""
    try:
        if row["kind"] == "rollback":
            what = f"roll back #{row['target']}"
        else:
            parts = []
            if row.get("command"):
                parts.append("command " + " ".join(json.loads(row["command"])))
            env = json.loads(row["env"]) if row.get("env") else {}
            parts += [f"unset {k}" if v is None else f"{k}={v}" for k, v in env.items()]
            if row.get("code_dir"):
                parts.append(f"code {row['code_dir']} ({row.get('code_version')})")
            what = ", ".join(parts) or "restart"
    except (KeyError, TypeError, ValueError) as exc:
        raise FailslowError(f"{path}: update {row.get('id')}: unexpected content ({exc})") from None
    return {**row, "what": what}


def snapshot_records(run_dir: Path, job: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The newest committed in-memory snapshot and backup per rank, from the launcher's snapshot
    directory (or ``<run dir>/snapshots``) while it still exists; None when none does."""
    launcher = job.get("launcher") if isinstance(job.get("launcher"), dict) else {}
    for where in (launcher.get("snapshot_dir"), run_dir / "snapshots"):
        if where and Path(where).is_dir():
            return [dict(r, dir=str(where)) for r in inventory(Path(where))]
    return None
