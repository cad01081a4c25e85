"""S2 allocation solve time: exact numpy allocator vs the cvxpy/HiGHS MILP (greyhound Table 5).

Usage::

    python benchmarks/s2_solve_time.py [--seeds N] [--repeats R] [--reference-max D] [--json]

For each number of DP replicas D, ``--seeds`` random instances: every replica's per-micro-batch
time is 1.0 except 1-8 slow ones at 1.2-3x (uniform), total = 8 * D micro-batches, in multiples
of 2 (1F1B with PP = 2). :func:`failslow.core.planner.allocation.allocate_microbatches` is
timed ``--repeats`` times per instance (median and p95 over all calls of that D); the MILP
reference (:mod:`failslow.core.planner.allocation_reference`, HiGHS, zero MIP gap) is timed
once per instance for D <= ``--reference-max`` (median over instances), and the two makespans
``max_i m_i * t_i`` are compared for exact equality on every instance. ``--jitter J`` spreads
the healthy times over ``[1 - J, 1 + J]`` (no ties between replicas).

greyhound Table 5 (cvxpy on Eq. 1, seconds): 16: 0.01, 32: 0.01, 64: 0.01, 128: 0.11,
256: 6.78, 512: 35.93.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from failslow.core.planner.allocation import allocate_microbatches

REPLICAS = (16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
PAPER_S = {16: 0.01, 32: 0.01, 64: 0.01, 128: 0.11, 256: 6.78, 512: 35.93}
PP = 2


def instance(d: int, seed: int, jitter: float = 0.0) -> np.ndarray:
    """Per-micro-batch times: healthy 1.0 (+-jitter), a few (1-8) replicas 1.2-3x slower."""
    rng = np.random.default_rng([d, seed])
    times = rng.uniform(1.0 - jitter, 1.0 + jitter, size=d) if jitter else np.ones(d)
    slow = rng.choice(d, size=min(d, int(rng.integers(1, 9))), replace=False)
    times[slow] = rng.uniform(1.2, 3.0, size=slow.size)
    return times


def makespan(counts: Sequence[int], times: np.ndarray) -> float:
    return float(np.max(np.asarray(counts) * times))


def run(seeds: int, repeats: int, reference_max: int, jitter: float = 0.0) -> dict[str, Any]:
    rows = []
    for d in REPLICAS:
        total = 8 * d
        ours_s: list[float] = []
        ref_s: list[float] = []
        same = compared = worse = 0
        for seed in range(seeds):
            times = instance(d, seed, jitter)
            for _ in range(repeats):
                start = time.perf_counter()
                counts = allocate_microbatches(times, total, multiple_of=PP)
                ours_s.append(time.perf_counter() - start)
            if d <= reference_max:
                from failslow.core.planner.allocation_reference import (
                    allocate_microbatches_milp,
                )

                start = time.perf_counter()
                ref = allocate_microbatches_milp(times, total, multiple_of=PP)
                ref_s.append(time.perf_counter() - start)
                compared += 1
                ours, theirs = makespan(counts, times), makespan(ref, times)
                same += ours == theirs
                worse += ours > theirs
        rows.append(
            {
                "D": d,
                "total": total,
                "ours_median_ms": 1e3 * statistics.median(ours_s),
                "ours_p95_ms": 1e3 * float(np.percentile(ours_s, 95)),
                "cvxpy_median_s": statistics.median(ref_s) if ref_s else None,
                "same_makespan": same,
                "ours_worse": worse,
                "compared": compared,
                "paper_s": PAPER_S.get(d),
            }
        )
    return {
        "seeds": seeds,
        "repeats": repeats,
        "reference_max": reference_max,
        "jitter": jitter,
        "rows": rows,
    }


def render(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"S2 allocation solve time: {result['seeds']} instances per D, total = 8 D, "
        f"multiple_of = {PP}, healthy 1.0 +- {result['jitter']:g}, "
        f"ours timed {result['repeats']}x per instance"
    )
    for col in (
        "D",
        "total",
        "ours median ms",
        "ours p95 ms",
        "cvxpy s",
        "same makespan (k/n)",
        "paper s (Table 5)",
    ):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        ref = "-" if r["cvxpy_median_s"] is None else f"{r['cvxpy_median_s']:.3f}"
        same = f"{r['same_makespan']}/{r['compared']}" if r["compared"] else "-"
        paper = "-" if r["paper_s"] is None else f"{r['paper_s']:g}"
        table.add_row(
            str(r["D"]),
            str(r["total"]),
            f"{r['ours_median_ms']:.3f}",
            f"{r['ours_p95_ms']:.3f}",
            ref,
            same,
            paper,
        )
    console.print(table)
    for goal, ok in targets(result).items():
        console.print(f"  {goal}: {'[green]met[/]' if ok else '[red]NOT met[/]'}")


def targets(result: dict[str, Any]) -> dict[str, bool]:
    by_d = {r["D"]: r for r in result["rows"]}
    return {
        "median <= 1 ms at D = 512": by_d[512]["ours_median_ms"] <= 1.0,
        "median <= 20 ms at D = 16,384": by_d[16384]["ours_median_ms"] <= 20.0,
        "same makespan as the MILP on every instance": all(
            r["same_makespan"] == r["compared"] for r in result["rows"]
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="instances per D")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per instance")
    parser.add_argument(
        "--reference-max", type=int, default=512, help="largest D solved with cvxpy (0: none)"
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="healthy times uniform in [1 - J, 1 + J] instead of exactly 1.0 (no ties)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.repeats < 1:
        parser.error("--seeds and --repeats must be >= 1")
    if not 0.0 <= args.jitter < 0.5:
        parser.error(f"--jitter must be in [0, 0.5), got {args.jitter}")
    result = run(args.seeds, args.repeats, args.reference_max, args.jitter)
    result["targets_met"] = targets(result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result, Console(width=max(Console().width, 120)))
    return 0 if all(result["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
