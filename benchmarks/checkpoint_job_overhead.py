"""Every-step in-memory checkpoints in a real 4-rank job: added step time, with and without
backups on peers (byterobust 6.3: 0.71% MFU loss; goal <= 1%).

Usage::

    python benchmarks/checkpoint_job_overhead.py [--steps 80] [--width 256] [--repeat 2]

The job is the DeepSpeed ZeRO-1 demo job (``failslow.demo.ds_worker``, 4 ranks, CPU/gloo, no
slowdown, no control plane), run three ways in rotation: no checkpoints; a snapshot every step
into /dev/shm; a snapshot every step plus its backup on the rank's holder (chunked p2p over a
dedicated gloo group). Printed: the median step (steps 10 to the end, slowest rank), the added
time against the same round's no-checkpoint run, and the state each rank snapshots. On this
machine 4 ranks share 2 cores, so the snapshot threads (copy, CRC, sends) take CPU from training;
:mod:`benchmarks.snapshot_overhead` separates what the training thread itself pays.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from failslow.demo.mitigation import MitigationDemoOptions, run_mitigation_demo, step_times_of

WAYS = {
    "none": None,
    "snapshot every step": {"every_steps": 1, "backup": False},
    "snapshot + backup every step": {"every_steps": 1, "backup": True},
}


def one(way: str, steps: int, width: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="failslow-ckbench-", dir="/dev/shm") as shm:
        out = Path(shm) / "out"
        settings = {}
        if WAYS[way] is not None:
            settings = {"checkpoint": {**WAYS[way], "directory": str(Path(shm) / "snap")}}
        run_mitigation_demo(
            MitigationDemoOptions(
                steps=steps, slow_start=steps - 1, slow_end=steps, mitigate=False, inject=False,
                out_dir=out, live=False, width=width, failslow=settings,
            )
        )  # fmt: skip
        times = step_times_of(out, 4)[10:]
        size = sum(p.stat().st_size for p in (Path(shm) / "snap").glob("rank0-slot*"))
        return float(statistics.median(times)), size // 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=140)
    table = Table(title=f"DeepSpeed ZeRO-1, 4 ranks on 2 cores, MLP width {args.width}")
    for col in ("round", "way", "state/rank", "median step", "added vs none"):
        table.add_column(col)
    for r in range(args.repeat):
        base = None
        for way in WAYS:
            console.print(f"round {r + 1}: {way} ...")
            step, size = one(way, args.steps, args.width)
            base = step if way == "none" else base
            added = "-" if way == "none" else f"{(step / base - 1) * 100:+.1f}%"
            table.add_row(str(r + 1), way, f"{size / 2**20:.1f} MiB", f"{step:.3f} s", added)
    console.print(table)


if __name__ == "__main__":
    main()
