"""What a node pays to start its rank processes: each importing the framework for itself, or
forked from one fork server that imported it once (``failslow run --nproc-per-node``'s default;
``node/fork_server.py``; byterobust 6.1-6.2, restarts and standbys that skip the imports).

Usage::

    python benchmarks/fork_server.py [--ranks 4] [--framework deepspeed] [--repeat 3]

Each round starts ``--ranks`` processes that import what a DeepSpeed (or Megatron-core) demo
rank imports before its first step - torch, the framework, failslow's adapter, torch._dynamo
(every torch.optim optimizer imports it), DeepSpeed's Muon optimizer (its ZeRO check imports
it) - and run a few small matmuls: spawned (``python rank.py`` each) and forked (a fork server
started for the round, then one fork per rank), interleaved. Prints wall time until every rank
exited and the CPU seconds spent (the ranks' own, and the fork server's with its children's),
per round and the median. The CPU is what a busy node loses beside its training (warm spares,
restarts, stop-time checks); the wall time what a launch waits.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from failslow.node.fork_server import ForkServer, available
from failslow.node.launcher import preloads

RANK = """
import importlib
for name in {modules!r}:
    try:
        importlib.import_module(name.lstrip("?"))
    except ImportError:
        if not name.startswith("?"):
            raise
import torch
x = torch.randn(256, 256)
for _ in range(20):
    x = x @ x.T / 256
"""
FRAMEWORKS = {"deepspeed": ("deepspeed",), "megatron": ("megatron.core",), "torch": ()}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children (from /proc, before it exits)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def spawned(script: Path, ranks: int) -> tuple[float, float]:
    start, cpu = time.monotonic(), _children_cpu()
    procs = [subprocess.Popen([sys.executable, str(script)]) for _ in range(ranks)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a spawned rank failed")
    return time.monotonic() - start, _children_cpu() - cpu


def forked(script: Path, ranks: int, preload: tuple[str, ...]) -> tuple[float, float]:
    start = time.monotonic()
    server = ForkServer(sys.executable, dict(os.environ), preload, say=lambda _: None)
    try:
        procs = [server.start(dict(os.environ), [str(script)]) for _ in range(ranks)]
        if any(p.wait() != 0 for p in procs):
            raise SystemExit("a forked rank failed")
        wall = time.monotonic() - start
        cpu = _process_tree_cpu(server.process.pid)
    finally:
        server.close()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--framework", choices=sorted(FRAMEWORKS), default="deepspeed")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not available():
        raise SystemExit("the fork server needs Linux (pidfds, descriptor passing)")
    preload = preloads(FRAMEWORKS[args.framework])
    console = Console()
    rows: dict[str, list[tuple[float, float]]] = {"spawned": [], "forked": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK.format(modules=list(preload)))
        with console.status("starting ranks") as status:
            for i in range(args.repeat):
                status.update(f"round {i + 1}/{args.repeat}: spawned")
                rows["spawned"].append(spawned(script, args.ranks))
                status.update(f"round {i + 1}/{args.repeat}: forked")
                rows["forked"].append(forked(script, args.ranks, preload))
    table = Table(title=f"{args.ranks} ranks importing {', '.join(preload)}")
    table.add_column("start")
    for i in range(args.repeat):
        table.add_column(f"round {i + 1}: wall / CPU s", justify="right")
    table.add_column("median wall s", justify="right")
    table.add_column("median CPU s", justify="right")
    for name, runs in rows.items():
        table.add_row(
            name,
            *(f"{w:.1f} / {c:.1f}" for w, c in runs),
            f"{statistics.median(w for w, _ in runs):.1f}",
            f"{statistics.median(c for _, c in runs):.1f}",
        )
    console.print(table)
    spawn_cpu = statistics.median(c for _, c in rows["spawned"])
    fork_cpu = statistics.median(c for _, c in rows["forked"])
    console.print(f"forked / spawned CPU: {fork_cpu / spawn_cpu:.2f}")


if __name__ == "__main__":
    main()
