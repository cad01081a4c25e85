"""The pause of an S3 topology swap in place vs stop + disk checkpoint + relaunch, same swap.

Usage::

    python benchmarks/topology_swap_pause.py [--framework megatron|fsdp] [--hidden 256]
        [--repeat 2] [--warm 3]

Greyhound 5.2 ("Implementation and overhead", Fig. 19) swaps the parallel topology in place:
pause at a step boundary, copy each moved role's state peer to peer, rebuild, resume - 6.72x
faster than stopping the job, writing a checkpoint, and relaunching it on the new placement.
Both sides here run the Megatron-core GPT of ``failslow demo --framework megatron`` (TP1 x PP2
x DP2, Megatron DDP, Adam, 4 ranks on CPU/gloo, each rank its own host via ``FAILSLOW_HOST``)
and apply the same swap: every role moves to the next rank's host (a rotation; every rank's
state travels). ``--framework fsdp`` runs the FSDP2 HSDP job of ``failslow demo --framework
fsdp`` instead (2 replicas x 2 shards, width ``--hidden``, SGD with momentum;
``failslow.fsdp.attach(..., model_factory=build)``), the same rotation.

- **in place** (failslow): ``failslow.megatron.attach(..., model_provider=...)``, the swap
  scheduled with ``session.schedule(TopologyPlan, step)``; the pause is the swap step's time
  minus the median of the ordinary steps around it (what training loses), on the slowest rank;
- **stop + relaunch**: at the same step boundary every rank writes its state (the same state
  a snapshot holds) with ``torch.save`` to local disk and ``fsync``, the processes exit, four
  new processes start with the roles on their new hosts (ranks renumbered, as a relaunch does:
  Python, torch and Megatron imported again, the process group, model, DDP and optimizer built
  again) and load the checkpoint; the pause runs from the stop to the slowest rank's ready.

Both continue one step after the swap, and the parameters of every role are compared between
the two (bitwise expected: the same state in the same groups). Printed: state per rank, the two
pauses, their ratio (goal >= 10x), and the relaunch's parts (save, restart and build, load).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLD = 4


# ---- rank side ---------------------------------------------------------------------------------
def _rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from failslow.core.planner.plans import TopologyPlan

    torch.set_num_threads(1)
    rank, out = args.rank, Path(args.out)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=WORLD
    )
    from swap_jobs import fsdp_job, megatron_job

    if args.framework == "fsdp":
        fs, train_step, parameters = fsdp_job(args.hidden, world=WORLD, start=args.start)
    else:
        fs, train_step, parameters = megatron_job(
            args.hidden, vocab=1024, micro_batch_size=4, samples=512, start=args.start
        )
    record: dict[str, object] = {"rank": rank}
    if args.mode == "relaunch":  # this process now runs the role whose checkpoint is named so
        state = torch.load(out / f"role{rank}.pt", weights_only=False)
        fs.failslow_restore_state(state, args.start)
        dist.barrier()
        record["ready"] = time.time()
    if args.mode == "inplace":
        hosts = fs.topology.hosts
        fs.session.schedule(TopologyPlan(hosts=hosts[1:] + hosts[:1]), args.warm)
    steps = []
    for step in range(args.start, args.warm + 3):
        if args.mode == "stop" and step == args.warm:
            dist.barrier()
            record["stop"] = time.time()
            path = out / f"role{rank}.pt"
            with open(path, "wb") as f:
                torch.save(fs.failslow_snapshot_state(step), f)
                f.flush()
                os.fsync(f.fileno())
            record["saved"] = time.time()
            record["state_bytes"] = path.stat().st_size
            break
        t0 = time.monotonic()
        train_step()
        steps.append(time.monotonic() - t0)
    record["steps"] = steps
    record["coord"] = list(fs.topology.coords[rank])
    if args.mode != "stop":
        np.savez(out / f"{args.mode}.rank{rank}.npz", **parameters())
    (out / f"{args.mode}.rank{rank}.json").write_text(json.dumps(record))
    fs.close()
    dist.destroy_process_group()


# ---- driver ------------------------------------------------------------------------------------
def _world(
    mode: str, out: Path, hidden: int, warm: int, start: int = 0, framework: str = "megatron"
) -> float:
    """Run four ranks of ``mode``; return the wall time from launch to the last exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.time()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "FAILSLOW_HOST": f"host{rank}", "OMP_NUM_THREADS": "1",
               "FAILSLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
        cmd = [sys.executable, __file__, "--rank", str(rank), "--mode", mode, "--out", str(out),
               "--port", str(port), "--hidden", str(hidden), "--warm", str(warm),
               "--start", str(start), "--framework", framework]  # fmt: skip
        log = open(out / f"{mode}.rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        rc = proc.wait(timeout=900)
        log.close()
        if rc != 0:
            tail = (out / f"{mode}.rank{procs.index((proc, log))}.log").read_text()[-3000:]
            raise SystemExit(f"{mode} rank failed (rc={rc}):\n{tail}")
    return time.time() - t0


def _records(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(WORLD)]


def one_run(hidden: int, warm: int, framework: str) -> dict[str, float]:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="swap-pause-", dir=Path.home()) as tmp:
        out = Path(tmp)
        _world("inplace", out, hidden, warm, framework=framework)
        inplace = _records(out, "inplace")
        pauses = []
        for rec in inplace:
            steps = rec["steps"]
            ordinary = steps[1:warm] + steps[warm + 1 :]  # the first step warms up
            pauses.append(steps[warm] - statistics.median(ordinary))
        _world("stop", out, hidden, warm, framework=framework)
        stopped = _records(out, "stop")
        # the relaunch: roles rotate one host on, so the process on host k runs role k - 1;
        # a relaunch renumbers ranks by role, which is what this launch does
        t_spawn = time.time()
        _world("relaunch", out, hidden, warm, start=warm, framework=framework)
        relaunched = _records(out, "relaunch")
        stop = min(r["stop"] for r in stopped)
        saved = max(r["saved"] for r in stopped)
        ready = max(r["ready"] for r in relaunched)
        worst = 0.0
        for rec in inplace:  # the same role's parameters after one more step, both ways
            role = rec["coord"]
            twin = next(r for r in relaunched if r["coord"] == role)
            a = np.load(out / f"inplace.rank{rec['rank']}.npz")
            b = np.load(out / f"relaunch.rank{twin['rank']}.npz")
            for name in a.files:
                worst = max(worst, float(np.max(np.abs(a[name] - b[name]))))
        return {
            "state_mb": statistics.mean(r["state_bytes"] for r in stopped) / 2**20,
            "inplace_s": max(pauses),
            "relaunch_s": ready - stop,
            "save_s": saved - stop,
            "restart_s": ready - t_spawn,
            "max_abs_diff": worst,
            "step_s": statistics.median(s for r in inplace for s in r["steps"][1:]),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=("megatron", "fsdp"), default="megatron")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--warm", type=int, default=3, help="steps before the swap")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        _rank_main(args)
        return
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    results = []
    with Progress(transient=True) as progress:
        task = progress.add_task("swap pause: in place, then stop + relaunch", total=args.repeat)
        for _ in range(args.repeat):
            results.append(one_run(args.hidden, args.warm, args.framework))
            progress.advance(task)
    job = (
        f"FSDP2 HSDP 2 x 2, width {args.hidden}"
        if args.framework == "fsdp"
        else f"Megatron GPT hidden {args.hidden}, TP1 x PP2 x DP2"
    )
    table = Table(title=f"S3 swap pause, {job}")
    for column in ("run", "state/rank", "step", "in place", "stop+disk+relaunch", "ratio",
                   "save", "restart+build+load", "max |diff|"):  # fmt: skip
        table.add_column(column, justify="right")
    for i, r in enumerate(results):
        table.add_row(
            str(i + 1), f"{r['state_mb']:.1f} MiB", f"{r['step_s']:.2f} s",
            f"{r['inplace_s']:.2f} s", f"{r['relaunch_s']:.2f} s",
            f"{r['relaunch_s'] / max(r['inplace_s'], 1e-3):.1f}x", f"{r['save_s']:.2f} s",
            f"{r['restart_s']:.2f} s", f"{r['max_abs_diff']:.1e}",
        )  # fmt: skip
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
