"""Fault injection from outside a process: compute slowdowns by SIGSTOP/SIGCONT duty cycling.

A CPU-quota throttle (the CPU contention of greyhound 3.2, Case 1) stops a process for part of
every scheduling period. :class:`DutyCycleThrottle` does the same from another process: in
every ``period_s`` it stops the target for ``stopped_fraction * period_s`` and continues it for
the rest. The target's code is untouched; it simply gets less wall time, as it would under
contention. The throttle always leaves the target running (SIGCONT) when it stops, also on error.

The cycle runs in a process of its own (``python -m failslow.faults``), real-time
(``SCHED_FIFO``) where the system allows it, and keeps account: each window is timed from the
stopped and running time the target has really had, so a late wake-up is made up in the next
window instead of lost. A thread of the injecting process (the first design) was not woken on
time on a loaded machine: its target ran 19-36 ms between two stops (nominally 5 ms) and was
stopped 63-71% of the time instead of 75% - long enough for a ~12 ms validation GEMM to run
unslowed, so validation timed the throttled rank at full speed (issue 45's notes;
``benchmarks/throttle_fidelity.py``). Neither design makes a rank on oversubscribed cores the
nominal ``1 / (1 - stopped_fraction)`` slower in CPU time: the scheduler owes a stopped process
CPU and it catches up in its running windows (~2-2.5x at 75% there).

Sending SIGCONT/SIGSTOP to a process needs the right to signal it (the same user, or root).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

_stopping = False
"""Set in the helper by SIGTERM: the window under way ends as planned, then the target runs."""
MAX_WINDOWS = 4.0
"""A window is at most this many times its nominal length: after a long stall of the throttle
itself (a machine paused) the target is not frozen for the whole debt at once."""


class DutyCycleThrottle:
    """Duty-cycle one process with SIGSTOP/SIGCONT from a helper process (:func:`_cycle`)."""

    def __init__(self, pid: int, stopped_fraction: float, period_s: float = 0.1) -> None:
        if not 0.0 < stopped_fraction < 1.0:
            raise ValueError(f"stopped_fraction must be in (0, 1), got {stopped_fraction}")
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        self.pid = pid
        self.stopped_fraction = stopped_fraction
        self.period_s = period_s
        self._helper: subprocess.Popen[str] | None = None
        self.started_ns: int | None = None
        self.stopped_ns: int | None = None
        self.scheduling: str | None = None
        """How the helper runs: ``SCHED_FIFO``, or ``normal`` where real time is not allowed."""
        self.achieved: float | None = None
        """The fraction of the throttled time the target was really stopped (after :meth:`stop`;
        None when the helper could not say)."""
        self.longest_run_s: float | None = None
        """The longest time the target ran between two stops (after :meth:`stop`): nominally
        ``(1 - stopped_fraction) * period_s``; work shorter than it can slip through unslowed."""

    @property
    def active(self) -> bool:
        return self._helper is not None and self._helper.poll() is None

    def start(self) -> None:
        if self._helper is not None:
            raise RuntimeError("throttle already started")
        self.started_ns = time.monotonic_ns()
        argv = [sys.executable, "-m", "failslow.faults", str(self.pid),
                str(self.stopped_fraction), str(self.period_s), str(os.getpid())]  # fmt: skip
        self._helper = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self.scheduling = _line(self._helper, timeout_s=10.0)
        if self.scheduling is None:
            code = self._helper.poll()
            self.stop()
            raise RuntimeError(
                f"throttle of pid {self.pid}: its helper did not start "
                f"({'exit status ' + str(code) if code is not None else 'no answer in 10 s'})"
            )

    def stop(self) -> None:
        """End the cycle (again: a no-op) and leave the target running."""
        helper = self._helper
        if helper is not None and helper.poll() is None:
            helper.send_signal(signal.SIGTERM)
            try:
                helper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
        if helper is not None and helper.stdout is not None and not helper.stdout.closed:
            summary = _line(helper, timeout_s=1.0)
            if summary and summary.startswith("stopped "):
                fields = summary.split()
                self.achieved, self.longest_run_s = float(fields[1]), float(fields[3])
            helper.stdout.close()
        _send(self.pid, signal.SIGCONT)
        if self.stopped_ns is None and self.started_ns is not None:
            self.stopped_ns = time.monotonic_ns()

    def __enter__(self) -> DutyCycleThrottle:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _line(helper: subprocess.Popen[str], *, timeout_s: float) -> str | None:
    """The helper's next line, or None when it has none within ``timeout_s`` (or exited)."""
    assert helper.stdout is not None
    ready, _, _ = select.select([helper.stdout], [], [], timeout_s)
    if not ready:
        return None
    return helper.stdout.readline().strip() or None


