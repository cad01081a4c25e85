"""What stack aggregation costs (byterobust 5.1; issue 18): the grouping at 1,024 and more
simulated ranks' stacks, and the capture of real processes with py-spy.

Usage::

    python benchmarks/stack_aggregation.py [--ranks 1024,4096,16384] [--processes 8]

- **aggregation**: a Megatron grid (TP 8, PP 8, DP the rest; 8 ranks per machine) where every
  rank has its training process and two data loader workers, with realistic 30-frame stacks
  (py-spy's innermost-first frames of a training loop); one pipeline hangs as in the paper's
  Fig. 7 (last stage in an all-gather, one stage in isend, the rest in irecv). The time of
  :func:`~failslow.core.diagnosis.stacks.aggregate` (median of 5), and whether it named that
  pipeline's machines.
- **capture**: ``--processes`` real Python processes (each sleeping in a loop), dumped at once
  by :func:`failslow.node.stacks.capture` (py-spy, 8 at a time) with and without ``--native``:
  the wall time of one round and per process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from failslow.core.diagnosis.stacks import CHILD, RANK, Frame, ProcessStack, aggregate
from failslow.core.topology import Topology

LOOP = [Frame(f"layer_{i}_forward", "model.py", 100 + i) for i in range(24)]
TAIL = [Frame(n, "train.py", 7) for n in ("forward_backward", "train_step", "train", "main")]


def _stacks(topology: Topology) -> list[ProcessStack]:
    hung = topology.dp - 1
    stacks = []
    for rank, (_, d, p) in enumerate(topology.coords):
        inner = "allreduce_grads"
        if d == hung:
            inner = {topology.pp - 1: "all_gather_into_tensor", topology.pp - 2: "isend"}.get(
                p, "irecv"
            )
        frames = (Frame(inner, "distributed_c10d.py", rank % 7), *LOOP, *TAIL)
        stacks.append(ProcessStack(rank, 10**6 + rank, RANK, frames))
        for w in range(2):
            worker = (Frame("wait", "queues.py", 1), Frame("worker_loop", "worker.py", 2))
            stacks.append(ProcessStack(rank, 2 * 10**6 + 2 * rank + w, CHILD, worker))
    return stacks


def _aggregation(ranks: int) -> dict[str, object]:
    tp, pp = 8, 8
    topology = Topology.megatron(
        tp=tp, dp=ranks // (tp * pp), pp=pp, gpus_per_host=8, micro_batches=ranks // (tp * pp)
    )
    stacks = _stacks(topology)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        found = aggregate(stacks, topology)
        times.append(time.perf_counter() - start)
    hung = {r for r, (_, d, _) in enumerate(topology.coords) if d == topology.dp - 1}
    hosts = {topology.hosts[r] for r in hung}
    named = found.suspects is not None and set(found.suspects.hosts) == hosts
    kind = found.suspects.kind if found.suspects else "-"
    return {
        "processes": len(stacks), "s": statistics.median(times), "named": named, "kind": kind,
        "machines": len(hosts),
    }  # fmt: skip


def _capture(processes: int, native: bool) -> tuple[float, int]:
    from failslow.node.stacks import capture

    code = "import time\ndef loop():\n    while True: time.sleep(0.05)\nloop()"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        time.sleep(1.0)
        start = time.perf_counter()
        stacks = capture({i: p.pid for i, p in enumerate(procs)}, native=native, children=False)
        took = time.perf_counter() - start
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return took, sum(1 for s in stacks if not s.error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1024,4096,16384")
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    console = Console(width=160)
    table = Table(title="stack aggregation: one hung pipeline among every rank and its 2 workers")
    for col in ("ranks", "processes", "aggregate (median of 5)", "named the pipeline", "as",
                "machines to evict"):  # fmt: skip
        table.add_column(col)
    for ranks in (int(r) for r in args.ranks.split(",")):
        r = _aggregation(ranks)
        ms = f"{float(str(r['s'])) * 1000:.1f} ms"
        named = "yes" if r["named"] else "NO"
        table.add_row(
            str(ranks), str(r["processes"]), ms, named, str(r["kind"]), str(r["machines"])
        )
    console.print(table)
    table = Table(title=f"capture: {args.processes} real processes with py-spy, 8 at a time")
    for col in ("mode", "one round", "per process", "stacks read"):
        table.add_column(col)
    for native in (False, True):
        took, read = _capture(args.processes, native)
        mode = "--native" if native else "Python frames"
        per = f"{took / args.processes * 1000:.0f} ms"
        table.add_row(mode, f"{took:.2f} s", per, f"{read}/{args.processes}")
    console.print(table)


if __name__ == "__main__":
    main()
