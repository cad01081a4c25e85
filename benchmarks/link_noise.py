"""Healthy links on shared cores: false slow links of greyhound's passes, with ballast, confirmed.

``python benchmarks/link_noise.py [--trials 100] [--hog 2] [--threshold 1.1] [--json]`` starts a
4-rank gloo world on this machine (TCPStore on port 0, one process per rank, one intra-op
thread each), every link healthy, and runs the O(1) link tests the controller's validation
round runs for it (``communicator_passes([[0, 1, 2, 3]])``: the group's ring and tree, each link
once; 16 MB x 3 repetitions, :class:`failslow.core.localize.config.ValidationConfig`'s defaults)
``--trials`` times in each of two phases - the machine as found, then beside ``--hog`` busy
loops (the load of a shared CI machine) - three ways, in a rotating order in every trial so
all see the same load:

- ``greyhound``: ``measure_links(..., ballast=False, confirm=None)``: the ranks a pass leaves
  idle stay idle (a tree's pass times one pair alone, a ring's every pair at once), one round;
- ``ballast``: ``measure_links(..., confirm=None)``: the idle ranks transfer between
  themselves, untimed, so every pass loads the machine alike; one round;
- ``ballast, confirmed``: ``measure_links(..., confirm=threshold)`` (what the controller runs):
  a second round when a link is above ``threshold`` x the median link, each link keeping the
  smaller of its two times.

Every link :func:`slow_links` flags at ``--threshold`` (the controller's detection threshold:
1.1 by default, 2.0 in the demos) is a false alarm. Prints a table (rich; with ``--json`` the
raw rows and the table as JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLD = 4
NBYTES = 16 << 20
REPETITIONS = 3
WAYS = ("greyhound", "ballast", "ballast, confirmed")


def worker(rank: int, port: int, trials: int, threshold: float, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from failslow.core.localize.validation.links import measure_links
    from failslow.core.localize.validation.schedules import communicator_passes

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    passes = communicator_passes([list(range(WORLD))])
    phases = json.loads(store.get("phases"))
    rows: list[dict[str, Any]] = []
    for phase in phases:
        store.set(f"ready/{phase}/{rank}", "1")
        store.wait([f"go/{phase}"])
        for trial in range(trials):
            options = [(False, None), (True, None), (True, threshold)]
            ways = list(zip(WAYS, options, strict=True))
            for way, (ballast, confirm) in ways[trial % 3 :] + ways[: trial % 3]:
                dist.barrier()
                t0 = time.perf_counter()
                seconds = measure_links(
                    passes, nbytes=NBYTES, repetitions=REPETITIONS, confirm=confirm,
                    ballast=ballast,
                )  # fmt: skip
                wall = time.perf_counter() - t0
                links = [[a, b, s] for (a, b), s in seconds.items()]
                rows.append({"phase": phase, "way": way, "wall_s": wall, "links": links})
        store.set(f"done/{phase}/{rank}", "1")
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def run(trials: int, hogs: int, threshold: float) -> tuple[list[str], list[dict[str, Any]]]:
    """Both phases in one world: ``(the phases, rank 0's rows)``."""
    import torch.distributed as dist

    phases = ["as found", f"beside {hogs} busy loops"] if hogs else ["as found"]
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=1800))
    store.set("phases", json.dumps(phases))
    busy: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, __file__, "worker"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [*argv, str(r), str(store.port), str(trials), str(threshold), str(out)], env=env
            )
            for r in range(WORLD)
        ]
        try:
            for phase in phases:
                store.wait([f"ready/{phase}/{r}" for r in range(WORLD)])
                if phase != "as found":
                    busy = [
                        subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(hogs)
                    ]
                store.set(f"go/{phase}", "1")
                _progress(store, phase)
            for p in procs:
                if p.wait(timeout=120) != 0:
                    raise SystemExit(f"link_noise: a rank failed (exit {p.returncode})")
            return phases, json.loads(out.read_text())
        finally:
            for p in procs + busy:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _progress(store: Any, phase: str) -> None:
    """Wait for every rank to finish ``phase``, with a spinner (rich)."""
    from rich.console import Console

    with Console(stderr=True).status(f"link tests, {phase} ..."):
        store.wait([f"done/{phase}/{r}" for r in range(WORLD)])


def summarize(
    phases: list[str], rows: list[dict[str, Any]], threshold: float
) -> list[dict[str, Any]]:
    from failslow.core.localize.validation.links import slow_links

    table = []
    for phase in phases:
        for way in WAYS:
            mine = [r for r in rows if r["phase"] == phase and r["way"] == way]
            flagged, worst = 0, []
            for row in mine:
                seconds = {(int(a), int(b)): float(s) for a, b, s in row["links"]}
                flagged += bool(slow_links(seconds, threshold=threshold))
                worst.append(max(seconds.values()) / statistics.median(seconds.values()))
            worst.sort()
            table.append(
                {
                    "phase": phase,
                    "way": way,
                    "tests": len(mine),
                    "false_slow_link_pct": 100.0 * flagged / len(mine),
                    "worst_link_x_median_p50": worst[len(worst) // 2],
                    "worst_link_x_median_p95": worst[min(len(worst) - 1, len(worst) * 95 // 100)],
                    "wall_ms_p50": 1e3 * statistics.median(r["wall_s"] for r in mine),
                }
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100, help="link tests per way and phase")
    parser.add_argument("--hog", type=int, default=2, help="busy loops in the second phase")
    parser.add_argument(
        "--threshold", type=float, default=1.1,
        help="slow at this x the median link (the controller's detection threshold; the demos "
        "run 2.0)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    phases, rows = run(args.trials, args.hog, args.threshold)
    table = summarize(phases, rows, args.threshold)
    if args.json:
        print(json.dumps({"rows": rows, "table": table}))
        return
    from rich.console import Console
    from rich.table import Table

    out = Table(
        title=f"healthy links, 4 gloo ranks, 16 MB x 3, slow at {args.threshold:g}x the median "
        f"link, {args.trials} tests per row"
    )
    for column in ("load", "way", "tests with a false slow link",
                   "worst link / median (p50, p95)", "wall per test (p50)"):  # fmt: skip
        out.add_column(column)
    for row in table:
        out.add_row(
            row["phase"], row["way"], f"{row['false_slow_link_pct']:.0f}%",
            f"{row['worst_link_x_median_p50']:.2f}x, {row['worst_link_x_median_p95']:.2f}x",
            f"{row['wall_ms_p50']:.0f} ms",
        )  # fmt: skip
    Console().print(out)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "worker":
        _, _, rank, port, trials, threshold, out = sys.argv
        worker(int(rank), int(port), int(trials), float(threshold), Path(out))
    else:
        main()
