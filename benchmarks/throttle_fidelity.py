"""Does the injected slowdown hold on a loaded machine? The demo's compute fault side by side with
the design it replaced (issue 45's notes: a rank meant to be ~4x slower ran 1.4x slower beside
a CPU hog, and its e2e test missed the fault).

    .venv/bin/python benchmarks/throttle_fidelity.py [--rounds 3] [--seconds 4] [--ranks 4]

``--ranks`` busy processes stand for a job's ranks (one busy core each, as the CPU demos' ranks
are), beside 0, 1 and 2 busy hogs; the first is throttled at the demo's setting (stopped 75% of
every 20 ms: nominally 4x slower). In each round, interleaved, for ``--seconds`` each:

* ``none``: no throttle - the target's CPU time is the yardstick;
* ``thread``: SIGSTOP/SIGCONT from a thread of this process with fixed sleeps (failslow's
  ``DutyCycleThrottle`` before this benchmark);
* ``process``: :class:`failslow.faults.DutyCycleThrottle` now - a helper process, real-time
  where allowed, each window timed from the stopped time the target has really had;
* ``..., busy``: the same while the injecting process's main thread does Python work (the demo
  launcher runs the control plane in the process that throttles).

Printed per load and design: the target's slowdown (its CPU time unthrottled / throttled,
median and worst of the rounds; 4.0 is the setting, but a process stopped 75% of the time on
oversubscribed cores is owed CPU by the scheduler and catches up in its running windows), the
fraction of the time it was stopped as the injector timed its own signals (0.75 is the setting)
and the longest it ran between two stops (5 ms is the setting: a GEMM repetition shorter than
that can run unslowed, and validation takes a rank's fastest repetition).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from rich.console import Console
from rich.table import Table

from failslow.faults import DutyCycleThrottle

FRACTION, PERIOD_S = 0.75, 0.02


class ThreadThrottle:
    """The replaced design: a thread of the injecting process, fixed sleeps."""

    def __init__(self, pid: int) -> None:
        self.pid, self._stop = pid, threading.Event()
        self.stopped_s, self.elapsed_s, self.longest_run_s = 0.0, 0.0, 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        off, start = FRACTION * PERIOD_S, time.monotonic()
        resumed = None
        while not self._stop.is_set():
            t = time.monotonic()
            os.kill(self.pid, signal.SIGSTOP)
            if resumed is not None:
                self.longest_run_s = max(self.longest_run_s, t - resumed)
            self._stop.wait(off)
            os.kill(self.pid, signal.SIGCONT)
            resumed = time.monotonic()
            self.stopped_s += resumed - t
            self._stop.wait(PERIOD_S - off)
        self.elapsed_s = time.monotonic() - start

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        os.kill(self.pid, signal.SIGCONT)
        return self.stopped_s / self.elapsed_s


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy(seconds: float) -> None:
    """Python work in the injecting process's main thread for ``seconds`` (the demo launcher's
    in-process control plane: its analyzer and controller hold the GIL between their sleeps)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(range(200))


def _window(design: str, pid: int, seconds: float) -> tuple[float, float | None, float | None]:
    """The target's CPU seconds over ``seconds`` under ``design``, the stopped fraction and the
    longest run between two stops."""
    throttle: ThreadThrottle | DutyCycleThrottle | None = None
    if design.startswith("thread"):
        throttle = ThreadThrottle(pid)
    elif design.startswith("process"):
        throttle = DutyCycleThrottle(pid, FRACTION, PERIOD_S)
    before = _cpu_s(pid)
    if throttle is not None:
        throttle.start()
    if design.endswith("busy"):
        _busy(seconds)
    else:
        time.sleep(seconds)
    if isinstance(throttle, ThreadThrottle):
        return _cpu_s(pid) - before, throttle.stop(), throttle.longest_run_s
    if throttle is not None:
        throttle.stop()
        return _cpu_s(pid) - before, throttle.achieved, throttle.longest_run_s
    return _cpu_s(pid) - before, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    designs = ("none", "thread", "thread, busy", "process", "process, busy")
    rows = []
    console = Console()
    for hogs in (0, 1, 2):
        procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.ranks + hogs)
        ]
        try:
            target = procs[0].pid
            time.sleep(0.5)
            cpu: dict[str, list[float]] = {d: [] for d in designs}
            stopped: dict[str, list[float]] = {d: [] for d in designs}
            longest: dict[str, list[float]] = {d: [] for d in designs}
            for r in range(args.rounds):
                console.print(f"{hogs} hog(s): round {r + 1} of {args.rounds}")
                for design in designs:
                    used, frac, run = _window(design, target, args.seconds)
                    cpu[design].append(used)
                    if frac is not None and run is not None:
                        stopped[design].append(frac)
                        longest[design].append(run)
            base = statistics.median(cpu["none"])
            for design in designs[1:]:
                pairs = zip(cpu["none"], cpu[design], strict=True)
                slowdowns = [b / max(c, 1e-9) for b, c in pairs]
                rows.append((hogs, design, statistics.median(slowdowns), min(slowdowns),
                             statistics.median(stopped[design]) if stopped[design] else None,
                             max(longest[design]) if longest[design] else None,
                             base / args.seconds))  # fmt: skip
        finally:
            for p in procs:
                p.kill()
                p.wait()
    table = Table(title=f"stopped {FRACTION:.0%} of every {PERIOD_S * 1e3:.0f} ms "
                  f"(nominal 4.0x), {args.ranks} busy ranks on {os.cpu_count()} cores, "
                  f"{args.rounds} rounds x {args.seconds:.0f} s")  # fmt: skip
    columns = ("hogs", "design", "slowdown (median)", "slowdown (worst)", "stopped",
               "longest run (ms)", "cores unthrottled")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for hogs, design, med, worst, frac, run, base in rows:
        table.add_row(str(hogs), design, f"{med:.2f}x", f"{worst:.2f}x",
                      "-" if frac is None else f"{frac:.1%}",
                      "-" if run is None else f"{run * 1e3:.1f}", f"{base:.2f}")  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
