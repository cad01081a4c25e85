"""Start a benchmark job's ranks on this machine: ``launch.py <job> --world 4 [job args]``.

Owns the rendezvous TCPStore (127.0.0.1, port 0) and passes it to every rank through
MASTER_ADDR/MASTER_PORT with RANK/WORLD_SIZE/LOCAL_RANK; waits for all ranks and kills the
rest if one fails. Jobs: ddp, fsdp2, deepspeed_zero1, megatron_pp2dp2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOBS = ("ddp", "fsdp2", "deepspeed_zero1", "megatron_pp2dp2")


def run_world(
    script: Path, world: int, job_args: list[str], *, timeout: float, stdout: Any = None
) -> int:
    """Run ``script`` as ranks 0..world-1 around a fresh TCPStore; 0 iff every rank exits 0.

    A failing rank ends the others (killed); ``timeout`` seconds end all of them (status 2).
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(script.parent), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, str(script), *job_args], stdout=stdout,
                         stderr=subprocess.STDOUT if stdout is not None else None,
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(world)
    ]
    t0, rc = time.monotonic(), 0
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                rc = 1
                break
            if time.monotonic() - t0 > timeout:
                rc = 2
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return rc or max(abs(p.returncode) for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=JOBS)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    args, job_args = ap.parse_known_args()
    t0 = time.monotonic()
    rc = run_world(HERE / f"{args.job}.py", args.world, job_args, timeout=args.timeout)
    print(f"launch: {args.job} world={args.world} rc={rc} in {time.monotonic() - t0:.1f}s")
    sys.exit(rc)


if __name__ == "__main__":
    main()
