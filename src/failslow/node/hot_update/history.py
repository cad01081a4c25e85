"""The job's update history: every hot update and rollback, in an embedded SQLite database.

byterobust 6.1 persists "every modification" of a job in a database, so that an update can be
applied later (lazy), audited, and rolled back (4.2, 8.1.2) to the version it replaced. Here the
database is one file, ``<state dir>/updates.sqlite``, shared by the launcher (which applies
updates) and ``failslow update`` (which submits, lists and rolls back): WAL mode, a busy timeout
and ``BEGIN IMMEDIATE`` for every write make the two safe to run at once.

An update moves through ``pending`` -> ``probation`` (relaunched; a failure within the probation
window rolls it back) -> ``applied``; or ends ``failed`` (the stop was refused, or the new version
could not start), ``rolled_back``, ``cancelled``, or ``expired`` (the job ended before it was
applied). Each applied update records the version it replaced (``previous``) and the one it made.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from failslow.errors import FailslowError
from failslow.node.hot_update.version import Version

DB_NAME = "updates.sqlite"
URGENCIES = ("urgent", "lazy")
LIVE = ("probation", "applied")  # outcomes of an update whose version may be running

SCHEMA = """
CREATE TABLE IF NOT EXISTS updates (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    submitted_at REAL NOT NULL,
    kind TEXT NOT NULL,              -- update | rollback
    urgency TEXT NOT NULL,           -- urgent | lazy
    command TEXT,                    -- JSON list, or NULL: unchanged
    env TEXT,                        -- JSON object (null value: unset), or NULL
    code_dir TEXT,
    code_version TEXT,
    target INTEGER,                  -- rollback: the update it undoes
    window_s REAL,                   -- lazy: apply at the latest this long after submission
    note TEXT NOT NULL DEFAULT '',
    outcome TEXT NOT NULL DEFAULT 'pending',
    trigger TEXT,                    -- what made the launcher apply it
    applied_at REAL,
    applied_step INTEGER,
    previous TEXT,                   -- JSON Version it replaced
    version TEXT,                    -- JSON Version it made
    finished_at REAL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS job (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class Update:
    """One row of the history."""

    id: int
    submitted_at: float
    kind: str
    urgency: str
    command: tuple[str, ...] | None
    env: dict[str, str | None] | None
    code_dir: str | None
    code_version: str | None
    target: int | None
    window_s: float | None
    note: str
    outcome: str
    trigger: str | None
    applied_at: float | None
    applied_step: int | None
    previous: Version | None
    version: Version | None
    finished_at: float | None
    detail: str

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Update:
        def version(text: str | None) -> Version | None:
            return None if text is None else Version.from_dict(json.loads(text))

        return cls(
            id=row["id"],
            submitted_at=row["submitted_at"],
            kind=row["kind"],
            urgency=row["urgency"],
            command=None if row["command"] is None else tuple(json.loads(row["command"])),
            env=None if row["env"] is None else json.loads(row["env"]),
            code_dir=row["code_dir"],
            code_version=row["code_version"],
            target=row["target"],
            window_s=row["window_s"],
            note=row["note"],
            outcome=row["outcome"],
            trigger=row["trigger"],
            applied_at=row["applied_at"],
            applied_step=row["applied_step"],
            previous=version(row["previous"]),
            version=version(row["version"]),
            finished_at=row["finished_at"],
            detail=row["detail"],
        )

    def apply_to(self, current: Version, history: History) -> Version:
        """The version this update makes out of ``current``."""
        if self.kind == "rollback":
            assert self.target is not None
            target = history.get(self.target)
            assert target.previous is not None
            return target.previous
        return current.changed(
            command=self.command,
            env=self.env,
            code_dir=self.code_dir,
            code_version=self.code_version,
        )

    def describe(self) -> str:
        """What the update changes, in a few words."""
        if self.kind == "rollback":
            return f"roll back #{self.target}"
        parts = []
        if self.command:
            parts.append("command " + " ".join(self.command))
        for key, value in (self.env or {}).items():
            parts.append(f"unset {key}" if value is None else f"{key}={value}")
        if self.code_dir:
            parts.append(f"code {self.code_dir} ({self.code_version})")
        return ", ".join(parts) or "restart"


def db_path(state_dir: str | os.PathLike[str]) -> Path:
    """The history file of a state directory (a path to the file itself is accepted too)."""
    path = Path(state_dir)
    return path if path.suffix == ".sqlite" else path / DB_NAME


class History:
    """The update history at ``path`` (see :func:`open_history`). Safe across processes; one
    instance belongs to one thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(str(path), timeout=10.0, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA busy_timeout = 10000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.executescript(SCHEMA)  # idempotent; each statement commits on its own
        except sqlite3.Error as exc:
            raise FailslowError(f"update history {path}: {exc}") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- submitting ---------------------------------------------------------------------------
    def submit(
        self,
        *,
        urgency: str,
        command: Sequence[str] | None = None,
        env: Mapping[str, str | None] | None = None,
        code_dir: str | None = None,
        code_version: str | None = None,
        note: str = "",
        window_s: float | None = None,
    ) -> Update:
        """Record a new pending update; FailslowError when it changes nothing."""
        if urgency not in URGENCIES:
            raise FailslowError(f"urgency must be one of {', '.join(URGENCIES)}, got {urgency!r}")
        if not command and not env and code_dir is None:
            raise FailslowError("an update must change something: --command, --env or --code-dir")
        if window_s is not None and not window_s >= 0:
            raise FailslowError(f"the lazy window must be >= 0 seconds, got {window_s}")
        return self._insert(
            kind="update",
            urgency=urgency,
            command=json.dumps(list(command)) if command else None,
            env=json.dumps(dict(env)) if env else None,
            code_dir=code_dir,
            code_version=code_version,
            note=note,
            window_s=window_s,
        )

    def request_rollback(
        self, target: int | None = None, *, urgency: str = "urgent", note: str = ""
    ) -> Update:
        """Record a rollback of ``target`` (default: the last update applied): the job goes back
        to the version that ran before it, undoing every update applied after it as well."""
        if target is None:
            row = self._db.execute(
                "SELECT id FROM updates WHERE kind = 'update' AND outcome IN (?, ?) "
                "ORDER BY applied_at DESC, id DESC LIMIT 1",
                LIVE,
            ).fetchone()
            if row is None:
                raise FailslowError(f"nothing to roll back: no applied update in {self.path}")
            target = int(row["id"])
        update = self.get(target)
        if update.outcome not in LIVE or update.previous is None:
            raise FailslowError(
                f"update {target} is {update.outcome}, not applied: nothing to roll back"
            )
        return self._insert(
            kind="rollback", urgency=urgency, target=target, note=note or f"roll back #{target}"
        )

    def cancel(self, update_id: int) -> Update:
        update = self.get(update_id)
        with self._write() as db:
            done = db.execute(
                "UPDATE updates SET outcome = 'cancelled', finished_at = ? "
                "WHERE id = ? AND outcome = 'pending'",
                (time.time(), update_id),
            ).rowcount
        if not done:
            raise FailslowError(f"update {update_id} is {update.outcome}, not pending")
        return self.get(update_id)

    def _insert(self, **values: Any) -> Update:
        values["submitted_at"] = time.time()
        names = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self._write() as db:
            cursor = db.execute(
                f"INSERT INTO updates ({names}) VALUES ({marks})", (*values.values(),)
            )
        assert cursor.lastrowid is not None
        return self.get(cursor.lastrowid)

    # -- reading ------------------------------------------------------------------------------
    def get(self, update_id: int) -> Update:
        row = self._db.execute("SELECT * FROM updates WHERE id = ?", (update_id,)).fetchone()
        if row is None:
            raise FailslowError(f"no update {update_id} in {self.path}")
        return Update.from_row(row)

    def updates(self, outcome: str | None = None) -> list[Update]:
        if outcome is None:
            rows = self._db.execute("SELECT * FROM updates ORDER BY id").fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM updates WHERE outcome = ? ORDER BY id", (outcome,)
            ).fetchall()
        return [Update.from_row(r) for r in rows]

    def due(self, now: float, default_window_s: float) -> list[Update]:
        """Pending updates that must be applied now: urgent ones, and lazy ones whose window
        (their own, else ``default_window_s``) has expired."""
        return [
            u
            for u in self.updates("pending")
            if u.urgency == "urgent"
            or now >= u.submitted_at + (default_window_s if u.window_s is None else u.window_s)
        ]

    # -- the launcher's records ---------------------------------------------------------------
    def record_applied(
        self,
        update: Update,
        *,
        previous: Version,
        version: Version,
        trigger: str,
        applied_step: int | None,
    ) -> None:
        with self._write() as db:
            db.execute(
                "UPDATE updates SET outcome = 'probation', trigger = ?, applied_at = ?, "
                "applied_step = ?, previous = ?, version = ? WHERE id = ?",
                (
                    trigger,
                    time.time(),
                    applied_step,
                    json.dumps(previous.to_dict()),
                    json.dumps(version.to_dict()),
                    update.id,
                ),
            )
            if update.kind == "rollback":  # the target and everything applied after it
                target = self.get(update.target or 0)
                db.execute(
                    "UPDATE updates SET outcome = 'rolled_back', finished_at = ?, detail = ? "
                    "WHERE kind = 'update' AND outcome IN (?, ?) AND applied_at >= ?",
                    (time.time(), f"rolled back by #{update.id}", *LIVE, target.applied_at),
                )

    def finish(self, ids: Iterable[int], outcome: str, detail: str = "") -> None:
        """Set the final outcome of the updates ``ids`` that are not final yet."""
        with self._write() as db:
            for update_id in ids:
                db.execute(
                    "UPDATE updates SET outcome = ?, finished_at = ?, "
                    "detail = CASE WHEN ? = '' THEN detail ELSE ? END "
                    "WHERE id = ? AND outcome IN ('pending', 'probation')",
                    (outcome, time.time(), detail, detail, update_id),
                )

    def set_job(self, key: str, value: Any) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO job (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value)),
            )

    def job(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM job WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row["value"])


def open_history(state_dir: str | os.PathLike[str], *, create: bool = False) -> History:
    """The history of a state directory; with ``create`` the directory and file are made,
    otherwise a missing one is a FailslowError saying where the state directory comes from."""
    path = db_path(state_dir)
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FailslowError(f"cannot create the state directory {path.parent}: {exc}") from None
    elif not path.is_file():
        raise FailslowError(
            f"no update history at {path} (failslow run prints its state directory)"
        )
    return History(path)
