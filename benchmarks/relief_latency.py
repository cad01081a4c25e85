"""How long the detector takes to report a relief, by noise and by where the job comes back to.

Usage::

    python benchmarks/relief_latency.py [--seeds 60]

Synthetic jobs fed to :class:`failslow.core.tracking.FailSlowDetector` (defaults): a healthy
level ``B`` for 60 iterations, a fail-slow at 1.34 ``B`` for 50 (the detection demo's slowdown
on a loaded CI machine: 0.307 -> 0.41 s), then the level after, with log-normal noise of
``sigma`` per iteration (the detection demo: 0.07-0.11 on a quiet machine). Where the job comes
back to ``B`` the relief is the fast path (two thirds of the points back under the line, or the
drop verified like an onset in reverse). Where it comes back *above* the threshold line
(1.105-1.13 ``B``: the machine itself slower than before the onset) the first verification
takes the drop for a partial recovery - a new, lower slow level - and the relief comes once
that level's ``settle`` points sit within half the slowdown of ``B`` by half a standard error,
which the noise decides (and, close to the line, may not happen in 50 iterations: "missed").

Prints, per case, over the seeds: missed, the relief's report minus its change point (p50,
p95, max, how many over 15) and its report minus the fail-slow's end (p50, p95, max). The
detection demo test (``tests/test_demo.py``) bounds the first by 15 for the fast path only.
"""

from __future__ import annotations

import argparse

import numpy as np
from rich.console import Console
from rich.table import Table

from failslow.core.tracking import FailSlowDetector

START, END, N = 60, 110, 160


def relief(sigma: float, after: float, seed: int, base: float = 0.307, slow: float = 1.34):
    """(report - change point, report - END) of the first relief reported after END, or None."""
    rng = np.random.default_rng(seed)
    x = np.full(N, base)
    x[START:END] = base * slow
    x[END:] = base * after
    y = x * np.exp(rng.normal(0.0, sigma, N))
    det = FailSlowDetector()
    for i, v in enumerate(y):
        for e in det.update(float(v)):
            if e.type == "relief" and i >= END:
                return i - e.iteration, i - END
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=60)
    args = ap.parse_args()
    table = Table(title=f"relief latency, {args.seeds} seeds per row (iterations)")
    for col in ("noise", "back to", "missed", "report - change p50/p95/max", "> 15",
                "report - end p50/p95/max"):  # fmt: skip
        table.add_column(col, justify="right")
    for sigma in (0.07, 0.1, 0.13):
        for after in (1.0, 1.105, 1.117, 1.13):
            got = [relief(sigma, after, s) for s in range(args.seeds)]
            found = np.array([g for g in got if g is not None]).reshape(-1, 2)
            cp, end = found[:, 0], found[:, 1]

            def q(a: np.ndarray) -> str:
                if not a.size:
                    return "-"
                return f"{np.median(a):.0f} / {np.percentile(a, 95):.0f} / {a.max()}"

            table.add_row(
                f"{sigma:.2f}", f"{after:.3f} B", str(len(got) - len(found)), q(cp),
                str(int((cp > 15).sum())), q(end),
            )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
