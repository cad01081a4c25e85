"""Where a demo writes its run: a new directory, or an empty one the user named.

A demo reads its own output while it runs (rank 0's progress file, the step records, the
journal), so an earlier run's files in the same directory would be taken for this run's: a
second ``failslow demo --out X`` once started its throttle at the first run's last step and
printed a phase table with no slowed phase. A directory that holds anything is refused before
anything starts."""

from __future__ import annotations

import time
from pathlib import Path

from failslow.errors import FailslowError


def new_run_dir(out: Path | None, kind: str) -> Path:
    """``out`` created (or ``runs/demo-<kind>-<time>``); FailslowError, one line, when it is
    a file or a directory that is not empty."""
    out = out or Path("runs") / time.strftime(f"demo-{kind}-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FailslowError(
            f"demo: --out {out} is not an empty directory (an earlier run's files would be "
            "read as this run's); name a new one or remove it"
        )
    out.mkdir(parents=True, exist_ok=True)
    return out
