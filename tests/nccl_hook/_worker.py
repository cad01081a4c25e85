"""One rank of a hook-test world: ``_worker.py <scenario> --rank R --world W --port P ...``.

Scenarios install the hook BEFORE ``init_process_group`` and record, per phase, the
CLOCK_MONOTONIC window and what the test should find in the ring.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import failslow.nccl_hook as hook
from failslow.core.events import DType, OpCode, group_key


class Phases:
    """CLOCK_MONOTONIC windows by phase name."""

    def __init__(self) -> None:
        self.windows: dict[str, tuple[int, int]] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        dist.barrier()
        t0 = time.monotonic_ns()
        out = fn()
        t1 = time.monotonic_ns()
        self.windows[name] = (t0, t1)
        return out


def _gk(pg: Any) -> int:
    return group_key(pg.group_name, dist.get_process_group_ranks(pg))


def nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- scenario "ops": every op kind on WORLD and on a non-sorted new group -------------------------
def scenario_ops(ctx: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2
    phases: Phases = ctx["phases"]
    expected: list[dict[str, Any]] = []
    W = dist.group.WORLD
    wk = _gk(W)

    def exp(op: OpCode, nbytes: int, peer: int = -1, key: int = wk, **more: Any) -> None:
        expected.append({"op": int(op), "nbytes": nbytes, "peer": peer, "key": key, **more})

    def ops() -> None:
        t = torch.arange(10, dtype=torch.float32) + rank
        dist.all_reduce(t)
        exp(OpCode.ALLREDUCE, 40, async_op=False, dtype=int(DType.FLOAT32))
        dist.all_reduce(t, async_op=True).wait()  # async_op=True is the schema's default:
        exp(OpCode.ALLREDUCE, 40, async_op=True)  # torch leaves it out of the boxed call
        dist.all_reduce(torch.ones(3, dtype=torch.int64))
        exp(OpCode.ALLREDUCE, 24, dtype=int(DType.INT64))
        ts = [torch.ones(3), torch.ones(5)]
        dist.all_reduce_coalesced(ts)
        exp(OpCode.ALLREDUCE_COALESCED, 12 + 20)
        outs = [torch.empty(4) for _ in range(world)]
        dist.all_gather(outs, torch.ones(4))
        exp(OpCode.ALLGATHER, 16)
        dist.all_gather_into_tensor(torch.empty(world * 6), torch.ones(6))
        exp(OpCode.ALLGATHER, 24)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(torch.empty(world * 2), torch.ones(2))
            dist.all_gather_into_tensor(torch.empty(world * 3), torch.ones(3))
        cm.wait()
        exp(OpCode.ALLGATHER_COALESCED, 20)
        dist.reduce_scatter_tensor(torch.empty(8), torch.ones(world * 8))
        exp(OpCode.REDUCE_SCATTER, world * 32)
        dist.reduce_scatter(torch.empty(3), [torch.ones(3) for _ in range(world)])
        exp(OpCode.REDUCE_SCATTER, world * 12)
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(world * 2))
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(world * 4))
        cm.wait()
        exp(OpCode.REDUCE_SCATTER_COALESCED, world * 24)
        dist.broadcast(torch.ones(7), src=1)
        exp(OpCode.BROADCAST, 28, peer=1)
        dist.reduce(torch.ones(9), dst=1)
        exp(OpCode.REDUCE, 36, peer=1)
        dist.all_to_all_single(torch.empty(world * 5), torch.ones(world * 5))
        exp(OpCode.ALLTOALL, world * 20)
        dist.gather(torch.ones(2), [torch.empty(2) for _ in range(world)] if rank == 0 else None,
                    dst=0)
        exp(OpCode.GATHER, 8, peer=0)
        dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(world)] if rank == 0 else None,
                     src=0)
        exp(OpCode.SCATTER, world * 12 if rank == 0 else 0, peer=0)
        if rank == 0:
            dist.send(torch.ones(11), dst=1)
            exp(OpCode.SEND, 44, peer=1)
            dist.isend(torch.ones(12), dst=1).wait()
            exp(OpCode.SEND, 48, peer=1)
            dist.send(torch.ones(13), dst=1)
            exp(OpCode.SEND, 52, peer=1)
        else:
            dist.recv(torch.empty(11), src=0)
            exp(OpCode.RECV, 44, peer=0)
            dist.irecv(torch.empty(12), src=0).wait()
            exp(OpCode.RECV, 48, peer=0)
            dist.recv(torch.empty(13))  # any source
            exp(OpCode.RECV, 52, peer=0)
        other = 1 - rank
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, torch.ones(6) * rank, other),
            dist.P2POp(dist.irecv, torch.empty(6), other),
        ])
        for r in reqs:
            r.wait()
        exp(OpCode.SEND, 24, peer=other)
        exp(OpCode.RECV, 24, peer=other)
        dist.barrier()
        exp(OpCode.BARRIER, 0)
        # A group whose rank order is not sorted: group rank 0 is global rank 1.
        g = dist.new_group([1, 0], sort_ranks=False)
        gk = group_key(g.group_name, [1, 0])
        dist.all_reduce(torch.ones(4), group=g)
        exp(OpCode.ALLREDUCE, 16, key=gk)
        dist.broadcast(torch.ones(5), group=g, group_src=0)  # group rank 0 = global rank 1
        exp(OpCode.BROADCAST, 20, peer=1, key=gk)
        ctx["group"] = {"name": g.group_name, "key": gk, "ranks": [1, 0]}

    phases.run("ops", ops)

    def uninstalled() -> None:
        hook.uninstall()
        dist.all_reduce(torch.ones(3))
        dist.barrier()
        hook.install()

    phases.run("uninstalled", uninstalled)
    return {"expected": expected, "world_key": wk, "world_name": W.group_name,
            "new_group": ctx["group"]}


# -- scenario "ddp" ---------------------------------------------------------------------------
def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 64),
    )


def _train_ddp(steps: int, phases: Phases | None) -> tuple[list[torch.Tensor], Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_mlp(0), bucket_cap_mb=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(steps):
        x = torch.randn(32, 256, generator=g)
        y = torch.randn(32, 64, generator=g)

        def one(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        if phases is None:
            one()
        else:
            phases.run(f"ddp_step{step}", one)
    return [p.detach().clone() for p in model.parameters()], model


def scenario_ddp(ctx: dict[str, Any]) -> dict[str, Any]:
    steps = 4
    hook.uninstall()
    ref, _ = _train_ddp(steps, None)
    hook.install()
    got, model = _train_ddp(steps, ctx["phases"])
    data = model._get_ddp_logging_data()
    return {
        "steps": steps,
        "equal": all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)),
        "param_bytes": sum(nb(p) for p in model.parameters()),
        "bucket_sizes": [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s],
        "world_key": _gk(dist.group.WORLD),
    }


# -- scenario "fsdp2" -------------------------------------------------------------------------
def scenario_fsdp2(ctx: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _mlp(1)
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    for m in layers:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 3
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = torch.randn(16, 256, generator=g)

        def one(x: torch.Tensor = x) -> None:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        ctx["phases"].run(f"fsdp_step{step}", one)
    pg = mesh.get_group()
    return {
        "steps": steps,
        "layer_bytes": [sum(nb(p) for p in m.parameters()) for m in layers],
        "layer_shard_bytes": [sum(nb(p.to_local()) for p in m.parameters()) for m in layers],
        "mesh_key": _gk(pg),
    }


def scenario_torch(ctx: dict[str, Any]) -> dict[str, Any]:
    """ops + ddp + fsdp2 in one world (spawning is the expensive part)."""
    return {
        "ops": scenario_ops(ctx),
        "ddp": scenario_ddp(ctx),
        "fsdp2": scenario_fsdp2(ctx),
    }


SCENARIOS: dict[str, str] = {
    "torch": "_worker:scenario_torch",
    "deepspeed": "_ds_scenario:scenario_deepspeed",
    "megatron": "_megatron_scenario:scenario_megatron",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ring-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.update(RANK=str(args.rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(args.rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
                      LOCAL_WORLD_SIZE=str(args.world))
    torch.set_num_threads(1)
    module, fn = SCENARIOS[args.scenario].split(":")
    scenario = getattr(importlib.import_module(module), fn)
    capture = hook.install(args.ring_dir)  # before init: capture from the first collective
    store = dist.TCPStore("127.0.0.1", args.port, args.world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    ctx: dict[str, Any] = {"phases": Phases(), "capture": capture}
    result = scenario(ctx)
    dist.barrier()
    time.sleep(0.2)  # let the last completion callbacks land
    out = {"result": result, "windows": ctx["phases"].windows,
           "ring_path": str(capture.ring_path), "native": capture.native is not None}
    with open(args.out, "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