def _send(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _realtime() -> str:
    """This process on ``SCHED_FIFO`` (a low real-time priority: above every normal process,
    below the kernel's own real-time threads) if allowed; its wake-ups then preempt a loaded
    machine's training ranks and hogs. Sleeping most of the time, it takes almost no CPU."""
    try:
        priority = os.sched_get_priority_min(os.SCHED_FIFO) + 9
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        return "SCHED_FIFO"
    except (AttributeError, OSError):
        return "normal"


def _cycle(pid: int, fraction: float, period_s: float, parent: int) -> tuple[float, float]:
    """Stop ``pid`` ``fraction`` of every ``period_s`` until SIGTERM, the target's or the
    parent's end; return the fraction of the elapsed time the target was stopped and the
    longest time it ran between two stops.

    Accounting instead of fixed sleeps: after ``e`` seconds with ``s`` of them stopped, a stop
    window lasts until the target's running time ``e - s`` is its share of the cycle it is in
    (ends at ``(e - s) / (1 - fraction) + off``), a run window until its stopped time is its
    share (ends at ``s / fraction``). On time, these are the nominal windows; a late wake-up
    lengthens the next window of the other kind by as much."""
    off, on = fraction * period_s, (1.0 - fraction) * period_s
    start = time.monotonic()
    stopped = longest = 0.0
    resumed: float | None = None
    try:
        while not _stopping and os.getppid() == parent:
            t = time.monotonic()
            window = (t - start - stopped) / (1.0 - fraction) + off - (t - start)
            window = min(window, MAX_WINDOWS * off)
            if window > 0:
                if not _send(pid, signal.SIGSTOP):
                    break
                if resumed is not None:
                    longest = max(longest, t - resumed)
                time.sleep(window)
                if not _send(pid, signal.SIGCONT):
                    break
                resumed = time.monotonic()
                stopped += resumed - t
            t = time.monotonic()
            window = min(stopped / fraction - (t - start), MAX_WINDOWS * on)
            if window > 0:
                time.sleep(window)
    finally:
        _send(pid, signal.SIGCONT)
    elapsed = time.monotonic() - start
    return (stopped / elapsed if elapsed > 0 else 0.0), longest


def _terminate(signum: int, frame: object) -> None:
    global _stopping
    _stopping = True


def _main(argv: list[str]) -> None:
    pid, fraction, period_s, parent = int(argv[0]), float(argv[1]), float(argv[2]), int(argv[3])
    signal.signal(signal.SIGTERM, _terminate)
    print(_realtime(), flush=True)
    achieved, longest = _cycle(pid, fraction, period_s, parent)
    with contextlib.suppress(OSError):  # a starter that died has closed the pipe
        print(f"stopped {achieved:.4f} longest_run {longest:.6f}", flush=True)


class SelfThrottle:
    """The calling process duty-cycled by a forked helper (:func:`throttle_self`).

    A process cannot SIGSTOP itself and continue itself, so a child does it: it stops its parent
    for ``stopped_fraction`` of every ``period_s`` until :meth:`stop` (or until the parent is
    gone). For scripts that slow one of their own ranks from a given step on. The child runs the
    same cycle as :class:`DutyCycleThrottle`'s helper (real-time where allowed, windows timed from
    the stopped time its parent really had).
    """

    def __init__(self, stopped_fraction: float, period_s: float = 0.01) -> None:
        if not 0.0 < stopped_fraction < 1.0:
            raise ValueError(f"stopped_fraction must be in (0, 1), got {stopped_fraction}")
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        parent = os.getpid()
        self.helper = os.fork()
        if self.helper == 0:  # the helper: os, signal and time only, then _exit (no parent state)
            try:
                signal.signal(signal.SIGTERM, _terminate)
                _realtime()
                _cycle(parent, stopped_fraction, period_s, parent)
            finally:
                os._exit(0)

    def stop(self) -> None:
        """End the helper and leave this process running. SIGTERM, not SIGKILL: the helper ends
        the window under way and continues this process itself (a helper killed right after it
        stopped this process would leave it stopped)."""
        if self.helper > 0:
            os.kill(self.helper, signal.SIGTERM)
            os.waitpid(self.helper, 0)
            self.helper = 0
        os.kill(os.getpid(), signal.SIGCONT)


def throttle_self(stopped_fraction: float, period_s: float = 0.01) -> SelfThrottle:
    """Slow this process from now on: stopped ``stopped_fraction`` of every ``period_s``."""
    return SelfThrottle(stopped_fraction, period_s)


if __name__ == "__main__":
    _main(sys.argv[1:])
