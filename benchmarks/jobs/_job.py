"""Shared plumbing of the benchmark training jobs (greyhound 4.2: iteration times to compare).

Every job: ``--ring-dir D --steps N --out steps.json``; installs the failslow hook before
``init_process_group``, trains N steps, and writes this rank's step timer (wall time between
optimizer steps, CLOCK_MONOTONIC ns, the rings' clock) to ``<out stem>.rank<R>.json``.
Ranks are started by ``launch.py``, which owns the TCPStore (127.0.0.1, port 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def start(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ring-dir", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import failslow.nccl_hook as hook

    torch.set_num_threads(1)
    hook.install(args.ring_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return args


def benchmark_mlp() -> torch.nn.Sequential:
    """The MLP every benchmark trains (512-1024-1024-512), seeded alike on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
    )


class StepTimer:
    """Monotonic timestamps of every optimizer step."""

    def __init__(self) -> None:
        self.marks = [time.monotonic_ns()]

    def step_done(self) -> None:
        self.marks.append(time.monotonic_ns())

    def write(self, out: str, job: str) -> None:
        rank = dist.get_rank()
        path = Path(out)
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")
        times = [(b - a) / 1e9 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        path.write_text(json.dumps({
            "job": job, "rank": rank, "world": dist.get_world_size(),
            "step_end_ns": self.marks[1:], "step_start_ns": self.marks[:-1], "step_s": times,
        }))


def train_and_finish(model: torch.nn.Module, args: argparse.Namespace, job: str) -> None:
    """SGD on one fixed batch for ``args.steps`` timed steps, then the timer file and teardown."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 512)
    timer = StepTimer()
    for _ in range(args.steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        timer.step_done()
    timer.write(args.out, job)
    finish()


def finish() -> None:
    dist.barrier()
    time.sleep(0.1)
    dist.destroy_process_group()
