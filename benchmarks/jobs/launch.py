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

HERE = Path(__file__).resolve().parent
JOBS = ("ddp", "fsdp2", "deepspeed_zero1", "megatron_pp2dp2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", choices=JOBS)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900)
    args, job_args = ap.parse_known_args()
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
               WORLD_SIZE=str(args.world), LOCAL_WORLD_SIZE=str(args.world),
               OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, str(HERE / f"{args.job}.py"), *job_args],
                         env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(args.world)
    ]
    t0 = time.monotonic()
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                rc = 1
                break
            if time.monotonic() - t0 > args.timeout:
                rc = 2
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    rc = rc or max(abs(p.returncode) for p in procs)
    print(f"launch: {args.job} world={args.world} rc={rc} in {time.monotonic() - t0:.1f}s")
    sys.exit(rc)


if __name__ == "__main__":
    main()
