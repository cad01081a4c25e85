"""Cost and coverage of the candidate capture mechanisms on a real gloo DDP job (greyhound 4.2).

``python benchmarks/hook_mechanisms.py [--world 2] [--rounds 6] [--steps 5]`` spawns a DDP
world on 127.0.0.1 and, interleaved in one run (the machine is noisy, so only ratios count),
trains blocks of ``--steps`` steps under each mechanism:

- ``none``: no capture (baseline);
- ``dispatcher``: failslow's hook - a Python kernel on the Autograd key of the c10d ops,
  records written to the ring from the Work future;
- ``dispatch_mode``: a TorchDispatchMode that records c10d ops (Python on every aten op,
  thread-local: entered around each step);
- ``py_monkeypatch``: wrapping the ``torch.distributed`` Python functions (sees nothing of
  DDP's C++ reducer).

Rank 0 prints mean step time, overhead vs. ``none`` and captured calls per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MECHS = ("none", "dispatcher", "dispatch_mode", "py_monkeypatch")


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils._python_dispatch import TorchDispatchMode

    import failslow.nccl_hook as hook
    from failslow.core.events import OpCode
    from failslow.core.ring import RingWriter

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    ring_dir = Path(args.ring_dir)
    from jobs._job import benchmark_mlp  # benchmarks/ is the script's directory

    model = DDP(benchmark_mlp(), bucket_cap_mb=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(768, 512)
    counts = {"n": 0}
    mode_writer = RingWriter(ring_dir / f"mode-rank{args.rank}.ring", capacity=1 << 12)

    class RecordMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if func.namespace != "c10d":
                return func(*args, **(kwargs or {}))
            t0 = time.monotonic_ns()
            out = func(*args, **(kwargs or {}))
            mode_writer.write(t_start_ns=t0, t_end_ns=time.monotonic_ns(), nbytes=0,
                              group_key=0, op=int(OpCode.UNKNOWN))
            counts["n"] += 1
            return out

    originals = {n: getattr(dist, n) for n in ("all_reduce", "broadcast", "all_gather")}

    def patch(on: bool) -> None:
        for n, fn in originals.items():
            if on:
                def wrapped(*a, __fn=fn, **k):  # type: ignore[no-untyped-def]
                    counts["n"] += 1
                    return __fn(*a, **k)
                setattr(dist, n, wrapped)
            else:
                setattr(dist, n, fn)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):  # warm-up, bucket rebuild
        step()
    times: dict[str, list[float]] = {m: [] for m in MECHS}
    calls: dict[str, list[int]] = {m: [] for m in MECHS}
    capture = None
    for _round in range(args.rounds):
        for mech in MECHS:
            counts["n"] = 0
            before = capture.writer._next if capture is not None and capture.writer else 0
            if mech == "dispatcher":
                capture = hook.install(ring_dir, global_rank=args.rank)
                before = capture.writer._next
            elif mech == "py_monkeypatch":
                patch(True)
            dist.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if mech == "dispatch_mode":
                    with RecordMode():
                        step()
                else:
                    step()
                times[mech].append(time.perf_counter() - t0)
            dist.barrier()
            if mech == "dispatcher":
                time.sleep(0.05)
                counts["n"] = capture.writer._next - before - 2  # minus the two barriers
                hook.uninstall()
            elif mech == "py_monkeypatch":
                patch(False)
            calls[mech].append(counts["n"])
    if args.rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "calls": calls,
                                              "steps": args.steps}))
    dist.barrier()
    dist.destroy_process_group()


def _table(data: dict) -> str:
    times, calls, steps = data["times"], data["calls"], data["steps"]
    base = statistics.mean(times["none"])
    rows = [
        "| mechanism | mean step (ms) | median step (ms) | overhead vs none "
        "| c10d calls seen/step |",
        "|---|---|---|---|---|",
    ]
    for m in MECHS:
        mean = statistics.mean(times[m])
        rows.append(
            f"| {m} | {mean * 1e3:.1f} | {statistics.median(times[m]) * 1e3:.1f} | "
            f"{(mean / base - 1) * 100:+.1f}% | {sum(calls[m]) / (steps * len(calls[m])):.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ring-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank >= 0:
        _rank_main(args)
        return
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen([
                sys.executable, __file__, "--world", str(args.world), "--rounds",
                str(args.rounds), "--steps", str(args.steps), "--rank", str(r), "--port",
                str(store.port), "--ring-dir", tmp, "--out", str(out),
            ], env=env)
            for r in range(args.world)
        ]
        rc = [p.wait() for p in procs]
        if any(rc):
            sys.exit(f"ranks failed: {rc}")
        data = json.loads(out.read_text())
    print(f"DDP MLP, {args.world} ranks gloo, "
          f"{args.rounds} interleaved rounds x {args.steps} steps")
    print(_table(data))


if __name__ == "__main__":
    main()
