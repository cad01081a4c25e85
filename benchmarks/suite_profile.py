"""Where the test suite's time goes: each test's wall time and the machine's idle CPU while it
ran (issue 49: the suite's 30-minute budget).

Usage::

    python benchmarks/suite_profile.py [--top 40] [-- PYTEST_ARGS ...]

Runs ``./dev test`` (the README's test command; pytest arguments after ``--``, e.g. a few test
files) with a pytest plugin that logs every test's start and end, while a thread samples
``/proc/stat`` every 2 s. Prints the slowest tests with the share of the machine's CPU that was
idle during each (a test at a few percent idle is CPU-bound: only less work makes it faster;
one at 50% or more waits - on a throttled rank, a timeout, a poll), and the suite's total,
then the same per group: the timed worlds (tests marked ``multiprocess``), the untimed ones
(also marked ``untimed``) and the single-process tests. ``./dev test`` runs the timed worlds on
one xdist worker and the other two groups on the other, at a lower CPU priority
(``tests/conftest.py``), so a test's idle share is the machine's while it ran, beside whatever
the other worker ran. ``--log PATH`` keeps every test's row (seconds, idle share, group, test
id) as TSV.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = """import os, time
_F = open(os.environ["FAILSLOW_SUITE_TIMELOG"], "a", buffering=1)
_WORKER = False
def pytest_configure(config):
    global _WORKER
    _WORKER = hasattr(config, "workerinput")  # an xdist worker: its controller logs the times
def pytest_runtest_logstart(nodeid, location):
    if not _WORKER:
        _F.write(f"start\\t{time.time():.3f}\\t{nodeid}\\n")
def pytest_runtest_logfinish(nodeid, location):
    if not _WORKER:
        _F.write(f"end\\t{time.time():.3f}\\t{nodeid}\\n")
def pytest_runtest_setup(item):
    if item.get_closest_marker("multiprocess") is not None:
        untimed = item.get_closest_marker("untimed") is not None
        _F.write(f"{'untimed' if untimed else 'multiprocess'}\\t0\\t{item.nodeid}\\n")
"""


def cpu_times() -> tuple[float, float]:
    """(idle, total) jiffies of all CPUs from /proc/stat (idle includes iowait)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def sample(samples: list[tuple[float, float, float]], stop: threading.Event) -> None:
    while not stop.wait(2.0):
        idle, total = cpu_times()
        samples.append((time.time(), idle, total))


def idle_share(samples: list[tuple[float, float, float]], start: float, end: float) -> float:
    """The idle share of the CPU between the samples that bracket [start, end] (nan if none)."""
    inside = [s for s in samples if start - 2.0 <= s[0] <= end + 2.0]
    if len(inside) < 2:
        return float("nan")
    (_, i0, t0), (_, i1, t1) = inside[0], inside[-1]
    return (i1 - i0) / (t1 - t0) if t1 > t0 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--log", type=Path, help="write every test's row here (TSV)")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="failslow-suite-") as tmp:
        (Path(tmp) / "failslow_suite_timelog.py").write_text(PLUGIN)
        log = Path(tmp) / "times.tsv"
        env = dict(os.environ, FAILSLOW_SUITE_TIMELOG=str(log))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, env.get("PYTHONPATH")]))
        samples: list[tuple[float, float, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(samples, stop), daemon=True)
        idle, total = cpu_times()
        samples.append((time.time(), idle, total))
        sampler.start()
        started = time.time()
        argv = ["./dev", "test", "-p", "failslow_suite_timelog", *args.pytest_args]
        rc = subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode
        stop.set()
        sampler.join()
        wall = time.time() - started
        begun: dict[str, float] = {}
        rows = []
        spawned: set[str] = set()
        untimed: set[str] = set()
        for line in log.read_text().splitlines() if log.is_file() else []:
            kind, at, nodeid = line.split("\t", 2)
            if kind == "multiprocess":
                spawned.add(nodeid)
            elif kind == "untimed":
                untimed.add(nodeid)
            elif kind == "start":
                begun[nodeid] = float(at)
            elif nodeid in begun:
                start = begun.pop(nodeid)
                rows.append((float(at) - start, nodeid, idle_share(samples, start, float(at))))
    rows.sort(reverse=True)
    table = Table(title=f"slowest {args.top} of {len(rows)} tests (2 s CPU samples)")
    table.add_column("seconds", justify="right")
    table.add_column("CPU idle", justify="right")
    table.add_column("test", overflow="fold")
    for seconds, nodeid, idle_frac in rows[: args.top]:
        table.add_row(f"{seconds:.1f}", f"{idle_frac:.0%}", escape(nodeid))
    console = Console(width=200)
    console.print(table)
    suite_idle = idle_share(samples, started, started + wall)
    console.print(
        f"pytest exit {rc}; {wall:.0f} s wall, tests {sum(r[0] for r in rows):.0f} s; the CPU was "
        f"{suite_idle:.0%} idle over the run ({os.cpu_count()} CPUs)"
    )
    cpus = os.cpu_count() or 1
    groups = Table(title="by group (idle core-seconds: seconds x CPUs x idle share)")
    for column in ("group", "tests", "seconds", "idle core-s"):
        groups.add_column(column, justify="left" if column == "group" else "right")

    def group(nodeid: str) -> str:
        return "timed worlds" if nodeid in spawned else (
            "untimed worlds" if nodeid in untimed else "single-process")  # fmt: skip

    for name in ("timed worlds", "untimed worlds", "single-process"):
        mine = [r for r in rows if group(r[1]) == name]
        idle_s = sum(s * cpus * i for s, _, i in mine if i == i)  # nan: too short to sample
        groups.add_row(name, str(len(mine)), f"{sum(r[0] for r in mine):.0f}", f"{idle_s:.0f}")
    console.print(groups)
    if args.log is not None:
        args.log.write_text("".join(
            f"{s:.3f}\t{i:.3f}\t{group(n)}\t{n}\n" for s, n, i in rows
        ))  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
