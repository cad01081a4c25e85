"""Hot update (in-place restart from memory) vs a fresh launch that reloads from disk.

Usage::

    python benchmarks/hot_update.py [--width 1024] [--repeat 1]

The job is the DeepSpeed ZeRO-1 demo job (4 ranks, CPU/gloo, ``failslow.demo.ds_worker``) under
``torchrun``. Both ways apply a code change at about step 15 and the figure is the *downtime*:
the time without training progress around the restart (the gap between the last step done
before it and the first done after, less one normal step; steps run while the stop is being
agreed count as progress).

- **hot update**: ``failslow run --controller 4`` with an in-memory snapshot every step;
  ``failslow update submit --urgent`` -> every rank stops at one step boundary with its snapshot
  committed in /dev/shm, the launcher restarts torchrun in place, the ranks restore from memory.
- **hot update, warm processes**: the same, with the node launching the ranks itself
  (``failslow run --nproc-per-node 4 --preload deepspeed``) and the update a new code
  directory (``--code-dir``): the ranks of the next launch are the warm spares, processes that
  imported torch and DeepSpeed before the update (the request waits until the launcher said they
  are ready). An update that changes the environment gets fresh processes instead.
- **fresh launch**: plain ``torchrun``; on request every rank stops at the next step
  (``engine.save_checkpoint`` to local disk), the job ends, and a new ``torchrun`` starts and
  ``engine.load_checkpoint``s from disk - how an update is applied without failslow (byterobust
  Table 7 compares with requeueing the job through the cluster scheduler: 11.04x).

Also printed: the snapshot/checkpoint size and where the time goes (stop, process start to
restored state, first step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from failslow.demo.worker_io import launch_env

STEPS = 40
REQUEST_AT = 15


def _env(out: Path, width: int, steps: int = STEPS, **extra: str) -> dict[str, str]:
    return launch_env(
        out, steps, FAILSLOW_DEMO_WIDTH=str(width), FAILSLOW_DEMO_MICRO_BATCH_SIZE="32", **extra
    )


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", "-m", "failslow.demo.ds_worker"]  # fmt: skip


class Steps:
    """When rank 0's progress file first showed each step done (polled every 20 ms)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "progress-rank0.json"
        self.seen: dict[int, float] = {}

    def poll(self) -> int:
        try:
            steps = json.loads(self.path.read_text())["steps"]
        except (OSError, ValueError, KeyError):
            steps = []
        now = time.time()
        for step, _ in steps:
            self.seen.setdefault(int(step), now)
        return max(self.seen, default=-1)

    def wait(self, what, proc: subprocess.Popen, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            self.poll()
            if proc.poll() is not None and not what():
                raise SystemExit(f"the job ended early with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit("timed out")
            time.sleep(0.02)

    def downtime(self, resumed: int) -> dict[str, float]:
        """Seconds without progress around the restart: the gap between the last step done
        before it and the first done after, less one normal step."""
        before = sorted(s for s in self.seen if s < resumed)
        recent = before[-11:]
        gaps = [self.seen[b] - self.seen[a] for a, b in itertools.pairwise(recent)]
        step = statistics.median(gaps)
        gap = self.seen[resumed] - self.seen[before[-1]]
        return {"step_s": step, "gap_s": gap, "downtime": gap - step}


def hot(tmp: Path, width: int, *, warm: bool = False) -> dict[str, float]:
    out, state = tmp / "hot", tmp / "hot-state"
    out.mkdir()
    launcher = ["--", *TORCHRUN]
    update = ["--env", "FAILSLOW_DEMO_LOG_TAG=v2 "]  # the "code change" the log shows
    if warm:
        launcher = ["--nproc-per-node", "4", "--preload", "deepspeed", "--spare-delay", "2",
                    "--", "-m", "failslow.demo.ds_worker"]  # fmt: skip
        (tmp / "code-v2").mkdir()
        update = ["--code-dir", str(tmp / "code-v2")]  # same environment: the warm spares fit
    settings = json.dumps({"checkpoint": {"every_steps": 1}, "planner": {"strategies": ["S2"]}})
    stop = tmp / "stop"  # warm: the job runs until the spares were ready and it restarted
    env = _env(
        out, width, 100 * STEPS if warm else STEPS, FAILSLOW_DEMO_CONFIG=settings,
        FAILSLOW_DEMO_STOP_FILE=str(stop),
    )  # fmt: skip
    log = open(tmp / "hot.log", "w")
    shm = Path(tempfile.mkdtemp(prefix="failslow-hotbench-", dir="/dev/shm"))  # node memory
    cmd = [sys.executable, "-m", "failslow.cli", "run", "--controller", "4", "--no-shim",
           "--ring-dir", str(tmp / "hot-rings"), "--state-dir", str(state),
           "--snapshot-dir", str(shm), "--update-poll", "0.1", *launcher]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    steps = Steps(out)
    text = lambda: (tmp / "hot.log").read_text()  # noqa: E731
    ready = lambda: not warm or "warm spares ready" in text()  # noqa: E731
    steps.wait(lambda: steps.poll() >= REQUEST_AT and ready(), proc)
    subprocess.run(
        [sys.executable, "-m", "failslow.cli", "update", "submit", "--urgent", "--state-dir",
         str(state), *update],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    marker = "rank 0: resumed at step"  # the launch after the update (the first is fresh)
    steps.wait(lambda: marker in text(), proc)
    line = next(x for x in text().splitlines() if marker in x)
    resumed = int(line.rsplit(" ", 1)[-1])
    steps.wait(lambda: resumed + 5 in steps.seen, proc)
    stop.touch()
    proc.wait(timeout=600)
    size = sum(p.stat().st_size for p in shm.glob("rank0-slot*")) / 3
    shutil.rmtree(shm, ignore_errors=True)
    return {**steps.downtime(resumed), "bytes": size, "step": resumed}


def fresh(tmp: Path, width: int) -> dict[str, float]:
    out, disk = tmp / "fresh", tmp / "fresh-ckpt"  # tmp is on local disk, not /dev/shm
    out.mkdir()
    stop = tmp / "stop-now"
    env = _env(
        out, width, FAILSLOW_DEMO_DISK_CHECKPOINT=str(disk), FAILSLOW_DEMO_STOP_FILE=str(stop),
        FAILSLOW_DEMO_CONFIG='{"capture": false}',
    )  # fmt: skip
    log = open(tmp / "fresh.log", "w")
    proc = subprocess.Popen(TORCHRUN, env=env, stdout=log, stderr=subprocess.STDOUT)
    steps = Steps(out)
    steps.wait(lambda: steps.poll() >= REQUEST_AT, proc)
    stop.touch()
    proc.wait(timeout=600)
    steps.poll()
    resumed = max(steps.seen) + 1
    stop.unlink()
    log = open(tmp / "fresh2.log", "w")
    proc = subprocess.Popen(TORCHRUN, env=env, stdout=log, stderr=subprocess.STDOUT)
    steps.wait(lambda: resumed in steps.seen, proc)
    proc.wait(timeout=600)
    size = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file()) / 4
    return {**steps.downtime(resumed), "bytes": size, "step": resumed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    console = Console(width=150)
    table = Table(title="code update of a 4-rank DeepSpeed ZeRO-1 job (CPU/gloo): downtime")
    for col in ("run", "way", "state/rank", "restart at step", "normal step",
                "gap around the restart", "downtime", "fresh / this"):  # fmt: skip
        table.add_column(col)
    for i in range(args.repeat):
        runs = {}
        for name, warm in (("hot update (memory)", False), ("hot update, warm (memory)", True)):
            with tempfile.TemporaryDirectory(prefix="failslow-hotbench-", dir="/tmp") as t:
                console.print(f"run {i + 1}: {name} ...")
                runs[name] = hot(Path(t), args.width, warm=warm)
        with tempfile.TemporaryDirectory(prefix="failslow-hotbench-", dir="/tmp") as t:
            console.print(f"run {i + 1}: fresh launch from disk ...")
            f = runs["fresh launch (disk)"] = fresh(Path(t), args.width)
        for name, r in runs.items():
            table.add_row(
                str(i + 1), name, f"{r['bytes'] / 2**20:.0f} MiB", str(r["step"]),
                f"{r['step_s']:.2f} s", f"{r['gap_s']:.1f} s", f"{r['downtime']:.1f} s",
                f"{f['downtime'] / r['downtime']:.2f}x",
            )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
