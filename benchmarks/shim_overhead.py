"""Host overhead of the LD_PRELOAD NCCL shim per intercepted call (greyhound 4.2, 6; 7.4).

Builds the stub libnccl of tests/nccl_hook/stub (zero delay) and times a tight ncclAllReduce
loop in a C driver that loads NCCL privately (RTLD_LOCAL, as torch does), without and with
``LD_PRELOAD=<shim>`` recording into a ring, in interleaved repeats; reports medians.
Goal: <= 1 us added per call.

    .venv/bin/python benchmarks/shim_overhead.py [--calls 2000000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "nccl_hook" / "stub"))
from shim_rig import build_rig, clean_env


def ns_per_call(rig, calls: int, env: dict[str, str]) -> float:
    out = subprocess.run(
        [str(rig.driver), str(rig.consumer), "bench", str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    elapsed, n = (int(x) for x in out.split()[:2])
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rig = build_rig(Path(tmp) / "rig")
        rings = Path(tmp) / "rings"
        variants = {
            "no shim": clean_env(),
            "shim, pass-through (no ring dir)": clean_env(LD_PRELOAD=rig.shim),
            "shim, recording": clean_env(LD_PRELOAD=rig.shim, FAILSLOW_RING_DIR=rings, RANK=0),
        }
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):  # interleaved, so drift hits every variant alike
            for name, env in variants.items():
                samples[name].append(ns_per_call(rig, args.calls, env))
    base = statistics.median(samples["no shim"])
    table = Table(title=f"NCCL shim host overhead ({args.calls:,} calls x {args.repeats} runs)")
    for col in ("variant", "ns/call (median)", "min-max", "calls/s", "added ns/call"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, xs in samples.items():
        med = statistics.median(xs)
        table.add_row(
            name,
            f"{med:.1f}",
            f"{min(xs):.1f}-{max(xs):.1f}",
            f"{1e9 / med:,.0f}",
            "-" if name == "no shim" else f"{med - base:.1f}",
        )
    Console(width=110).print(table)
    added = statistics.median(samples["shim, recording"]) - base
    verdict = "met" if added <= 1000 else "NOT met"
    print(f"goal <= 1000 ns added per recorded call: {verdict} ({added:.0f} ns)")


if __name__ == "__main__":
    main()
