"""A ``failslow run`` launcher around ``_job.py`` (stand-in ranks), driven from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from failslow.node.hot_update.history import History, open_history

JOB = Path(__file__).with_name("_job.py")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FAILSLOW_", "JOB_")) and k not in ("LD_PRELOAD", "PYTHONPATH")
    }
    env.update(extra)
    return env


def failslow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "failslow.cli", *args],
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


class Launcher:
    """``failslow run [run_args] -- CMD`` in the background; the job logs to ``log.jsonl``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.state_dir = tmp_path / "rings"
        self.log = tmp_path / "log.jsonl"
        self.ctl = tmp_path / "ctl"
        self.ctl.mkdir()
        self.proc: subprocess.Popen[str] | None = None
        self.stderr = ""

    def start(
        self,
        *run_args: str,
        command: list[str] | None = None,
        world: int = 1,
        hook: bool = False,
        **env: str,
    ) -> Launcher:
        """``hook``: the Python hook on (failslow's runtime starts in a process that imports
        torch, as in a rank)."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "failslow.cli",
                "run",
                "--no-shim",
                *([] if hook else ["--no-python-hook"]),
                "--ring-dir",
                str(self.state_dir),
                "--snapshot-dir",
                str(self.tmp / "snapshots"),
                "--update-poll",
                "0.05",
                *run_args,
                "--",
                *(command or [sys.executable, str(JOB)]),
            ],
            env=clean_env(
                JOB_LOG=str(self.log), JOB_CTL=str(self.ctl), JOB_WORLD=str(world), **env
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self

    def records(self, event: str = "start") -> list[dict[str, Any]]:
        """The job's log records of ``event`` ("*": all)."""
        if not self.log.is_file():
            return []
        lines = self.log.read_text().splitlines()
        return [r for r in map(json.loads, lines) if event in ("*", r["event"])]

    def wait_for(self, what: Callable[[], Any], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = what()
            if value:
                return value
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher ended ({self.proc.returncode}): {self.end()[1]}")
            time.sleep(0.05)
        raise AssertionError(f"timed out; launcher said: {self.stop_now()}")

    def starts(self, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        return self.wait_for(lambda: len(self.records()) >= n and self.records(), timeout)

    def history(self) -> History:
        return open_history(self.state_dir)

    def end(self, timeout: float = 30.0) -> tuple[int, str]:
        assert self.proc is not None
        _, self.stderr = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, self.stderr

    def finish(self) -> tuple[int, str]:
        (self.ctl / "done").touch()
        return self.end()

    def stop_now(self) -> str:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.end(timeout=15)[1]
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.end()[1]
        return self.stderr
