"""Seal time of a snapshot: CRC-32 on 1..N threads vs zlib on one (byterobust 6.3, issue 50).

    .venv/bin/python benchmarks/checksum_threads.py [--gib 1.0] [--repeats 3] [--max-threads 4]

On an H200 machine the 4.46 GB state of a GPT-2 medium with AdamW took 1.4 s to seal on one
thread (``benchmarks/gpu``), so most every-step snapshots were skipped. This times
:func:`failslow.core.checkpoint.crc32.crc32` over a buffer of random bytes for each thread
count, interleaved with plain ``zlib.crc32`` (repeats alternate, so drift hits all alike), and
checks that every value is zlib's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib

from rich.console import Console
from rich.table import Table

from failslow.core.checkpoint import crc32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-threads", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args()
    block = os.urandom(64 << 20)
    data = bytearray(block) * max(1, int(args.gib * 16))
    want = zlib.crc32(data)
    variants = ["zlib", *(str(t) for t in range(1, args.max_threads + 1))]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            if v != "zlib":
                os.environ["FAILSLOW_CHECKSUM_THREADS"] = v
            t0 = time.perf_counter()
            got = zlib.crc32(data) if v == "zlib" else crc32.crc32(data)
            seconds[v].append(time.perf_counter() - t0)
            assert got == want, v
    base = statistics.median(seconds["zlib"])
    table = Table(title=f"CRC-32 of {len(data) / 1e9:.2f} GB, {os.cpu_count()} CPUs")
    for col in ("variant", "seconds (median)", "GB/s", "vs zlib"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v, xs in seconds.items():
        med = statistics.median(xs)
        name = "zlib.crc32, one thread" if v == "zlib" else f"crc32.crc32, {v} thread(s)"
        table.add_row(name, f"{med:.3f}", f"{len(data) / med / 1e9:.2f}", f"{base / med:.2f}x")
    Console(width=100).print(table)


if __name__ == "__main__":
    main()
