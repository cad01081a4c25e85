"""Onset -> diagnosis reaction time of the whole localization pipeline (greyhound Table 6).

Usage::

    python benchmarks/reaction_time.py [--runs 3]

Each run is the end-to-end test ``tests/core/control/test_controller_e2e.py`` (a real 4-rank
gloo job with the Python hook and an agent per rank; LocalAnalyzer -> NodePublisher ->
Controller; rank 2 duty-cycled 75% from iteration 120), run by pytest with its own
``--basetemp`` so its ``reaction.json`` can be collected. Prints per run, in the straggler's
iterations (as the node's analyzer counts them): onset -> the controller's profiling (detection,
publication, one controller tick), profiling -> diagnosis (the pause margin; no iteration runs
while paused), onset -> diagnosis, seconds from
the controller's first reaction to the diagnosis, the pause, and the diagnosis.
greyhound reports 10.56 s at 256 GPUs (BOCD 3.7 s + profiling and validation 6.86 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/core/control/test_controller_e2e.py"


def one_run(base: Path) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            TEST,
            f"--basetemp={base}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    found = list(base.rglob("reaction.json"))
    if out.returncode != 0 or not found:
        return {"error": (out.stdout + out.stderr)[-400:]}
    return json.loads(found[0].read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    console = Console(width=max(Console().width, 130))
    table = Table(title="failslow localization: onset -> diagnosis (4-rank gloo, CPU)")
    for col in (
        "run",
        "onset -> profiling (it)",
        "profiling -> diagnosis (it)",
        "onset -> diagnosis (it)",
        "reaction (s)",
        "paused (s)",
        "diagnosis",
    ):
        table.add_column(col, justify="left" if col == "diagnosis" else "right")
    iters, secs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            r = one_run(Path(tmp) / f"run{i}")
            if "error" in r:
                table.add_row(str(i), "-", "-", "-", "-", "-", "FAILED: " + r["error"][-80:])
                continue
            d = r["diagnosis"]
            # the straggler's iteration count when the controller started profiling (the
            # first published onset was read): detection, publication and one controller tick
            at = dict((state, n) for state, n in reversed(r.get("timeline", [])))
            profiling = at.get("profiling")
            detected = profiling - r["onset_iteration"] if profiling is not None else None
            rest = r["diagnosis_iteration"] - profiling if profiling is not None else None
            iters.append(r["iterations"])
            secs.append(r["seconds"])
            paused = d["evidence"].get("paused_s", 0.0)
            table.add_row(
                str(i),
                str(detected),
                str(rest),
                str(r["iterations"]),
                f"{r['seconds']:.2f}",
                f"{paused:.2f}",
                f"{d['kind']}: ranks {[s[0] for s in d['slow_ranks']]} "
                f"({', '.join(f'{s[1]:.2f}x' for s in d['slow_ranks'])})",
            )
    if iters:
        table.add_row(
            "median",
            "",
            "",
            f"{statistics.median(iters):.0f}",
            f"{statistics.median(secs):.2f}",
            "",
            "",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
