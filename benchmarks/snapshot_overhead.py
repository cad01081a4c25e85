"""Step-time overhead of every-step checkpointing, side by side (byterobust 6.3 and 8.2).

Usage::

    .venv/bin/python benchmarks/snapshot_overhead.py [--rounds 3] [--steps 8] [--batch 384]

One CPU model trains in this process on ``--threads`` (1) intra-op threads: a residual stack of
``--blocks`` (4) transformer-FFN blocks (LayerNorm, Linear d->h, GELU, Linear h->d; d=1024,
h=3072) and a head, 26.2 M parameters, Adam, MSE on a fixed random batch of ``--batch``. The
checkpointed state is ``{"model": state_dict, "optim": state_dict, "step", "rng"}``: parameters
plus both Adam moments, ~315 MB - the state of a ~26 M-parameter shard, and a step of ~1 s on one
core, so per-step costs of a few ms are visible against it and the run fits in minutes.

Variants, each run for ``--steps`` measured steps (after 2 warm-up steps) in every round, the
order rotating across rounds so drift hits all alike:

* ``none``: no checkpointing;
* ``snapshotter``: :class:`~failslow.core.checkpoint.snapshot.Snapshotter` into ``/dev/shm``,
  ``start`` after the optimizer step of step s, ``wait_consistent`` before the optimizer step of
  step s+1 (so the copy overlaps the next forward/backward), as byterobust orders it;
* ``torch.save``: the same state to one file on local disk (``--disk-dir``, default a temporary
  directory under /tmp), every step, synchronous, no fsync (page cache: optimistic);
* ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` of the same state to local
  disk every step, single process (no process group); the previous save's future is waited on
  before the next one starts (the documented pattern), and staging happens inside the call.

Step time = wall time from one step's start to the next. Reported per variant: median step
time, added % vs ``none`` (ratio of medians), the training thread's time blocked inside the
checkpoint calls (median per step), and for the snapshotter the copy / seal seconds and the
skipped count. Goal for the snapshotter: <= 1% added (byterobust: 0.71% MFU loss).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from failslow.core.checkpoint.snapshot import SnapshotStats, Snapshotter


class Block(torch.nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def filesystem(path: Path) -> str:
    out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True).stdout
    fields = out.splitlines()[-1].split()
    return f"{fields[1]} on {fields[0]}" if len(fields) > 1 else "unknown"


class Bench:
    def __init__(self, args: argparse.Namespace, shm: Path, disk: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            *[Block(args.width, args.hidden) for _ in range(args.blocks)],
            torch.nn.Linear(args.width, args.width),
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(args.batch, args.width)
        self.y = torch.randn(args.batch, args.width)
        self.shm, self.disk = shm, disk
        self.step = 0
        self.results: dict[str, dict[str, list[float]]] = {}
        self.snap_stats: list[SnapshotStats] = []
        self.snapshotter: Snapshotter | None = None
        self.variant_hooks: dict[str, tuple[Callable[[], float], ...]] = {}
        self.closers: list[Callable[[], None]] = []

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "step": self.step,
            "rng": torch.get_rng_state(),
        }

    def forward_backward(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1

    def block(self, name: str, steps: int, warmup: int = 1) -> None:
        """``steps`` measured steps of variant ``name``: wall, training-thread CPU and blocked s."""
        out = self.results.setdefault(name, {"step_s": [], "cpu_s": [], "blocked_s": []})
        if name not in self.variant_hooks:
            self.variant_hooks[name] = self.hooks(name)
        before, after, finish = self.variant_hooks[name]
        for i in range(warmup + steps):
            began, began_cpu = time.perf_counter(), time.thread_time()
            self.forward_backward()
            blocked = before()
            self.optimizer_step()
            blocked += after()
            if i >= warmup:
                out["step_s"].append(time.perf_counter() - began)
                out["cpu_s"].append(time.thread_time() - began_cpu)
                out["blocked_s"].append(blocked)
        finish()  # the last checkpoint completes before the next variant's block

    def close(self) -> None:
        for _, _, finish in self.variant_hooks.values():
            finish()
        for closing in self.closers:
            closing()

    def hooks(
        self, name: str
    ) -> tuple[Callable[[], float], Callable[[], float], Callable[[], None]]:
        """(before the optimizer step, after it, end of block); the first two return seconds."""
        nothing: Callable[[], float] = lambda: 0.0  # noqa: E731
        if name == "none":
            return nothing, nothing, lambda: None
        if name == "snapshotter":
            snap = Snapshotter(self.shm, rank=0)
            snap.on_sealed(lambda step, buf: self.snap_stats.append(snap.stats))  # type: ignore[arg-type]

            def wait() -> float:
                t = time.perf_counter()
                snap.wait_consistent()
                return time.perf_counter() - t

            def start() -> float:
                t = time.perf_counter()
                snap.start(self.state(), self.step)
                return time.perf_counter() - t

            def finish() -> None:
                snap.wait_sealed()

            self.snapshotter = snap
            self.closers.append(snap.close)

            return wait, start, finish
        if name == "torch.save":

            def save() -> float:
                t = time.perf_counter()
                torch.save(self.state(), self.disk / "ckpt.pt")
                return time.perf_counter() - t

            return nothing, save, lambda: None
        if name == "dcp.async_save":
            import torch.distributed.checkpoint as dcp

            pending: list[Any] = []

            def async_save() -> float:
                t = time.perf_counter()
                if pending:
                    pending.pop().result()
                state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
                pending.append(dcp.async_save(state, checkpoint_id=str(self.disk / "dcp")))
                return time.perf_counter() - t

            def finish() -> None:
                if pending:
                    pending.pop().result()

            return nothing, async_save, finish
        raise ValueError(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per variant and round")
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    ap.add_argument("--disk-dir", type=Path, default=None, help="local disk (not tmpfs)")
    ap.add_argument("--variants", default="none,snapshotter,torch.save,dcp.async_save")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialized
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    shm = Path(tempfile.mkdtemp(prefix="failslow-bench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="failslow-bench-", dir=args.disk_dir or "/tmp"))
    try:
        bench = Bench(args, shm, disk)
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for name in order:
                bench.block(name, args.steps)
        bench.close()
        report(args, bench, variants, filesystem(disk))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def report(args: argparse.Namespace, bench: Bench, variants: list[str], disk_fs: str) -> None:
    params = sum(p.numel() for p in bench.model.parameters())
    state_mb = bench.snap_stats[-1].nbytes / 1e6 if bench.snap_stats else float("nan")
    base = bench.results["none"]
    k = args.steps

    def paired(name: str, key: str) -> list[float]:
        """Per round: this variant's block median / the ``none`` block median of that round, - 1."""
        runs = bench.results[name][key]
        return [
            (
                statistics.median(runs[r * k : (r + 1) * k])
                / statistics.median(base[key][r * k : (r + 1) * k])
                - 1
            )
            * 100
            for r in range(args.rounds)
        ]

    rows: dict[str, dict[str, Any]] = {}
    for name in variants:
        res = bench.results[name]
        rows[name] = {
            "step_s": statistics.median(res["step_s"]),
            "added_pct": (statistics.median(res["step_s"]) / statistics.median(base["step_s"]) - 1)
            * 100,
            "paired_pct": paired(name, "step_s"),
            "cpu_s": statistics.median(res["cpu_s"]),
            "cpu_added_pct": (
                statistics.median(res["cpu_s"]) / statistics.median(base["cpu_s"]) - 1
            )
            * 100,
            "cpu_paired_pct": paired(name, "cpu_s"),
            "blocked_s": statistics.median(res["blocked_s"]),
        }
    snap = {
        "copy_s": statistics.median(s.copy_s for s in bench.snap_stats),
        "seal_s": statistics.median(s.seal_s for s in bench.snap_stats),
        "start_s": statistics.median(s.start_s for s in bench.snap_stats),
        "snapshots": len(bench.snap_stats),
        "skipped": bench.snapshotter.skipped if bench.snapshotter else 0,
    } if bench.snap_stats else {}  # fmt: skip
    if args.json:
        print(json.dumps({"rows": rows, "snapshotter": snap, "state_mb": state_mb}, indent=2))
        return
    table = Table(
        title=f"Every-step checkpoint overhead: {params / 1e6:.1f} M params + Adam, state "
        f"{state_mb:.0f} MB, {args.rounds} rounds x {args.steps} steps, {args.threads} thread(s), "
        f"{os.cpu_count()} cores"
    )
    cols = ("variant", "step (median)", "added", "added, per round", "train-thread CPU",
            "added CPU", "CPU, per round", "blocked/step", "target")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("variant", "target") else "right")
    targets = {
        "none": "",
        "snapshotter": "/dev/shm (tmpfs)",
        "torch.save": f"{disk_fs}, sync, no fsync",
        "dcp.async_save": f"{disk_fs}, async, 1 process",
    }

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):+.1f}% [{min(xs):+.1f}, {max(xs):+.1f}]"

    for name, row in rows.items():
        none = name == "none"
        table.add_row(
            name,
            f"{row['step_s']:.3f} s",
            "-" if none else f"{row['added_pct']:+.2f}%",
            "-" if none else spread(row["paired_pct"]),
            f"{row['cpu_s']:.3f} s",
            "-" if none else f"{row['cpu_added_pct']:+.2f}%",
            "-" if none else spread(row["cpu_paired_pct"]),
            f"{row['blocked_s'] * 1e3:.1f} ms",
            targets.get(name, ""),
        )
    console = Console(width=200)
    console.print(table)
    if snap:
        console.print(
            f"snapshotter: copy {snap['copy_s']:.3f} s, seal {snap['seal_s']:.3f} s (medians, "
            f"off the training thread), start() {snap['start_s'] * 1e3:.1f} ms on it; "
            f"{snap['snapshots']} taken, {snap['skipped']} skipped (previous still sealing)"
        )


if __name__ == "__main__":
    main()
