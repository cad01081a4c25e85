"""S3 on a really congested link: a Megatron-core job with one DP link shaped by tc, unmitigated
vs the planner's topology swap applied in place.

Usage (root: network namespaces)::

    python benchmarks/topology_swap_link.py [--framework megatron|fsdp] [--rate 50mbit]
        [--steps 30] [--repeat 1]

Four ranks, each in its own network namespace and its own host (``FAILSLOW_HOST``), on one
bridge (:mod:`failslow.demo.netns`; gloo binds to the rank's veth, so every byte crosses the
bridge). The job is ``failslow demo --framework megatron``'s GPT on TP1 x PP2 x DP2 (Megatron
DDP, Adam, 1F1B, 4 micro-batches of 8 per replica). After ``--healthy`` steps the link between
ranks 0 and 1 - stage 0 of the two replicas, the link their gradient all-reduce crosses - is
shaped to ``--rate`` in both directions (htb). Greyhound 5.2, S3 (Fig. 11): the planner's
:func:`~failslow.core.planner.plan_topology` on that diagnosis moves the roles so the congested
link carries less traffic; the failslow run applies its plan in place two steps after the
shaping (``session.schedule``), the unmitigated run never does. Both runs train on the same
data; every role's parameters are compared between them at the end (bitwise expected).
``--framework fsdp``: ``failslow demo --framework fsdp``'s FSDP2 HSDP job (2 replicas x 2
shards) instead, the link between ranks 0 and 1 then inside replica 0's shard group (every
layer's all-gathers and reduce-scatters cross it); the planner knows the job is sharded.

Printed per run: the healthy step (median before the shaping), the shaped step unmitigated, the
shaped step after the swap, the share of the slowdown removed ``(unmit - swapped) / (unmit -
healthy)``, the swap step's pause, the plan (which host runs which role) and the parameter check.
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

WORLD = 4
PORT = 29500  # rank 0's namespace is brand new: nothing else listens there
SHAPED = (0, 1)


def _rank_main(args: argparse.Namespace) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist
    from swap_jobs import fsdp_job, megatron_job

    from failslow.core.diagnosis.record import Diagnosis, Kind, SlowLink
    from failslow.core.planner import plan_topology

    torch.set_num_threads(1)
    rank, out = args.rank, Path(args.out)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(args.master, PORT, WORLD, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    if args.framework == "fsdp":
        fs, train_step, parameters = fsdp_job(args.hidden, world=WORLD)
    else:
        fs, train_step, parameters = megatron_job(
            args.hidden, vocab=512, micro_batch_size=8, samples=2048
        )
    plan = None
    if args.mode == "swap":
        link = Diagnosis(Kind.COMMUNICATION, slow_links=(SlowLink(*SHAPED, 10.0),))
        # the planner's defaults: the state size only sets the plan's overhead estimate
        plan = plan_topology(fs.topology, link, state_bytes_per_rank=0,
                             transfer_bandwidth_bytes_per_s=1.25e9, pause_s=1.0)  # fmt: skip
        if plan is None:
            raise SystemExit("the planner found no better placement for the congested link")
        fs.session.schedule(plan, args.healthy + 2)
    steps = []
    for step in range(args.steps):
        if step == args.healthy:  # wait until the driver has shaped the link
            (out / f"{args.mode}.at.rank{rank}").touch()
            while not (out / f"{args.mode}.shaped").exists():
                time.sleep(0.01)
            dist.barrier()
        t0 = time.monotonic()
        train_step()
        steps.append(time.monotonic() - t0)
    np.savez(out / f"{args.mode}.rank{rank}.npz", **parameters())
    record = {
        "steps": steps,
        "coord": list(fs.topology.coords[rank]),
        "plan": list(plan.hosts) if plan is not None else None,
        "hosts": list(fs.topology.hosts),
    }
    (out / f"{args.mode}.rank{rank}.json").write_text(json.dumps(record))
    fs.close()
    dist.destroy_process_group()


def _world(net: object, mode: str, out: Path, args: argparse.Namespace) -> list[dict]:
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "FAILSLOW_HOST": f"host{rank}", "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": net.ranks[rank].veth,  # type: ignore[attr-defined]
               "FAILSLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}  # fmt: skip
        cmd = [sys.executable, __file__, "--rank", str(rank), "--mode", mode, "--out", str(out),
               "--master", net.ranks[0].address,  # type: ignore[attr-defined]
               "--hidden", str(args.hidden), "--steps", str(args.steps),
               "--healthy", str(args.healthy), "--framework", args.framework]  # fmt: skip
        log = open(out / f"{mode}.rank{rank}.log", "w")  # closed below
        procs.append((net.popen(rank, cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))  # type: ignore[attr-defined]
    try:
        while not all((out / f"{mode}.at.rank{r}").exists() for r in range(WORLD)):
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break
            time.sleep(0.05)
        else:
            for a, b in (SHAPED, SHAPED[::-1]):
                net.shape(a, b, rate=args.rate)  # type: ignore[attr-defined]
            (out / f"{mode}.shaped").touch()
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=1200)
            log.close()
            if rc != 0:
                tail = (out / f"{mode}.rank{rank}.log").read_text()[-3000:]
                raise SystemExit(f"{mode} rank {rank} failed (rc={rc}):\n{tail}")
    finally:
        for a in SHAPED:
            try:
                net.unshape(a)  # type: ignore[attr-defined]
            except RuntimeError:
                pass  # never shaped (a rank failed before)
    return [json.loads((out / f"{mode}.rank{r}.json").read_text()) for r in range(WORLD)]


def one_run(net: object, args: argparse.Namespace) -> dict[str, object]:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="swap-link-") as tmp:
        out = Path(tmp)
        unmit = _world(net, "unmitigated", out, args)
        swap = _world(net, "swap", out, args)
        h, at = args.healthy, args.healthy + 2
        step_of = lambda recs, sl: [max(r["steps"][i] for r in recs) for i in sl]  # noqa: E731
        healthy = statistics.median(step_of(unmit, range(1, h)) + step_of(swap, range(1, h)))
        shaped = statistics.median(step_of(unmit, range(h + 1, args.steps)))
        swapped = statistics.median(step_of(swap, range(at + 1, args.steps)))
        pause = step_of(swap, [at])[0] - swapped
        bitwise = True
        for r, rec in enumerate(swap):
            twin = next(i for i, u in enumerate(unmit) if u["coord"] == rec["coord"])
            a = np.load(out / f"swap.rank{r}.npz")
            b = np.load(out / f"unmitigated.rank{twin}.npz")
            bitwise &= all(np.array_equal(a[n], b[n]) for n in a.files)
        return {
            "healthy": healthy, "shaped": shaped, "swapped": swapped, "pause": pause,
            "removed": (shaped - swapped) / (shaped - healthy) if shaped > healthy else 0.0,
            "plan": swap[0]["plan"], "hosts": swap[0]["hosts"], "bitwise": bitwise,
            "coords": [r["coord"] for r in swap],
        }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--framework", choices=("megatron", "fsdp"), default="megatron")
    parser.add_argument("--rate", default="50mbit", help="the congested link's rate (tc htb)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--healthy", type=int, default=10, help="steps before the shaping")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--master", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank >= 0:
        _rank_main(args)
        return
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from failslow.demo.netns import NetnsUnavailable, netns_network

    results = []
    try:
        with netns_network(WORLD) as net, Progress(transient=True) as progress:
            task = progress.add_task("unmitigated, then S3 in place", total=args.repeat)
            for _ in range(args.repeat):
                results.append(one_run(net, args))
                progress.advance(task)
    except NetnsUnavailable as exc:
        raise SystemExit(f"topology_swap_link: needs network namespaces (root): {exc}") from None
    job = "FSDP2 HSDP 2 x 2" if args.framework == "fsdp" else "Megatron GPT TP1 x PP2 x DP2"
    table = Table(title=f"S3 on a shaped link 0-1 ({args.rate}), {job}")
    for column in ("run", "healthy", "shaped, unmitigated", "shaped, swapped", "removed",
                   "swap pause", "roles after (tp, dp, pp) per host", "params"):  # fmt: skip
        table.add_column(column, justify="right")
    for i, r in enumerate(results):
        h = r["healthy"]
        table.add_row(
            str(i + 1), f"{h:.3f} s", f"{r['shaped']:.3f} s ({r['shaped'] / h:.2f}x)",
            f"{r['swapped']:.3f} s ({r['swapped'] / h:.2f}x)", f"{r['removed']:.0%}",
            f"{r['pause']:.2f} s",
            " ".join(f"{host}:{tuple(c)}" for host, c in zip(r["hosts"], r["coords"], strict=True)),
            "bitwise" if r["bitwise"] else "DIFFER",
        )  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
