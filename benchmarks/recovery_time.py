"""Recovery time of one rank's state: in-memory snapshot/backup vs disk (byterobust 6.3).

Usage::

    python benchmarks/recovery_time.py [--mb 256] [--repeats 3] [--json]

One training state of ``--mb`` MiB (fp32 weights plus Adam's two moments, a third each) is
restored five ways, each timed from "nothing in this process" to "every tensor in this process's
memory, bitwise equal to the original":

* ``memory: local snapshot`` - :func:`failslow.core.checkpoint.restore.restore` in a 1-rank gloo
  world over the rank's own Snapshotter file in ``/dev/shm`` (mmap, CRC-32 check, copy out);
* ``memory: peer backup (gloo)`` - a replaced rank with empty memory restores in a 2-rank world
  (two processes) from its holder's ``backup-of-rank0`` file in ``/dev/shm``: agreement, chunked
  p2p transfer over gloo/TCP on 127.0.0.1, CRC-32 check, copy out;
* ``disk: torch.load`` - ``torch.save`` file on the local disk (``/tmp`` or ``--disk-dir``);
* ``disk: DCP load`` - ``torch.distributed.checkpoint`` save, then load into preallocated tensors;
* disk rows come cold (``fsync`` + ``posix_fadvise(DONTNEED)`` on every file before each load,
  so the page cache does not serve them) and warm (loaded again right away: page cache hit).

The methods are interleaved in each repeat (the median of ``--repeats`` is shown) so machine
noise hits them alike. greyhound Fig. 19 reports 6.72x for in-memory over disk checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from failslow.core.checkpoint import blob
from failslow.core.checkpoint.backup import backup_path
from failslow.core.checkpoint.restore import restore
from failslow.core.checkpoint.snapshot import Snapshotter

STEP = 7


def make_state(mb: int) -> dict[str, Any]:
    """Weights + Adam moments, ``mb`` MiB in all, in 8 layers."""
    per_tensor = mb * (1 << 20) // 4 // 24  # 8 layers x 3 tensors, fp32
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(per_tensor, generator=g) for i in range(8)}
    moments = {
        i: {
            "step": torch.tensor(float(STEP)),
            "exp_avg": torch.randn(per_tensor, generator=g),
            "exp_avg_sq": torch.rand(per_tensor, generator=g),
        }
        for i in range(8)
    }
    return {
        "model": weights,
        "optim": {"state": moments, "param_groups": [{"lr": 1e-3, "params": list(range(8))}]},
        "step": STEP,
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file or every file below it) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def write_blob(state: Any, path: Path) -> None:
    layout = blob.plan(state)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, layout.total_bytes)
    import mmap

    mm = mmap.mmap(fd, layout.total_bytes)
    view = memoryview(mm)
    blob.write_payload(view, layout, STEP)
    blob.seal(view)
    view.release()
    mm.close()
    os.close(fd)


# ---------------------------------------------------------------- the peer (2-process) rows


def _peer(rank: int, port: int, root: str, repeats: int, mb: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    directory = Path(root) / f"host{rank}"
    times = []
    ok = True
    expected = make_state(mb) if rank == 0 else None
    for _ in range(repeats):
        dist.barrier()
        elapsed, got = timed(
            lambda: restore(rank=rank, holders=(1, 0), directory=directory).state()
        )
        times.append(elapsed)
        if rank == 0:
            ok = ok and same(got, expected)
        del got
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "ok": ok}))
    dist.destroy_process_group()


def peer_times(state: Any, mb: int, repeats: int, root: Path) -> tuple[list[float], bool]:
    """Rank 0 (replaced, empty memory) pulls its state from rank 1's backup over gloo."""
    (root / "host0").mkdir(parents=True)
    (root / "host1").mkdir(parents=True)
    write_blob(state, backup_path(root / "host1", 0, 0))
    write_blob({"tiny": torch.zeros(4)}, root / "host1" / "rank1-slot0.fsck")
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    out = root / "peer.json"
    mp.start_processes(
        _peer,
        args=(store.port, str(root), repeats, mb, str(out)),
        nprocs=2,
        start_method="spawn",
    )
    result = json.loads(out.read_text())
    return result["times"], bool(result["ok"])


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="state size in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import torch.distributed.checkpoint as dcp

    state = make_state(args.mb)
    nbytes = blob.plan(state).total_bytes
    shm = Path(tempfile.mkdtemp(prefix="failslow-recovery-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="failslow-recovery-", dir=args.disk_dir))
    times: dict[str, list[float]] = {}
    checks: dict[str, bool] = {}
    try:
        # the rank's own snapshot, written by the real Snapshotter
        local_dir = shm / "local"
        with Snapshotter(local_dir, rank=0) as snap:
            snap.start(state, STEP)
            snap.wait_sealed()
        pt = disk / "state.pt"
        torch.save(state, pt)
        dcp_dir = disk / "dcp"
        dcp.save(state, checkpoint_id=str(dcp_dir), no_dist=True)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

        def record(name: str, fn: Callable[[], Any]) -> None:
            elapsed, got = timed(fn)
            times.setdefault(name, []).append(elapsed)
            checks[name] = checks.get(name, True) and same(got, state)

        def dcp_load() -> Any:
            template = {
                "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
                "optim": {
                    "state": {
                        i: {k: torch.empty_like(v) for k, v in m.items()}
                        for i, m in state["optim"]["state"].items()
                    },
                    "param_groups": [{"lr": 0.0, "params": []}],
                },
                "step": 0,
            }
            dcp.load(template, checkpoint_id=str(dcp_dir), no_dist=True)
            return template

        for _ in range(args.repeats):
            record(
                "memory: local snapshot (/dev/shm)",
                lambda: restore(rank=0, holders=(0,), directory=local_dir).state(),
            )
            drop_cache(pt)
            record("disk: torch.load, cold", lambda: torch.load(pt, weights_only=False))
            record("disk: torch.load, warm", lambda: torch.load(pt, weights_only=False))
            drop_cache(dcp_dir)
            record("disk: DCP load, cold", dcp_load)
            record("disk: DCP load, warm", dcp_load)
        dist.destroy_process_group()
        peer, peer_ok = peer_times(state, args.mb, args.repeats, shm / "peer")
        times["memory: peer backup (gloo p2p)"] = peer
        checks["memory: peer backup (gloo p2p)"] = peer_ok
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    order = [
        "memory: local snapshot (/dev/shm)",
        "memory: peer backup (gloo p2p)",
        "disk: torch.load, cold",
        "disk: DCP load, cold",
        "disk: torch.load, warm",
        "disk: DCP load, warm",
    ]
    median = {k: statistics.median(v) for k, v in times.items()}
    cold = min(median["disk: torch.load, cold"], median["disk: DCP load, cold"])
    rows = []
    for name in order:
        rows.append(
            {
                "method": name,
                "median_s": median[name],
                "all_s": times[name],
                "gb_per_s": nbytes / median[name] / 1e9,
                "speedup_vs_best_cold_disk": cold / median[name],
                "bitwise_equal": checks[name],
            }
        )
    if args.json:
        print(json.dumps({"nbytes": nbytes, "rows": rows}, indent=2))
    else:
        table = Table(
            title=f"Recovery of one {nbytes / 2**20:.0f} MiB state "
            f"(median of {args.repeats}; torch {torch.__version__}, {os.cpu_count()} cores)"
        )
        for col in ("method", "median (s)", "GB/s", "vs best cold disk", "bitwise"):
            table.add_column(col, justify="left" if col == "method" else "right")
        for r in rows:
            table.add_row(
                r["method"],
                f"{r['median_s']:.3f}",
                f"{r['gb_per_s']:.2f}",
                f"{r['speedup_vs_best_cold_disk']:.1f}x",
                "yes" if r["bitwise_equal"] else "NO",
            )
        Console().print(table)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
