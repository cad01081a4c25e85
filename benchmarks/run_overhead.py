"""What a healthy job pays for running under ``failslow run``: each piece added in turn, beside
plain torchrun (issue 49, "the cost of being there").

Usage::

    python benchmarks/run_overhead.py [--jobs deepspeed,megatron,accelerate] [--world 4]
        [--steps 120] [--repeat 3]

Each job is a demo worker that attached failslow (``failslow.deepspeed.initialize``, the
Megatron-LM loop with ``failslow.megatron.attach``, Accelerate's ``accumulate`` loop with
``failslow.accelerate.attach``), started by ``torchrun --standalone`` (its own rendezvous), with
no fault. Ways, each one piece more than the one before:

1. ``torchrun``: the job alone (failslow attached, nothing to talk to);
2. ``failslow run (no capture)``: ``failslow run --no-shim --no-python-hook -- torchrun ...`` -
   the launcher, its update agent and node publisher;
3. ``+ capture``: the LD_PRELOAD shim and the Python hook recording every collective;
4. ``+ controller``: ``--controller W`` - the embedded control store and controller, the ranks'
   step reports and progress records;
5. ``+ snapshots``: ``checkpoint.every_steps = 1`` with backups on peers (off by default).

Printed per job: the median step over steps 10 to the end (the slowest rank's step ends) of each
way, and its ratio to the same round's ``torchrun`` (the ways of a round run back to back, the
order rotated from round to round; the machine is shared and noisy, so ratios, not times); and
the CPU seconds each run's processes used beyond the round's ``torchrun`` run (less noisy than
wall time where the ranks share cores with other work; start-up included, so divided by the
steps it is an upper bound of what a step adds).
"""

from __future__ import annotations

import argparse
import json
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

from failslow.demo.mitigation import step_times_of
from failslow.demo.worker_io import launch_env

JOBS = {
    "deepspeed": ("failslow.demo.ds_worker", {"FAILSLOW_DEMO_MICRO_BATCH_SIZE": "32"}),
    "megatron": ("failslow.demo.megatron_worker", {}),
    "accelerate": ("failslow.demo.accelerate_worker", {"FAILSLOW_DEMO_MICRO_BATCH_SIZE": "32"}),
}
WAYS = ("torchrun", "failslow run (no capture)", "+ capture", "+ controller", "+ snapshots")


def command(way: str, module: str, world: int, tmp: Path) -> list[str]:
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={world}", "-m", module,
    ]  # fmt: skip
    if way == "torchrun":
        return torchrun
    run = [
        sys.executable, "-m", "failslow.cli", "run", "--ring-dir", str(tmp / "rings"),
        "--state-dir", str(tmp / "state"), "--snapshot-dir", str(tmp / "snapshots"),
    ]  # fmt: skip
    if way == "failslow run (no capture)":
        run += ["--no-shim", "--no-python-hook"]
    if way in ("+ controller", "+ snapshots"):
        run += ["--controller", str(world)]
    return [*run, "--", *torchrun]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one(job: str, way: str, world: int, steps: int) -> tuple[float, float]:
    """The median step of one run of ``job`` the ``way`` given (steps 10 to the end), and the
    CPU seconds the run's processes used (every process of it is waited for: torchrun's ranks,
    failslow run's launcher with its agent, publisher and controller threads)."""
    module, extra = JOBS[job]
    with tempfile.TemporaryDirectory(prefix="failslow-overhead-", dir="/dev/shm") as name:
        tmp = Path(name)
        out = tmp / "out"
        out.mkdir()
        snapshots = {"checkpoint": {"every_steps": 1, "backup": True}}
        settings = snapshots if way == "+ snapshots" else {}
        env = launch_env(out, steps, FAILSLOW_DEMO_CONFIG=json.dumps(settings), **extra)
        env.pop("FAILSLOW_DEMO_STORE_PORT", None)
        log = tmp / "log"
        cpu = _children_cpu_s()
        with log.open("w") as f:
            done = subprocess.run(
                command(way, module, world, tmp), env=env, stdout=f, stderr=subprocess.STDOUT,
                timeout=1200, check=False, cwd=tmp,
            )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{job} / {way}: exit {done.returncode}\n{log.read_text()[-3000:]}")
        cpu = _children_cpu_s() - cpu
        return float(statistics.median(step_times_of(out, world)[10:])), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="deepspeed,megatron,accelerate")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS), help="a subset of the ways, in order")
    args = parser.parse_args()
    jobs = args.jobs.split(",")
    ways = [w for w in args.ways.split(",") if w]
    unknown = [j for j in jobs if j not in JOBS] + [w for w in ways if w not in WAYS]
    if unknown or ways[:1] != ["torchrun"]:
        raise SystemExit(f"unknown jobs or ways {unknown}, or the ways do not start with torchrun")
    console = Console(width=150)
    cores = os.cpu_count()
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for job in jobs:
        for r in range(args.repeat):
            order = ways[r % len(ways) :] + ways[: r % len(ways)]  # rotate: no way always first
            times, cpus = {}, {}
            for way in order:
                started = time.monotonic()
                times[way], cpus[way] = one(job, way, args.world, args.steps)
                took = time.monotonic() - started
                console.print(f"{job} round {r + 1}: {way}: median step {times[way]:.4f} s, "
                              f"{cpus[way]:.1f} CPU-s ({took:.0f} s)")  # fmt: skip
            for way in ways:
                results.setdefault((job, way), []).append(
                    (times[way], times[way] / times["torchrun"], cpus[way] - cpus["torchrun"])
                )
    table = Table(title=f"healthy steps, {args.world} ranks on {cores} cores, {args.steps} steps, "
                        f"{args.repeat} rounds (ratio to the round's torchrun)")  # fmt: skip
    columns = ("job", "way", "median step", "ratios", "overhead (median ratio)",
               "added CPU-s per run", "added CPU-ms per step (upper bound)")  # fmt: skip
    for col in columns:
        table.add_column(col)
    for job in jobs:
        for way in ways:
            rows = results[(job, way)]
            ratio = statistics.median(x for _, x, _ in rows)
            added = statistics.median(c for _, _, c in rows)
            table.add_row(
                job, way, f"{statistics.median(t for t, _, _ in rows):.4f} s",
                " ".join(f"{x:.3f}" for _, x, _ in rows), f"{(ratio - 1) * 100:+.1f}%",
                f"{added:+.1f} ({' '.join(f'{c:+.1f}' for _, _, c in rows)})",
                f"{added / args.steps * 1000:+.1f}",
            )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
