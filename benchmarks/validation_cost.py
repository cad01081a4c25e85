"""Cost of validation (greyhound 4.3, Fig. 17: ~5 s for GEMM plus link tests at 3 repetitions).

``python benchmarks/validation_cost.py [--world 4] [--rounds 3]`` starts a gloo world of
``--world`` ranks on this machine (TCPStore on port 0, one process per rank, one intra-op thread
each) and times, on rank 0, from a barrier to the end of the step:

- GEMM validation: every rank runs ``gemm_seconds()`` (CPU defaults: 1024^3, float32 and
  bfloat16, warm-up + 3 repetitions) at the same time, then the times are gathered;
- link tests: ``measure_links(ring_passes(n))`` then ``measure_links(tree_passes(n))``
  (3 repetitions, one untimed warm-up round each) at 1, 4 and 16 MB, and at the paper's
  default sizes 16+32+64 MB.

Each row is the median over ``--rounds`` rounds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MB = 1 << 20
LINK_SIZES: list[tuple[str, tuple[int, ...]]] = [
    ("1 MB", (1 * MB,)),
    ("4 MB", (4 * MB,)),
    ("16 MB", (16 * MB,)),
    ("16+32+64 MB (paper default)", (16 * MB, 32 * MB, 64 * MB)),
]


def worker(rank: int, world: int, port: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from failslow.core.localize.validation.gemm import gemm_seconds, slow_ranks
    from failslow.core.localize.validation.links import measure_links
    from failslow.core.localize.validation.schedules import ring_passes, tree_passes

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    rows: dict[tuple[str, str], list[float]] = {}

    def timed(what: str, size: str, fn) -> None:  # type: ignore[no-untyped-def]
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        rows.setdefault((what, size), []).append(time.perf_counter() - t0)

    def gemm() -> None:
        mine = gemm_seconds(device="cpu")
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        for dtype in mine:
            slow_ranks({r: g[dtype] for r, g in enumerate(gathered)})

    gemm_seconds(size=64, device="cpu")  # first-call costs outside the timing
    for _ in range(rounds):
        timed("GEMM validation (fp32 + bf16, 1024^3)", "-", gemm)
        for label, sizes in LINK_SIZES:
            timed(
                "ring link test", label, lambda s=sizes: measure_links(ring_passes(world), nbytes=s)
            )
            timed(
                "tree link test", label, lambda s=sizes: measure_links(tree_passes(world), nbytes=s)
            )
    if rank == 0:
        print(
            f"{world} ranks, gloo on one host, {os.cpu_count()} cores, {rounds} rounds, "
            f"torch {torch.__version__}"
        )
        print()
        print("| what | size | seconds (median) | min | max |")
        print("|---|---|---|---|---|")
        for (what, size), values in rows.items():
            print(
                f"| {what} | {size} | {statistics.median(values):.3f} | {min(values):.3f} | "
                f"{max(values):.3f} |"
            )
        ring_tree = [
            statistics.median(rows[("ring link test", label)])
            + statistics.median(rows[("tree link test", label)])
            for label, _ in LINK_SIZES
        ]
        gemm_s = statistics.median(rows[("GEMM validation (fp32 + bf16, 1024^3)", "-")])
        print()
        for (label, _), link_s in zip(LINK_SIZES, ring_tree, strict=True):
            print(f"whole validation at {label}: GEMM + ring + tree = {gemm_s + link_s:.3f} s")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=2, type=int, metavar=("RANK", "PORT"), help="internal")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.world, args.worker[1], args.rounds)
        return

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--world",
                str(args.world),
                "--rounds",
                str(args.rounds),
                "--worker",
                str(rank),
                str(store.port),
            ],
            env=env,
        )
        for rank in range(args.world)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
