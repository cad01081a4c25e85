"""A rank's uncaught exception, recorded for the launcher (byterobust 4.1: "user-space errors
... traceable to specific code modules from logs and exit codes").

Under ``failslow run`` (``$FAILSLOW_STATE_DIR`` set) the runtime's exception hook
(:mod:`.teardown`) writes one JSON file per process that ends with an uncaught exception:
``<state dir>/exceptions/pid<P>.json`` with the rank, the exception's type and message, and
its frames (file, line, function; outermost first). The node agent reads them after a failure
and rolls back a code update the exception is traceable to
(:mod:`failslow.node.hot_update.blame`). Never raises: a record that cannot be written is lost,
the exception is still printed as Python prints it.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from failslow import envvars
from failslow.core.control.stop import put_json, take_json

EXCEPTIONS = "exceptions"
"""The directory of the records, in the job's state directory."""
MAX_FRAMES = 64


def record(
    kind: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> Path | None:
    """Write this process's record (see the module doc); its path, or None."""
    state_dir = os.environ.get(envvars.STATE_DIR)
    if not state_dir or issubclass(kind, KeyboardInterrupt | SystemExit):
        return None
    with contextlib.suppress(Exception):
        frames = [[f.filename, f.lineno or 0, f.name] for f in traceback.extract_tb(tb)]
        rank = os.environ.get("RANK")
        body: dict[str, Any] = {
            "rank": int(rank) if rank and rank.isdigit() else None,
            "pid": os.getpid(),
            "wall": time.time(),
            "type": kind.__qualname__,
            "message": str(exc)[:1000],
            "frames": frames[-MAX_FRAMES:],
        }
        return put_json(Path(state_dir) / EXCEPTIONS / f"pid{os.getpid()}.json", body)
    return None


def take(state_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record in ``state_dir``, removed as read (unreadable ones are skipped)."""
    taken = take_json(Path(state_dir) / EXCEPTIONS, "pid*.json")
    return [record for _, record in taken if record is not None]


def raised_at(state_dir: str | os.PathLike[str], pid: int) -> float | None:
    """When process ``pid``'s uncaught exception reached its top level (``time.time()``), if it
    left a record; the record stays for :func:`take`."""
    import json

    try:
        record = json.loads((Path(state_dir) / EXCEPTIONS / f"pid{pid}.json").read_text())
        return float(record["wall"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
