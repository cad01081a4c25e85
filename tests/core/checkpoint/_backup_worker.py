"""One rank of a backup/restore test world (byterobust 6.3): ``_backup_worker.py <phase> ...``.

``train``: snapshot + peer backup every step of a tiny model, dumping each step's state
(``rank{r}-step{s}.pt``) for comparison; then ``--then idle`` (wait to be killed) or ``--then
train`` (keep training until killed). ``restore``: restore in a new world, dump the restored state
and its step/source, train two more steps with backups and close cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from failslow.core.checkpoint.backup import BackupService
from failslow.core.checkpoint.placement import backup_holders
from failslow.core.checkpoint.restore import restore
from failslow.core.checkpoint.snapshot import Snapshotter
from failslow.core.topology import Topology


def build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1000 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def train_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int, snap: Snapshotter
) -> None:
    g = torch.Generator().manual_seed(rank * 7919 + step)
    x = torch.randn(8, 16, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # data parallel: keeps the ranks within a step of each other
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    snap.wait_consistent()  # the previous snapshot's copies are done: parameters may change
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["train", "restore", "reshard"])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spec", required=True, help="json: tp, dp, pp, hosts, host_dirs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--then", choices=["idle", "train"], default="idle")
    ap.add_argument("--old-ranks", default="", help="reshard: the old rank of each new rank")
    args = ap.parse_args()
    if args.phase == "reshard":
        reshard(args)
        return
    spec = json.loads(args.spec)
    rank = args.rank
    out = Path(args.out)
    topo = Topology(
        tp=spec["tp"],
        dp=spec["dp"],
        pp=spec["pp"],
        coords=tuple(tuple(c) for c in spec["coords"]),
        hosts=tuple(spec["hosts"]),
        micro_batches=1,
    )
    world = topo.world_size
    hostdir = Path(spec["host_dirs"][topo.hosts[rank]])
    hostdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", args.port, world, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    holders = backup_holders(topo)
    model, opt = build(rank)
    first = 1
    if args.phase == "restore":
        t0 = time.perf_counter()
        got = restore(rank=rank, holders=holders, directory=hostdir)
        elapsed = time.perf_counter() - t0
        state = got.state()
        torch.save(state, out / f"restored-rank{rank}.pt")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        (out / f"restored-rank{rank}.json").write_text(
            json.dumps(
                {"step": got.step, "source": got.source, "attempts": got.attempts, "s": elapsed}
            )
        )
        first = got.step + 1
    snap = Snapshotter(hostdir, rank=rank, slots=3, on_busy="wait")
    backups = BackupService(snap, holders, rank, hostdir, after_step=first - 1, chunk_bytes=4096)
    last = first + args.steps - 1
    step = first
    while True:
        train_step(model, opt, rank, step, snap)
        state = state_of(model, opt, step)
        if args.phase == "train":
            torch.save(state, out / f"rank{rank}-step{step}.pt")
        snap.start(state, step)
        if step == last and args.then == "train" and args.phase == "train":
            (out / f"ready-rank{rank}").write_text("training on")
        elif step == last:
            snap.close()  # seals the last snapshot and runs its on_sealed (backup) callback
            backups.flush(60)
            (out / f"ready-rank{rank}").write_text(json.dumps(backups.backups()))
            break
        if step > last:
            time.sleep(0.05)  # keep training slowly until the test kills this node
        step += 1
    if args.phase == "restore":
        backups.close(last)
        (out / f"done-rank{rank}").write_text(json.dumps(backups.backups()))
        dist.barrier()
        dist.destroy_process_group()
        return
    # idle: the node stays up until the test kills it
    while True:
        time.sleep(1)
    os._exit(0)


def reshard(args: argparse.Namespace) -> None:
    """A smaller world of the survivors gathers every old rank's state (one file per old rank)."""
    from failslow.core.checkpoint.reshard import restore_resharded

    spec = json.loads(args.spec)
    old = Topology(
        tp=spec["tp"], dp=spec["dp"], pp=spec["pp"],
        coords=tuple(tuple(c) for c in spec["coords"]), hosts=tuple(spec["hosts"]),
        micro_batches=1,
    )  # fmt: skip
    old_ranks = [int(r) for r in args.old_ranks.split(",")]
    world = len(old_ranks)
    old_rank = old_ranks[args.rank]
    store = dist.TCPStore(
        "127.0.0.1", args.port, world, is_master=False, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=world, timeout=timedelta(seconds=60)
    )
    if not os.environ.get("FAILSLOW_RESHARD_FROM"):
        got = restore_resharded(
            rank=args.rank,
            world_size=world,
            old_rank=old_rank,
            old_holders=backup_holders(old),
            directory=Path(spec["host_dirs"][old.hosts[old_rank]]),
            chunk_bytes=4096,
        )
    out = Path(args.out)
    if os.environ.get("FAILSLOW_RESHARD_FROM"):  # through the rank runtime's service
        got = _service_reshard(args.rank, world)
    torch.save(got.states(), out / f"resharded-rank{args.rank}.pt")
    record = {"step": got.step, "providers": got.providers, "sources": got.sources}
    if os.environ.get("FAILSLOW_RESHARD_FROM"):
        record = {"step": got.step}
    (out / f"resharded-rank{args.rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _service_reshard(rank: int, world: int) -> Any:
    """The rank runtime's resume in a smaller world: ``$FAILSLOW_RESHARD_FROM`` names the
    worlds to try, newest first; the service hands the gathered states to the plugin hook."""
    from types import SimpleNamespace

    from failslow.capabilities import SUPPORTED, Capabilities
    from failslow.core.checkpoint.config import CheckpointConfig
    from failslow.runtime.snapshot_service import SnapshotService

    got: dict[str, Any] = {}

    def restore_resharded_hook(states: list[Any], step: int, old_rank: int | None) -> bool:
        got.update(states=states, step=step, old_rank=old_rank)
        return True

    hooks = SimpleNamespace(failslow_restore_resharded=restore_resharded_hook)
    supported = Capabilities(**{name: SUPPORTED for name in Capabilities.names()})
    service = SnapshotService(
        CheckpointConfig(every_steps=1, backup=False),
        hooks,
        rank=rank,
        world_size=world,
        topology=lambda: Topology.megatron(tp=1, dp=world, pp=1, gpus_per_host=1, micro_batches=3),
        capabilities=lambda: supported,
        wait_timeout_s=30,
    ).start()
    assert service.resumed_step == got["step"]
    assert service.resized is not None and service.resized["world"] == world
    return SimpleNamespace(states=lambda: got["states"], step=got["step"], providers=[], sources=[])


if __name__ == "__main__":
    main()
