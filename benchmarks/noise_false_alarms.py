"""False alarms on a healthy job whose iteration times are only noisy (greyhound 4.2 R2).

Usage::

    python benchmarks/noise_false_alarms.py [--traces 10] [--iterations 2000] [--json]

The life corpus (``detection_accuracy.py``) gives every job Gaussian plus Student-t noise of a
few percent. Real jobs can be noisier: variable sequence lengths, a shared host, four ranks on
two cores (the FSDP example here is ~40 ms iterations with 10-20% jitter). This script feeds
pure noise - no fail-slow, no periodic step, no level change: ``base * exp(N(0, sd) + 0.3 * sd
* t_3)`` - to each detector, at several ``sd``, and counts what a user would see as false
alarms (every reported onset is one), beside what BOCD+V's rhythm learned from the noise: the
iterations it left out as "periodic slow steps" and the rhythms it holds at the end (on pure
noise every one of them is a chance alignment). BOCD+V is run with and without its rhythm.

Same seeds for every detector, so the columns compare like with like. No target is asserted:
this is the yardstick for the detector's behaviour above the corpus's noise.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from failslow.core.tracking import (
    BOCDDetector,
    Detector,
    FailSlowDetector,
    SlidingWindowDetector,
)

DETECTORS: dict[str, Callable[[], Detector]] = {
    "SlidingWindow": SlidingWindowDetector,
    "BOCD": BOCDDetector,
    "BOCD+V (no rhythm)": lambda: FailSlowDetector(rhythm=False),
    "BOCD+V": FailSlowDetector,
}
SDS = (0.02, 0.05, 0.08, 0.12, 0.16)


def noise(sd: float, n: int, seed: int, base: float = 0.04) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return base * np.exp(rng.normal(0.0, sd, n) + 0.3 * sd * rng.standard_t(3, n))


def run(traces: int, iterations: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for sd in SDS:
        for name, factory in DETECTORS.items():
            onsets = left_out = rhythms = jobs_alarmed = 0
            for seed in range(traces):
                det = factory()
                found = 0
                for x in noise(sd, iterations, seed).tolist():
                    found += sum(e.type == "onset" for e in det.update(x))
                onsets += found
                jobs_alarmed += found > 0
                if isinstance(det, FailSlowDetector):
                    left_out += det.skipped - det.special_skipped
                    rhythms += len(det.rhythm.periods) if det.rhythm is not None else 0
            rows.append(
                {
                    "sd": sd,
                    "detector": name,
                    "false_alarms_per_10k": 1e4 * onsets / (traces * iterations),
                    "jobs_alarmed": jobs_alarmed,
                    "traces": traces,
                    "left_out_share": left_out / (traces * iterations),
                    "rhythms_at_end": rhythms / traces,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", type=int, default=10, help="noise traces per sd")
    p.add_argument("--iterations", type=int, default=2000, help="iterations per trace")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if args.traces < 1 or args.iterations < 100:
        p.error("need --traces >= 1 and --iterations >= 100")
    rows = run(args.traces, args.iterations)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"Pure noise: {args.traces} traces x {args.iterations} iterations per sd")
    for col in ("sd", "detector", "false alarms / 10k it", "jobs alarmed", "left out", "rhythms"):
        table.add_column(col, justify="right")
    for r in rows:
        fsd = r["detector"] in ("BOCD+V", "BOCD+V (no rhythm)")
        table.add_row(
            f"{r['sd']:.0%}",
            str(r["detector"]),
            f"{r['false_alarms_per_10k']:.2f}",
            f"{r['jobs_alarmed']}/{r['traces']}",
            f"{r['left_out_share']:.1%}" if fsd else "-",
            f"{r['rhythms_at_end']:.1f}" if fsd else "-",
        )
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
