"""Errors a user can cause, each with a message that names the input and what was expected.

The CLI prints these as one line and exits with status 2; everything else is a bug.
"""

from __future__ import annotations

EXIT_USAGE = 2
"""Exit status of a ``failslow`` command that a user error stopped."""


class FailslowError(Exception):
    """Base class of user-facing errors."""


class ConfigError(FailslowError, ValueError):
    """A setting with an unknown key or an invalid value."""


class MetricIncidentError(FailslowError):
    """A watched training metric went bad (``failslow.report_metrics``) and nothing can roll
    the job back (no ``failslow run``, or no in-memory snapshots)."""


class TraceFormatError(FailslowError, ValueError):
    """A trace file that cannot be parsed; names the file and, where known, the line."""

    def __init__(self, path: str, message: str, line: int | None = None) -> None:
        self.path = path
        self.line = line
        self.detail = message
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")
