"""A plan watched after its verdict (issues 44, 46): a fault that grows while S2 is in effect.

Usage::

    python benchmarks/plan_watch.py [--framework deepspeed] [--zero 1|2] [--world-size 2]
        [--slow-rank 1] [--steps 260] [--slow-start 60] [--factor 3] [--then 150:9]
        [--repeat 1] [--micro-batches 4] [--launcher failslow-run|demo]

The job of ``failslow demo --framework deepspeed`` (the user's loop, ZeRO-1 by default: S2 by
count), ``--world-size`` ranks; from ``--slow-start`` rank ``--slow-rank``'s device computes
``--factor`` times slower (:mod:`failslow.demo.slow_device`: its collectives at full speed, a
throttled GPU), and from the step of ``--then STEP:FACTOR`` that factor instead - a fault that
grows after the plan sized for the first one paid. Three runs, one after the other, the same
data:

- **unmitigated**: plain ``torchrun``, no control plane;
- **no watch**: ``failslow run --controller`` with ``planner.keep_steps=0`` - a plan is judged
  once, a few steps after it took effect (the closed loop before this benchmark);
- **watched**: the default (``planner.keep_steps=10``) - a plan that paid is judged again every
  ten steps, and re-planned, kept or reverted once two windows in a row fall short.

Printed per run (ratios; the machine is shared): the healthy step (steps 10 to the slow start),
the median step over the first factor's last 30 steps before the change, and over the steps
from 20 after the change to the end; the share of the slowdown removed after the change against
the unmitigated run, ``(unmitigated - run) / (unmitigated - healthy)``; every action with its
effect, outcome and - where it stopped paying - what was done (``describe`` of
``benchmarks/straggler_mitigation.py``); the largest parameter difference from the unmitigated
run (rank 0 writes the full parameters).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from straggler_mitigation import describe

from failslow.demo.mitigation import (
    MitigationDemoOptions,
    job_name,
    run_mitigation_demo,
    step_times_of,
)

RUNS: tuple[tuple[str, bool, dict[str, Any]], ...] = (
    ("unmitigated", False, {}),
    ("no watch", True, {"planner": {"keep_steps": 0}}),
    ("watched", True, {}),
)


def one_round(
    base: Path, args: argparse.Namespace, then: tuple[int, float]
) -> list[dict[str, Any]]:
    rows = []
    for name, mitigate, settings in RUNS:
        out = base / name.replace(" ", "-")
        summary = run_mitigation_demo(
            MitigationDemoOptions(
                framework=args.framework,
                zero=args.zero,
                steps=args.steps,
                slow_start=args.slow_start,
                slow_end=None,
                mitigate=mitigate,
                out_dir=out,
                live=False,
                launcher=args.launcher,
                fault="device",
                device_factor=args.factor,
                device_factor_then=then,
                world_size=args.world_size,
                slow_rank=args.slow_rank,
                micro_batches_per_replica=args.micro_batches,
                failslow=settings,
            )
        )
        changed = (summary.get("fault_changed") or [then[0]])[0]
        times = step_times_of(out, args.world_size)
        rows.append(
            {
                "name": name,
                "out": out,
                "healthy": float(np.median(times[10 : args.slow_start])),
                "first": float(np.median(times[max(args.slow_start, changed - 30) : changed])),
                "after": float(np.median(times[changed + 20 :])),
                "changed": changed,
                "actions": describe(summary["actions"]) if mitigate else ("-", "-"),
            }
        )
    healthy = statistics.median(r["healthy"] for r in rows)
    unmitigated = rows[0]["after"]
    want = np.load(rows[0]["out"] / "parameters.npz")
    for r in rows:
        r["removed"] = (unmitigated - r["after"]) / (unmitigated - healthy)
        got = np.load(r["out"] / "parameters.npz")
        r["rel"] = max(
            float(np.abs(got[n] - want[n]).max()) / float(np.abs(want[n]).max()) for n in want.files
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="deepspeed", choices=("deepspeed",))
    parser.add_argument("--zero", type=int, choices=(1, 2), default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=260)
    parser.add_argument("--slow-start", type=int, default=60)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--then", default="150:9", help="STEP:FACTOR")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches per replica per step (more: a finer split for the plans)",
    )
    parser.add_argument("--launcher", choices=("demo", "failslow-run"), default="failslow-run")
    parser.add_argument("--keep", type=Path, help="keep the runs' directories here")
    args = parser.parse_args()
    step, factor = args.then.split(":")
    then = (int(step), float(factor))
    console = Console(width=230)
    job = job_name(args.framework, zero=args.zero)
    table = Table(
        title=f"{job}, {args.world_size} ranks x {args.micro_batches} micro-batches, rank "
        f"{args.slow_rank}'s device {args.factor:g}x "
        f"slower from step {args.slow_start}, {then[1]:g}x from step {then[0]} (CPU/gloo, "
        f"launcher {args.launcher})"
    )
    for col in ("round", "run", "healthy", f"{args.factor:g}x, plan on", f"{then[1]:g}x",
                "removed", "param rel diff", "actions", "left without effect"):  # fmt: skip
        table.add_column(col)
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="failslow-watch-") as tmp:
            console.print(f"round {i + 1}/{args.repeat}: unmitigated, no watch, watched ...")
            base = args.keep / f"round-{i + 1}" if args.keep else Path(tmp)
            rows = one_round(base, args, then)
        for r in rows:
            table.add_row(
                str(i + 1),
                r["name"],
                f"{r['healthy']:.3f} s",
                f"{r['first']:.3f} s",
                f"{r['after']:.3f} s (from {r['changed'] + 20})",
                "-" if r["name"] == "unmitigated" else f"{r['removed']:.0%}",
                f"{r['rel']:.1e}",
                *r["actions"],
            )
    console.print(table)


if __name__ == "__main__":
    main()
