"""Hot update (in-place restart from memory) vs a fresh launch that reloads from disk.

Usage::

    python benchmarks/hot_update.py [--width 1024] [--repeat 1]

The job is the DeepSpeed ZeRO-1 demo job (4 ranks, CPU/gloo, ``failslow.demo.ds_worker``) under
``torchrun``. Both ways apply a code change at about step 15 and the figure is the *downtime*:
from the request until the first step after the restart has completed.

- **hot update**: ``failslow run --controller 4`` with an in-memory snapshot every step;
  ``failslow update submit --urgent`` -> every rank stops at one step boundary with its snapshot
  committed in /dev/shm, the launcher restarts torchrun in place, the ranks restore from memory.
- **fresh launch**: plain ``torchrun``; on request every rank stops at the next step
  (``engine.save_checkpoint`` to local disk), the job ends, and a new ``torchrun`` starts and
  ``engine.load_checkpoint``s from disk - how an update is applied without failslow (byterobust
  Table 7 compares with requeueing the job through the cluster scheduler: 11.04x).

Also printed: the snapshot/checkpoint size and where the time goes (stop, process start to
restored state, first step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

STEPS = 40
REQUEST_AT = 15


def _env(out: Path, width: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW")}
    env.update(
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        FAILSLOW_DEMO_STEPS=str(STEPS),
        FAILSLOW_DEMO_OUT=str(out),
        FAILSLOW_DEMO_WIDTH=str(width),
        FAILSLOW_DEMO_MICRO_BATCH_SIZE="32",
        **extra,
    )
    return env


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", "-m", "failslow.demo.ds_worker"]  # fmt: skip


def _progress(out: Path) -> tuple[int, float]:
    """(last step rank 0 finished, when that file was written)."""
    path = out / "progress-rank0.json"
    try:
        steps = json.loads(path.read_text())["steps"]
        return max(s for s, _ in steps), path.stat().st_mtime
    except (OSError, ValueError, KeyError):
        return -1, 0.0


def _wait(what, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if proc.poll() is not None and not what():
            raise SystemExit(f"the job ended early with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.05)


def hot(tmp: Path, width: int) -> dict[str, float]:
    out, state = tmp / "hot", tmp / "hot-state"
    out.mkdir()
    settings = json.dumps({"checkpoint": {"every_steps": 1}, "planner": {"strategies": ["S2"]}})
    env = _env(out, width, FAILSLOW_DEMO_CONFIG=settings)
    log = open(tmp / "hot.log", "w")
    cmd = [sys.executable, "-m", "failslow.cli", "run", "--controller", "4", "--no-shim",
           "--ring-dir", str(tmp / "hot-rings"), "--state-dir", str(state),
           "--update-poll", "0.1", "--", *TORCHRUN]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait(lambda: _progress(out)[0] >= REQUEST_AT, proc)
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "failslow.cli", "update", "submit", "--urgent", "--state-dir",
         str(state), "--env", "FAILSLOW_DEMO_LOG_TAG=v2 "],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    text = lambda: (tmp / "hot.log").read_text()  # noqa: E731
    _wait(lambda: "relaunching at step" in text(), proc)
    t_stop = time.time()
    _wait(lambda: "v2 rank 0: resumed at step" in text(), proc)
    t_restored = time.time()
    line = next(x for x in text().splitlines() if "v2 rank 0: resumed at step" in x)
    resumed = int(line.rsplit(" ", 1)[-1])
    _wait(lambda: _progress(out)[0] >= resumed and _progress(out)[1] > t_restored, proc)
    t_step = _progress(out)[1]
    proc.wait(timeout=600)
    size = sum(p.stat().st_size for p in (tmp / "hot-rings" / "snapshots").glob("rank0-slot*"))
    return {"stop": t_stop - t0, "restart": t_restored - t_stop, "first_step": t_step - t_restored,
            "downtime": t_step - t0, "bytes": size / 3}  # fmt: skip


def fresh(tmp: Path, width: int) -> dict[str, float]:
    out, disk = tmp / "fresh", tmp / "fresh-ckpt"  # tmp is on local disk, not /dev/shm
    out.mkdir()
    stop = tmp / "stop-now"
    env = _env(
        out,
        width,
        FAILSLOW_DEMO_DISK_CHECKPOINT=str(disk),
        FAILSLOW_DEMO_STOP_FILE=str(stop),
        FAILSLOW_DEMO_CONFIG='{"capture": false}',
    )
    log = open(tmp / "fresh.log", "w")
    proc = subprocess.Popen(TORCHRUN, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait(lambda: _progress(out)[0] >= REQUEST_AT, proc)
    t0 = time.time()
    stop.touch()
    proc.wait(timeout=600)
    t_stop = time.time()
    stop.unlink()
    log = open(tmp / "fresh2.log", "w")
    before = _progress(out)
    proc = subprocess.Popen(TORCHRUN, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait(lambda: _progress(out)[1] > before[1] + 1e-6 and _progress(out)[1] > t_stop, proc)
    t_step = _progress(out)[1]
    proc.wait(timeout=600)
    size = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file())
    return {"stop": t_stop - t0, "restart": float("nan"), "first_step": t_step - t_stop,
            "downtime": t_step - t0, "bytes": size / 4}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    console = Console(width=150)
    table = Table(title="code update of a 4-rank DeepSpeed ZeRO-1 job (CPU/gloo): downtime")
    for col in ("run", "way", "state/rank", "stop", "restart to restored", "to first step",
                "downtime", "fresh / hot"):  # fmt: skip
        table.add_column(col)
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="failslow-hotbench-", dir="/tmp") as t:
            console.print(f"run {i + 1}: hot update ...")
            h = hot(Path(t), args.width)
        with tempfile.TemporaryDirectory(prefix="failslow-hotbench-", dir="/tmp") as t:
            console.print(f"run {i + 1}: fresh launch from disk ...")
            f = fresh(Path(t), args.width)
        for name, r in (("hot update (memory)", h), ("fresh launch (disk)", f)):
            table.add_row(
                str(i + 1), name, f"{r['bytes'] / 2**20:.0f} MiB", f"{r['stop']:.1f} s",
                "-" if r["restart"] != r["restart"] else f"{r['restart']:.1f} s",
                f"{r['first_step']:.1f} s", f"{r['downtime']:.1f} s",
                f"{f['downtime'] / h['downtime']:.2f}x" if r is f else "",
            )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
