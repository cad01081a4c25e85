"""Fault injection from outside a process: compute slowdowns by SIGSTOP/SIGCONT duty cycling.

A CPU-quota throttle (the CPU contention of greyhound 3.2, Case 1) stops a process for part of
every scheduling period. :class:`DutyCycleThrottle` does the same from another process: in
every ``period_s`` it stops the target for ``stopped_fraction * period_s`` and continues it for
the rest. The target's code is untouched; it simply gets less wall time, as it would under
contention. The throttle always leaves the target running (SIGCONT) when it stops, also on error.
"""

from __future__ import annotations

import os
import signal
import threading
import time


class DutyCycleThrottle:
    """Duty-cycle one process with SIGSTOP/SIGCONT from a background thread."""

    def __init__(self, pid: int, stopped_fraction: float, period_s: float = 0.1) -> None:
        if not 0.0 < stopped_fraction < 1.0:
            raise ValueError(f"stopped_fraction must be in (0, 1), got {stopped_fraction}")
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.pid = pid
        self.stopped_fraction = stopped_fraction
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_ns: int | None = None
        self.stopped_ns: int | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("throttle already started")
        self.started_ns = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{self.pid}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)
        if self.stopped_ns is None and self.started_ns is not None:
            self.stopped_ns = time.monotonic_ns()

    def _signal(self, sig: signal.Signals) -> bool:
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _run(self) -> None:
        off = self.stopped_fraction * self.period_s
        on = self.period_s - off
        try:
            while not self._stop.is_set():
                if not self._signal(signal.SIGSTOP):
                    break
                self._stop.wait(off)
                if not self._signal(signal.SIGCONT):
                    break
                self._stop.wait(on)
        finally:
            self._signal(signal.SIGCONT)

    def __enter__(self) -> DutyCycleThrottle:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SelfThrottle:
    """The calling process duty-cycled by a forked helper (:func:`throttle_self`).

    A process cannot SIGSTOP itself and continue itself, so a child does it: it stops its parent
    for ``stopped_fraction`` of every ``period_s`` until :meth:`stop` (or until the parent is
    gone). For scripts that slow one of their own ranks from a given step on.
    """

    def __init__(self, stopped_fraction: float, period_s: float = 0.01) -> None:
        if not 0.0 < stopped_fraction < 1.0:
            raise ValueError(f"stopped_fraction must be in (0, 1), got {stopped_fraction}")
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        parent = os.getpid()
        off = stopped_fraction * period_s
        self.helper = os.fork()
        if self.helper == 0:  # the helper: only os and time, then _exit (no parent state runs)
            try:
                while True:
                    os.kill(parent, signal.SIGSTOP)
                    time.sleep(off)
                    os.kill(parent, signal.SIGCONT)
                    time.sleep(period_s - off)
            finally:
                os._exit(0)

    def stop(self) -> None:
        """End the helper and leave this process running."""
        if self.helper > 0:
            os.kill(self.helper, signal.SIGKILL)
            os.waitpid(self.helper, 0)
            self.helper = 0
        os.kill(os.getpid(), signal.SIGCONT)


def throttle_self(stopped_fraction: float, period_s: float = 0.01) -> SelfThrottle:
    """Slow this process from now on: stopped ``stopped_fraction`` of every ``period_s``."""
    return SelfThrottle(stopped_fraction, period_s)
