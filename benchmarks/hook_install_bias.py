"""Does installing the hook slow ordinary (non-c10d) ops, or only move the memory layout?

Usage::

    python benchmarks/hook_install_bias.py [--rounds 50] [--modes none,kernels,alloc:4000000]

``benchmarks/tracking_overhead.py`` toggles the hook inside one process and finds each rank's
training thread 1-3 ms per step slower with it on - 8x what the hook's per-call cost explains
(it also saw non-collective steps slow down). This script asks what that toggle measures: one
process, world 1 (gloo), an MLP training step with no collective in it, and per round the
training thread's CPU time per step in ABBA blocks (off, on, on, off; 5 steps each), where
"on" is one of

- ``none``: nothing (the noise floor and any ordering bias);
- ``kernels``: a passthrough Python kernel on the ``Autograd`` key of every c10d op the hook
  registers (what ``install()`` adds to the dispatcher; no c10d op runs in the step);
- ``alloc:N``: an N-byte bytearray plus an N/4-element tensor kept alive (memory that no op of
  the step touches).

Measured 2026-11-25, one mode per process (``--modes X``), 50 rounds each: ``kernels``
+0.01% / +4.35% (two processes), ``alloc:4000000`` +0.06% / -10.54%, ``none`` +0.30%. Four
megabytes that no op reads moved the step by up to 10%, either way, per process.

The cause is glibc's *dynamic* mmap threshold: freeing a large block raises it, and whether
this step's tensors (a few hundred KB each) are then served from the heap or from fresh,
zero-filled mmaps depends on the process's allocation history. Setting the thresholds
explicitly turns the adjustment off: with ``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=262144`` (the mmap threshold at glibc's default, fixed) in the
environment, ``alloc:4000000`` gave -0.03%,
-0.01%, -0.16%, -0.24% in four processes (30 rounds) and the round-to-round spread fell from
~4.3% to 1.2-2.1%; ``kernels`` -0.33%, -0.44%, +0.36%, ``none`` -0.24%, +0.90%, +0.26%. So the
Python kernels do not slow ordinary ops, and ``tracking_overhead.py`` now runs its ranks with
fixed thresholds (``--malloc fixed``). What the Python hook does cost is per collective (its
kernel and the GIL on the backend's threads: ``tracking_overhead.py --kernel python``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table


def toggles(mode: str) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch

    held: list[Any] = []
    if mode == "none":
        return (lambda: None), (lambda: None)
    if mode == "kernels":
        from failslow.nccl_hook.c10d_ops import OP_SPECS

        def on() -> None:
            lib = torch.library.Library("c10d", "IMPL")
            for spec in OP_SPECS:
                packet = getattr(torch.ops.c10d, spec.name, None)
                if packet is not None:
                    overload = packet.default
                    lib.impl(spec.name, _passthrough(overload), "Autograd")
            held.append(lib)

        def off() -> None:
            held.pop()._destroy()

        return on, off
    if mode.startswith("alloc:"):
        size = int(mode.split(":", 1)[1])
        return (lambda: held.append((bytearray(size), torch.empty(size // 4)))), held.clear
    raise SystemExit(f"unknown mode {mode!r}: none, kernels or alloc:N")


def _passthrough(overload: Any) -> Callable[..., Any]:
    import torch

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            return overload(*args, **kwargs)

    return kernel


def measure(mode: str, rounds: int) -> list[float]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512)

    def block(steps: int = 5) -> float:
        t0 = time.thread_time_ns()
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return (time.thread_time_ns() - t0) / steps

    block()
    on, off = toggles(mode)
    ratios = []
    for _ in range(rounds):
        a = block()
        on()
        b, c = block(), block()
        off()
        d = block()
        ratios.append((b + c) / (a + d) - 1)
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--modes", default="none,kernels,alloc:4000000")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = tempfile.mkdtemp(prefix="failslow-bias-")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    table = Table(title="training-thread CPU per step, on blocks / off blocks - 1 (ABBA)")
    for col in ("mode", "mean", "median", "stdev over rounds", "rounds"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        r = measure(mode, args.rounds)
        table.add_row(
            mode,
            f"{100 * statistics.mean(r):+.2f}%",
            f"{100 * statistics.median(r):+.2f}%",
            f"{100 * statistics.stdev(r):.2f}%",
            str(len(r)),
        )
    Console().print(table)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
