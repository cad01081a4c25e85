"""One rank of a conformance world: ``python -m failslow.conformance.worker --harness mod:Cls ...``.

Spawned by :func:`failslow.conformance.world.run_world`. Points ``$FAILSLOW_RING_DIR`` at the
world's ring directory - the capture itself (greyhound 4.2) is installed by the adapter's session
as in production, so a session that does not capture fails the suite - joins the gloo world
through the test's TCPStore, lets the harness set the framework up, then runs every layout's
scenarios (:mod:`failslow.conformance.scenarios`) in turn. A layout that
raises ends the rank (its peers would otherwise wait in a collective): the error is in the
layout's result file and the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path


def load_harness(path: str) -> type:
    module, _, name = path.partition(":")
    obj: object = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, type)
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m failslow.conformance.worker")
    ap.add_argument("--harness", required=True, help="module:Class of an AdapterHarness")
    ap.add_argument("--layouts", required=True, help="comma-separated layout names")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ring-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync", required=True)
    args = ap.parse_args(argv)
    os.environ.update(
        RANK=str(args.rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(args.rank),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        FAILSLOW_RING_DIR=args.ring_dir,
    )
    import torch
    import torch.distributed as dist

    from failslow.conformance.scenarios import LayoutRunner

    torch.set_num_threads(1)
    harness = load_harness(args.harness)()
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    harness.setup_rank()
    out, sync = Path(args.out), Path(args.sync)
    for layout in args.layouts.split(","):
        t0 = time.monotonic()
        LayoutRunner(harness, layout, rank=args.rank, out=out, sync=sync).run()
        took = time.monotonic() - t0
        print(f"rank {args.rank}: layout {layout} done in {took:.1f} s", flush=True)
    dist.barrier()
    time.sleep(0.2)  # let the last completion callbacks land in the ring
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
