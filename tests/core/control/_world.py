"""Start the ranks of a real gloo world for the control tests: each rank runs a test file as a
script, around a fresh job TCPStore (127.0.0.1, port 0); FAILSLOW_* taken out of the parent's
environment, one intra-op thread, the given pause timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any


def spawn_ranks(
    script: str, world: int, args: Callable[[int, int], Sequence[str]], *, pause_timeout: str
) -> tuple[Any, list[subprocess.Popen[str]]]:
    """``args(rank, job_port)``: the script's arguments. Returns (job store, processes)."""
    import torch.distributed as dist

    job = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAILSLOW_")}
    env.update(OMP_NUM_THREADS="1", FAILSLOW_PAUSE_TIMEOUT_S=pause_timeout)
    procs = [
        subprocess.Popen(
            [sys.executable, script, *args(r, job.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    return job, procs
