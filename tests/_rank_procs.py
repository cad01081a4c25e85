"""Waiting for a spawned world's rank processes (shared by the multi-process test harnesses)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO, Any


def await_ranks(
    procs: list[subprocess.Popen[Any]],
    logs: list[IO[str]],
    log_dir: Path,
    *,
    timeout: float,
    label: str,
) -> None:
    """Wait up to ``timeout`` for every rank, kill (by PID) what is left, close the logs, and
    raise an AssertionError with each failed rank's log tail (``log_dir/rank<R>.log``)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {r} (rc={procs[r].returncode}) ---\n"
            + (log_dir / f"rank{r}.log").read_text()[-4000:]
            for r in failed
        )
        raise AssertionError(f"{label} failed on ranks {failed}:\n{tails}")
