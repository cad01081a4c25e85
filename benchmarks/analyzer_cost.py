"""What the node's LocalAnalyzer costs per poll, and that it scales with new records only.

``python benchmarks/analyzer_cost.py [--ranks 4] [--steps 6000] [--window 500]`` prints one
table from one run (greyhound 4.2: the LocalAnalyzer reads the rings in shared memory and
tracks iteration times; the node's share of the tracking overhead).

Real :class:`~failslow.core.ring.RingWriter` rings, one per rank, get the records of the
``tracking_overhead.py`` job - three bucket all-reduces and one step marker per step of
``--step-ms`` (200 ms: that job's step on this machine) with 2% jitter - in one of two writer
modes: ``hook`` (the Python hook: every call begun and ended, so the header's ``settled_ns``
vouches for what is committed) and ``shim`` (the C shim: no ``settled_ns``, the reorder buffer
holds records for its horizon). A real :class:`~failslow.core.tracking.analyzer.LocalAnalyzer`
polls the directory twice per step (its 0.1 s period against a 0.2 s step), as the node agent
does. The analyzer's CPU time (``time.process_time_ns``, this process only) is taken over a
window of ``--window`` steps early in the run and again after ``--steps`` steps of history:
the two must match, because a poll may cost O(new records), never O(history) (the summarizer
keeps the newest 16,384 records and once copied all of them on every poll).

A third figure is a poll's CPU after ``--sleep`` seconds asleep (the thread's CPU time,
``time.thread_time_ns``), one poll per step, over ``--sleep-window`` steps, beside the same
polls made back to back: the node's publisher sleeps between polls, and a thread that wakes
after a while pays for it (on these machines 2-3x the back-to-back cost, even with the cores
idle). That is why the publisher polls less often while its ranks are calm, rather than
cutting the per-record work further.

Each writer mode runs twice: with the detectors' BOCD update in C (the package's native
kernel, :mod:`failslow.core.tracking.native`) and in numpy (the fallback when it was not built).

The last column is the analyzer's CPU per step as a share of the ranks' CPU per step
(``--rank-cpu-ms``: 100 ms, the DDP job's measured rank CPU per step, times the ranks): the
analyzer's part of the tracking overhead on a node whose cores are all busy with ranks.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from failslow.core.events import OpCode, group_key
from failslow.core.ring import RingWriter, ring_path
from failslow.core.tracking import bocd
from failslow.core.tracking.analyzer import LocalAnalyzer

BUCKETS = (4_000_000, 4_000_000, 2_000_000)


class Job:
    """The ranks' rings and a synthetic clock: one :meth:`step` writes one training step."""

    def __init__(self, ring_dir: str, ranks: int, step_ms: float, mode: str, seed: int) -> None:
        self.writers = [
            RingWriter(ring_path(ring_dir, r, 10_000 + r), capacity=1 << 14, global_rank=r)
            for r in range(ranks)
        ]
        self.mode = mode
        self.step_ns = step_ms * 1e6
        self.group = group_key("0", range(ranks))
        self.marker = group_key("failslow:step:Adam", [6, 3_000_000])
        self.rng = np.random.default_rng(seed)
        self.t = 1_000_000  # in the past: the hook's settled_ns (now) vouches for every record
        self.calls = 0
        self.steps = 0

    def step(self) -> None:
        dt = int(self.step_ns * (1 + 0.02 * self.rng.standard_normal()))
        for w in self.writers:
            for k, nbytes in enumerate(BUCKETS):
                start = self.t + int(dt * (0.5 + 0.15 * k))
                token = w.begin()[0] if self.mode == "hook" else None
                w.write(
                    t_start_ns=start,
                    t_end_ns=start + 2_000_000,
                    nbytes=nbytes,
                    group_key=self.group,
                    op=int(OpCode.ALLREDUCE),
                    call_index=self.calls + k,
                    token=token,
                )
            w.write(
                t_start_ns=self.t + dt,
                t_end_ns=self.t + dt,
                nbytes=0,
                group_key=self.marker,
                op=int(OpCode.STEP),
                call_index=self.steps,
            )
        self.calls += len(BUCKETS)
        self.steps += 1
        self.t += dt


def measure(args: argparse.Namespace, mode: str, kernel: str) -> dict[str, float]:
    native = bocd.bocd_update
    if kernel == "numpy":  # as if the kernel had not been built
        bocd.bocd_update = lambda: None  # type: ignore[assignment]
    try:
        return _measure(args, mode)
    finally:
        bocd.bocd_update = native


def _measure(args: argparse.Namespace, mode: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        job = Job(d, args.ranks, args.step_ms, mode, args.seed)
        # The rings were made long ago (a job's steady state): a directory changed under a
        # second ago is listed on every poll (LocalAnalyzer.discover), which this compressed
        # clock would otherwise charge to every early poll.
        past = time.time_ns() - 60 * 10**9
        os.utime(d, ns=(past, past))
        analyzer = LocalAnalyzer(d)
        out: dict[str, float] = {}
        marks = {"early": 200, "late": args.steps}
        for name, start in marks.items():
            while job.steps < start:
                job.step()
                analyzer.poll()
                analyzer.poll()
            cpu = 0
            for _ in range(args.window):
                job.step()
                for _ in range(2):
                    c0 = time.process_time_ns()
                    analyzer.poll()
                    cpu += time.process_time_ns() - c0
            out[name] = cpu / args.window / 2 / 1e3  # us per poll
        for name, pause in (("hot", 0.0), ("woken", args.sleep)):
            cpu = 0
            for _ in range(args.sleep_window):
                job.step()
                if pause:
                    time.sleep(pause)
                c0 = time.thread_time_ns()
                analyzer.poll()
                cpu += time.thread_time_ns() - c0
            out[name] = cpu / args.sleep_window / 1e3  # us per poll of one step's records
        out["iterations"] = min(s.iterations for s in analyzer.ranks.values())
        analyzer.close()
        for w in job.writers:
            w.close()
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6000, help="history before the late window")
    p.add_argument("--window", type=int, default=500, help="steps per measured window")
    p.add_argument("--step-ms", type=float, default=200.0)
    p.add_argument("--rank-cpu-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds asleep before a poll")
    p.add_argument("--sleep-window", type=int, default=100, help="steps per sleep figure")
    args = p.parse_args()
    table = Table(title=f"LocalAnalyzer CPU, {args.ranks} ranks, 2 polls per step")
    for col in (
        "writer",
        "BOCD update",
        "us / poll (early)",
        "us / poll (after history)",
        "late / early",
        "us / poll, 1 step (back to back)",
        f"us / poll, 1 step (after {args.sleep:g} s asleep)",
        "iterations",
        "share of rank CPU",
    ):
        table.add_column(col, justify="right")
    if bocd.bocd_update() is None:
        raise SystemExit("analyzer_cost: the native BOCD kernel is not built (pip install -e .)")
    for mode, kernel in itertools.product(("hook", "shim"), ("C", "numpy")):
        r = measure(args, mode, kernel)
        share = 2 * r["late"] / 1e3 / (args.rank_cpu_ms * args.ranks)
        table.add_row(
            mode,
            kernel,
            f"{r['early']:.0f}",
            f"{r['late']:.0f}",
            f"{r['late'] / r['early']:.2f}",
            f"{r['hot']:.0f}",
            f"{r['woken']:.0f}",
            f"{r['iterations']:.0f}",
            f"{100 * share:.3f}%",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
